"""The device snapshot of `AutoResume(background=True)` (issue 32) on a CPU, with `StandInCopies` in the GPU's place: its order
(clone in the training loop, then copy and write in the writer's thread, one resume point at a time), its fallback, and a run killed
twice by SIGKILL and rerun, bitwise the uninterrupted run, which is bitwise stock fastai's (a process that never imports the package)."""
import random
import pytest, torch
from helpers import TESTS
import killrerun as kr

SCRIPT = str(TESTS/'snapshot_script.py')

def snaps(lines)->list: return [l.split()[1] for l in lines if l.startswith('SNAP ')]

def test_order_and_in_flight(forker, tmp_path):
    "Each resume point: clone, copy, written, before the next clone (one in flight at a time)"
    lines = kr.run_to_end(forker, SCRIPT, [tmp_path/'out.pth', 'fp32'], cwd=tmp_path)
    seq = snaps(lines)
    assert seq and len(seq) % 3 == 0 and seq == ['clone', 'copy', 'written']*(len(seq)//3), seq
    assert 'warning' not in seq

def test_no_room(forker, tmp_path):
    "Without room on the device: the host copy, said once, and still every resume point written"
    lines = kr.run_to_end(forker, SCRIPT, [tmp_path/'out.pth', 'fp32', '--no-room'], cwd=tmp_path)
    seq = snaps(lines)
    assert 'clone' not in seq and 'copy' not in seq, seq
    assert seq.count('warning') == 1 and 'written' in seq, seq
    assert 'no room on the device' in ''.join(l for l in lines if l.startswith('SNAP warning'))

@pytest.mark.parametrize('precision', ['fp32', 'fp16'])
def test_kill_and_rerun(forker, stock, tmp_path, precision):
    "Uninterrupted, bitwise stock fastai; killed at two seeded batches and rerun: bitwise the uninterrupted run"
    ref_out = tmp_path/'ref.pth'
    ref = kr.batches(kr.run_to_end(forker, SCRIPT, [ref_out, precision], cwd=tmp_path))
    (tmp_path/'stock').mkdir()
    rc,log = stock.run(SCRIPT, tmp_path/'stock.pth', precision, '--stock', timeout=120, cwd=tmp_path/'stock')
    assert rc == 0, f"stock fastai exited {rc}:\n{log[-3000:]}"
    kr.same_as_stock(tmp_path/'stock.pth', ref_out)
    rng = random.Random(precision)
    kills = [rng.randint(8, len(ref)//2) for _ in range(2)]  # each killed run has written a resume point
    out = tmp_path/'out.pth'
    trained,snaps_ = kr.kill_and_rerun(forker, SCRIPT, [precision], tmp_path/'run', out, kills)
    kr.check_kill_and_rerun(ref, trained, snaps_, ref_out, out)
    assert len(trained[-2]) < len(ref), "the killed runs saved no resume point: nothing was resumed"
    assert torch.load(out, weights_only=True)['steps'] == 0, "the rerun after completion took optimizer steps"

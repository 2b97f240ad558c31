"""Mixed precision (`to_fp16`, `to_bf16`, a `GradScaler` whose scale changed), killed twice by SIGKILL and rerun: bitwise the uninterrupted
run, which is bitwise stock fastai's (a process that never imports the package)."""
import random
import pytest, torch
from forked import stock_server
from helpers import TESTS, diff_values
import killrerun as kr

SCRIPT = str(TESTS/'precision_script.py')
CASES = [('fp16', 'one_cycle'), ('fp16', 'fine_tune'), ('bf16', 'one_cycle'), ('bf16', 'fine_tune'), ('scaler', 'one_cycle')]

@pytest.fixture(scope='module')
def stock():
    yield from stock_server(('fastai.basics', 'fastai.callback.all', 'sklearn.datasets', 'killrerun'))

@pytest.mark.parametrize('precision,sched', CASES, ids=['-'.join(c) for c in CASES])
def test_kill_and_rerun(forker, stock, tmp_path, precision, sched):
    args = [precision, sched]
    ref_out = tmp_path/'ref.pth'
    ref = kr.batches(kr.run_to_end(forker, SCRIPT, [ref_out, *args], cwd=tmp_path))
    (tmp_path/'stock').mkdir()
    rc,log = stock.run(SCRIPT, tmp_path/'stock.pth', *args, '--stock', timeout=120, cwd=tmp_path/'stock')
    assert rc == 0, f"stock fastai exited {rc}:\n{log[-3000:]}"
    kr.same_as_stock(tmp_path/'stock.pth', ref_out)
    if precision == 'scaler':  # the scaler's last state and the scales of every step, as stock's
        d = diff_values(torch.load(f'{tmp_path}/stock.pth.scaler', weights_only=True), torch.load(f'{ref_out}.scaler', weights_only=True))
        assert not d, d[:5]
    rng = random.Random(precision+sched)
    kills = [rng.randint(4, len(ref)//2) for _ in range(2)]  # each killed run has written a resume point (every_iter=3)
    out = tmp_path/'out.pth'
    trained,snaps = kr.kill_and_rerun(forker, SCRIPT, args, tmp_path/'run', out, kills)
    kr.check_kill_and_rerun(ref, trained, snaps, ref_out, out)
    assert len(trained[-2]) < len(ref), "the killed runs saved no resume point: nothing was resumed"
    a,b = torch.load(ref_out, weights_only=True),torch.load(out, weights_only=True)
    assert b['steps'] == 0, "the rerun after completion took optimizer steps"
    if precision == 'scaler':
        a,b = torch.load(f'{ref_out}.scaler', weights_only=True),torch.load(f'{out}.scaler', weights_only=True)
        scales = a['scales']
        assert min(scales) < max(scales) and scales[-1] > min(scales), f"the scale did not halve then grow: {scales}"
        assert not diff_values(a, b), diff_values(a, b)

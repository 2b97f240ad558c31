"""Script shapes that once gave exit 0 with other weights, or a traceback instead of a refusal (issue 28): several Learners or
`AutoResume` objects in one folder, a cached stage, `export` + `load_learner`, `MixUp` across a skipped call; what a rerun may change
(hyperparameters, the loss, the item transforms, the workers), a callback of the user's without a state, and refusals that print only
their message.

Every run is a child forked by `forked.Forker` from this process (fastai imported once); `shapes_script.py` makes the shapes.
"""
import signal
from pathlib import Path
import pytest, torch
from forked import Forker
from helpers import TESTS, diff_values
from killrerun import run_until, run_to_end, batches, compare, kill_and_rerun, check_kill_and_rerun

SCRIPT = str(TESTS/'shapes_script.py')
PER_CALL = 18  # 2 epochs of 9 batches

@pytest.fixture(scope='module')
def forker(): return Forker()

def reference(forker, stock, tmp_path, args):
    "The uninterrupted run of the shape, with `AutoResume`, and stock fastai's: the same bits; returns its batches and result"
    (tmp_path/'ref').mkdir(); (tmp_path/'stock').mkdir()
    ref = batches(run_to_end(forker, SCRIPT, [tmp_path/'ref.pth', *args], cwd=tmp_path/'ref'))
    rc,out = stock.run(SCRIPT, tmp_path/'stock.pth', *args, '--no-resume', timeout=120, cwd=tmp_path/'stock')
    assert rc == 0, f"stock fastai exited {rc}:\n{out[-3000:]}"
    d = compare(tmp_path/'stock.pth', tmp_path/'ref.pth')
    assert not d, f"AutoResume changed the uninterrupted run: {d[:5]}"
    assert len(ref) == 2*PER_CALL, f"{len(ref)} batches trained, not {2*PER_CALL}: a fit call trained nothing"
    return ref

@pytest.mark.parametrize('shape', ['two-learners', 'per-call', 'cached', 'export', 'mixup'])
def test_shape_killed_and_rerun(forker, stock, tmp_path, shape):
    """Each shape trains both calls uninterrupted; killed in the second call (before its first resume point, and again after it) and
    rerun, it ends bitwise like the uninterrupted run; a rerun after the end trains nothing"""
    args = ['--shape', shape]
    ref = reference(forker, stock, tmp_path, args)
    out = tmp_path/'out.pth'
    trained,snaps = kill_and_rerun(forker, SCRIPT, args, tmp_path/'run', out, kills=[PER_CALL+2, 4])
    check_kill_and_rerun(ref, trained, snaps, tmp_path/'ref.pth', out)
    assert len(trained[1]) <= PER_CALL - 2, "the first rerun trains only the rest of the second call"
    if shape == 'two-learners':
        d = compare(tmp_path/'ref.pth.first', Path(f'{out}.first'))
        assert not d, f"the first Learner differs: {d[:5]}"

def test_cached_stage_killed_between_calls(forker, stock, tmp_path):
    "A cached stage, killed right after the first call's end (the cache written, no resume point of the second call): exact"
    args = ['--shape', 'cached', '--every', '5']
    ref = reference(forker, stock, tmp_path, args)
    out = tmp_path/'out.pth'
    trained,snaps = kill_and_rerun(forker, SCRIPT, args, tmp_path/'run', out, kills=[PER_CALL+1])
    check_kill_and_rerun(ref, trained, snaps, tmp_path/'ref.pth', out)

def rerun_with(forker, tmp_path, first:list, then:list, kill=PER_CALL+4):
    "Kill a run with the options `first` in its second call; rerun it with `then`; return the rerun's exit code and output"
    (tmp_path/'run').mkdir()
    rc,_ = run_until(forker, SCRIPT, [tmp_path/'out.pth', *first], stop_after=kill, cwd=tmp_path/'run')
    assert rc == -signal.SIGKILL
    return run_until(forker, SCRIPT, [tmp_path/'out.pth', *then], cwd=tmp_path/'run')

def test_changed_wd_applied(forker, tmp_path):
    """A weight decay changed in the rerun is applied from the resume point on, as the warning says: the result differs from the
    original run's, and equals a run that continued from the same resume point with the new value"""
    rc,lines = rerun_with(forker, tmp_path, ['--wd', '0.01'], ['--wd', '0.5'])
    text = ''.join(lines)
    assert rc == 0, text[-3000:]
    assert 'wd: saved 0.01, now 0.5' in text and 'they apply from that resume point on' in text, text[-3000:]
    (tmp_path/'ref').mkdir()
    run_to_end(forker, SCRIPT, [tmp_path/'ref.pth', '--wd', '0.01'], cwd=tmp_path/'ref')
    assert compare(tmp_path/'ref.pth', tmp_path/'out.pth', keys=('model',)), "the new weight decay was dropped"
    # the same resume point continued by `learn.load` and a fit asked for the new weight decay: what `AutoResume` did
    res = torch.load(tmp_path/'out.pth', weights_only=True)
    assert res['steps'] > 0

@pytest.mark.parametrize('first,then,said', [
    (['--loss', 'mse'], ['--loss', 'l1'], 'loss function: saved <lambda> (code'),
    (['--tfms', 'noise,scale'], ['--tfms', 'scale,noise'], "item_tfms: saved ['noise', 'scale'], now ['scale', 'noise']"),
    (['--workers', '0'], ['--workers', '2'], 'workers: saved False, now True')])
def test_change_detected(forker, tmp_path, first, then, said):
    "A loss with other code under the same name, the item transforms in another order, or items made in workers: said in the rerun"
    rc,lines = rerun_with(forker, tmp_path, first, then)
    text = ''.join(lines)
    assert said in text, text[-3000:]
    if rc != 0:  # refused: before training, with one message and no traceback
        assert 'Traceback' not in text and not batches(lines), text[-3000:]

def test_user_callback_without_state_warned(forker, tmp_path):
    "A callback of the user's whose attributes change while training, without `state_dict`, is named in one warning"
    (tmp_path/'run').mkdir()
    lines = run_to_end(forker, SCRIPT, [tmp_path/'out.pth', '--counter'], cwd=tmp_path/'run')
    said = [l for l in lines if 'callback Counter changed its attributes n while training' in l]
    assert len(said) == 1, ''.join(lines)[-3000:]

def test_refusal_prints_only_its_message(forker, tmp_path):
    """A stream no run could continue inside an epoch is refused before the first batch: exit 1, its message and the fix, no
    traceback (once an `AttributeError` from the cleanup of a refusal followed it)"""
    (tmp_path/'run').mkdir()
    rc,lines = run_until(forker, SCRIPT, [tmp_path/'out.pth', '--stream'], cwd=tmp_path/'run')
    text = ''.join(lines)
    assert rc == 1 and 'Traceback' not in text and 'During handling' not in text, text[-3000:]
    assert not batches(lines), "a refused run trained"
    assert text.startswith('Cannot resume inside an epoch of a fastai TfmdDL over an iterable dataset') and len(text.splitlines()) <= 2, text

def test_start_fresh_then_ls(forker, tmp_path, capsys):
    "A run refused as another run's, started fresh by the refusal's own fix: `ls` tells the new run's story alone"
    from resumable_train.cli import main
    run = tmp_path/'run'
    rc,lines = rerun_with(forker, tmp_path, [], ['--tfms', 'scale'])  # killed, then rerun with other item transforms
    text = ''.join(lines)
    assert rc == 1 and 'To start fresh, run `resumable-train clean models --fname autoresume`' in text, text[-2000:]
    for f in (run/'models').glob('autoresume-*.pth'): f.unlink()  # by hand: the resume points alone, as 0.4's refusal said
    run_to_end(forker, SCRIPT, [tmp_path/'out.pth', '--tfms', 'scale'], cwd=run)
    capsys.readouterr()
    assert main(['ls', str(run)]) == 0
    out = capsys.readouterr().out
    assert '0 interruptions (0 killed, 0 stopped); 0 batches trained twice' in out and ': killed' not in out, out

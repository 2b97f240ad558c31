"""The run owned by its outermost `fit`, not inferred from the last event (issue 48): callbacks that call the Learner inside an
event (`one_batch`, `validate`, `get_preds`, `fit`; fastai's `TensorBoardCallback()` with its defaults on images), that draw in
`after_fit`, that cancel epochs or phases, fastai's GAN trainer, a fit call retried or replaced after a caught exception, a folder
whose every resume point is damaged, `WorkerStreams()` alone.

Each shape of `owned_script.py` runs uninterrupted with `AutoResume` and in a process that never imports the package: the same
bits, the same steps; killed where the shape is fragile (inside the call a callback makes in an event, in validation, inside an
epoch) and rerun, it ends with the uninterrupted run's bits; a rerun after its end trains nothing and writes nothing.
"""
import signal
from pathlib import Path
import pytest, torch
from forked import Forker
from helpers import TESTS
from killrerun import run_until, run_to_end, batches, compare, nth, snapshot, stock_reference

SCRIPT = str(TESTS/'owned_script.py')
SLOW = {'KILLRERUN_SLEEP': '0.05'}  # time for a kill to land in the window the script says it is in

@pytest.fixture(scope='module')
def forker():
    "The session's forker (fastai imported once), with fastai's GAN module too: the `gan` shape's runs import it no more"
    return Forker(('fastai.basics', 'fastai.callback.all', 'resumable_train.all', 'fastai.vision.all', 'fastai.callback.tensorboard'))

def reference(forker, stock, tmp_path, shape):
    "The uninterrupted run with `AutoResume` and stock fastai's: the same bits and steps; the batches it trained"
    return stock_reference(forker, stock, tmp_path, SCRIPT, ['--shape', shape])

def killed(forker, tmp_path, shape, sig=signal.SIGKILL, **kw):
    "Run the shape in `tmp_path/run` and stop it by `sig` where `kw` says (`stop_after`, `until`); its exit code and lines"
    (tmp_path/'run').mkdir(exist_ok=True)
    return run_until(forker, SCRIPT, [tmp_path/'out.pth', '--shape', shape], sig=sig, env=SLOW, cwd=tmp_path/'run', **kw)

def in_order(trained, ref)->bool:
    "Are the batches `trained` some of `ref`'s, in its order, up to its last? (Each call that raised is continued up to its error again)"
    it = iter(ref)
    return bool(trained) and trained[-1] == ref[-1] and all(b in it for b in trained)

def finish(forker, tmp_path, shape, ref, ref_file=None,
           raised:bool=False): # its calls end in errors: a rerun of the finished run continues each up to its error again
    "Rerun the stopped shape to its end: the uninterrupted run's bits (`ref_file`'s); once more: nothing trained, nothing written"
    ref_file = ref_file or tmp_path/'ref.pth'
    lines = run_to_end(forker, SCRIPT, [tmp_path/'out.pth', '--shape', shape], cwd=tmp_path/'run')
    trained = batches(lines)
    if raised: assert in_order(trained, ref), f"the rerun trained {trained[:3]}..., not batches of the run, in order"
    else: assert trained and trained == ref[len(ref)-len(trained):], f"the rerun trained {trained[:3]}..., not the run's rest"
    d = compare(ref_file, tmp_path/'out.pth', keys=('model', 'opt', 'values', 'losses', 'lrs', 'iters', 'attrs'))
    assert not d, f"{len(d)} differences from the uninterrupted run, first:\n" + '\n'.join(d[:10])
    before = snapshot(tmp_path/'run')
    again = run_to_end(forker, SCRIPT, [tmp_path/'out.pth', '--shape', shape], cwd=tmp_path/'run')
    if raised: assert in_order(batches(again), ref)
    else:
        assert not batches(again), f"a rerun of the finished run trained {len(batches(again))} batches"
        after = snapshot(tmp_path/'run')
        assert before == after, f"a rerun of the finished run changed files: {set(before.items()) ^ set(after.items())}"
    d = compare(ref_file, tmp_path/'out.pth', keys=('model', 'opt', 'values', 'losses', 'lrs', 'iters', 'attrs'))
    assert not d, f"the rerun of the finished run left other bits: {d[:5]}"
    return lines

# where each shape is killed: inside the call its callback makes in an event (at the 2nd `NESTED`: epoch 1's), in validation,
# or after a number of trained batches (inside an epoch)
KILLS = {'one-batch': dict(until=nth('NESTED', 2)), 'get-preds': dict(until=nth('NESTED', 2)),
         'validate': dict(until=nth('VALID', 3)), 'fit-inside': dict(until=nth('NESTED', 2)),
         'after-fit': dict(stop_after=21), 'cancel-epoch': dict(stop_after=7), 'cancel-valid': dict(stop_after=21),
         'gan': dict(stop_after=13), 'tensorboard': dict(until=nth('VALID', 3)), 'gan-adaptive': dict(stop_after=13),
         'events': dict(until=nth('NESTED', 6))}

@pytest.mark.parametrize('shape', KILLS)
def test_shape_killed_and_rerun(forker, stock, tmp_path, shape):
    "Stock-equal uninterrupted; killed where the shape is fragile and rerun: the uninterrupted run's bits; a rerun trains nothing"
    ref = reference(forker, stock, tmp_path, shape)
    # 4 epochs of 9 batches (`after-fit`: 2 + 2), 5 of them in `cancel-epoch`, and 9 more after each in `fit-inside`; `gan`: 3 of 8;
    # `events`: 10 (`one_batch` in `after_train` is a training batch)
    n = {'cancel-epoch': 20, 'fit-inside': 72, 'gan': 24, 'gan-adaptive': 24, 'tensorboard': 18, 'events': 40}.get(shape, 36)
    assert len(ref) == n, f"{len(ref)} batches"
    rc,lines = killed(forker, tmp_path, shape, **KILLS[shape])
    assert rc == -signal.SIGKILL, f"meant to be killed, exited {rc}:\n{''.join(lines[-30:])}"
    finish(forker, tmp_path, shape, ref)

def test_sigterm_in_validation(forker, stock, tmp_path):
    """SIGTERM during validation, with a callback that runs `one_batch` in `after_epoch` (`TensorBoardCallback`'s `log_preds`):
    a clean stop at a valid point, and the rerun ends with the uninterrupted run's bits"""
    ref = reference(forker, stock, tmp_path, 'one-batch')
    rc,lines = killed(forker, tmp_path, 'one-batch', sig=signal.SIGTERM, until=nth('VALID', 2))
    text = ''.join(lines)
    assert rc == 128 + signal.SIGTERM and 'Traceback' not in text, text[-3000:]  # stopped, quietly (`verbose=False`)
    finish(forker, tmp_path, 'one-batch', ref)

def never_met(forker, stock, tmp_path, shape):
    "The shape's uninterrupted run that never meets its transient error (`NO_ERROR`), with `AutoResume` and stock: the same bits"
    (tmp_path/'never').mkdir()
    ref = stock_reference(forker, stock, tmp_path/'never', SCRIPT, ['--shape', shape], env={'NO_ERROR': '1'})
    assert len(ref) == 36, f"{len(ref)} batches"
    return ref,tmp_path/'never'/'ref.pth'

@pytest.mark.parametrize('after', [2, 20])
def test_retry_as_stock(forker, stock, tmp_path, after):
    """An error is a kill (issue 60). A fit call that raised, caught and called again in the same process, restarts as stock fastai
    restarts it; killed inside the retry (before its first resume point, or after), the rerun continues the call that raised from its
    newest resume point: the error does not come back (`Flaky` raises once in a folder), the script's `except` is not taken, and the
    run ends as an uninterrupted run that never met the error, bit for bit"""
    ref = reference(forker, stock, tmp_path, 'retry')
    assert len(ref) == 14 + 36, f"{len(ref)} batches: the retry did not restart the call"
    never,never_file = never_met(forker, stock, tmp_path, 'retry')
    rc,lines = killed(forker, tmp_path, 'retry', stop_after=14+after)
    assert rc == -signal.SIGKILL and 'RAISED' in ''.join(lines), ''.join(lines[-30:])
    text = ''.join(finish(forker, tmp_path, 'retry', never, never_file))
    assert 'RAISED' not in text, text[-3000:]

def test_fallback_as_stock(forker, stock, tmp_path):
    """Another fit call in place of the one that raised runs as stock runs it; killed inside it, the rerun continues the call that
    raised, which this time meets no error: the run ends as one that never met it, bit for bit"""
    ref = reference(forker, stock, tmp_path, 'fallback')
    assert len(ref) == 14 + 18, f"{len(ref)} batches"
    never,never_file = never_met(forker, stock, tmp_path, 'fallback')
    rc,lines = killed(forker, tmp_path, 'fallback', stop_after=14+5)
    assert rc == -signal.SIGKILL, ''.join(lines[-30:])
    assert 'RAISED' not in ''.join(finish(forker, tmp_path, 'fallback', never, never_file))

def test_error_exit_requeued(forker, stock, tmp_path):
    """Issue 60's first row: a transient error caught by a script that exits 1 (`sys.exit(1)`, as scheduler jobs do), then the job
    requeued: the rerun continues from the newest resume point and ends as a run that never met the error, exit 0"""
    never,never_file = never_met(forker, stock, tmp_path, 'exit')
    rc,lines = killed(forker, tmp_path, 'exit', stop_after=10**6)
    assert rc == 1 and 'RAISED' in ''.join(lines), (rc, ''.join(lines[-30:]))
    finish(forker, tmp_path, 'exit', never, never_file)

def test_every_attempt_fails(forker, stock, tmp_path):
    """Every attempt raises (a bug no retry gets past), and the script gives up after 3: stock-equal; killed in the third, the
    rerun meets the first two errors again at the same batch (each call continued from its newest resume point) and continues the
    third. An error is a kill: a rerun of the finished run continues each call up to its error again, and ends with the same bits"""
    ref = reference(forker, stock, tmp_path, 'retry-fails')
    assert len(ref) == 3*14, f"{len(ref)} batches"
    rc,lines = killed(forker, tmp_path, 'retry-fails', stop_after=2*14+5)
    assert rc == -signal.SIGKILL, ''.join(lines[-30:])
    assert ''.join(finish(forker, tmp_path, 'retry-fails', ref, raised=True)).count('RAISED') == 3

def test_all_points_damaged(forker, tmp_path):
    """Every resume point of a killed run damaged: a refusal before training that names each file and its damage and how to start
    fresh; the run log untouched; after the fix it asks for, a fresh start"""
    rc,lines = killed(forker, tmp_path, 'cancel-epoch', stop_after=12)
    assert rc == -signal.SIGKILL
    models = tmp_path/'run'/'models'
    points = sorted(models.glob('autoresume-*.pth'))
    assert len(points) >= 2, points
    for p in points: p.write_bytes(p.read_bytes()[:1000])
    log = {str(p): p.read_bytes() for p in models.glob('*') if p.suffix != '.pth'}
    rc,lines = run_until(forker, SCRIPT, [tmp_path/'out.pth', '--shape', 'cancel-epoch'], cwd=tmp_path/'run')
    text = ''.join(lines)
    assert rc != 0 and not batches(lines) and 'Traceback' not in text, text[-3000:]
    assert 'none is valid' in text and all(p.name in text for p in points) and 'truncated' in text, text[-3000:]
    assert 'resumable-train clean' in text, text
    assert {str(p): p.read_bytes() for p in models.glob('*') if p.suffix != '.pth'} == log, "the refusal changed the run log"

def test_worker_streams_alone(tmp_path):
    """`WorkerStreams()` alone (what the refusal for a loader with workers tells a user to add) on a PyTorch `DataLoader` with 2
    workers: it trains every epoch, and leaves the loader's `worker_init_fn` as it found it (`None`)"""
    from torch.utils.data import DataLoader, TensorDataset
    from fastai.basics import DataLoaders, Learner, MSELossFlat
    import fastai.callback.progress  # `Learner.no_bar`
    from resumable_train.workers import WorkerStreams
    x = torch.randn(64, 1)
    ds = TensorDataset(x, 2*x+1)
    train,valid = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2),DataLoader(ds, batch_size=16)
    assert train.worker_init_fn is None
    learn = Learner(DataLoaders(train, valid), torch.nn.Linear(1, 1), loss_func=MSELossFlat(), cbs=WorkerStreams(),
                    path=tmp_path)
    with learn.no_bar(), learn.no_logging(): learn.fit(3, 1e-2)
    assert learn.train_iter == 3*4, learn.train_iter
    assert 'worker_init_fn' in vars(train) and train.worker_init_fn is None, vars(train).get('worker_init_fn', 'absent')

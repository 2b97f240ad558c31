"""Issue 48's matrix: each callback fastai ships, with its defaults, on the data it is meant for (`matrix_script.py`), with
`AutoResume(every_iter=3)`. Uninterrupted, the run is stock fastai's bit for bit (weights, optimizer, `Recorder`, steps, the random
streams, each fastai callback's plain attributes). Killed in each window (inside an epoch, during validation, at an epoch's end,
inside the call a callback makes in an event) and rerun, it ends with the uninterrupted run's bits; a rerun after the end trains
nothing and writes nothing. fastai's `TensorBoardCallback`, GAN trainer and the text callbacks are in test_owned.py and test_text.py.
"""
import signal
import pytest
from forked import Forker
from helpers import TESTS
from killrerun import run_until, run_to_end, batches, compare, snapshot
from test_owned import nth

SCRIPT = str(TESTS/'matrix_script.py')
KEYS = ('model', 'opt', 'values', 'losses', 'lrs', 'iters', 'streams', 'cbs')
CBS = ['csv', 'graph', 'stats', 'save', 'early', 'plateau', 'nan', 'accum', 'clip', 'bnfreeze', 'mixup', 'cutmix', 'channels',
       'short', 'mcdropout']
# the windows: inside epoch 2 (its 5th batch; `short` trains 2 batches an epoch: epoch 2's 1st), in epoch 2's validation, after
# epoch 2's end, and inside the `get_preds` a callback makes in epoch 2's `after_epoch`
WINDOWS = {'inside': lambda cb: dict(stop_after=3 if cb == 'short' else 13), 'valid': lambda cb: dict(until=nth('VALID', 2)),
           'end': lambda cb: dict(until=nth('END', 2)), 'nested': lambda cb: dict(until=nth('NESTED', 2))}

@pytest.fixture(scope='module')
def forker(): return Forker(('fastai.basics', 'fastai.callback.all', 'resumable_train.all'))

@pytest.mark.parametrize('cb', CBS)
def test_callback_in_every_window(forker, stock, tmp_path, cb):
    "Stock-equal uninterrupted; killed in each window and rerun: the uninterrupted run's bits; a rerun after the end: nothing"
    for d in ('ref', 'stock'): (tmp_path/d).mkdir()
    ref = batches(run_to_end(forker, SCRIPT, [tmp_path/'ref.pth', '--cb', cb], cwd=tmp_path/'ref'))
    rc,out = stock.run(SCRIPT, tmp_path/'stock.pth', '--cb', cb, '--no-resume', timeout=120, cwd=tmp_path/'stock')
    assert rc == 0, f"stock fastai exited {rc}:\n{out[-3000:]}"
    d = compare(tmp_path/'stock.pth', tmp_path/'ref.pth', keys=(*KEYS, 'steps'))
    assert not d, f"AutoResume changed an uninterrupted run: {len(d)} differences from stock fastai, first:\n" + '\n'.join(d[:10])
    assert len(ref) == {'short': 8, 'early': len(ref)}.get(cb, 36), f"{len(ref)} batches"
    windows = [w for w in WINDOWS if w != 'nested' or cb == 'mcdropout']
    for i,w in enumerate(windows):
        run = tmp_path/w
        run.mkdir()
        rc,lines = run_until(forker, SCRIPT, [tmp_path/f'{w}.pth', '--cb', cb], env={'KILLRERUN_SLEEP': '0.05'}, cwd=run,
                             **WINDOWS[w](cb))
        assert rc == -signal.SIGKILL, f"{w}: meant to be killed, exited {rc}:\n{''.join(lines[-30:])}"
        trained = batches(run_to_end(forker, SCRIPT, [tmp_path/f'{w}.pth', '--cb', cb], cwd=run))
        assert trained == ref[len(ref)-len(trained):], f"{w}: the rerun trained {trained[:3]}..., not the run's rest"
        d = compare(tmp_path/'ref.pth', tmp_path/f'{w}.pth', keys=KEYS)
        assert not d, f"{w}: {len(d)} differences from the uninterrupted run, first:\n" + '\n'.join(d[:10])
        if i: continue  # once per callback: a rerun after the end trains nothing and writes nothing
        before = snapshot(run)
        again = run_to_end(forker, SCRIPT, [tmp_path/f'{w}.pth', '--cb', cb], cwd=run)
        assert not batches(again) and snapshot(run) == before, f"{w}: a rerun of the finished run trained or wrote"

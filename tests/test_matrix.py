"""Issue 48's matrix: each callback fastai ships, with its defaults, on the data it is meant for (`matrix_script.py`), with
`AutoResume(every_iter=3)`. Uninterrupted, the run is stock fastai's bit for bit (weights, optimizer, `Recorder`, steps, the random
streams, each fastai callback's plain attributes). Killed in each window (inside an epoch, during validation, at an epoch's end,
inside the call a callback makes in an event) and rerun, it ends with the uninterrupted run's bits; a rerun after the end trains
nothing and writes nothing. Beside them, a user's callback raising each `Cancel*Exception` in each event where fastai's loop catches
it (`cancels`), and `CancelFitException` inside an epoch (`cancel-fit`). `WandbCallback` runs offline, its files in the test's folder;
its predictions (`log_preds`) are the same in every run that ends. fastai's `TensorBoardCallback`, GAN trainer and the text callbacks are
in test_owned.py and test_text.py.
"""
import signal
import pytest
from forked import Forker
from helpers import TESTS, wandb_env
from killrerun import run_until, run_to_end, batches, compare, nth, snapshot, stock_reference

SCRIPT = str(TESTS/'matrix_script.py')
KEYS = ('model', 'opt', 'values', 'losses', 'lrs', 'iters', 'streams', 'cbs')
CBS = ['csv', 'graph', 'stats', 'save', 'early', 'plateau', 'nan', 'accum', 'clip', 'bnfreeze', 'mixup', 'cutmix', 'channels',
       'short', 'mcdropout', 'cancels', 'cancel-fit', 'wandb', 'late']
# the windows: inside epoch 2 (its 5th batch; `short` trains 2 batches an epoch: epoch 2's 1st; `cancels`: after each of several
# batches, around its cancels), in epoch 2's validation, after epoch 2's end, and inside the `get_preds` a callback makes in epoch
# 2's `after_epoch` (`wandb`: in its `after_validate`); `late`: inside a callback ordered after `AutoResume` at the 15th batch's end
# (a periodic point's) and at epoch 2's end, before its draws. The call inside an event says `VALID` (`mcdropout`'s and `late`'s,
# not `inner`: `END` too) in each epoch: epoch 2's own are later lines
NTH = {'mcdropout': dict(VALID=3, END=4), 'late': dict(VALID=3, END=4), 'wandb': dict(VALID=3, END=2)}
def windows(cb)->dict:
    "The windows `cb` is killed in, by name (each `nth` counts its own lines: new for each test)"
    k = NTH.get(cb, dict(VALID=2, END=2))
    ws = dict(inside=dict(stop_after=13), valid=dict(until=nth('VALID', k['VALID'])), end=dict(until=nth('END', k['END'])))
    if cb in ('mcdropout', 'wandb'): ws['nested'] = dict(until=nth('NESTED', 2))
    if cb == 'short': ws['inside'] = dict(stop_after=3)
    if cb == 'late': ws.update(late=dict(until=nth('LATE', 5)), late_epoch=dict(until=nth('LATE_EPOCH', 2)))
    if cb == 'cancels': ws.update({f'inside{n}': dict(stop_after=n) for n in (7, 22, 31, 40, 47)})
    return ws
# the batches each trains uninterrupted: 4 epochs of 9; `short`: 2 an epoch; `cancels`: 12 epochs, their cancels; `cancel-fit`: it
# ends at epoch 2's 5th batch; `early`: when the valid loss stops improving
N_BATCHES = {'short': 8, 'cancels': 50, 'cancel-fit': 23}

@pytest.fixture(scope='module')
def forker(): return Forker(('fastai.basics', 'fastai.callback.all', 'resumable_train.all'))

@pytest.mark.parametrize('cb', CBS)
def test_callback_in_every_window(forker, stock, tmp_path, cb):
    "Stock-equal uninterrupted; killed in each window and rerun: the uninterrupted run's bits; a rerun after the end: nothing"
    env = wandb_env(tmp_path/'wandb') if cb == 'wandb' else {}  # W&B offline, its files beside the runs' folders
    ref = stock_reference(forker, stock, tmp_path, SCRIPT, ['--cb', cb], keys=(*KEYS, 'steps'), env=env)
    assert len(ref) == N_BATCHES.get(cb, len(ref) if cb == 'early' else 36), f"{len(ref)} batches"
    for i,(w,kill) in enumerate(windows(cb).items()):
        run = tmp_path/w
        run.mkdir()
        rc,lines = run_until(forker, SCRIPT, [tmp_path/f'{w}.pth', '--cb', cb], env={**env, 'KILLRERUN_SLEEP': '0.05'}, cwd=run,
                             **kill)
        assert rc == -signal.SIGKILL, f"{w}: meant to be killed, exited {rc}:\n{''.join(lines[-30:])}"
        trained = batches(run_to_end(forker, SCRIPT, [tmp_path/f'{w}.pth', '--cb', cb], cwd=run, env=env))
        assert trained == ref[len(ref)-len(trained):], f"{w}: the rerun trained {trained[:3]}..., not the run's rest"
        d = compare(tmp_path/'ref.pth', tmp_path/f'{w}.pth', keys=KEYS)
        assert not d, f"{w}: {len(d)} differences from the uninterrupted run, first:\n" + '\n'.join(d[:10])
        if i: continue  # once per callback: a rerun after the end trains nothing and writes nothing
        before = snapshot(run)
        again = run_to_end(forker, SCRIPT, [tmp_path/f'{w}.pth', '--cb', cb], cwd=run, env=env)
        assert not batches(again) and snapshot(run) == before, f"{w}: a rerun of the finished run trained or wrote"
    if cb == 'wandb':  # `log_preds` logged its table once in each run that trained to the end: stock's, ref's, each window's rerun
        tables = [p.name for p in (tmp_path/'wandb'/'wandb').glob('offline-run-*/files/media/table/Prediction_Samples_*.json')]
        assert len(tables) == 2 + len(windows(cb)) and len(set(tables)) == 1, f"not the same predictions at the same step: {tables}"

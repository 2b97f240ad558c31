"""A training script that signals itself at a chosen moment, for the signal tests: `python signal_script.py OUT [options]`.

`--during WRITE` sends `--sig` while the chosen resume point is being written (`end0`: the end of fit call 1; `end`: the end of the last
call; `epoch`: the end of epoch 1; `periodic`: the one after batch 4). `--stop-at N` sends SIGINT after training batch N, as Ctrl-C does;
`--presses K` then sends K more while that stop's resume point is written. `--busy` holds the first write from batch 4 on (a periodic one, deferred while the writer is busy, or an epoch's end) until it is
abandoned, and sends SIGTERM meanwhile; `--fail-stop` makes the stop's write fail as on a read-only folder. `--catch` catches what ends
`fit`, then sends itself SIGTERM: with the handlers put back, the process dies of it. `--stock` trains the same run as stock fastai:
the package never imported, no `AutoResume`, nothing signalled.
"""
import argparse, errno, os, signal, sys, time
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from fastai.test_utils import synth_dbunch
from killrerun import Report, save_result

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('--sched', default='one', choices=['one', 'fine_tune'])
p.add_argument('--sig', default='SIGTERM')
p.add_argument('--during', default=None, choices=['end0', 'end', 'epoch', 'periodic'])
p.add_argument('--background', action='store_true')
p.add_argument('--stop-at', type=int, default=None)
p.add_argument('--presses', type=int, default=0)
p.add_argument('--busy', action='store_true')
p.add_argument('--fail-stop', action='store_true')
p.add_argument('--stop-wait', type=float, default=30)
p.add_argument('--error-at', type=int, default=None, help='raise in this training batch')
p.add_argument('--catch', action='store_true')
p.add_argument('--stock', action='store_true', help='stock fastai: the package never imported, no signal (the uninterrupted run)')
a = p.parse_args()
sig = getattr(signal, a.sig)

def wait_for(cond, what, timeout=20):
    "Wait until `cond()` (set by this process's main thread)"
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline: raise TimeoutError(what)
        time.sleep(0.01)

def chosen(rec)->bool:
    "Is the resume point with record `rec` the write `--during` names?"
    end,f = rec['epoch'] is None,rec['fit_index']
    return {'end0': end and f == 0, 'end': end and f == len(rec['fits'])-1 and f == (1 if a.sched == 'fine_tune' else 0),
            'epoch': not end and rec['epoch'] == 1 and rec['iter'] == 0, 'periodic': not end and rec['epoch'] == 0 and rec['iter'] == 4}[a.during]

if not a.stock:
    from resumable_train.autoresume import AutoResume
    from resumable_train.files import resume_record

    from resumable_train.checkpoints import RunPoints

    _write = RunPoints._write
    def write(self, ck, name, start=None):
        "`RunPoints._write`, signalling this process during the chosen write"
        rec,stop = resume_record(ck),next(cb for cb in learn.cbs if isinstance(cb, AutoResume)).stop_signals
        if a.during and chosen(rec): os.kill(os.getpid(), sig); print('SIGNALLED during', name, flush=True)
        if (a.busy and not stop.stopping and rec['epoch'] is not None and rec['train_iter'] >= 4
                and not self.writer.cancel.is_set()):
            os.kill(os.getpid(), signal.SIGTERM)
            self.writer.cancel.wait(30)  # held until the stop abandons it
        if stop.stopping:
            for k in range(a.presses):
                time.sleep(0.6)  # the same signal twice within half a second counts once
                os.kill(os.getpid(), signal.SIGINT)
                if k == 0: wait_for(lambda: stop.presses == 1, 'the second Ctrl-C')
                else: wait_for(self.writer.cancel.is_set, 'the third Ctrl-C')
            if a.fail_stop:
                raise OSError(errno.EROFS, f"Could not write {self.store.where(name)}: Read-only file system; nothing was written")
        return _write(self, ck, name, start)
    RunPoints._write = write

    class Trigger(Callback):
        "Ctrl-C after training batch `--stop-at`, or an exception in batch `--error-at` (counted in the process, from 1)"
        order = AutoResume.order-1
        def after_batch(self):
            if not self.training: return
            self.seen = getattr(self, 'seen', 0) + 1
            if self.seen == a.stop_at: os.kill(os.getpid(), signal.SIGINT)
            if self.seen == a.error_at: raise RuntimeError('boom')

set_seed(11, reproducible=True)
dls = synth_dbunch(bs=8, n_train=6, n_valid=2)
model = nn.Sequential(nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Dropout(0.2)), nn.Linear(16, 1))
cbs = [Report()] + ([] if a.stock else [AutoResume(every_iter=2, background=a.background, stop_wait=a.stop_wait), Trigger()])
learn = Learner(dls, model, loss_func=MSELossFlat(), metrics=mae, cbs=cbs, path='.', lr=1e-2,
                splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])
try:
    with learn.no_bar():
        if a.sched == 'one': learn.fit_one_cycle(2)
        else: learn.fine_tune(1, freeze_epochs=1)
except (RuntimeError, KeyboardInterrupt) as e:
    if not a.catch: raise
    print('CAUGHT', type(e).__name__, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print('SURVIVED', flush=True)
    sys.exit(0)
save_result(learn, a.out)
print('DONE', flush=True)

"""A script with two fit calls and AutoResume, for the safety tests: `python safety_script.py OUT [options]`.

Between the calls it saves what code there sees (weights, `Recorder`, a `validate`, draws from each random stream, a `learn.save`), to
`--between`: a skipped fit call must leave exactly what the uninterrupted run leaves.
"""
import argparse, os, random, signal, sys
from pathlib import Path
import numpy as np, torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from fastai.test_utils import synth_dbunch
from resumable_train.autoresume import AutoResume
from resumable_train.state import to_plain
from killrerun import Report, save_result

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('--calls', type=int, default=2, help='fit calls to make (1: the second call removed)')
p.add_argument('--second', default='other', choices=['other', 'same'], help='the second call: another schedule, or the first one again (a cell run twice)')
p.add_argument('--lr', type=float, default=1e-2, help='lr_max of the first call')
p.add_argument('--between', default=None, help='where to save what the code between the calls sees')
p.add_argument('--fname', default='autoresume')
p.add_argument('--keep', type=int, default=2)
p.add_argument('--every', type=int, default=2)
p.add_argument('--strict', action='store_true')
p.add_argument('--wait', type=float, default=0)
p.add_argument('--no-resume', action='store_true', help='no AutoResume (the stock fastai learner)')
p.add_argument('--sigint-at', type=int, default=None, help='send this process SIGINT after this many batches, then run the same fit again (a notebook cell re-run after Ctrl-C)')
p.add_argument('--export', default=None, help='learn.export to this file at the end')
p.add_argument('--bar', action='store_true', help='show the progress bar as on a terminal')
p.add_argument('--umask', default=None)
p.add_argument('--add-cb', default=None, choices=['early', 'csv'], help='add a callback with state (EarlyStoppingCallback, CSVLogger)')
p.add_argument('--fresh', default=None, help='AutoResume(fresh_callbacks=[this key])')
p.add_argument('--act', default='relu', choices=['relu', 'gelu'], help="the model's activation")
p.add_argument('--p', type=float, default=0.2, help="the model's dropout")
a = p.parse_args()
if a.umask: os.umask(int(a.umask, 8))
if a.bar:
    import fastprogress.fastprogress as fp, resumable_train.autoresume as ar
    fp.printing = ar.printing = lambda: True

class SigintAt(Callback):
    "Send this process SIGINT after the `n`-th training batch, as Ctrl-C would"
    order = -20
    def __init__(self, n): self.n,self.seen = n,0
    def after_batch(self):
        if not self.training: return
        self.seen += 1
        if self.seen == self.n: os.kill(os.getpid(), signal.SIGINT)

set_seed(11, reproducible=True)
dls = synth_dbunch(bs=8, n_train=6, n_valid=2)
model = nn.Sequential(nn.Sequential(nn.Linear(1, 16), nn.GELU() if a.act == 'gelu' else nn.ReLU(), nn.Dropout(a.p)), nn.Linear(16, 1))
cbs = [Report()] + ([] if a.no_resume else [AutoResume(fname=a.fname, every_iter=a.every, keep=a.keep, strict_hypers=a.strict, wait=a.wait,
                                                       fresh_callbacks=[a.fresh] if a.fresh else [])])
if a.add_cb: cbs.append(EarlyStoppingCallback(patience=50) if a.add_cb == 'early' else CSVLogger())
if a.sigint_at: cbs.append(SigintAt(a.sigint_at))
learn = Learner(dls, model, loss_func=MSELossFlat(), metrics=mae, cbs=cbs, path='.', lr=1e-2,
                splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])

def fit(f):
    "Run fit call `f`; after a Ctrl-C, run it again in this process, keeping the exception alive as a notebook does"
    try: f()
    except KeyboardInterrupt as e:
        if not a.sigint_at: raise
        sys.last_value,sys.last_traceback = e,e.__traceback__
        print('INTERRUPTED', flush=True)
        f()

ctx = learn.no_bar() if not a.bar else learn.no_logging()
with ctx:
    fit(lambda: learn.fit_one_cycle(2, lr_max=a.lr))
    if a.between:
        learn.save(Path(a.between).with_suffix('.stage1').absolute())
        torch.save(to_plain(dict(model=learn.model.state_dict(), opt=learn.opt.state_dict(), values=learn.recorder.values,
                                 losses=learn.recorder.losses, lrs=learn.recorder.lrs, iters=learn.recorder.iters, valid=learn.validate(),
                                 epoch=learn.epoch, train_iter=learn.train_iter, pct_train=learn.pct_train,
                                 draws=[torch.rand(3), random.random(), np.random.rand(2)])), a.between)
    if a.calls > 1:
        if a.second == 'same': fit(lambda: learn.fit_one_cycle(2, lr_max=a.lr))
        else: fit(lambda: learn.fit(2, lr=3e-3))
save_result(learn, a.out)
if a.export:
    learn.dls.new_empty = lambda: DataLoaders(DataLoader([0]), DataLoader([0]))  # synth_dbunch's datasets have no `new_empty`
    learn.export(Path(a.export).absolute())
print('DONE', flush=True)

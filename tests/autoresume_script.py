"A training script that uses AutoResume, for the kill-and-rerun tests: run it, kill it, run it again."
import argparse, os, sys, time
import torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from fastai.test_utils import synth_dbunch
from killrerun import plain

p = argparse.ArgumentParser()
p.add_argument('--dir', required=True)
p.add_argument('--out', required=True)
p.add_argument('--sched', default='one_cycle', choices=['one_cycle', 'fine_tune', 'two', 'zero', 'stage'])
p.add_argument('--every', type=int, default=3)
p.add_argument('--background', action='store_true')
p.add_argument('--sleep', type=float, default=0.0, help='seconds to sleep in each training batch')
p.add_argument('--slow-write', type=float, default=0.0, help='seconds each checkpoint write stays unfinished')
p.add_argument('--no-resume', action='store_true', help='stock fastai: the package never imported (the uninterrupted reference)')
p.add_argument('--lr', type=float, default=1e-2, help="the Learner's default learning rate")
p.add_argument('--load', help='a file to load before the fit calls (another script\'s, in the same folder)')
p.add_argument('--save', help='a file to save after the fit calls')
p.add_argument('--per-call', action='store_true', help='AutoResume given to each fit call, not to the Learner')
p.add_argument('--no-ar', action='store_true', help='the package imported, but no AutoResume: the same script without it')
p.add_argument('--tag', default='', help="a suffix for the script's own files (best, history.csv): another script's in the folder")
a = p.parse_args()
if not a.no_resume: from resumable_train.autoresume import AutoResume
if a.no_ar: a.no_resume = True  # the package imported, as it is

if a.slow_write:
    import resumable_train.state as st
    _save = torch.save
    def slow_save(obj, f, *args, **kw):
        _save(obj, f, *args, **kw)
        if not isinstance(f, (str, os.PathLike)):  # write_checkpoint's temporary file
            print('WRITING', flush=True)
            time.sleep(a.slow_write)
    st.torch.save = slow_save

class Report(Callback):
    "Print each trained batch, count optimizer steps"
    order = 0
    def before_fit(self): self.learn.n_fit = getattr(self.learn, 'n_fit', -1) + 1
    def after_step(self): self.learn.steps = getattr(self.learn, 'steps', 0) + 1
    def after_batch(self):
        if not self.training: return
        print('BATCH', self.learn.n_fit, self.epoch, self.iter, flush=True)
        if a.sleep: time.sleep(a.sleep)

Path(a.dir).mkdir(parents=True, exist_ok=True)
set_seed(11, reproducible=True)
dls = synth_dbunch(bs=8, n_train=6, n_valid=2)
model = nn.Sequential(nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Dropout(0.2)), nn.Linear(16, 1))
sfx = f'-{a.tag}' if a.tag else ''
cbs = [Report(), CSVLogger(f'history{sfx}.csv', append=True), EarlyStoppingCallback(patience=50), SaveModelCallback(fname=f'best{sfx}')]
if a.sched == 'zero': cbs.pop()  # fastai's SaveModelCallback loads its file after each fit: a fit(0) wrote none
def ar(): return [] if a.no_resume else [AutoResume(every_iter=a.every, background=a.background, verbose=True)]
if not a.per_call: cbs += ar()
def per_call(): return ar() if a.per_call else []
learn = Learner(dls, model, loss_func=MSELossFlat(), metrics=mae, cbs=cbs, path=a.dir, lr=a.lr,
                splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])
if a.load: learn.load(a.load)
with learn.no_bar():
    if a.sched == 'one_cycle': learn.fit_one_cycle(4)
    elif a.sched == 'fine_tune': learn.fine_tune(2, freeze_epochs=2)
    elif a.sched == 'zero': learn.fit(0); learn.fine_tune(2, freeze_epochs=0)  # three fit calls, two of 0 epochs
    elif a.sched == 'stage':  # a stage cached with save and load, whose branch sets the Learner's lr (issue 49)
        if (Path(a.dir)/'models'/'stage1.pth').exists(): learn.load('stage1')
        else:
            learn.lr = 3e-2
            learn.fit_one_cycle(2, cbs=per_call()); learn.save('stage1')
        learn.fit_one_cycle(2, cbs=per_call())
    else:
        learn.fit_one_cycle(2, cbs=per_call())
        learn.fit_one_cycle(2, lr_max=3e-3, cbs=per_call())
if a.save: learn.save(a.save)
torch.save(plain(dict(model=learn.model.state_dict(), opt=learn.opt.state_dict()['state'], values=learn.recorder.values,
                losses=learn.recorder.losses, steps=getattr(learn, 'steps', 0))), a.out)
print('DONE', flush=True)

"""The script shapes of issue 28, each with `AutoResume` in one folder: `python shapes_script.py OUT --shape SHAPE [options]`.

Shapes (each makes two fit calls, `fit_one_cycle(2)` then `fit(2, lr=1e-3)`, unless it says otherwise):
- `plain`: one Learner, `AutoResume` among its callbacks;
- `two-learners`: a Learner makes the first call, a second Learner (another model) in the same folder the second (saved to OUT.first too);
- `per-call`: `AutoResume` passed to each fit call (`cbs=AutoResume(...)`), not to the Learner;
- `cached`: the first stage cached with `learn.save`/`learn.load`: a rerun that finds `models/stage1.pth` loads it instead of fitting;
- `export`: the first call, then `learn.export` and `load_learner`, and the second call on the loaded Learner;
- `mixup`: `MixUp` among the callbacks.
Options change what a rerun may change (`--wd`, `--loss`, `--tfms`, `--workers`), add a callback of the user's with a counter and no
`state_dict` (`--counter`), or make the training data a stream that no run could continue inside an epoch (`--stream`).
"""
import argparse, warnings
from pathlib import Path
import torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from killrerun import Report, save_result

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('--shape', default='plain', choices=['plain', 'two-learners', 'per-call', 'cached', 'export', 'mixup'])
p.add_argument('--every', type=int, default=3)
p.add_argument('--wd', type=float, default=None, help='weight decay of the second fit call')
p.add_argument('--loss', default='mse', choices=['mse', 'l1'], help='the loss: a lambda either way')
p.add_argument('--tfms', default='noise,scale', help='the item transforms, in order')
p.add_argument('--workers', type=int, default=0)
p.add_argument('--counter', action='store_true', help="add a callback of the user's that counts batches, with no state_dict")
p.add_argument('--stream', action='store_true', help='train on a plain iterable dataset (refused: no run could continue it)')
p.add_argument('--no-resume', action='store_true', help='stock fastai: the package never imported')
a = p.parse_args()

def noise(t):
    "A random item transform (fastai applies it to the input and the target): draws from torch's stream, or the worker's"
    return t + 0.01*torch.randn(t.shape)
def scale(t): return t*1.5

class Stream(torch.utils.data.IterableDataset):
    def __init__(self, items): self.items = items
    def __len__(self): return len(self.items)
    def __iter__(self): return iter(self.items)

class Counter(Callback):
    "A callback of the user's: it counts batches and scales the loss by its count, with no `state_dict`"
    def __init__(self): self.n = 0
    def after_loss(self):
        if self.training: self.n += 1

set_seed(5, reproducible=True)
x = torch.randn(96, 1)
items = [(x[i], 2*x[i]+1) for i in range(96)]
tfms = [dict(noise=noise, scale=scale)[n] for n in a.tfms.split(',') if n]
if a.stream: dls = DataLoaders(TfmdDL(Stream(items[:72]), bs=8), TfmdDL(items[72:], bs=8))
else: dls = DataLoaders.from_dsets(items[:72], items[72:], bs=8, after_item=tfms, num_workers=a.workers, device='cpu')
losses = dict(mse=lambda p,y: F.mse_loss(p.view(-1), y.view(-1)), l1=lambda p,y: F.l1_loss(p.view(-1), y.view(-1)))

if not a.no_resume: from resumable_train.autoresume import AutoResume
def ar(): return [] if a.no_resume else [AutoResume(every_iter=a.every, verbose=False)]

def learner(seed=None):
    if seed is not None: set_seed(seed, reproducible=True)
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    cbs = [Report()] + ([] if a.shape == 'per-call' else ar()) + ([MixUp()] if a.shape == 'mixup' else [])
    return Learner(dls, model, loss_func=losses[a.loss], cbs=cbs + ([Counter()] if a.counter else []), path='.', lr=1e-2)

def first_call(learn): learn.fit_one_cycle(2, cbs=ar() if a.shape == 'per-call' else None)
def second_call(learn): learn.fit(2, lr=1e-3, wd=a.wd, cbs=ar() if a.shape == 'per-call' else None)

learn = learner()
with learn.no_bar():
    if a.shape == 'cached' and Path('models/stage1.pth').exists():
        learn.load('stage1')
        learn.n_fit = 0  # the cached stage stands for the first fit call: `Report` numbers the next one 1
    else:
        first_call(learn)
        if a.shape == 'cached': learn.save('stage1')
    if a.shape == 'two-learners':
        save_result(learn, f'{a.out}.first')
        learn = learner(seed=6)
    if a.shape == 'export':
        learn.dls.new_empty = lambda: DataLoaders(DataLoader([0]), DataLoader([0]))  # datasets of plain lists have no `new_empty`
        exported = Path(f'{a.out}.pkl').absolute()  # beside the result, not among the run's files
        learn.export(exported)
        del learn.dls.new_empty
        steps,learn = getattr(learn, 'steps', 0),load_learner(exported)
        learn.dls,learn.steps = dls,steps
    with learn.no_bar(): second_call(learn)
save_result(learn, a.out)
print('DONE', flush=True)

"""A user's training script for test_check.py's `resumable-train check`: `python check_script.py FOLDER [--defect D] [--model M]`.

`--model`: `mlp` (a digits MLP, `fit_one_cycle(2)`), `vision` (vision_learner's xresnet on 16x16 digit images, `fine_tune(1)`, 2
DataLoader workers and random crops), `ddp` (the MLP under `DDPTrainer`, for ranks with torchrun's environment). `--defect` plants what
makes a resume inexact: `random` (a Dataset drawing from a generator nobody seeds), `counter` (a callback whose batch counter scales the
loss, without `state_dict`), `nondet` (an operation that says it has no deterministic kernel, drawing from an unseeded generator),
`dict_counter` (a callback counting steps in a dict, dividing the lr
by 10 from step 30, without `state_dict`), `loader` (a DataLoader over a plain stream, which the package refuses for resume points inside an
epoch), `index_add` (a layer summing rows with `index_add_`, which CUDA does with atomic adds: benchmarks/gpu_check.py's check 8). `--no-autoresume`: without
`AutoResume`. `--writers`: with every writer of a Learner's files (`SaveModelCallback`, `CSVLogger`, TensorBoard, `export`, `save`)
and W&B's (`WandbCallback`, its model logged as an artifact; `check` runs it offline).
"""
import argparse, random, time
from functools import partial
from pathlib import Path
import torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from torch._prims_common import alert_not_deterministic
from resumable_train.autoresume import AutoResume

p = argparse.ArgumentParser()
p.add_argument('folder')
p.add_argument('--model', default='mlp', choices=['mlp', 'vision', 'ddp'])
p.add_argument('--defect', default='none', choices=['none', 'random', 'counter', 'dict_counter', 'nondet', 'loader', 'index_add'])
p.add_argument('--no-autoresume', action='store_true')
p.add_argument('--writers', action='store_true')
a = p.parse_args()
unseeded = random.Random()  # seeded from the OS: another stream in every process

class Digits(torch.utils.data.Dataset):
    "scikit-learn's digits as (64 floats, label); with `--defect random`, noise from `unseeded` on each item"
    def __init__(self, x, y): self.x,self.y = x,y
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return self.x[i] + (0.01*unseeded.random() if a.defect == 'random' else 0.), self.y[i]
    def new_empty(self): return Digits(self.x[:0], self.y[:0])  # what `learn.export` keeps of the data

class Stream(torch.utils.data.IterableDataset):
    "The same items as a plain stream, with no state of its own"
    def __init__(self, ds): self.ds = ds
    def __len__(self): return len(self.ds)
    def __iter__(self): return (self.ds[i] for i in range(len(self.ds)))

class Counter(Callback):
    "A callback of the user's: it counts the training batches and scales the gradient by the count, and keeps no state_dict"
    def __init__(self): self.n = 0
    def after_loss(self):
        if self.training: self.n += 1; self.learn.loss_grad = self.learn.loss_grad*(1 + self.n/100)

class DropLR(Callback):
    "A callback of the user's: it counts the training steps in a dict and divides the lr by 10 from step 30, and keeps no state_dict"
    order = ParamScheduler.order+1  # after the schedule's lr
    def __init__(self): self.seen = {'steps': 0}
    def before_batch(self):
        if not self.training: return
        self.seen['steps'] += 1
        if self.seen['steps'] >= 30: self.opt.set_hyper('lr', float(self.opt.hypers[-1]['lr'])/10)

class Planted(nn.Module):
    "An operation without a deterministic kernel, as CUDA's `index_add_` is: it says so, and adds noise nobody seeded"
    def __init__(self): super().__init__(); self.g = torch.Generator().manual_seed(time.time_ns() % 2**31)
    def forward(self, x):
        alert_not_deterministic('Planted.forward')  # what torch's own such kernels call
        return x + 1e-3*torch.rand(x.shape, generator=self.g)

class PairSums(nn.Module):
    "Each row plus its pair's, summed with `index_add_` (on CUDA with atomic adds, whose order varies from run to run)"
    def forward(self, x):
        idx = torch.arange(len(x), device=x.device)//2
        return torch.zeros(len(x)//2 + 1, x.shape[1], device=x.device).index_add_(0, idx, x)[idx]

def mlp_learner(cbs):
    from sklearn.datasets import load_digits
    x,y = load_digits(return_X_y=True)
    x,y = torch.tensor(x, dtype=torch.float32)/16,torch.tensor(y)
    trn,val = Digits(x[:1152], y[:1152]),Digits(x[1152:1280], y[1152:1280])
    dls = DataLoaders(DataLoader(Stream(trn) if a.defect == 'loader' else trn, bs=32, shuffle=a.defect != 'loader', drop_last=True),
                      DataLoader(val, bs=64))
    extra = dict(nondet=[Planted()], index_add=[PairSums()]).get(a.defect, [])
    layers = [nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2), *extra, nn.Linear(32, 10)]
    return Learner(dls, nn.Sequential(*layers), loss_func=CrossEntropyLossFlat(), metrics=accuracy, path=a.folder, cbs=cbs)

def vision_learner_(cbs):
    from fastai.vision.all import ImageDataLoaders, RandomResizedCrop, vision_learner, xresnet18
    from apps_script import digits_folder
    dls = ImageDataLoaders.from_folder(digits_folder(Path(a.folder).parent/'digits', n=8), bs=6, num_workers=2,
                                       item_tfms=RandomResizedCrop(16, min_scale=0.5))
    return vision_learner(dls, partial(xresnet18, widen=0.25), pretrained=False, metrics=accuracy, path=a.folder, cbs=cbs)

set_seed(7, reproducible=True)
cbs = ([] if a.no_autoresume else [AutoResume(every_secs=600)]) + dict(counter=[Counter()], dict_counter=[DropLR()]).get(a.defect, [])
if a.writers:  # every writer of a Learner's files; W&B's predictions need fastai's Datasets (test_matrix.py has them)
    from fastai.callback.tensorboard import TensorBoardCallback
    from fastai.callback.wandb import WandbCallback
    from helpers import wandb_config_fix
    wandb_config_fix()
    cbs += [SaveModelCallback(), CSVLogger(), TensorBoardCallback(trace_model=False, log_preds=False),
            WandbCallback(log_preds=False, log_model=True)]
    class Exports(Callback):
        "`learn.save` inside the fit call that `check` runs (after it, the check's runs have stopped)"
        def after_epoch(self):
            if self.epoch == 0: self.learn.save('epoch1')
    cbs += [Exports()]
if a.model == 'ddp':
    from resumable_train.distributed import DDPTrainer
    cbs.insert(0, DDPTrainer(timeout=30))
learn = (vision_learner_ if a.model == 'vision' else mlp_learner)(cbs)
if a.writers:  # one W&B run across a killed run and its rerun
    import wandb
    from resumable_train.trackers import wandb_id
    wandb.init(project='resumable-train-check', id=wandb_id(learn), resume='allow')
if a.writers: learn.export()  # before the fit call (inside it, fastai cannot pickle CSVLogger's open file)
with learn.no_bar(), learn.no_logging():
    if a.model == 'vision': learn.fine_tune(1, freeze_epochs=1)
    else: learn.fit_one_cycle(2, 1e-2)
if a.writers: wandb.finish()
print('DONE', learn.train_iter)

"""A training script whose DataLoader workers read slow items, for the tests that signal the whole process group (issue 23).

It writes `killrerun.save_result` to `--out`. `--stock` trains the same run as stock fastai: the package never imported, no `AutoResume`,
nothing signalled."""
import argparse, os, signal, threading, time
import torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from sklearn.datasets import load_digits
from killrerun import save_result

p = argparse.ArgumentParser()
p.add_argument('--dir', required=True)
p.add_argument('--out', required=True)
p.add_argument('--signal', default='SIGTERM', help='the signal sent to the whole process group')
p.add_argument('--at', type=int, default=-1, help='send it shortly after this batch (counted over training and validation from 0)')
p.add_argument('--delay', type=float, default=0.002, help='seconds after that batch: the main process is then waiting for data')
p.add_argument('--item-secs', type=float, default=0.003, help='seconds each item takes to read, as decoding an image would')
p.add_argument('--stock', action='store_true', help='stock fastai: the package never imported (no --at)')
a = p.parse_args()
if a.stock and a.at >= 0: p.error('a --stock run is never signalled')
if not a.stock: from resumable_train.autoresume import AutoResume

class SlowItems:
    "Digits as (image, label) pairs that take `item_secs` each to read"
    def __init__(self, x, y): self.x,self.y = x,y
    def __len__(self): return len(self.y)
    def __getitem__(self, i):
        time.sleep(a.item_secs)
        return self.x[i], self.y[i]

class GroupSignal(Callback):
    "Count batches and optimizer steps, print each trained batch, and signal the whole process group (workers included) after batch `at`"
    order = Callback.order if a.stock else AutoResume.order - 1
    def __init__(self): self.n,self.trained = 0,0
    def after_step(self): self.learn.steps = getattr(self.learn, 'steps', 0) + 1
    def after_batch(self):
        if self.training:
            self.trained += 1
            print('BATCH', self.epoch, self.iter, flush=True)
        if self.n == a.at:
            sig = getattr(signal, a.signal)
            threading.Timer(a.delay, os.killpg, (os.getpgrp(), sig)).start()
            print('SIGNAL', 'train' if self.training else 'valid', self.epoch, self.iter, flush=True)
        self.n += 1

set_seed(7, reproducible=True)
x,y = load_digits(return_X_y=True)
x,y = torch.tensor(x, dtype=torch.float32)/16, torch.tensor(y)
dls = DataLoaders.from_dsets(SlowItems(x[:160], y[:160]), SlowItems(x[160:208], y[160:208]), bs=8, num_workers=2)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))
gs = GroupSignal()
learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, path=a.dir,
                cbs=[gs] + ([] if a.stock else [AutoResume(every_iter=1000)]))
with learn.no_bar(): learn.fit_one_cycle(2, 1e-2)
save_result(learn, a.out)
print('TRAINED', gs.trained, flush=True)

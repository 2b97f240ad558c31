"A digits run with AutoResume, for the tests of what a user sees when the package refuses or stops a run (test_refusals.py)."
import sys, time
import torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from sklearn.datasets import load_digits
from resumable_train.autoresume import AutoResume

folder,epochs = sys.argv[1],int(sys.argv[2])
class Pace(Callback):
    "Print each trained batch, then wait a little (time for a Ctrl-C)"
    def after_batch(self):
        if self.training: print('BATCH', self.train_iter, flush=True); time.sleep(0.05)

set_seed(1, reproducible=True)
x,y = load_digits(return_X_y=True)
x,y = torch.tensor(x, dtype=torch.float32)/16, torch.tensor(y)
dls = DataLoaders.from_dsets(list(zip(x[:256], y[:256])), list(zip(x[256:320], y[256:320])), bs=32, num_workers=0)
learn = Learner(dls, nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)), loss_func=CrossEntropyLossFlat(), path=folder,
                cbs=[Pace(), AutoResume()])
with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, 1e-2)
print('DONE', flush=True)

"""A digits MLP trained in mixed precision with `AutoResume(every_iter=3)`, for `killrerun`.

`python precision_script.py OUT PRECISION SCHED [--stock]` (`--stock`: without the package, never imported): PRECISION is `fp16` (`to_fp16`), `bf16` (`to_bf16`) or `scaler` (`to_fp16` with
PyTorch's CPU `GradScaler` in place of fastai's, which a CPU disables, and gradients that overflow at seeded batches: the scale halves,
then grows back); SCHED is `one_cycle` or `fine_tune`. OUT gets `save_result`'s weights, optimizer and Recorder, plus the scaler's last
state and the scale of every step of the last fit call in OUT.scaler (written by a run that trained).
"""
import argparse, warnings
import torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from fastai.callback.fp16 import MixedPrecision
from sklearn.datasets import load_digits
from killrerun import Report, save_result, plain

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('precision', choices=['fp16', 'bf16', 'scaler'])
p.add_argument('sched', choices=['one_cycle', 'fine_tune'])
p.add_argument('--stock', action='store_true', help='stock fastai: the package never imported')
a = p.parse_args()
if not a.stock: from resumable_train.autoresume import AutoResume
warnings.filterwarnings('ignore', message='.*CUDA is not available.*')  # fastai's GradScaler('cuda') and autocast on a CPU

class CPUScaler(Callback):
    "Put PyTorch's CPU `GradScaler` in fastai's place; make the gradients overflow every 7th batch; keep the scaler's last state"
    order = MixedPrecision.order+1
    def before_fit(self): self.learn.scaler = torch.amp.GradScaler('cpu', init_scale=2.**12, growth_interval=3)
    def after_backward(self):
        if self.train_iter % 7 == 3: next(self.model.parameters()).grad[0,0] = float('inf')
    def after_step(self): self.last = (self.learn.scaler.state_dict(), list(self.learn.mixed_precision.scales))

set_seed(3, reproducible=True)
x,y = load_digits(return_X_y=True)
x,y = torch.tensor(x, dtype=torch.float32)/16, torch.tensor(y)
dls = DataLoaders.from_dsets(list(zip(x[:256], y[:256])), list(zip(x[256:320], y[256:320])), bs=16, num_workers=0)
model = nn.Sequential(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2)), nn.Linear(32, 10))
keep = CPUScaler()
cbs = [Report()] + ([] if a.stock else [AutoResume(every_iter=3)]) + ([keep] if a.precision == 'scaler' else [])
learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=cbs, lr=1e-2,
                splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])
learn = learn.to_bf16() if a.precision == 'bf16' else learn.to_fp16()
with learn.no_bar(), learn.no_logging():
    if a.sched == 'one_cycle': learn.fit_one_cycle(3)
    else: learn.fine_tune(2, freeze_epochs=1)
save_result(learn, a.out)
if a.precision == 'scaler' and hasattr(keep, 'last'):  # a run that trained: the scaler as its last step left it
    torch.save(dict(scaler=plain(keep.last[0]), scales=keep.last[1]), f'{a.out}.scaler')

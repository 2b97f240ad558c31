"""A digits MLP with `AutoResume(every_iter=3, background=True)` whose device snapshot is forced on `StandInCopies`, for `killrerun`.

`python snapshot_script.py OUT PRECISION [--no-room] [--stock]`: PRECISION is `fp32` or `fp16` (`to_fp16`). Every tensor counts as
a device tensor, so each resume point is cloned in the training loop, copied to host buffers in the writer's thread (slowed by 0.15 s,
so that the next batches run meanwhile) and written; the script prints `SNAP clone`, `SNAP copy` and `SNAP written NAME` as that
happens. With `--no-room` the stand-in has no room: the host copy, and one warning (`SNAP warning ...`). `--stock` trains the same run
as stock fastai: the package never imported, no `AutoResume`.
"""
import argparse, warnings
import torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from sklearn.datasets import load_digits
from killrerun import Report, save_result

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('precision', choices=['fp32', 'fp16'])
p.add_argument('--no-room', action='store_true')
p.add_argument('--stock', action='store_true', help='stock fastai: the package never imported')
a = p.parse_args()
warnings.filterwarnings('ignore', message='.*CUDA is not available.*')
warnings.showwarning = lambda msg, *args, **kw: print('SNAP warning', msg, flush=True)

say = lambda s: print('SNAP', s, flush=True)
if not a.stock:
    from resumable_train.autoresume import AutoResume
    from resumable_train.checkpoints import Snapshot, StandInCopies, RunPoints
    Snapshot.copies = StandInCopies(room=not a.no_room, delay=0.15, say=say)
    _write = RunPoints._write
    def told(self, ck, name, start=None):
        "`RunPoints._write`, saying when a resume point is written"
        _write(self, ck, name, start)
        say(f'written {name}')
    RunPoints._write = told
    Told = AutoResume

set_seed(3, reproducible=True)
x,y = load_digits(return_X_y=True)
x,y = torch.tensor(x, dtype=torch.float32)/16, torch.tensor(y)
dls = DataLoaders.from_dsets(list(zip(x[:256], y[:256])), list(zip(x[256:320], y[256:320])), bs=16, num_workers=0)
model = nn.Sequential(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2)), nn.Linear(32, 10))
cbs = [Report()] + ([] if a.stock else [Told(every_iter=3, background=True)])
learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=cbs,
                lr=1e-2, splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])
if a.precision == 'fp16': learn = learn.to_fp16()
with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(3)
save_result(learn, a.out)

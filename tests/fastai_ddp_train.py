"""A tiny training script under fastai's own `DistributedTrainer` (`with learn.distrib_ctx(): ...`), with `AutoResume`, for
test_fastai_ddp.py: launch it with `torchrun --standalone --nproc_per_node=2 fastai_ddp_train.py OUT ...` or
`accelerate launch --multi_gpu --num_processes 2 fastai_ddp_train.py OUT ...` (on a CPU with `ACCELERATE_USE_CPU=1`), or fork its
ranks. Each rank writes OUT/rank{R}.pt with its final weights, optimizer state, Recorder values and the files it wrote while training.
With `--stock`, stock fastai: the package never imported, no `AutoResume`."""
import argparse, os, signal, sys, time
from functools import partial
from pathlib import Path
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('--model', default='mlp', choices=['mlp', 'xresnet'])   # a digits MLP, or vision_learner's xresnet on 16x16 digits
p.add_argument('--fit', default='one_cycle', choices=['one_cycle', 'fine_tune'])
p.add_argument('--every', type=int, default=2)         # AutoResume(every_iter=...); 0: at epoch ends only
p.add_argument('--kill-rank', type=int, default=-1)    # SIGKILL this rank (-2: every rank) ...
p.add_argument('--kill-at', type=int, default=-1)      # ... after this training batch (counted over the fit calls)
p.add_argument('--mark-at', type=int, default=-1)      # rank 0 writes OUT/marker after this training batch ...
p.add_argument('--sleep', type=float, default=0.)      # ... and from then on sleeps this long after each batch
p.add_argument('--hold', action='store_true')         # ... or there waits (at most 60 s) for a stop signal (the ranks then stop at the next)
p.add_argument('--elastic', action='store_true')      # AutoResume(elastic=True)
p.add_argument('--fp16', action='store_true')          # learn.to_fp16()
p.add_argument('--timeout', type=float, default=20)    # seconds a rank waits for the others in a collective call
p.add_argument('--nodes', default='shared', choices=['shared', 'own', 'swapped'])   # one run folder, or each rank its own (run0, run1)
p.add_argument('--stock', action='store_true')        # stock fastai: the package never imported
args = p.parse_args()
out = Path(args.out); (out/'run').mkdir(parents=True, exist_ok=True)
rank = int(os.environ.get('RANK', 0))

from fastai.basics import *
from fastai.callback.all import *
from fastai.distributed import *
from datetime import timedelta
from accelerate.utils import InitProcessGroupKwargs
if not args.stock: from resumable_train.autoresume import AutoResume
elif not torch.cuda.is_available():   # stock fastai's DistributedDL broadcasts its order on CUDA (nccl); on a CPU (gloo): on the CPU
    def _broadcast(self, t, rank): t = torch.LongTensor(t); torch.distributed.broadcast(t, rank); return t.tolist()
    DistributedDL._broadcast = _broadcast
from apps_script import digits_folder
from helpers import Writes
writes = Writes()   # the files this rank writes while training

def mlp():
    from sklearn.datasets import load_digits
    x,y = load_digits(return_X_y=True)
    x,y = torch.tensor(x[:300], dtype=torch.float32)/16,torch.tensor(y[:300])
    # 255 samples: padded to 256 on 2 ranks, 4 batches of 32 each (DistributedDL's length, which counts its batches before padding,
    # is then the number it yields)
    dls = DataLoaders.from_dsets(list(zip(x[:255], y[:255])), list(zip(x[255:], y[255:])), bs=32, num_workers=0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy)

def xresnet():
    from fastai.vision.all import ImageDataLoaders, RandomResizedCrop, vision_learner, xresnet18
    # 60 images: 5 batches of 6 on each of 2 ranks
    dls = ImageDataLoaders.from_folder(digits_folder(out.parent/'digits', n=8), bs=6, item_tfms=RandomResizedCrop(16, min_scale=0.5),
                                       num_workers=0)
    return vision_learner(dls, partial(xresnet18, widen=0.25), pretrained=False, metrics=accuracy, lr=1e-3)

class Test(Callback):
    order = 96  # after AutoResume (95): a kill here lands before the batch's resume point (written once every callback saw the event)
    def after_batch(self):
        if not self.training: return
        step = self.learn.auto_resume.fit_index*len(self.dls.train) + self.train_iter   # counted over fine_tune's two fit calls
        if rank == 0 and step == args.mark_at:
            (out/'marker').touch()
            end = time.monotonic() + 60
            while args.hold and not self.learn.auto_resume.stop_signals.signum and time.monotonic() < end: time.sleep(0.02)
        if args.sleep and step >= args.mark_at >= 0: time.sleep(args.sleep)
        if args.kill_rank in (rank, -2) and step == args.kill_at: os.kill(os.getpid(), signal.SIGKILL)

set_seed(0)
learn = (mlp if args.model == 'mlp' else xresnet)()
# each rank a node without a shared disk: its own folder, or the other rank's (rank 0 relaunched on the other node)
learn.path = out/('run' if args.nodes == 'shared' else f"run{rank if args.nodes == 'own' else 1-rank}")
torch.manual_seed(1000 + rank)   # each rank its own random streams (dropout, augmentations), which a resume must give back to each
if not args.stock: learn.add_cbs([Test(), AutoResume(every_iter=args.every or None, elastic=args.elastic)])
if args.fp16: learn.to_fp16()
writes.on = True
try:
    # SyncBatchNorm needs CUDA: on a CPU, sync_bn=False
    with learn.distrib_ctx(sync_bn=torch.cuda.is_available(), kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=args.timeout))]):
        if args.fit == 'one_cycle': learn.fit_one_cycle(2, 1e-2)
        else: learn.fine_tune(1, freeze_epochs=1)
except (SystemExit, KeyboardInterrupt) as e:   # a stop by a signal: 128+signal, or Ctrl-C's KeyboardInterrupt
    (out/f'exit{rank}').write_text(f"{getattr(e, 'code', 'KeyboardInterrupt')} {learn.train_iter}")   # this rank's status and batch
    raise
writes.on = False
res = dict(writes=list(writes), model={k: v.clone() for k, v in learn.model.state_dict().items()}, opt=learn.opt.state_dict(),
           values=learn.recorder.values, lrs=learn.recorder.lrs, train_iter=learn.train_iter,
           trained=None if args.stock else learn.auto_resume.resumed_iter)
torch.save(res, out/f'rank{rank}.pt')

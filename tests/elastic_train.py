"""A tiny training script for the elastic and multi-node tests. Run it as one rank of a process group (under `torchrun`, or forked with
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set) or alone: `elastic_train.py OUT [--elastic] [--workers 2] [--kill-at K] ...`.

The training samples carry their index (the input value maps back to it), so each rank appends to OUT/ledger-{tag}-rank{R}.jsonl, after
every training batch, the indices it trained with the epoch, batch, `pct_train` the batch was scheduled with and its learning rate: the
sample ledger. At the end each rank writes OUT/result-{tag}-rank{R}.pt (weights, optimizer, Recorder, schedule,
tracker). `--fine-tune` runs `learn.fine_tune(EPOCHS)` (two fit calls) on a model split in two, without the tracker."""
import argparse, json, os, signal, sys, time
from pathlib import Path
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('--run', default='run')                 # the folder of resume points (under OUT): one per node in multi-node tests
p.add_argument('--tag', default='run')                 # names the ledger and the result of this launch
p.add_argument('--epochs', type=int, default=3)
p.add_argument('--fine-tune', action='store_true')     # learn.fine_tune(EPOCHS): 1 epoch with layer 0 frozen, then EPOCHS
p.add_argument('--n', type=int, default=30)            # training samples (not a multiple of 2 or 3 batches of 4)
p.add_argument('--bs', type=int, default=4)
p.add_argument('--workers', type=int, default=0)
p.add_argument('--drop-last', action='store_true')
p.add_argument('--every', type=int, default=1)         # AutoResume(every_iter=...)
p.add_argument('--elastic', action='store_true')
p.add_argument('--kill-at', type=int, default=-1)      # after this training batch (train_iter) is saved, SIGKILL ...
p.add_argument('--kill-rank', type=int, default=-1)    # ... this rank only (-1: all ranks, after a barrier), in the first attempt only
p.add_argument('--mark-at', type=int, default=-1)      # rank 0 writes OUT/marker-{tag} after this training batch
p.add_argument('--sleep', type=float, default=0.)      # seconds per training batch
p.add_argument('--slow-valid', type=float, default=0.) # seconds rank 0 spends in its first validation (as a loaded machine may)
p.add_argument('--timeout', type=float, default=20)
args = p.parse_args()
out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
rank = int(os.environ.get('RANK', 0))
attempt = int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))

from fastai.basics import *
from fastai.callback.all import *   # fit_one_cycle, SaveModelCallback (the package does not import them)
import torch.distributed as dist
from resumable_train.autoresume import AutoResume
from resumable_train.distributed import DDPTrainer

class Ledger(Callback):
    "Log what each training batch trained; kill, mark or slow down where the arguments say"
    order = AutoResume.order+1
    def before_fit(self): self.f = open(out/f'ledger-{args.tag}-rank{rank}.jsonl', 'a')
    def before_batch(self):
        self.pct = self.pct_train
        if self.training: self._kill()
    def _kill(self):
        "At the event after training batch `--kill-at`: past the write of its resume point (once every callback saw its `after_batch`)"
        if self.train_iter == args.kill_at and attempt == 0 and args.kill_rank in (-1, rank):
            if args.kill_rank == -1 and dist.is_initialized(): dist.barrier()   # every rank past the write of the resume point
            os.kill(os.getpid(), signal.SIGKILL)
    def after_batch(self):
        if not self.training: return
        idx = [index[v] for v in self.xb[0][:,0].tolist()]
        self.f.write(json.dumps(dict(epoch=self.epoch, iter=self.iter, train_iter=self.train_iter, pct=self.pct,
                                     lr=self.opt.hypers[-1]['lr'], idx=idx)) + '\n')
        self.f.flush()
        if args.sleep: time.sleep(args.sleep)
        if rank == 0 and self.train_iter == args.mark_at: (out/f'marker-{args.tag}').touch()
    def before_validate(self):
        self._kill()  # the epoch's last batch
        if rank == 0 and args.slow_valid and self.epoch == 0: time.sleep(args.slow_valid)
    def after_fit(self):   # a fit call that AutoResume skips (it finished in an earlier run) never opened the file
        if (f := self.__dict__.pop('f', None)): f.close()

trainer = DDPTrainer(timeout=args.timeout)
set_seed(0)
x = torch.randn(args.n, 1)
index = {v: i for i,v in enumerate(x[:,0].tolist())}
assert len(index) == args.n
train = TfmdDL(list(zip(x, 2*x + 3 + 0.1*torch.randn(args.n, 1))), bs=args.bs, shuffle=True, drop_last=args.drop_last, num_workers=args.workers)
xv = torch.randn(8, 1)
valid = TfmdDL(list(zip(xv, 2*xv + 3)), bs=8)
model = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 1))
torch.manual_seed(1000 + rank)   # each rank its own streams (dropout)
tracker = SaveModelCallback(monitor='valid_loss')   # its file is on rank 0's node: not in fine_tune, whose rank 0 moves
def split(m): return [params(m[0]), params(m[3])]
learn = Learner(DataLoaders(train, valid), model, loss_func=MSELossFlat(), path=out/args.run,
                splitter=split if args.fine_tune else trainable_params,
                cbs=[trainer, AutoResume(every_iter=args.every, elastic=args.elastic), Ledger()]
                    + ([] if args.fine_tune else [tracker]))
if args.fine_tune: learn.fine_tune(args.epochs, 1e-2)
else: learn.fit_one_cycle(args.epochs, 1e-2)
rec = learn.recorder
res = dict(model={k: v.clone() for k,v in learn.model.state_dict().items()}, opt=learn.opt.state_dict(),
           values=rec.values, lrs=rec.lrs, losses=rec.losses, iters=rec.iters, train_iter=learn.train_iter,
           pct_train=learn.pct_train, best=getattr(tracker, 'best', None), world_size=trainer.world_size)
torch.save(res, out/f'result-{args.tag}-rank{rank}.pt')

"""A tiny training script for the DDPTrainer tests: run it with `torchrun --standalone --nproc_per_node=2 dist_train.py OUT ...`
(or with plain `python`). Each rank writes OUT/rank{R}.pt with its final weights, Recorder values, a single-process validation of the
final weights, the files it opened for writing during fit, and timings."""
import argparse, os, signal, sys, time
from pathlib import Path
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('--epochs', type=int, default=3)
p.add_argument('--n-train', type=int, default=7)       # batches of 15 in the whole training set: 105 items, not a multiple of 2
p.add_argument('--every', type=int, default=0)         # AutoResume(every_iter=...); 0: no AutoResume
p.add_argument('--every-secs', type=float, default=0)  # AutoResume(every_secs=...) (or with --every)
p.add_argument('--kill-rank', type=int, default=-1)    # SIGKILL this rank ...
p.add_argument('--kill-at', type=int, default=-1)      # ... after this training batch (train_iter)
p.add_argument('--hang-rank', type=int, default=-1)    # SIGSTOP this rank (it hangs, it does not die) ...
p.add_argument('--hang-at', type=int, default=-1)      # ... after this training batch (train_iter)
p.add_argument('--torch-dl', action='store_true')     # the training data in a PyTorch DataLoader over a map-style dataset (refused)
p.add_argument('--stream', action='store_true')       # the training data a stream of this rank's items, which keeps its position
p.add_argument('--source', choices=('hf_buffer', 'sdl_map', 'replay_gen'), default=None)  # issue 29's training data (`streams`)
p.add_argument('--elastic', action='store_true')      # AutoResume(elastic=True)
p.add_argument('--stop-rank0-at', type=int, default=-1)  # rank 0 alone raises CancelFitException at the end of this epoch
p.add_argument('--sleep', type=float, default=0.)      # seconds per training batch
p.add_argument('--mark-at', type=int, default=-1)      # rank 0 writes OUT/marker after this training batch
p.add_argument('--timeout', type=float, default=20)
p.add_argument('--workers', type=int, default=0)       # DataLoader workers; with them the items are read slowly (--item-secs each)
p.add_argument('--item-secs', type=float, default=0.004)
p.add_argument('--fp16', action='store_true')          # learn.to_fp16() (on a CPU fastai disables autocast and its GradScaler)
p.add_argument('--no-gate', action='store_true')      # for timing only: skip the stop all-reduce (stops then are not coordinated)
p.add_argument('--cached', action='store_true')       # a first fit call of 1 epoch cached as the stage `stage1`, loaded when found,
                                                      # then a draw, and the fit call of `--epochs`, the only one `--kill-at` counts in
p.add_argument('--nested', type=int, default=0)       # a callback scores a shuffled copy of the validation set with `get_preds` in
                                                      # each `after_epoch`; this rank (1: rank 0, 2: rank 1) killed inside it in epoch 2
args = p.parse_args()
out = Path(args.out); (out/'run').mkdir(parents=True, exist_ok=True)
rank = int(os.environ.get('RANK', 0))

from fastai.basics import *
from fastai.test_utils import synth_dbunch
from fastai.callback.progress import CSVLogger
from helpers import Sized, Writes
writes = Writes()   # the files this rank writes while training

from fastai.callback.tracker import SaveModelCallback
import resumable_train
from resumable_train.autoresume import AutoResume
from resumable_train.distributed import DDPTrainer


class RankStream(torch.utils.data.IterableDataset):
    "This rank's part of a stream over `ds`: items rank, rank+world, ... (as many on every rank); it keeps its position, the index of its next item, which differs by rank"
    def __init__(self, ds, rank, world): self.ds,self.rank,self.world,self.i,self.n = ds,rank,world,rank,len(ds)//world*world
    def __len__(self): return self.n//self.world
    def __iter__(self):
        while self.i < self.n:
            self.i += self.world
            yield self.ds[self.i - self.world]
        self.i = self.rank
    def state_dict(self): return {'i': self.i}
    def load_state_dict(self, sd): self.i = sd['i']

class Buffered(torch.utils.data.IterableDataset):
    "This rank's part of `ds` (items rank, rank+world, ...), shared among workers, shuffled through a buffer that draws with `torch.randint`"
    def __init__(self, ds, rank, world): self.ds,self.rank,self.world = ds,rank,world
    def __len__(self): return len(self.ds)//self.world
    def __iter__(self):
        w,buf = torch.utils.data.get_worker_info(),[]
        mine = range(self.rank, len(self)*self.world, self.world)
        for i in mine[w.id if w else 0::w.num_workers if w else 1]:
            buf.append(i)
            if len(buf) == 6: yield self.ds[buf.pop(int(torch.randint(6, ())))]
        while buf: yield self.ds[buf.pop(int(torch.randint(len(buf), ())))]

class SetEpoch(Callback):
    "Tell the training data the epoch (Hugging Face and DistributedSampler reshuffle by it)"
    def before_train(self):
        dl = self.dls.train
        for o in (getattr(dl, 'sampler', None), getattr(dl.dataset, 'ds', None)):
            if hasattr(o, 'set_epoch'): o.set_epoch(self.epoch)

def source_data(dls, ds, world):
    "The training data `--source` asks for, this rank's part of `ds`: 2 workers each"
    from torchdata.stateful_dataloader import StatefulDataLoader
    if args.source == 'replay_gen': return DataLoaders(torch.utils.data.DataLoader(Buffered(ds, rank, world), batch_size=15, num_workers=2), dls.valid)
    if args.source == 'sdl_map':
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=3)
        return DataLoaders(StatefulDataLoader(ds, batch_size=15, sampler=sampler, num_workers=2), dls.valid)
    from datasets import Dataset as HFDataset
    from datasets.distributed import split_dataset_by_node
    x,y = (t[:len(ds)//4*4].squeeze(-1).tolist() for t in ds.tensors)
    hf = HFDataset.from_dict({'x': x, 'y': y}).to_iterable_dataset(num_shards=4).shuffle(seed=0, buffer_size=16)
    hf = split_dataset_by_node(hf, rank=rank, world_size=world)
    return DataLoaders(StatefulDataLoader(Sized(hf, len(x)//world), batch_size=15, num_workers=2), dls.valid)

def train_data(dls):
    "`dls` with the training data as `--torch-dl`, `--stream` or `--source` ask"
    ds,world = dls.train.dataset,int(os.environ.get('WORLD_SIZE', 1))
    if args.source: return source_data(dls, ds, world)
    if args.torch_dl: return DataLoaders(torch.utils.data.DataLoader(ds, batch_size=15), dls.valid)
    if args.stream: return DataLoaders(torch.utils.data.DataLoader(RankStream(ds, rank, world), batch_size=15), dls.valid)
    return dls

class Test(Callback):
    order,trained = 96,0
    def after_batch(self):
        if not self.training: return
        self.trained += 1   # the batches this process trained
        if args.sleep: time.sleep(args.sleep)
        if args.cached and self.n_epoch == 1: return  # the cached stage's fit call
        if rank == 0 and self.train_iter == args.mark_at: (out/'marker').touch()
        if rank == args.kill_rank and self.train_iter == args.kill_at: os.kill(os.getpid(), signal.SIGKILL)
        if rank == args.hang_rank and self.train_iter == args.hang_at: os.kill(os.getpid(), signal.SIGSTOP)
    def after_epoch(self):
        if rank == 0 and self.epoch == args.stop_rank0_at: raise CancelFitException()

class Score(Callback):
    "`--nested`: `get_preds` inside `after_epoch` (the `FetchPredsCallback` pattern), over a shuffled loader: it draws"
    order = 97
    def after_epoch(self):
        learn,kill = self.learn,rank == args.nested - 1 and self.epoch == 1
        class Kill(Callback):
            def after_batch(self): os.kill(os.getpid(), signal.SIGKILL)  # inside the call, at its first batch
        with learn.removed_cbs(self): learn.scores = learn.get_preds(dl=learn.dls.valid.new(shuffle=True), cbs=[Kill()] if kill else [])

trainer = DDPTrainer(timeout=args.timeout)
if args.no_gate: trainer._agree = lambda stop: stop
set_seed(0)
dls = synth_dbunch(bs=15, n_train=args.n_train, n_valid=3)
if args.workers:
    class SlowItems(list):
        "Items that take `--item-secs` each to read, as decoding an image would: the main process waits for its workers"
        def __getitem__(self, i): time.sleep(args.item_secs); return super().__getitem__(i)
    dls = DataLoaders.from_dsets(*(SlowItems(zip(dl.dataset.tensors[0], dl.dataset.tensors[1])) for dl in dls.loaders), bs=15,
                                 num_workers=args.workers)
model = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 1))
torch.manual_seed(1000 + rank)   # each rank its own random streams (dropout), which a resume must give back to each
test = Test()
cbs = [trainer, test, CSVLogger(), SaveModelCallback(every_epoch=True)] + ([SetEpoch()] if args.source else [])
cbs += [Score()] if args.nested else []
cbs += [AutoResume(every_iter=args.every or None, every_secs=args.every_secs or None, elastic=args.elastic,
                  replay=args.source == 'replay_gen')] if args.every or args.every_secs else []
dls = train_data(dls)
learn = Learner(dls, model, loss_func=MSELossFlat(), metrics=[mae, rmse], cbs=cbs, path=out/'run')
if args.fp16: learn.to_fp16()
writes.on = True
start = time.perf_counter()
if args.cached:
    if (out/'run'/'models'/'stage1.pth').exists(): learn.load('stage1')
    else:
        learn.fit(1, 1e-2)
        learn.save('stage1')
    torch.randn(3)  # a draw between the stages, as a new head's initialisation would make
try: learn.fit(args.epochs, 1e-2)
except SystemExit as e:
    writes.on = False
    (out/f'exit{rank}').write_text(f'{e.code} {learn.train_iter}')   # this rank's status and batch (torchrun's status says less)
    raise
secs = time.perf_counter() - start
where = dict(epoch=learn.epoch, n_epoch=learn.n_epoch, pct_train=learn.pct_train)   # as fit left them (validate moves them)
writes.on = False
# `validate` runs their fit events, which would write (model_0.pth); `Score`'s `get_preds` inside `validate` waits forever (stock too)
learn.remove_cbs([CSVLogger, AutoResume, SaveModelCallback, Score])
res = dict(model={k: v.clone() for k, v in learn.model.state_dict().items()}, values=learn.recorder.values, train_iter=learn.train_iter,
           epochs=len(learn.recorder.values), validate=list(learn.validate()), writes=list(writes), secs=secs,
           gate_secs=trainer.gate_secs, world_size=trainer.world_size, trained=test.trained, **where)
torch.save(res, out/f'rank{rank}.pt')

"""Train on a stream or a stateful loader with `AutoResume(every_iter=3)`, for `killrerun` (issue 19).

`python stream_script.py OUT SOURCE [--no-replay]`, run in the run's folder: SOURCE is one of `SOURCES`.
`python stream_script.py OUTDIR --stock --sources SOURCE...` trains each source as stock fastai (the package never imported), one after
the other in `OUTDIR/SOURCE`, and saves `OUTDIR/SOURCE.pth`.
"""
import argparse, random, sys, warnings
import numpy as np
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader as TorchDL, Dataset, IterableDataset, get_worker_info
from fastai.basics import *
from fastai.callback.all import *
from killrerun import Report, save_result
from helpers import Sized
warnings.filterwarnings('ignore', message="'set_vital' is deprecated")

N,BS = 48,8  # items a training epoch, batch size: 6 batches an epoch

def _xy(i): x = (i % N)/N*2 - 1; return torch.tensor([x]), torch.tensor([2*x + 0.3])

class Points(Dataset):
    "A map-style dataset of `n` points on a line"
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
    def __getitem__(self, i): return _xy(i)

class Noisy(Points):
    "Points with noise drawn from python's, numpy's and torch's streams when an item is loaded (in a DataLoader worker)"
    def __getitem__(self, i):
        x,y = _xy(i)
        return x + 0.1*random.random() + 0.1*float(np.random.rand()) + 0.1*torch.rand(1), y

class Counter(IterableDataset):
    "A stream of `n` points that keeps its position (`state_dict`), shared among DataLoader workers by striding"
    def __init__(self, n): self.n,self.pos,self.loaded = n,0,None
    def __len__(self): return self.n
    def __iter__(self):
        w = get_worker_info()
        k,m = (w.id,w.num_workers) if w else (0,1)
        self.pos,self.loaded = self.loaded or 0,None  # an iteration starts at the beginning, or where a loaded state says
        while (i := k + self.pos*m) < self.n:
            self.pos += 1
            yield _xy(i)
    def state_dict(self): return {'pos': self.pos}
    def load_state_dict(self, sd): self.loaded = sd['pos']

class Generated(IterableDataset):
    "A generator stream, with no position of its own: its order is drawn from torch's stream when it starts"
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
    def __iter__(self):
        for i in torch.randperm(self.n).tolist(): yield _xy(i)

class Buffered(IterableDataset):
    "A stream shuffled through a buffer of 8 items, which picks the item to yield with `torch.randint` (torch's global stream); workers share it by striding"
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
    def __iter__(self):
        w,buf = get_worker_info(),[]
        for i in range(w.id if w else 0, self.n, w.num_workers if w else 1):
            buf.append(i)
            if len(buf) == 8: yield _xy(buf.pop(int(torch.randint(8, ()))))
        while buf: yield _xy(buf.pop(int(torch.randint(len(buf), ()))))

class SetEpoch(Callback):
    "Tell the training dataset the epoch (Hugging Face reshuffles by it)"
    def before_train(self): self.dls.train.dataset.set_epoch(self.epoch)

def _hf(shuffle, n=N):
    "`N` points in 4 shards, shuffled through a buffer or not, that say they are `n`"
    from datasets import Dataset as HFDataset
    xs = [i/N*2-1 for i in range(N)]
    ds = HFDataset.from_dict({'x': xs, 'y': [2*x+0.3 for x in xs]}).to_iterable_dataset(num_shards=4)
    return Sized(ds.shuffle(seed=3, buffer_size=16) if shuffle else ds, n)

def hf_buffer(a):
    "The issue's stream: 512 examples in 4 shards, a shuffle buffer of 128, 2 workers, 32 a batch (16 batches an epoch)"
    from datasets import Dataset as HFDataset
    from torchdata.stateful_dataloader import StatefulDataLoader
    xs = [i/256 - 1 for i in range(512)]
    ds = HFDataset.from_dict({'x': xs, 'y': [2*x+0.3 for x in xs]}).to_iterable_dataset(num_shards=4).shuffle(seed=0, buffer_size=128)
    return DataLoaders(StatefulDataLoader(Sized(ds, 512), batch_size=32, num_workers=2), _valid()), [SetEpoch()]

def _shards():
    "4 tar shards of 12 points each in ./shards (made once), as webdataset reads them"
    import webdataset as wds
    Path('shards').mkdir(exist_ok=True)
    for s in range(4):
        if Path(f'shards/{s}.tar').exists(): continue
        with wds.TarWriter(f'shards/{s}.tar.tmp') as w:
            for i in range(s*12, s*12+12): w.write({'__key__': f'{i:04d}', 'i.txt': str(i)})
        Path(f'shards/{s}.tar.tmp').rename(f'shards/{s}.tar')
    return [f'shards/{s}.tar' for s in range(4)]

def _wds_point(sample): return _xy(int(sample['i.txt']))

def wds_loader(a):
    "`wds.WebDataset(...).shuffle(8, seed=1)` in a `WebLoader` with 2 workers (each reads 2 shards)"
    import webdataset as wds
    ds = wds.WebDataset(_shards(), shardshuffle=False).shuffle(8, seed=1).decode().map(_wds_point).with_length(N)
    return DataLoaders(wds.WebLoader(ds, batch_size=BS, num_workers=2).with_length(N//BS), _valid()), []

def wds_unseeded(a):
    "The same without a seed: webdataset seeds its buffer's generator with the clock"
    import webdataset as wds
    ds = wds.WebDataset(_shards(), shardshuffle=False).shuffle(8).decode().map(_wds_point).with_length(N)
    return DataLoaders(wds.WebLoader(ds, batch_size=BS, num_workers=2).with_length(N//BS), _valid()), []

def _valid(): return TorchDL(Points(16), batch_size=BS)

def sdl_map(a):
    from torchdata.stateful_dataloader import StatefulDataLoader
    return DataLoaders(StatefulDataLoader(Points(N), batch_size=BS, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5)),
                       StatefulDataLoader(Points(16), batch_size=BS, num_workers=2)), []

def sdl_noisy(a):
    from torchdata.stateful_dataloader import StatefulDataLoader
    return DataLoaders(StatefulDataLoader(Noisy(N), batch_size=BS, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5)),
                       StatefulDataLoader(Points(16), batch_size=BS, num_workers=2)), []

def sdl_iter(a):
    from torchdata.stateful_dataloader import StatefulDataLoader
    return DataLoaders(StatefulDataLoader(Counter(N), batch_size=BS, num_workers=2), _valid()), []

def hf_state(a):
    from torchdata.stateful_dataloader import StatefulDataLoader
    return DataLoaders(StatefulDataLoader(_hf(False), batch_size=BS, num_workers=2), _valid()), [SetEpoch()]

def hf_long(a):
    "A shuffled stream in torchdata's loader with 2 workers whose epoch holds 6 batches where `len()` says 5 (issue 48)"
    from torchdata.stateful_dataloader import StatefulDataLoader
    return DataLoaders(StatefulDataLoader(_hf(True, N-BS), batch_size=BS, num_workers=2), _valid()), [SetEpoch()]

def hf_short(a):
    "The same stream, whose epoch holds 6 batches where `len()` says 7"
    from torchdata.stateful_dataloader import StatefulDataLoader
    return DataLoaders(StatefulDataLoader(_hf(True, N+BS), batch_size=BS, num_workers=2), _valid()), [SetEpoch()]

def hf_replay(a): return DataLoaders(TorchDL(_hf(True), batch_size=BS), _valid()), [SetEpoch()]

def gen(a): return DataLoaders(TorchDL(Generated(N), batch_size=BS), _valid()), []

def gen_buffer(a): return DataLoaders(TorchDL(Buffered(N), batch_size=BS), _valid()), []

def gen_workers(a): return DataLoaders(TorchDL(Buffered(N), batch_size=BS, num_workers=2), _valid()), []

def fastai_buffer(a):
    from fastai.data.load import DataLoader
    return DataLoaders(DataLoader(Buffered(N), bs=BS), _valid()), []

def fastai_state(a):
    from fastai.data.load import DataLoader
    return DataLoaders(DataLoader(Counter(N), bs=BS), _valid()), []

def fastai_gen(a):
    from fastai.data.load import DataLoader
    return DataLoaders(DataLoader(Generated(N), bs=BS), _valid()), []

def persistent(a): return DataLoaders(TorchDL(Points(N), batch_size=BS, shuffle=True, num_workers=2, persistent_workers=True), _valid()), []

SOURCES = dict(sdl_map=sdl_map, sdl_noisy=sdl_noisy, sdl_iter=sdl_iter, hf_state=hf_state, hf_long=hf_long, hf_short=hf_short, hf_replay=hf_replay, hf_buffer=hf_buffer, gen=gen, fastai_state=fastai_state, fastai_gen=fastai_gen, gen_buffer=gen_buffer, gen_workers=gen_workers, fastai_buffer=fastai_buffer, wds=wds_loader, wds_unseeded=wds_unseeded, persistent=persistent)
REPLAY = ('hf_replay', 'gen', 'fastai_gen', 'gen_buffer', 'gen_workers', 'fastai_buffer', 'wds', 'wds_unseeded')  # resumed by replaying the stream (`AutoResume(replay=True)`)

def run(a, out, source, path, cbs=()):
    "Train on `source` in `path`, with `Report` and `cbs`; save the result to `out`"
    set_seed(11, reproducible=True)
    dls,own = SOURCES[source](a)
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    learn = Learner(dls, model, loss_func=MSELossFlat(), metrics=mae, path=Path(path).absolute(), cbs=own)
    learn.add_cbs([Report(), *cbs])
    with learn.no_bar(): learn.fit_one_cycle(3, 1e-2)
    save_result(learn, out)

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('out')
    p.add_argument('source', nargs='?', choices=list(SOURCES))
    p.add_argument('--no-replay', action='store_true', help='without the replay opt-in')
    p.add_argument('--stock', action='store_true', help='the --sources, as stock fastai (the package never imported)')
    p.add_argument('--sources', nargs='*', default=[], help='with --stock: the sources to train on')
    a = p.parse_args()
    if a.stock:
        for source in a.sources: run(a, Path(a.out)/f'{source}.pth', source, Path(a.out)/source)
        assert not any(m.startswith('resumable_train') for m in sys.modules), "the stock run imported the package"
    else:
        from resumable_train.autoresume import AutoResume
        run(a, a.out, a.source, '.', [AutoResume(every_iter=3, verbose=True, replay=a.source in REPLAY and not a.no_replay)])
    print('DONE', flush=True)

"10. Resuming a stream at batch k: from its state, by replay, by iterating and discarding, and with torchdata's own resume"
import logging, random, time, warnings
import torch
from torch.utils.data import DataLoader as TorchDL, IterableDataset
from resumable_train.loaders import Resumed, loader_position
from common import *

class Stream(IterableDataset):
    "`n` items of `n_in` floats, each made when read (as if decoded); with `stateful`, it keeps its position (`state_dict`)"
    def __init__(self, n, n_in=64, stateful=False): self.n,self.n_in,self.stateful,self.pos = n,n_in,stateful,0
    def __len__(self): return self.n
    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield torch.full((self.n_in,), float(self.pos))
        self.pos = 0

class Counted(Stream):
    def state_dict(self): return {'pos': self.pos}
    def load_state_dict(self, sd): self.pos = sd['pos']

def _position(mk, k):
    "The position of a loader from `mk` after `k` batches, as a resume point keeps it"
    dl = mk(); it = iter(dl)
    for _ in range(k): next(it)
    return dl, it

def _first(make)->float:
    "Seconds to make an iterable with `make` and get its first batch"
    t = time.perf_counter()
    next(iter(make()))
    return time.perf_counter() - t

def _variants(k, bs, n):
    "The ways to start a stream of `n` items at batch `k`: each a function that makes an iterable whose first batch is batch `k`"
    from torchdata.stateful_dataloader import StatefulDataLoader
    state = loader_position(_position(lambda: TorchDL(Counted(n), batch_size=bs), k)[0], 'dataset')
    sdl = lambda ds: StatefulDataLoader(ds, batch_size=bs)
    sd_state,sd_plain = _position(lambda: sdl(Counted(n)), k)[0].state_dict(),_position(lambda: sdl(Stream(n)), k)[0].state_dict()
    def discard():
        it = iter(TorchDL(Stream(n), batch_size=bs))
        for _ in range(k): next(it)
        return it
    def torchdata(ds, sd):
        dl = sdl(ds); dl.load_state_dict(sd); return dl
    return {'state': lambda: Resumed(TorchDL(Counted(n), batch_size=bs), k, 'dataset', state),
            'replay': lambda: Resumed(TorchDL(Stream(n), batch_size=bs), k, 'replay'),
            'discard': discard,
            'torchdata state': lambda: torchdata(Counted(n), sd_state),
            'torchdata replay': lambda: torchdata(Stream(n), sd_plain)}

def run(quick=False, reps=None, **kwargs):
    ks = (0, 10, 100) if quick else (0, 100, 1000, 10_000)
    reps,bs = reps or (1 if quick else 3),32
    n = (max(ks)+2)*bs
    times = {}
    warnings.filterwarnings('ignore', message='Replaying')
    warnings.filterwarnings('ignore', message="'set_vital' is deprecated")  # torchdata 0.11 on torch 2.9+
    logging.getLogger('torchdata').setLevel(logging.ERROR)  # torchdata warns of its own replay
    for r in range(reps):
        for k in ks:
            vs = _variants(k, bs, n)
            names = list(vs); random.Random(f'{r}{k}').shuffle(names)
            for v in names: times.setdefault((k, v), []).append(_first(vs[v]))
    t = Table('streams', '10. Streams: time to the first batch when resuming at batch k of an epoch',
              ['k', 'state ms', 'replay ms', 'replay / state', 'iterate-and-discard ms', 'discard / replay', 'torchdata state ms', 'torchdata replay ms'],
              [f"a stream of {n:,} items of 64 floats, made when read; {bs} items a batch; no workers; median of {reps} runs, variants interleaved",
               "state: the dataset's own `state_dict` (`loader_kind` 'dataset'); replay: `AutoResume(replay=True)`, the items before batch k read but "
               "not collated; iterate-and-discard: the first k batches loaded and collated (timed with the rest); torchdata: its `StatefulDataLoader` "
               "resumed from its `state_dict`, over the stateful stream, and over the plain stream (which it fast-forwards by loading k batches)"])
    for k in ks:
        m = {v: med(times[(k, v)]) for v in ('state', 'replay', 'discard', 'torchdata state', 'torchdata replay')}
        t.add(k, ms(m['state']), ms(m['replay']), ratio(m['replay'], m['state']), ms(m['discard']), ratio(m['discard'], m['replay']),
              ms(m['torchdata state']), ms(m['torchdata replay']))
    t.raw = {f'{k}/{v}': xs for (k, v),xs in times.items()}
    return t

def _hf_stream(n, buffer_size, keep):
    "The issue's stream: `n` examples in 4 shards, shuffled with a buffer; with `keep`, the buffer kept in its state (`keep_buffers`)"
    from datasets import Dataset as HFDataset
    from torch.utils.data import DataLoader as TorchDL
    from resumable_train.loaders import keep_buffers
    ds = HFDataset.from_dict({'x': list(range(n))}).to_iterable_dataset(num_shards=4).shuffle(seed=0, buffer_size=buffer_size)
    if keep: keep_buffers(TorchDL(ds))
    return ds

_STATES = {}
def _hf_variants(k, bs, n, buffer_size, workers, every):
    "The ways to start the buffered stream at batch `k`; and for each state-based one, the examples of the rest of the epoch"
    from torchdata.stateful_dataloader import StatefulDataLoader
    # a snapshot of the workers every `every` batches (torchdata's default, every batch, copies the buffer each time: `_snapshot_ms`)
    sdl = lambda keep: StatefulDataLoader(_hf_stream(n, buffer_size, keep), batch_size=bs, num_workers=workers, snapshot_every_n_steps=every)
    def state_at(keep): return _position(lambda: sdl(keep), k)[0].state_dict()
    def from_state(keep, sd): return _loaded(sdl(keep), sd)
    def discard():
        it = iter(TorchDL(_hf_stream(n, buffer_size, False), batch_size=bs))
        for _ in range(k): next(it)
        return it
    if k not in _STATES:  # the positions at batch k, taken once for all repetitions
        _STATES[k] = state_at(True),_position(lambda: StatefulDataLoader(_hf_stream(n, buffer_size, False), batch_size=bs), k)[0].state_dict()
    kept,lossy = _STATES[k]
    return {'ours': lambda: from_state(True, kept),
            'replay': lambda: Resumed(TorchDL(_hf_stream(n, buffer_size, False), batch_size=bs), k, 'replay'),
            'replay workers': lambda: Resumed(TorchDL(_hf_stream(n, buffer_size, False), batch_size=bs, num_workers=workers), k, 'replay'),
            'discard': discard,
            'torchdata': lambda: _loaded(StatefulDataLoader(_hf_stream(n, buffer_size, False), batch_size=bs), lossy)}

def _loaded(dl, sd): dl.load_state_dict(sd); return dl

def _lost(k, bs, n, buffer_size)->tuple:
    "Examples that torchdata's own resume at batch `k` (no workers) loses and repeats, against the uninterrupted epoch"
    from torchdata.stateful_dataloader import StatefulDataLoader
    sdl = lambda: StatefulDataLoader(_hf_stream(n, buffer_size, False), batch_size=bs)
    full = torch.cat([b['x'] for b in sdl()]).tolist()
    rest = torch.cat([b['x'] for b in _loaded(sdl(), _position(sdl, k)[0].state_dict())]).tolist()
    seen,want = full[:k*bs],set(full[k*bs:])
    return len(want - set(rest)),len(rest) - len(set(rest) - set(seen))

def _snapshot_ms(buffer_size, reps=20)->float:
    "Milliseconds to take the `state_dict` of a kept buffer of `buffer_size` examples and pickle it, as a torchdata worker does"
    import pickle
    ds = _hf_stream(4*buffer_size, buffer_size, True)
    it = iter(ds)
    for _ in range(buffer_size//4): next(it)   # in the middle of filling its buffer again
    t = time.perf_counter()
    for _ in range(reps): pickle.dumps(ds.state_dict())
    return (time.perf_counter() - t)/reps

def run_hf(quick=False, reps=None, **kwargs):
    "Resuming the buffered Hugging Face stream at batch k: ours, replay (one process, workers), iterate-and-discard, torchdata's own"
    ks = (1, 10, 100) if quick else (1_000, 10_000, 100_000)
    reps,bs,workers,every = reps or 1,8,2,(1 if quick else 1000)
    buffer_size = 100 if quick else 10_000
    n = (max(ks)+2)*bs + 2*buffer_size
    warnings.filterwarnings('ignore', message='Replaying')
    warnings.filterwarnings('ignore', message="'set_vital' is deprecated")
    logging.getLogger('datasets').setLevel(logging.ERROR)  # its buffer warns that it refills
    times,lost = {},{}
    _STATES.clear()
    for k in ks:
        lost[k] = _lost(k, bs, n, buffer_size)
        for r in range(reps):
            vs = _hf_variants(k, bs, n, buffer_size, workers, every)
            names = list(vs); random.Random(f'{r}{k}').shuffle(names)
            for v in names: times.setdefault((k, v), []).append(_first(vs[v]))
    t = Table('streams_hf', '10b. A Hugging Face stream with a shuffle buffer: time to the first batch when resuming at batch k',
              ['k', 'ours ms', 'replay ms', f'replay, {workers} workers ms', 'iterate-and-discard ms', 'torchdata (no workers) ms',
               'torchdata: examples lost', 'torchdata: examples repeated'],
              [f"`Dataset.from_dict` of {n:,} ints, `to_iterable_dataset(num_shards=4).shuffle(seed=0, buffer_size={buffer_size:,})`; "
               f"{bs} examples a batch; median of {reps} run{'s'*(reps > 1)}, variants interleaved",
               f"ours: `StatefulDataLoader` ({workers} workers) over the stream whose buffer `keep_buffers` keeps, resumed from its "
               "`state_dict`; replay: `Resumed(..., 'replay')` (`AutoResume(replay=True)`) in one process and with workers (each "
               "reads its own part); iterate-and-discard: k batches loaded and collated in one process; torchdata: its own resume "
               "over `datasets`' buffer, whose state leaves the buffer out (lost and repeated counted against the uninterrupted "
               "epoch: lost = examples of the rest of the epoch it never yields), without workers: with workers, `datasets` 5.2 "
               "fails to load its own state (a KeyError in `_prepare_ex_iterable_for_iteration`: it loads a worker's state into "
               "the pipeline of all the shards)"])
    for k in ks:
        m = {v: med(times[(k, v)]) for v in ('ours', 'replay', 'replay workers', 'discard', 'torchdata')}
        t.add(f'{k:,}', ms(m['ours']), ms(m['replay']), ms(m['replay workers']), ms(m['discard']), ms(m['torchdata']), *lost[k])
    snap = _snapshot_ms(buffer_size)
    t.notes.append(f"a snapshot of the kept buffer ({buffer_size:,} examples: `state_dict`, pickled) costs {snap*1e3:.1f} ms in a worker; "
                   f"ours snapshots every {every:,} batches (`StatefulDataLoader(snapshot_every_n_steps=...)`: a resume point between "
                   "two snapshots reads the batches since the last one again)")
    t.raw = {f'{k}/{v}': xs for (k, v),xs in times.items()} | {f'{k}/lost,repeated': list(v) for k,v in lost.items()} | {'snapshot_s': snap}
    return t

"""7. Peers in the same run: resumable_train next to Hugging Face Accelerate (`save_state`/`load_state`, `skip_first_batches`) and
`torch.distributed.checkpoint` (`save`, `async_save`), on the same model and the same data: save cost, training-thread stall of a
non-blocking save, and time from "resume" to the first batch at batch k. The peers come from the `bench` extra
(`pip install -e ".[bench]"`); a peer that is not installed is reported as such."""
import io, random, shutil, tempfile, time, warnings
import torch
from torch import nn
from fastai.callback.core import Callback, CancelFitException
from resumable_train.autoresume import AutoResume
from resumable_train.fitcalls import RunState
from common import *

try:
    import accelerate
    from accelerate import Accelerator
    from accelerate.data_loader import skip_first_batches
except ImportError: accelerate = None
import torch.distributed.checkpoint as dcp

def _torch_setup(size, n_batches, bs=64, delay=0., seed=0):
    "The same MLP and data as `make_learner`, for the plain-PyTorch peers: model, `torch.optim.Adam`, DataLoader"
    torch.manual_seed(seed)
    n_in,hidden = SIZES[size]
    model = mlp(n_in, hidden)
    dl = torch.utils.data.DataLoader(Items(n_batches*bs, n_in, delay), batch_size=bs, shuffle=True, drop_last=True)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), dl

def _step(model, opt, b, backward=None):
    x,y = b
    loss = nn.functional.mse_loss(model(x), y)
    (backward or (lambda l: l.backward()))(loss)
    opt.step(); opt.zero_grad()

# --- save cost and stall -------------------------------------------------------------------------------------------------------

class _SaveTimes(Callback):
    "At each of `reps` training batches, time `fns` (name -> function of the learner) once each, in rotated order; then stop"
    order = 100
    def __init__(self, fns, reps): self.fns,self.reps,self.times = fns,reps,{}
    def after_batch(self):
        if not self.training: return
        vs = list(self.fns)
        vs = vs[self.iter % len(vs):] + vs[:self.iter % len(vs)]
        for v in vs:
            for k,s in self.fns[v](self.learn).items(): self.times.setdefault(k, []).append(s)
        if self.iter+1 >= self.reps: raise CancelFitException()

def _timed_dict(name, f, *args, **kwargs)->dict: return {name: timed(f, *args, **kwargs)}

def _rt_background(ar):
    "Stall (`AutoResume._save` in the training thread: snapshot, history rows, host copy) and total time of a background resume point"
    def f(learn):
        t = time.perf_counter()
        ar._save()
        stall = time.perf_counter() - t
        ar.writer.wait()
        return {'resumable_train background: stall': stall, 'resumable_train background: total': time.perf_counter() - t}
    return f

def _rt_times(size, reps, d):
    learn = make_learner(reps+2, bs=64, size=size, path=d)
    ar = AutoResume(background=True, verbose=False, dir=Path(d)/'ar')
    ar.learn,ar.state,ar.run_state = learn,'training',RunState('peers')
    ar.points.store = ar.store  # as inside a fit call
    bare = lambda l: torch.save({'model': l.model.state_dict(), 'opt': l.opt.state_dict()}, Path(d)/'bare.pth')
    fns = {'bare': lambda l: _timed_dict('bare torch.save', bare, l),
           'save': lambda l: _timed_dict('resumable_train learn.save', l.save, Path(d)/'save', durable=False),
           'durable': lambda l: _timed_dict('resumable_train learn.save durable', l.save, Path(d)/'save', durable=True),
           'background': _rt_background(ar)}
    st = _SaveTimes(fns, reps)
    learn.fit(1, cbs=st)
    return st.times, state_bytes(learn)

def _peer_times(size, reps, d):
    "Save and stall times of Accelerate and torch.distributed.checkpoint, at successive batches of their own training loop"
    model,opt,dl = _torch_setup(size, reps+2)
    times,acc = {},None
    if accelerate is not None:
        acc = Accelerator(cpu=True)
        model,opt,dl = acc.prepare(model, opt, dl)
    def dcp_async():
        t = time.perf_counter()
        fut = dcp.async_save({'model': model.state_dict(), 'optim': opt.state_dict()}, checkpoint_id=f'{d}/dcp-async')
        stall = time.perf_counter() - t
        fut.result()
        return {'dcp.async_save: stall': stall, 'dcp.async_save: total': time.perf_counter() - t}
    fns = {'dcp': lambda: _timed_dict('dcp.save', dcp.save, {'model': model.state_dict(), 'optim': opt.state_dict()}, checkpoint_id=f'{d}/dcp'),
           'dcp async': dcp_async}
    if acc is not None: fns['accelerate'] = lambda: _timed_dict('accelerate save_state', acc.save_state, f'{d}/acc', safe_serialization=True)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for i,b in zip(range(reps), dl):
            _step(model, opt, b, acc.backward if acc else None)
            vs = list(fns)
            for v in vs[i % len(vs):] + vs[:i % len(vs)]:
                for k,s in fns[v]().items(): times.setdefault(k, []).append(s)
    return times

# --- resume to first batch -----------------------------------------------------------------------------------------------------

class _FirstBatch(Callback):
    order = 100
    def before_batch(self):
        if self.training: self.t,self.at = time.perf_counter(),self.iter; raise CancelFitException()

class _SaveAt(Callback):
    def __init__(self, file): self.file = file
    def after_batch(self):
        if self.training: self.learn.save(self.file, durable=False, with_iter=True); raise CancelFitException()

def _rt_resume(learn, file, k):
    "Seconds from `learn.load(resume point at k)` to the first batch of the resumed fit, ready to train"
    fb = _FirstBatch()
    t = time.perf_counter()
    if file: learn.load(file)
    learn.fit(1, cbs=fb)
    if fb.at != k: raise RuntimeError(f"resumable_train at k={k}: first batch {fb.at}")
    return fb.t - t

def _acc_resume(acc, model, opt, dl, d, k):
    "Seconds from `load_state` to the first batch of `skip_first_batches(dl, k)`"
    t = time.perf_counter()
    if k:
        acc.load_state(d)
        dl = skip_first_batches(dl, k)
    next(iter(dl))
    return time.perf_counter() - t

def _resume_times(ks, reps, d, bs=8, delay=0.002):
    learn = make_learner(max(ks)+2, bs=bs, delay=delay, path=d)
    files = {}
    for k in ks:
        if k: learn.fit(1, start_iter=k-1, cbs=_SaveAt(f'rp-{k}')); files[k] = f'rp-{k}'
    times = {}
    acc = None
    if accelerate is not None:
        acc = Accelerator(cpu=True)
        n_in = SIZES['small'][0]
        model = mlp(16, ())
        opt = torch.optim.Adam(model.parameters())
        tdl = torch.utils.data.DataLoader(Items((max(ks)+2)*bs, 16, delay), batch_size=bs, shuffle=True, drop_last=True)
        model,opt,tdl = acc.prepare(model, opt, tdl)
        acc.save_state(f'{d}/acc-state', safe_serialization=True)
    sd = {'model': learn.model.state_dict(), 'optim': learn.opt.state_dict()}
    dcp.save(sd, checkpoint_id=f'{d}/dcp-state')
    for r in range(reps):
        for k in ks:
            vs = ['rt'] + (['acc'] if acc else []) + (['dcp'] if k else [])
            random.Random(f'{r}{k}').shuffle(vs)
            for v in vs:
                if v == 'rt': s = _rt_resume(learn, files.get(k), k)
                elif v == 'acc': s = _acc_resume(acc, model, opt, tdl, f'{d}/acc-state', k)
                else: s = timed(dcp.load, {'model': learn.model.state_dict(), 'optim': learn.opt.state_dict()}, checkpoint_id=f'{d}/dcp-state')
                times.setdefault((v, k), []).append(s)
    return times

# --- the tables ----------------------------------------------------------------------------------------------------------------

def run(quick=False, device=None, reps=None):
    reps = reps or (1 if quick else 5)
    sizes = ('small',) if quick else ('medium', 'large')
    ks = (0, 10) if quick else (0, 100, 10_000, 100_000)
    t = Table('peers', '7. Peers in the same run: save cost, stall of a non-blocking save, resume to the first batch',
              ['measure', 'model', 'state MB', 'ms', 'vs bare torch.save'], [])
    tmp = tempfile.mkdtemp(prefix='bench-peers-')
    try:
        for size in sizes:
            with tempfile.TemporaryDirectory(dir=tmp) as d:
                times,nbytes = _rt_times(size, reps, d)
            with tempfile.TemporaryDirectory(dir=tmp) as d: times.update(_peer_times(size, reps, d))
            bare = med(times['bare torch.save'])
            for k,xs in times.items(): t.add(k, size, mb(nbytes), ms(med(xs)), ratio(med(xs), bare))
            t.raw[size] = times
        with tempfile.TemporaryDirectory(dir=tmp) as d: rt = _resume_times(ks, reps, d)
    finally: shutil.rmtree(tmp, ignore_errors=True)
    names = {'rt': 'resumable_train: learn.load + fit', 'acc': 'accelerate: load_state + skip_first_batches', 'dcp': 'dcp.load (state only: no data position)'}
    for (v, k),xs in sorted(rt.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        fresh = med(rt.get((v, 0), [float('nan')])) if v != 'dcp' else float('nan')
        t.add(f"resume at batch {k:,}: {names[v]}", 'tiny', '—', ms(med(xs)), f"{ratio(med(xs), fresh)} of its fresh start" if k and v != 'dcp' else '—')
    t.raw['resume'] = {f'{v}/{k}': xs for (v, k),xs in rt.items()}
    t.notes += [f"median of {reps} per cell, variants interleaved; CPU; Adam (fastai's for resumable_train, torch's for the peers); "
                f"accelerate {accelerate.__version__ if accelerate else 'not installed'}, torch.distributed.checkpoint of torch {torch.__version__}",
                "save: at successive training batches of each framework's own loop; resumable_train's and the bare save are in the fastai loop; "
                "accelerate save_state writes model (safetensors), optimizer, RNG states and sampler; dcp.save writes model and optimizer state only",
                "non-blocking: stall = time the training thread is held (resumable_train: snapshot, history rows, copy to host buffers; "
                "dcp.async_save: staging); total = until the write is complete",
                "resume: items sleep 2 ms each, 8 a batch; from the start of loading to the first batch ready to train, in the same process; "
                "'fresh start' = the same at batch 0 without loading"]
    return t

"""Issue 32 on a GPU: what a resume point costs the training loop, side by side in one process, and how long a resumed run takes from
process start to its first training batch. `gpu_check.py` runs both (checks 5 and 6); `--device cpu` runs the same code on small
sizes, with `StandInCopies` in the GPU's place for the device snapshot.

The model is an MLP of `width`-wide layers with fastai's Adam (12 bytes of state per parameter): 3 layers are 0.6 GB, 12 are 2.4 GB."""
import os, shutil, subprocess, sys, tempfile, threading, time, warnings
from pathlib import Path
import torch
from torch import nn
from fastai.callback.core import Callback, CancelFitException
from fastai.callback.progress import ProgressCallback
from resumable_train.autoresume import AutoResume
from resumable_train.fitcalls import RunState
from resumable_train.checkpoints import Snapshot, StandInCopies, host_copy, tensor_leaves
from common import *

def sizes(device, quick)->dict:
    "name -> (width, layers): the two sizes of the issue on a GPU, small ones on a CPU or with `quick`"
    if device == 'cuda' and not quick: return {'0.6 GB': (4096, 3), '2.4 GB': (4096, 12)}
    return {'tiny': (256, 2), 'small': (512, 4)}

def _learner(width, layers, device, path, n_batches=64, bs=64):
    "A `Learner` as `make_learner`'s, its MLP made on `device` (no copy from the host)"
    train = DataLoader(Items(n_batches*bs, width), bs=bs, shuffle=True, drop_last=True)
    valid = DataLoader(Items(bs, width, seed=1), bs=bs)
    with torch.device(device): model = mlp(width, (width,)*layers)
    learn = Learner(DataLoaders(train, valid, device=device), model, loss_func=nn.MSELoss(), path=path)
    learn.logger = lambda *a, **k: None
    if hasattr(learn, 'progress'): learn.remove_cb(ProgressCallback)
    return learn

def _sync(device):
    if device == 'cuda': torch.cuda.current_stream().synchronize()  # the training stream only: the side stream runs on

# --- the stall of each way to save ---------------------------------------------------------------------------------------------

class _Variants(Callback):
    "At each training batch, run every variant once (rotated order), after `os.sync()`; the first round is a warm-up; then stop"
    order = 100
    def __init__(self, fns, reps): self.fns,self.reps,self.times,self.errors = fns,reps,{},{}
    def after_batch(self):
        if not self.training: return
        vs = [v for v in self.fns if v not in self.errors]
        for v in vs[self.iter % len(vs):] + vs[:self.iter % len(vs)]:
            os.sync()
            try: res = self.fns[v]()
            except Exception as e:  # one variant that fails (a peer's API in another torch) is reported, not the end of the table
                self.errors[v] = f"{type(e).__name__}: {e}"[:300]
                continue
            for k,s in res.items(): self.times.setdefault(k, []).append(s)
        if self.iter >= self.reps: raise CancelFitException()

def _timed(name, device, f):
    "`{name: seconds}` of `f()`, the training stream drained before and after"
    _sync(device)
    t = time.perf_counter()
    f()
    _sync(device)
    return {name: time.perf_counter() - t}

def _autoresume(learn, d, name, device, on_device):
    "A background `AutoResume` whose `_save` is timed: stall (until `_save` returns and the training stream has its work done), total"
    ar = AutoResume(background=True, verbose=False, dir=Path(d)/name)
    ar.learn,ar.state,ar.run_state = learn,'training',RunState(name)
    ar.points.store = ar.store  # as inside a fit call: `_save` is timed alone
    ar.points.snapshot = Snapshot()
    if not on_device: ar.points.snapshot.on_device = False  # the host copy: today's path
    def f():
        _sync(device)
        t = time.perf_counter()
        ar._save()
        _sync(device)
        stall = time.perf_counter() - t
        ar.writer.wait(600)
        chosen = ar.points.snapshot.on_device
        return {f'{name}: stall': stall, f'{name}: until written': time.perf_counter() - t, f'{name}: device path': float(bool(chosen))}
    return f

def _plain(width, layers, device):
    "The same MLP with `torch.optim.Adam`, one step taken (its state exists), for the peers that want a PyTorch optimizer"
    with torch.device(device): model = mlp(width, (width,)*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(8, width, device=device)).sum().backward()
    opt.step()
    return model, opt

def _dcp_variants(model, opt, d, device):
    "DCP `async_save` with its default stager and with the pinned-memory stager (where this torch has `DefaultStager`)"
    import torch.distributed.checkpoint as dcp
    stagers = {'dcp async_save (default stager)': None}
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        stagers['dcp async_save (pinned-memory stager)'] = DefaultStager(StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=device == 'cuda'))
    except (ImportError, TypeError): pass  # a torch without it, or with other options
    def variant(name, stager):
        def f():
            sd = {'model': model.state_dict(), 'optim': opt.state_dict()}
            _sync(device)
            t = time.perf_counter()
            kw = {} if stager is None else dict(async_stager=stager)
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                fut = dcp.async_save(sd, checkpoint_id=f'{d}/dcp-{"default" if stager is None else "pinned"}', no_dist=True, **kw)
            _sync(device)
            stall = time.perf_counter() - t
            getattr(fut, 'upload_completion', fut).result()
            return {f'{name}: stall': stall, f'{name}: until written': time.perf_counter() - t}
        return f
    return {n: variant(n, s) for n,s in stagers.items()}

def _limits(learn, device):
    "The two limits: copying the state into pinned host buffers, and cloning it on the device, into buffers allocated at the warm-up"
    bufs = {}
    def state(): return [t for t in tensor_leaves({'m': learn.model.state_dict(), 'o': learn.opt.state_dict()})]
    def pinned():
        ts = state()
        if 'host' not in bufs: bufs['host'] = host_copy(ts)
        return _timed('limit: copy to pinned host buffers', device, lambda: host_copy(ts, bufs['host']))
    def clone():
        ts = state()
        if 'dev' not in bufs: bufs['dev'] = [torch.empty_like(t) for t in ts]
        return _timed('limit: clone on the device', device, lambda: torch._foreach_copy_(bufs['dev'], ts))
    return {'limit: copy to pinned host buffers': pinned, 'limit: clone on the device': clone}

def save_times(width, layers, device, reps, d):
    "Seconds each variant holds the training loop (and until its file is written), at successive batches of one fastai fit"
    learn = _learner(width, layers, device, d, n_batches=reps+4)
    model,opt = _plain(width, layers, device)
    bare = lambda: torch.save({'model': learn.model.state_dict(), 'opt': learn.opt.state_dict()}, Path(d)/'bare.pth')
    fns = {'bare torch.save': lambda: _timed('bare torch.save', device, bare),
           'learn.save': lambda: _timed('learn.save', device, lambda: learn.save(Path(d)/'save', with_iter=True, durable=False))}
    try:
        from accelerate import Accelerator
        acc = Accelerator(cpu=device != 'cuda')
        amodel,aopt = acc.prepare(model, opt)
        fns['accelerate save_state'] = lambda: _timed('accelerate save_state', device, lambda: acc.save_state(f'{d}/acc', safe_serialization=True))
    except ImportError: pass
    fns.update(_dcp_variants(model, opt, d, device))
    fns['AutoResume background, host copy'] = _autoresume(learn, d, 'AutoResume background, host copy', device, False)
    fns['AutoResume background, device snapshot'] = _autoresume(learn, d, 'AutoResume background, device snapshot', device, True)
    fns.update(_limits(learn, device))
    v = _Variants(fns, reps)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1, cbs=v)
    return {k: xs[1:] for k,xs in v.times.items()}, {k: xs[0] for k,xs in v.times.items()}, v.errors, state_bytes(learn)

def snapshot_exact(device)->str:
    "A device snapshot of 0.5 GB, the original changed on the training stream right after: the copy holds the values at the snapshot"
    t = torch.arange(2**27, dtype=torch.float32, device=device)
    want = t.cpu().clone()
    s,base = Snapshot(),(torch.cuda.memory_allocated() if device == 'cuda' else 0)
    if device != 'cuda': s.copies = StandInCopies()
    get = s.take({'w': t})
    for _ in range(20): t.mul_(1.5).add_(1)  # the next batches, queued behind the clone
    res = [None]
    th = threading.Thread(target=lambda: res.__setitem__(0, get.to_host()))
    th.start(); th.join(60)
    freed = device != 'cuda' or torch.cuda.memory_allocated() == base
    ok = res[0] is not None and torch.equal(res[0]['w'], want) and not torch.equal(t.cpu(), want)
    return (f"device snapshot of 0.5 GB, changed 20 times on the training stream right after: the copy "
            f"{'equals' if ok else 'DIFFERS from'} the values at the snapshot (torch.equal); path: "
            f"{'device' if s.on_device else 'host'}; the clone {'freed' if freed else 'NOT freed'} once copied")

def save_table(device, quick, reps, d)->Table:
    t = Table('device_saves', f'Issue 32: what a resume point costs the training loop ({device}), side by side in one fastai fit',
              ['size', 'state GB', 'what', 'stall ms', 'until written ms', 'stall / bare torch.save', 'first stall ms (buffers allocated)',
               'target ≤ 10 ms (device snapshot, 2.4 GB)'])
    old = Snapshot.copies
    if device != 'cuda': Snapshot.copies = StandInCopies()  # the device path on a CPU: every tensor counts as a device tensor
    try:
        for size,(w,l) in sizes(device, quick).items():
            with tempfile.TemporaryDirectory(dir=d) as dd: times,first,errors,nbytes = save_times(w, l, device, reps, dd)
            bare = med(times['bare torch.save'])
            names = list(dict.fromkeys(k.split(': ')[0] if k.startswith(('dcp', 'AutoResume')) else k for k in times))
            for n in names:
                stall = times.get(f'{n}: stall', times.get(n))
                total = times.get(f'{n}: until written')
                path = times.get(f'{n}: device path')
                what = n + ('' if path is None else ' (device path taken)' if min(path) else ' (host path taken)' if 'device' in n else '')
                t.add(size, f"{nbytes/1e9:.2f}", what, ms(med(stall)), ms(med(total)) if total else '—', ratio(med(stall), bare),
                      ms(first.get(f'{n}: stall', first.get(n))),
                      ('met' if med(stall) <= 0.01 else 'NOT met') if size == '2.4 GB' and n.endswith('device snapshot') else '')
            for n,e in errors.items(): t.add(size, f"{nbytes/1e9:.2f}", n, f"failed: {e}", '', '', '', '')
            t.raw[size] = dict(times, errors=errors)
    finally: Snapshot.copies = old
    t.notes += [f"median of {reps} saves at successive training batches of one fastai fit (an MLP of {w}-wide layers, fastai's Adam; "
                "the PyTorch peers on the same MLP with torch.optim.Adam), after one unmeasured warm-up save each; variants rotated, each after "
                "os.sync(); files in a temporary folder on the machine's disk",
                "stall = until the call returns and the training stream has finished the work it queued (`current_stream().synchronize()`); "
                "a side stream's copy is not waited for. until written = until the file is complete (background thread or future)",
                "bare torch.save: model + optimizer state dicts of the fastai learner; learn.save: with_iter=True, durable=False; AutoResume: "
                "`_save` of a background AutoResume (snapshot of model, optimizer, callbacks, RNG; durable write); host copy = the path without "
                "room on the device; device snapshot = the path the room check chooses",
                "limits: the state's tensors copied into pinned host buffers allocated beforehand; cloned on the device into buffers "
                "allocated beforehand (`torch._foreach_copy_`)"]
    if device != 'cuda': t.notes.append("on a CPU the device snapshot runs on `StandInCopies` (a clone in host memory): its logic, not its speed")
    t.notes.append(snapshot_exact(device))
    return t

# --- resume at disk speed ------------------------------------------------------------------------------------------------------

def child(folder, width, layers, device, save):
    "One run (`--resume-child`): with `save`, train a batch, write a resume point, exit; else print `FIRST <time>` at the first batch"
    class First(Callback):
        order = AutoResume.order+1
        def before_batch(self):
            if self.training and not save:
                print('FIRST', time.time(), self.iter, flush=True)
                os._exit(0)
        def after_batch(self):
            if self.training and save and any(Path(folder, 'models').glob('autoresume-*.pth')): os._exit(0)
    learn = _learner(width, layers, device, folder, n_batches=4)
    learn.add_cbs([AutoResume(every_iter=1, verbose=False), First()])
    learn.fit(1)

def _drop_caches(device)->bool:
    "Empty the page cache (root on Linux) on a GPU machine (one's own); `False` where it cannot or on a CPU (perhaps a shared one)"
    if device != 'cuda': return False
    try:
        os.sync()
        Path('/proc/sys/vm/drop_caches').write_text('3\n')
        return True
    except OSError: return False

def _first_batch(cmd, env)->float:
    "Seconds from starting `cmd` to its `FIRST` line (the first training batch)"
    t = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    line = next((l for l in out.stdout.splitlines() if l.startswith('FIRST ')), None)
    if line is None: raise RuntimeError(f"{cmd}: no first batch ({out.returncode}): {(out.stdout + out.stderr)[-1500:]}")
    return float(line.split()[1]) - t

def resume_table(device, quick, reps, d, script, env)->Table:
    t = Table('resume_time', f'Issue 32: from process start to the first training batch of a resumed run ({device})',
              ['size', 'file GB', 'fresh start s', 'cat file s', 'fresh + cat s', 'resumed s', 'resumed / (fresh + cat)', 'target ≤ 1.20'])
    cold = None
    for size,(w,l) in sizes(device, quick).items():
        run,fresh = Path(d)/f'resume-{w}-{l}',Path(d)/f'fresh-{w}-{l}'
        base = [sys.executable, script, '--device', device, '--width', str(w), '--layers', str(l), '--resume-child']
        out = subprocess.run(base + [str(run), '--save'], capture_output=True, text=True, env=env, timeout=300)
        files = sorted(Path(run, 'models').glob('autoresume-*.pth'))
        if not files: raise RuntimeError(f"no resume point written ({out.returncode}): {(out.stdout + out.stderr)[-1500:]}")
        f,times = files[-1],{}
        for r in range(reps):
            shutil.rmtree(fresh, ignore_errors=True)
            for v in ('fresh', 'cat', 'resumed')[r % 3:] + ('fresh', 'cat', 'resumed')[:r % 3]:
                cold = _drop_caches(device)
                if v == 'cat':
                    s = time.perf_counter()
                    subprocess.run(['cat', str(f)], stdout=subprocess.DEVNULL, check=True)
                    times.setdefault(v, []).append(time.perf_counter() - s)
                else: times.setdefault(v, []).append(_first_batch(base + [str(run if v == 'resumed' else fresh)], env))
        fr,c,rs = med(times['fresh']),med(times['cat']),med(times['resumed'])
        t.add(size, f"{f.stat().st_size/1e9:.2f}", f"{fr:.2f}", f"{c:.2f}", f"{fr+c:.2f}", f"{rs:.2f}", ratio(rs, fr+c),
              'met' if rs <= 1.2*(fr+c) else 'NOT met')
        t.raw[size] = times
    t.notes += [f"median of {reps}, variants rotated; {'page cache emptied before each (drop_caches)' if cold else 'page cache not emptied (a CPU run, or no permission): warm'}",
                "fresh start: `python gpu_check.py --resume-child` (imports, CUDA, a Learner with the MLP on the device, AutoResume finding "
                "no resume point) until the first training batch; resumed: the same command in a folder with one resume point (written at "
                "batch 1), until its first training batch (batch 2): the scan (mmap, checksums), `learn.load` straight to the device",
                "cat file: `cat autoresume-0001.pth > /dev/null`"]
    return t

"5. Memory: peak extra host memory (RSS) during one save, against the size of the state; each measurement in a fresh process"
import gc, json, os, subprocess, sys, tempfile, threading, time
from pathlib import Path
import torch
from fastai.callback.core import Callback, CancelFitException

VARIANTS = ('bare', 'learn.save', 'sync', 'background', 'background x2')
_DOC = {'bare': "`torch.save({'model':..., 'opt':...})`", 'learn.save': '`learn.save(f)` (durable)', 'sync': 'AutoResume resume point, synchronous',
        'background': 'AutoResume(background=True) resume point, until its write ends',
        'background x2': 'two background resume points in a row (the second due while the first is written)'}

def _status(key):
    for l in Path('/proc/self/status').read_text().splitlines():
        if l.startswith(key + ':'): return int(l.split()[1])*1024

class _Peak:
    "Peak RSS from here on: the kernel's high-water mark after resetting it, else sampling every 0.5 ms"
    def __enter__(self):
        gc.collect()
        self.base = _status('VmRSS')
        try:
            with open('/proc/self/clear_refs', 'w') as f: f.write('5')
            self.how,self.thread = 'VmHWM',None
        except OSError:
            import psutil
            self.how,self.peak,self.done,p = 'sampled',self.base,False,psutil.Process()
            def sample():
                while not self.done: self.peak = max(self.peak, p.memory_info().rss); time.sleep(0.0005)
            self.thread = threading.Thread(target=sample, daemon=True); self.thread.start()
        return self
    def __exit__(self, *exc):
        if self.thread is None: self.peak = _status('VmHWM')
        else: self.done = True; self.thread.join()
        self.extra = self.peak - self.base

class _Measure(Callback):
    "At the first training batch, measure the peak extra memory of one save of the `variant` kind, then stop"
    def __init__(self, variant, folder): self.variant,self.folder = variant,Path(folder)
    def after_batch(self):
        from common import state_bytes
        if not self.training: return
        ar,learn = getattr(self.learn, 'auto_resume', None),self.learn
        self.state = state_bytes(learn)
        with _Peak() as pk:
            if self.variant == 'bare':
                torch.save({'model': learn.model.state_dict(), 'opt': learn.opt.state_dict()}, self.folder/'bare.pth')
            elif self.variant == 'learn.save': learn.save(self.folder/'save', with_iter=True)
            else:
                for _ in range(2 if self.variant.endswith('x2') else 1): ar._save()
                ar.writer.wait()
        self.extra,self.how = pk.extra,pk.how
        raise CancelFitException()

def measure(variant, size, device=None)->dict:
    "Peak extra RSS of one save of the `variant` kind with a `size` model, in this process"
    from common import make_learner
    from resumable_train.autoresume import AutoResume
    with tempfile.TemporaryDirectory(prefix='bench-mem-') as d:
        learn = make_learner(2, bs=8, size=size, device=device, path=d)
        m = _Measure(variant, d)
        cbs = [m] + ([AutoResume(background=variant.startswith('background'), verbose=False)] if variant not in ('bare', 'learn.save') else [])
        learn.fit(1, cbs=cbs)
    return dict(variant=variant, size=size, state=m.state, extra=m.extra, how=m.how)

def _child(variant, size, device):
    cmd = [sys.executable, str(Path(__file__).parent/'run.py'), '--memory-child', variant, size] + (['--device', device] if device else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get('OMP_NUM_THREADS', '1')))
    if p.returncode: raise RuntimeError(f"memory measurement {variant} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])

def run(quick=False, device=None, reps=None):
    from common import Table, mb, med
    reps = reps or 1
    size = 'small' if quick else 'large'
    res = {}
    for r in range(reps):
        for v in VARIANTS:  # quick: in this process (glibc may reuse memory freed by an earlier measurement, so less exact)
            res.setdefault(v, []).append(measure(v, size, device) if quick else _child(v, size, device))
    t = Table('memory', '5. Memory: peak extra host memory (RSS) during one save, vs the size of the state',
              ['save', 'state MB', 'peak extra MB', 'extra / state', 'target (background: ≤ 1 copy)'],
              [f"{size} MLP with Adam; extra = peak RSS during the save − RSS before it ({res['bare'][0]['how']}); "
               + ("in this process (quick)" if quick else f"each measurement in a fresh process, median of {reps}"),
               *[f"{v}: {d}" for v,d in _DOC.items()]])
    for v in VARIANTS:
        st,ex = res[v][0]['state'],med([o['extra'] for o in res[v]])
        target = ('met' if ex <= 1.1*st else 'NOT met') if v.startswith('background') else ''
        t.add(v, mb(st), mb(ex), f"{ex/st:.2f}", target)
    t.raw = res
    return t

"""Tiny deterministic fastai training runs for the exactness tests, several per process (importing fastai costs seconds).

`python exact_script.py JOBS.json [--stock]` runs each job of the JSON list in turn and writes its result with `torch.save`:
- `{"mode": "ref", "cfg": ..., "dir": D, "out": F}`: an uninterrupted fit;
- `{"mode": "stop", ..., "at": [epoch, iter], "ckpt": NAME}`: a fit that saves a resume point with `learn.save` at batch `iter` of
  `epoch` (after batch `iter-1`, or after epoch `epoch-1` when `iter` is 0) and stops there;
- `{"mode": "resume", ..., "ckpt": NAME}`: `learn.load(NAME)` then the same fit call;
- `{"mode": "stockload", ..., "ckpt": NAME}`: load NAME with stock fastai (run with `--stock`) and dump the model and optimizer;
- `{"mode": "errors", ...}`: the error messages of damaged, hostile, foreign and mismatched files (see `errors`).
With `--stock` the package is not imported: fastai runs as shipped.
"""
import argparse, contextlib, json, os, random, sys, traceback, warnings
from pathlib import Path
import numpy as np, torch
from torch import nn

STOCK = '--stock' in sys.argv
from fastai.basics import *
from fastai.callback.tracker import TrackerCallback, SaveModelCallback, EarlyStoppingCallback, ReduceLROnPlateau
from fastai.callback.training import GradientAccumulation
from fastai.callback.progress import CSVLogger, ProgressCallback
from fastai.callback.hook import ActivationStats
from fastai.callback.schedule import *
if not STOCK:
    import resumable_train
    from resumable_train.files import *
    from resumable_train.state import *
    from resumable_train.all import *

N_FEAT,N_CLS = 6,3

def rand_tfm(o):
    "A random item transform that draws from python's, numpy's and torch's streams (in whichever process loads the item)"
    x,y = o
    return x + 0.1*random.random() + 0.1*float(np.random.rand()) + 0.1*torch.rand(N_FEAT), y

def make_items(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEAT, generator=g)
    y = ((x[:,0]+x[:,1] > 0).long() + (x[:,2] > 0.5).long())
    return list(zip(x, y))

class Probe(Callback):
    "Count real optimizer steps; snapshot the model at `after_fit` before the trackers' `after_fit` (which may load the best model)"
    order = 55
    def before_fit(self): self.steps = 0
    def after_step(self): self.steps += 1
    def after_fit(self): self.model_pre = {k: v.detach().clone() for k,v in self.model.state_dict().items()}

class StopAt(Callback):
    "Save a resume point at batch `iter` of `epoch` and stop the fit"
    order = 95
    def __init__(self, epoch, iter, fname): self.at,self.fname,self.saved = (epoch, iter),fname,False
    def _stop(self):
        self.learn.save(self.fname, with_iter=True)
        self.saved = True
        raise CancelFitException()
    def after_batch(self):
        e,i = self.at
        if i and self.training and self.epoch == e and self.iter == i-1: self._stop()
    def after_epoch(self):
        e,i = self.at
        if not i and self.epoch == e-1: self._stop()

DEFAULT = dict(sched='fit_one_cycle', n_epoch=3, lr=1e-2, seed=42, n_train=48, n_valid=16, bs=8, workers=0, tfm=False,
               seed_batches=False, cbs=['save', 'early', 'plateau'], train_metrics=False, bar=False, drop_last=False)

def build(cfg, path):
    "A small classifier `Learner` (shuffle, dropout, accuracy), the same every time it is built from the same `cfg`"
    c = {**DEFAULT, **cfg}
    set_seed(c['seed'], reproducible=True)
    items = make_items(c['n_train'] + c['n_valid'])
    kw = dict(num_workers=c['workers'], after_item=rand_tfm) if c['tfm'] else dict(num_workers=c['workers'])
    trn = DataLoader(items[:c['n_train']], bs=c['bs'], shuffle=True, drop_last=c['drop_last'], **kw)
    val = DataLoader(items[c['n_train']:], bs=2*c['bs'], num_workers=c['workers'])
    dls = DataLoaders(trn, val, path=path)
    hidden = c.get('hidden', 16)
    model = nn.Sequential(nn.Linear(N_FEAT, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, N_CLS))
    cbs = [Probe()]
    known = dict(save=lambda: SaveModelCallback(), early=lambda: EarlyStoppingCallback(patience=100),
                 plateau=lambda: ReduceLROnPlateau(patience=1, factor=2., min_delta=1.),
                 ga=lambda: GradientAccumulation(n_acc=3*c['bs']), csv=lambda: CSVLogger(),
                 astats=lambda: ActivationStats(with_hist=True))
    cbs += [known[n]() for n in c['cbs']]
    if c['seed_batches']: cbs.append(SeedBatches())
    # saving by hand inside an epoch of a loader with workers: their streams kept with the batches, as the refusal without it says
    elif c['workers'] and c.get('streams', True) and not STOCK: cbs.append(WorkerStreams())
    kw = dict(splitter=lambda m: [list(m[0].parameters()), list(m[3].parameters())]) if c.get('two_groups') else {}
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=cbs, **kw)
    learn.recorder.train_metrics = c['train_metrics']
    if not c['bar']: learn.remove_cb(ProgressCallback)
    return learn, c

def do_fit(learn, c, cbs=None):
    n,lr,s = c['n_epoch'],c['lr'],c['sched']
    with learn.no_logging() if not c['bar'] else contextlib.nullcontext():
        if s == 'fit': learn.fit(n, lr, cbs=cbs)
        elif s == 'fit_one_cycle': learn.fit_one_cycle(n, lr, cbs=cbs)
        elif s == 'fit_flat_cos': learn.fit_flat_cos(n, lr, cbs=cbs)
        elif s == 'fit_sgdr':  # n_epoch = cycle_len*(2**n_cycles-1)
            assert n in (1, 3, 7), n
            learn.fit_sgdr({1:1, 3:2, 7:3}[n], 1, lr_max=lr, cbs=cbs)
        else: raise ValueError(s)

def snapshot(learn, c, path):
    "Everything the exactness tests compare, as plain values"
    rec,probe = learn.recorder,learn.probe
    trackers = {cb.name: {k: getattr(cb, k) for k in ('best','new_best','wait') if hasattr(cb, k)}
                for cb in learn.cbs if isinstance(cb, TrackerCallback)}
    csv = None
    if 'csv' in c['cbs']:  # the time column differs between any two runs
        rows = [l.split(',') for l in (path/'history.csv').read_text().splitlines()]
        t = rows[0].index('time') if rows and 'time' in rows[0] else None
        csv = [[v for j,v in enumerate(r) if j != t] for r in rows]
    return dict(model={k: v.detach().clone() for k,v in learn.model.state_dict().items()},
                model_pre=getattr(probe, 'model_pre', None), opt=learn.opt.state_dict(),
                values=[list(map(float, v)) for v in rec.values], losses=[l.clone() for l in rec.losses],
                lrs=list(rec.lrs), iters=list(rec.iters), hps=getattr(rec, 'hps', None), steps=probe.steps,
                train_iter=learn.train_iter, pct_train=learn.pct_train, epoch=learn.epoch, trackers=trackers, csv=csv,
                astats=[[dict(d) for d in s] for s in learn.activation_stats.stats] if 'astats' in c['cbs'] else None)

def job_ref(j):
    path = Path(j['dir']); path.mkdir(parents=True, exist_ok=True)
    learn,c = build(j['cfg'], path)
    do_fit(learn, c)
    return snapshot(learn, c, path)

def job_stop(j):
    path = Path(j['dir']); path.mkdir(parents=True, exist_ok=True)
    learn,c = build(j['cfg'], path)
    stop = StopAt(*j['at'], j['ckpt'])
    try: do_fit(learn, c, cbs=stop)
    except Exception as e:  # stopped in epoch 0, SaveModelCallback's after_fit has no 'model.pth' to load (stock fastai does the same)
        if not (stop.saved and 'model.pth does not exist' in str(e)): raise
    assert stop.saved, f"never reached {j['at']}"
    return dict(steps=learn.probe.steps)

def job_resume(j):
    path = Path(j['dir'])
    learn,c = build(j['cfg'], path)
    learn.load(j['ckpt'], **j.get('load_kw', {}))
    do_fit(learn, c)
    return snapshot(learn, c, path)

def job_stockload(j):
    "Stock fastai loads a file written with `with_iter=True`: any warning (e.g. 'Could not load the optimizer state') fails"
    path = Path(j['dir'])
    learn,c = build(j['cfg'], path)
    learn.create_opt()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        learn.load(j['ckpt'])
    return dict(model=learn.model.state_dict(), opt=learn.opt.state_dict(),
                warnings=[str(w.message) for w in ws if issubclass(w.category, UserWarning)])

def _msg(f):
    "The exception `f()` raises, as 'Type: message', or 'NO ERROR'"
    try: f()
    except Exception as e: return f"{type(e).__name__}: {e}"
    return 'NO ERROR'

class Evil:
    def __reduce__(self): return (os.system, (f"touch {os.environ['EVIL_MARKER']}",))

def job_errors(j):
    "Error messages for bad files, mismatched learners and resume points of other setups"
    import pickle
    path = Path(j['dir']); good = path/'models'/(j['ckpt']+'.pth')
    bad = path/'bad'; bad.mkdir(exist_ok=True)
    data = good.read_bytes()
    files = {}
    def put(name, b): files[name] = bad/name; (bad/name).write_bytes(b)
    put('truncated.pth', data[:len(data)//2])
    put('empty.pth', b'')
    mid = bytearray(data); i = len(mid)//2
    mid[i:i+64] = bytes(x ^ 0xFF for x in mid[i:i+64]); put('corrupt.pth', bytes(mid))
    put('text.pth', b'hello, this is not a checkpoint\n' * 10)
    torch.save([1, 2, 3], bad/'list.pth'); files['list.pth'] = bad/'list.pth'
    torch.save(Evil(), bad/'evil_zip.pth'); files['evil_zip.pth'] = bad/'evil_zip.pth'
    with open(bad/'evil_pickle.pth', 'wb') as f: pickle.dump(Evil(), f, protocol=2)
    files['evil_pickle.pth'] = bad/'evil_pickle.pth'
    torch.save({'model': {'w': torch.zeros(2)}, 'opt': Evil()}, bad/'evil_nested.pth'); files['evil_nested.pth'] = bad/'evil_nested.pth'
    res = {}
    for name,f in files.items():
        learn,c = build(j['cfg'], path)
        res[name] = _msg(lambda: learn.load(f.with_suffix('')))  # `load` adds '.pth', as fastai's does
    res['file_paths'] = {k: str(v) for k,v in files.items()}
    ns = {}
    exec('from resumable_train.all import *', ns)
    res['missing_from_all'] = [n for n in ('AutoResume', 'SkipToIter', 'SeedBatches', 'CheckpointError', 'read_checkpoint',
                                           'register_state') if n not in ns]
    learn,c = build(dict(j['cfg'], hidden=12), path)
    res['model_mismatch'] = _msg(lambda: learn.load(j['ckpt']))
    learn,c = build(dict(j['cfg'], two_groups=True), path)
    res['opt_groups_mismatch'] = _msg(lambda: learn.load(j['ckpt']))
    for name,change in j['setups'].items():
        learn,c = build({**j['cfg'], **change}, path)
        learn.load(j['ckpt'])
        res[f'setup_{name}'] = _msg(lambda: do_fit(learn, c))
        learn,c = build({**j['cfg'], **change}, path)
        learn.load(j['ckpt'], check_setup=False)
        res[f'setup_{name}_override'] = _msg(lambda: do_fit(learn, c))
    return res

JOBS = dict(ref=job_ref, stop=job_stop, resume=job_resume, stockload=job_stockload, errors=job_errors)

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('jobs', help='JSON file with a list of jobs')
    p.add_argument('--stock', action='store_true', help='do not import resumable_train')
    a = p.parse_args()
    assert STOCK == ('resumable_train' not in sys.modules)
    fails = 0
    for j in json.loads(Path(a.jobs).read_text()):
        try: res = JOBS[j['mode']](j)
        except Exception:
            fails += 1
            res = dict(error=traceback.format_exc())
            print(f"JOB FAILED {j.get('name')}:\n{res['error']}", file=sys.stderr)
        torch.save(res, j['out'])
    sys.exit(0)

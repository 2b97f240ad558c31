"""Workflows that never resume, for the differential test of issue 37 ("invisible until it resumes").

`python invisible_script.py OUTDIR JOB [JOB...] [--stock]` runs each JOB (a key of `JOBS`) in turn on a tiny deterministic learner
(scikit-learn's digits, an MLP) in the folder OUTDIR/JOB, and writes OUTDIR/JOB.pth: plain values (every model tensor, the optimizer
state, the Recorder, `train_iter`, `lr`, `wd`, the random states, the optimizer steps, the warnings raised, the error if the
workflow raised). With `--stock` the package is never imported: fastai as shipped. Jobs named `X_a` to `X_d` share OUTDIR/X (two
scripts, or four, in one folder) and run in two invocations, `_a` first.
"""
import os, random, subprocess, sys, traceback, warnings
from pathlib import Path
import numpy as np, torch
from torch import nn

STOCK = '--stock' in sys.argv
from fastai.basics import *
from fastai.callback.all import *
if not STOCK: from resumable_train.all import *
from sklearn.datasets import load_digits

STEPS = [0]  # optimizer steps of the job running, all its Learners together
MADE = []  # the Learners of the job running: one that raised still reports the state of its last Learner

class StepCounter(Callback):
    "Count optimizer steps"
    def after_step(self): STEPS[0] += 1

def digits():
    x,y = load_digits(return_X_y=True)
    ds = list(zip(torch.tensor(x, dtype=torch.float32)/16, torch.tensor(y)))
    return ds[:1400], ds[1400:]

TRAIN,VALID = digits()

def body(): return nn.Sequential(nn.Linear(64, 64), nn.ReLU())
def mlp(): return nn.Sequential(body(), nn.Linear(64, 10))
def two_groups(m): return [list(m[0].parameters()), list(m[1:].parameters())]

def make_learner(path, model=mlp, dls=None, seed=42, cbs=(), **kw):
    "The Quick start's learner in `path`: seeded, then data, model and `Learner` built"
    set_seed(seed, reproducible=True)
    dls = dls() if dls else DataLoaders.from_dsets(TRAIN, VALID, bs=64, num_workers=0)
    MADE.append(Learner(dls, model(), loss_func=CrossEntropyLossFlat(), metrics=accuracy, path=path, cbs=[StepCounter(), *cbs], **kw))
    return MADE[-1]

def weights(learn): return {k: v.detach().clone() for k,v in learn.model.state_dict().items()}

def plain_opt(learn):
    if learn.opt is None: return None
    sd = learn.opt.state_dict()
    return dict(state=[{k: v.clone() if isinstance(v, torch.Tensor) else v for k,v in s.items()} for s in sd['state']],
                hypers=[dict(h) for h in sd['hypers']])

def rng_states():
    name,keys,pos,gauss,cached = np.random.get_state()
    return dict(torch=torch.get_rng_state(), numpy=(name, torch.from_numpy(keys.astype(np.int64)), pos, gauss, cached),
                python=random.getstate())

def snapshot(learn):
    "Everything the test compares, as plain values"
    rec = learn.recorder  # its lists are made by the first fit
    return dict(model=weights(learn), opt=plain_opt(learn), values=[list(map(float, v)) for v in getattr(rec, 'values', [])],
                losses=[l.detach().clone() for l in getattr(rec, 'losses', [])], lrs=[float(o) for o in getattr(rec, 'lrs', [])],
                train_iter=getattr(learn, 'train_iter', None),
                lr=learn.lr, wd=learn.wd, requires_grad=[p.requires_grad for p in learn.model.parameters()],
                frozen_idx=getattr(learn.opt, 'frozen_idx', None), rng=rng_states())

# The jobs: each returns its last Learner and a dict of extra values to compare; one row of issue 37 each

def course(d):
    "The fastai course's two stages: frozen, saved, unfrozen, loaded, discriminative learning rates"
    learn = make_learner(d, splitter=two_groups)
    learn.freeze(); learn.fit_one_cycle(1); learn.save('stage-1')
    learn.unfreeze(); learn.load('stage-1'); learn.fit_one_cycle(1, slice(1e-4, 1e-3))
    return learn, {}

def freezeload(d):
    "The reverse: trained unfrozen, saved, frozen, loaded, trained"
    learn = make_learner(d, splitter=two_groups)
    learn.fit_one_cycle(1); learn.save('s')
    learn.freeze(); learn.load('s'); learn.fit_one_cycle(1)
    return learn, {}

def foreign(d):
    "Weights and optimizer of another Learner (other lr and wd) loaded into a new one, then trained"
    first = make_learner(d, wd=0.5, lr=0.1)
    first.fit(1); first.save('other')
    learn = make_learner(d, wd=0.01, lr=1e-3)
    set_seed(7)
    learn.load('other'); learn.fit(1)
    return learn, {}

def wdchange(d):
    learn = make_learner(d)
    learn.fit_one_cycle(1); learn.save('s')
    learn.wd = 0.1
    learn.load('s'); learn.fit_one_cycle(1)
    return learn, {}

def xproc_a(d):
    learn = make_learner(d)
    learn.fit_one_cycle(1); learn.save('m')
    return learn, {}

def xproc_b(d):
    learn = make_learner(d)
    learn.load('m'); learn.fit_one_cycle(1)
    return learn, {}

def bestfile_a(d):
    learn = make_learner(d, cbs=[SaveModelCallback(with_opt=True)])
    learn.fit_one_cycle(2)
    return learn, {}

def bestfile_b(d):
    "SaveModelCallback's best file of a 2-epoch run, loaded into a 3-epoch run (stock trains 3 epochs)"
    learn = make_learner(d)
    learn.load('model'); learn.fit_one_cycle(3)
    return learn, {}

def strict(d):
    "A pretrained body and head, loaded with `strict=False` into a model with 2 more parameters (stock: the optimizer state is not loaded)"
    pre = make_learner(d)
    pre.fit(1); pre.save('pretrained')
    learn = make_learner(d, model=lambda: nn.Sequential(body(), nn.Linear(64, 10), nn.ReLU(), nn.Linear(10, 10)))
    learn.load('pretrained', strict=False); learn.fit(1)
    return learn, {}

def withoptnone(d):
    first = make_learner(d)
    first.fit(1); first.save('f')
    learn = make_learner(d)
    learn.load('f', with_opt=None)
    return learn, dict(opt_after_load=plain_opt(learn))

class Items(torch.utils.data.Dataset):
    "A map-style dataset of plain PyTorch"
    def __init__(self, items): self.items = items
    def __len__(self): return len(self.items)
    def __getitem__(self, i): return self.items[i]

def torch_dls(train_ds, **kw):
    "PyTorch DataLoaders in fastai's `DataLoaders`"
    return DataLoaders(torch.utils.data.DataLoader(train_ds, batch_size=64, **kw),
                       torch.utils.data.DataLoader(Items(VALID), batch_size=64, num_workers=0))

def persistent(d):
    "A worker that stays alive between epochs, and a file saved every epoch (stock trains both epochs)"
    learn = make_learner(d, dls=lambda: torch_dls(Items(TRAIN), shuffle=True, num_workers=1, persistent_workers=True),
                         cbs=[SaveModelCallback(with_opt=True, every_epoch=True)])
    learn.fit_one_cycle(2)
    return learn, {}

class Stream(torch.utils.data.IterableDataset):
    "The training items as a stream, with the length fastai needs"
    def __len__(self): return len(TRAIN)
    def __iter__(self): return iter(TRAIN)

class SaveAt(Callback):
    "The user's own save, in the middle of an epoch"
    def after_batch(self):
        if self.training and self.epoch == 0 and self.iter == 3: self.learn.save('mid')

def midsave(d):
    learn = make_learner(d, dls=lambda: torch_dls(Stream()), cbs=[SaveAt()])
    learn.fit_one_cycle(2)
    return learn, {}

# Loads the exported Learner in a process that never imports the package (an import of it fails and is recorded), and predicts
LOADER = r'''
import sys, traceback, torch
attempts = []
class Forbid:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'resumable_train':
            attempts.append(name)
            raise ImportError(f'{name}: this process must load the exported Learner without the package')
sys.meta_path.insert(0, Forbid())
res = dict(ok=False, error=None, preds=None)
try:
    from fastai.learner import load_learner
    learn = load_learner(sys.argv[1])
    items = torch.load(sys.argv[2])
    preds,_ = learn.get_preds(dl=learn.dls.test_dl(items, num_workers=0))
    res.update(ok=True, preds=preds)
except Exception: res['error'] = traceback.format_exc()
res['imported'] = sorted(set(attempts) | {m for m in sys.modules if m.split('.')[0] == 'resumable_train'})
torch.save(res, sys.argv[3])
'''

def run_bounded(cmd, timeout, **kw):
    "Run `cmd` in its own session, killed with its children after `timeout` seconds; return (rc, output)"
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)
    try: out,_ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out,_ = p.communicate()
        out += f'\n[killed after {timeout}s timeout]'
    return p.returncode, out

def export(d):
    "Exported with the package imported, loaded and used by fastai alone in another process"
    tfms = [[ItemGetter(0)], [ItemGetter(1)]]
    learn = make_learner(d, dls=lambda: DataLoaders.from_dsets(Datasets(TRAIN, tfms), Datasets(VALID, tfms), bs=64, num_workers=0))
    learn.fit(1)
    learn.remove_cb(learn.step_counter)  # a class of this script: not importable where the export is loaded
    learn.export('export.pkl')
    items,out = d/'valid.pth',d/'loaded.pth'
    torch.save(VALID, items)  # (x, y): `test_dl` applies the x transform alone
    repo = str(Path(__file__).resolve().parents[1])
    path = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p and Path(p).resolve() != Path(repo)]
    env = {k: v for k,v in os.environ.items() if k != 'PYTHONPATH'}
    if path: env['PYTHONPATH'] = os.pathsep.join(path)
    rc,log = run_bounded([sys.executable, '-c', LOADER, str(d/'export.pkl'), str(items), str(out)], 120, env=env, cwd=d)
    loaded = torch.load(out, weights_only=False) if out.exists() else dict(ok=False, error=f'no result (rc={rc})', imported=[])
    if loaded['error']: loaded['error'] += f'\n--- loader output (rc={rc})\n{log[-3000:]}'
    return learn, dict(loaded=loaded)

def startepoch_onecycle(d):
    learn = make_learner(d)
    learn.fit_one_cycle(3, start_epoch=1)
    return learn, {}

def startepoch_flatcos(d):
    learn = make_learner(d)
    learn.fit_flat_cos(3, start_epoch=1)
    return learn, {}

def lrfind(d):
    learn = make_learner(d)
    sug = learn.lr_find()
    learn.fit_one_cycle(1)
    return learn, dict(suggestion=tuple(map(float, sug)))

def autoresume_smc(d):
    "Two fit calls with SaveModelCallback; the package side with `AutoResume` (the same script run again trains nothing)"
    learn = make_learner(d, cbs=[SaveModelCallback()] + ([] if STOCK else [AutoResume()]))
    learn.fit_one_cycle(2)
    between = weights(learn)
    learn.fit_one_cycle(2)
    return learn, dict(between=between)

def autoresume_course(d):
    "The fastai course's two stages (`course`), the package side with `AutoResume`: the stage loaded in the process that saved it"
    learn = make_learner(d, splitter=two_groups, cbs=[] if STOCK else [AutoResume()])
    learn.freeze(); learn.fit_one_cycle(1); learn.save('stage-1')
    learn.unfreeze(); learn.load('stage-1'); learn.fit_one_cycle(1, slice(1e-4, 1e-3))
    return learn, {}

def autoresume_ft(d):
    "`fine_tune` beside SaveModelCallback and EarlyStoppingCallback; the package side with `AutoResume`"
    cbs = [SaveModelCallback(), EarlyStoppingCallback(patience=1)] + ([] if STOCK else [AutoResume()])
    learn = make_learner(d, cbs=cbs, splitter=two_groups)
    learn.fine_tune(3, freeze_epochs=1)
    return learn, {}

def ar(): return [] if STOCK else [AutoResume()]  # the package side of a job with `AutoResume` in the Learner

def pair_a(d):
    "Issue 49's script A: its own lr and wd, a stage saved as 'pretrained' (the package side with `AutoResume`)"
    learn = make_learner(d, lr=3e-2, wd=0.1, cbs=ar())
    learn.fit_one_cycle(2); learn.save('pretrained')
    return learn, {}

def shifted():
    "Other data of the same size"
    return DataLoaders.from_dsets(TRAIN[300:]+TRAIN[:300], VALID, bs=64, num_workers=0)

def pair_b(d):
    "Issue 49's script B in A's folder: other lr, wd and data, A's file loaded, then trained: as stock B, not as A's run"
    learn = make_learner(d, dls=shifted, lr=1e-3, wd=0., cbs=ar())
    learn.load('pretrained'); learn.fit(2)
    return learn, {}

def pair_c(d):
    "A third script in that folder: frozen around the load of A's file, SaveModelCallback and EarlyStopping, unfrozen"
    learn = make_learner(d, splitter=two_groups, cbs=[SaveModelCallback(), EarlyStoppingCallback(patience=1)] + ar())
    learn.freeze(); learn.load('pretrained'); learn.fit_one_cycle(2)
    learn.unfreeze(); learn.fit_one_cycle(1, slice(1e-4, 1e-3))
    return learn, {}

def pair_d(d):
    "A fourth script in that folder: `lr_find`, A's file loaded, `start_epoch`, then exported and loaded back for predictions"
    tfms = [[ItemGetter(0)], [ItemGetter(1)]]  # as `export` needs them
    learn = make_learner(d, dls=lambda: DataLoaders.from_dsets(Datasets(TRAIN[300:]+TRAIN[:300], tfms), Datasets(VALID, tfms), bs=64,
                                                               num_workers=0), cbs=ar())
    sug = learn.lr_find()
    learn.load('pretrained'); learn.fit_one_cycle(3, start_epoch=1)
    learn.remove_cb(learn.step_counter)  # a class of this script
    learn.export('d.pkl')
    preds,_ = load_learner(d/'d.pkl').get_preds(dl=learn.dls.valid)
    return learn, dict(suggestion=tuple(map(float, sug)), loaded=dict(preds=preds))

def bigger(): return nn.Sequential(body(), nn.Linear(64, 10), nn.ReLU(), nn.Linear(10, 10))
def wider(): return nn.Sequential(nn.Sequential(nn.Linear(64, 32), nn.ReLU()), nn.Linear(32, 10))

def _failing_files(m):
    "Files `learn.load` fails on, as users meet them: a good one first (its optimizer state too), then damaged ones"
    src = make_learner(m.parent)
    src.create_opt(); src.save('good')
    good = (m/'good.pth').read_bytes()
    (m/'empty.pth').write_bytes(b'')
    (m/'text.pth').write_text('hello, not weights\n')
    (m/'truncated.pth').write_bytes(good[:len(good)//2])
    (m/'garbage.pth').write_bytes(bytes(range(256))*4)
    torch.save(Items([1]), m/'object.pth')
    torch.save({'x': torch.zeros(1)}, m/'otherkeys.pth')
    torch.save([1, 2], m/'list.pth')
    (m/'folder.pth').mkdir()

# each failure: (the Learner's model and splitter, the file, `load`'s keyword arguments)
FAILURES = dict(missing=(mlp, None, 'nosuchfile', {}), empty=(mlp, None, 'empty', {}), text=(mlp, None, 'text', {}),
                truncated=(mlp, None, 'truncated', {}), garbage=(mlp, None, 'garbage', {}), object=(mlp, None, 'object', {}),
                folder=(mlp, None, 'folder', {}), list=(mlp, None, 'list', {}), other_keys=(mlp, None, 'otherkeys', {}),
                shapes=(wider, None, 'good', {}), missing_keys=(bigger, None, 'good', {}),
                strict_false=(bigger, None, 'good', dict(strict=False)), opt_groups=(mlp, two_groups, 'good', {}))

def _failures(d, cbs):
    "Each of `FAILURES` in turn: the exception's classes (most derived first), or `None`; a load that works is then trained"
    _failing_files(d/'models')
    raised = {}
    for k,(model,split,file,kw) in FAILURES.items():
        learn = make_learner(d, model=model, cbs=cbs(), **({'splitter': split} if split else {}))
        try: learn.load(file, **kw); raised[k] = None
        except Exception as e: raised[k] = [c.__name__ for c in type(e).__mro__]
    learn.fit(1)
    return learn, dict(raised=raised)

def failures(d): return _failures(d, list)
def failures_ar(d): return _failures(d, ar)

def _eafp_stage(d):
    "Issue 49's stage cache written the EAFP way (`except FileNotFoundError`); the package side with `AutoResume`"
    learn = make_learner(d, cbs=ar())
    try: learn.load('stage1')
    except FileNotFoundError:
        learn.fit_one_cycle(1); learn.save('stage1')
    return learn

def autoresume_eafp(d):
    "The EAFP stage cache, then a fit"
    learn = _eafp_stage(d)
    learn.fit(1)
    return learn, {}

def autoresume_strict(d):
    "The stage loaded with `strict=False` into a larger model (a new head), then trained; run again in its folder"
    _eafp_stage(d)
    big = make_learner(d, model=bigger, cbs=ar())
    big.load('stage1', strict=False); big.fit(1)
    return big, {}

JOBS = {f.__name__: f for f in (course, freezeload, foreign, wdchange, xproc_a, xproc_b, bestfile_a, bestfile_b, strict, withoptnone,
                                 persistent, midsave, export, startepoch_onecycle, startepoch_flatcos, lrfind, autoresume_smc,
                                 autoresume_ft, autoresume_course, pair_a, pair_b, pair_c, pair_d, failures, failures_ar,
                                 autoresume_eafp, autoresume_strict)}

# What python hides from a user by default (fastai's `load_model` raises numpy's DeprecationWarning for `np.core` at every load)
HIDDEN = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)

def run_job(name, out):
    "Run one job; its result (with the error, if it raised) as plain values"
    d = out/name.rsplit('_', 1)[0] if name.endswith(('_a', '_b', '_c', '_d')) else out/name
    d.mkdir(parents=True, exist_ok=True)
    STEPS[0] = 0
    MADE.clear()
    learn,extra,error = None,{},None
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')  # every warning a user sees, each time it is raised
        for c in HIDDEN: warnings.filterwarnings('ignore', category=c)
        try: learn,extra = JOBS[name](d)
        except Exception:
            error = traceback.format_exc()
            learn = MADE[-1] if MADE else None
    res = snapshot(learn) if learn is not None else {}
    return dict(res, **extra, steps=STEPS[0], error=error, warnings=[f'{w.category.__name__}: {w.message}' for w in ws])

if __name__ == '__main__':
    args = [a for a in sys.argv[1:] if a != '--stock']
    out,names = Path(args[0]),args[1:]
    unknown = [n for n in names if n not in JOBS]
    assert not unknown, f"unknown jobs {unknown}; the jobs: {list(JOBS)}"
    for name in names:
        res = run_job(name, out)
        print(f"JOB {name}: {'FAILED' if res['error'] else 'ok'}, {res['steps']} steps", flush=True)
        if res['error']: print(res['error'], file=sys.stderr, flush=True)
        torch.save(res, out/f'{name}.pth')
    assert STOCK == ('resumable_train' not in sys.modules), f"--stock={STOCK}, resumable_train imported: {'resumable_train' in sys.modules}"

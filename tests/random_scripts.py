"""Randomized training scripts for the kill-and-rerun defense of issue 28: a seeded generator, the kill windows, and the check.

`make_script(seed)` writes a user's script (digits MLP or a small text classifier; 1-4 fit calls of random kinds with random steps
between them; one of the shapes of issue 28; a random `every_iter`) and says what it holds. The script adds `Probe()` to each Learner
and ends with `save_results(out, *learners)`; run with `--plain` it is stock fastai (no `AutoResume`).

`Probe` prints what the run does, each line naming the fit call by the line of the script that called it and how many times that
line called before in this process (`12.0`, `12.1` for `fine_tune`'s two calls or a loop), so that a rerun which skips, loads or
caches calls numbers the others as the uninterrupted run did:
`FIT id n_epoch n_iter`, `BATCH id epoch iter`, `VALID id epoch iter`, `EVAL id` (a `validate`/`get_preds`), `END id` (before
`AutoResume` writes the end of the call), `SAVED id` (after every callback's `after_fit`: the end state is written), `RAISE id epoch
iter` (`Flaky`'s error). An error is a kill: a rerun continues the call that raised from its newest resume point, where a
deterministic error comes back at the same batch and a transient one does not; each fit call the process makes keeps its number.
With `RS_KILL` set in its environment the script SIGKILLs itself at one precise event (`kill_spec`), so a kill lands in its window
every time, with no sleep and no race: a training batch (before `AutoResume` writes at that batch), a validation batch, the start of
a fit call, just after a call's end state is written, or inside that write (the temporary file half written, or whole but not yet
renamed).

`choose_kills(events, rng)` draws one or two kill points from an uninterrupted run's events, in these windows: `first` (the first
batch of a fit call), `epoch_end` (the last batch of an epoch), `between` (after a call's end state is written and before the next
call's first resume point: just after the write, at the next call's start, in a `validate`/`get_preds` between them, or in its
first batches), `valid` (inside validation), `end_write` (inside the end-of-call write), `mid` (any batch); and the windows of
a family (`FAMILY_WINDOWS`): `before_raise` (a batch of the call that raises, before it raises), `retry_start` (the retry's or the
fallback's start, before its first resume point), `retry` (the rest of it), `past_len` (a stream's batches at or past the last one
`len()` counts, or an epoch's real last batch where `len()` counts more).

`run_case(forker, seed, folder)` runs the script uninterrupted with and without `AutoResume` (the same bits; the same batches alone
with `AutoResume(replay=True)`, whose stream draws apart from the training), kills it, reruns it to the end and once more, and
says `passed`, `refused` (a rerun exited non-zero with a message, no Traceback, and trained no batch) or `failed`, with the symptom.
"""
import hashlib, io, os, random, re, resource, signal, sys, time
from pathlib import Path
import torch
from torch.utils.data import IterableDataset
from fastai.callback.core import Callback, CancelEpochException, CancelStepException, CancelValidException

# ---------------------------------------------------------------- what runs inside a generated script
_P = dict(pid=None, count={}, steps=0, end=None, spec=None, raised=False, frames={})

def _state():
    "This process's probe state (a forked child starts afresh)"
    if _P['pid'] != os.getpid():
        _P.update(pid=os.getpid(), count={}, steps=0, end=None, spec=os.environ.get('RS_KILL'), raised=False, frames={})
        if _P['spec'] and _P['spec'].startswith('endwrite'): _patch_save()
    return _P

def _say(*a): print(*a, flush=True)

def _hit(*event):
    "SIGKILL this process if `event` is the kill point named in `RS_KILL`"
    if _state()['spec'] == ' '.join(map(str, event)):
        _say('KILL', *event)
        sys.stdout.flush(); sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

def _patch_save():
    "Kill inside the end-of-call write: `torch.save` to a file object (the resume point's temporary file) while a call ends"
    kind,cid,mode = _P['spec'].split()
    orig = torch.save
    def save(obj, f, *args, **kw):
        if _P['end'] != cid or isinstance(f, (str, os.PathLike)): return orig(obj, f, *args, **kw)
        buf = io.BytesIO()
        orig(obj, buf, *args, **kw)
        b = buf.getvalue()
        f.write(b if mode == 'whole' else b[:len(b)//2])
        f.flush()
        _hit(kind, cid, mode)
    torch.save = save

def _site(kind):
    "The id of this fit call (`kind` 'F') or evaluation ('E'): the script's line that called it, and its count on that line"
    f,script = sys._getframe(2),os.path.abspath(sys.argv[0])
    while f is not None and os.path.abspath(f.f_code.co_filename) != script: f = f.f_back
    line = f.f_lineno if f is not None else 0
    c = _state()['count']
    n = c[(kind, line)] = c.get((kind, line), -1) + 1
    return f"{'' if kind == 'F' else 'E'}{line}.{n}"

def _fit_frames()->list:
    "The frames of `Learner.fit` running now, innermost first (none in a `get_preds`, which sends `before_fit` too)"
    f,out = sys._getframe(1),[]
    while f is not None:
        if f.f_code.co_name == 'fit' and f.f_code.co_filename.endswith(os.path.join('fastai', 'learner.py')): out.append(f)
        f = f.f_back
    return out

class ProbeLate(Callback):
    "After every other callback's `after_fit` (`AutoResume`'s end-of-call write included)"
    order = 10_000
    def after_fit(self):
        if getattr(self.learn, '_rs_depth', 0):  # the end of a call inside an event (a `get_preds` not `inner`)
            self.learn._rs_depth -= 1
            return
        cid = getattr(self.learn, '_rs_call', None)
        if cid is None or not getattr(self.learn, '_rs_fitting', False): return
        _P['end'],self.learn._rs_fitting = None,False
        _say('SAVED', cid)
        _hit('saved', cid)

class Probe(Callback):
    "Print what the run does (see the module's doc), count optimizer steps, and kill the process at `RS_KILL`'s event"
    order = -20
    def after_create(self):
        if not any(isinstance(cb, ProbeLate) for cb in self.learn.cbs): self.learn.add_cb(ProbeLate())
    def before_fit(self):
        _state()
        self.after_create()
        frames,held = _fit_frames(),_state()['frames']  # the outermost `fit` frame of each Learner's running call
        # a call inside an event of the fit call (its `before_fit`); not after a call that an exception ended (no `after_fit`)
        if getattr(self.learn, '_rs_fitting', False) and any(f is held.get(id(self.learn)) for f in frames):
            self.learn._rs_depth = getattr(self.learn, '_rs_depth', 0) + 1
            return
        fitting = bool(frames) and not hasattr(self.learn, 'lr_finder')
        self.learn._rs_fitting,self.learn._rs_depth,held[id(self.learn)] = fitting,0,(frames[-1] if fitting else None)
        if not fitting: return
        cid = self.learn._rs_call = _site('F')
        _say('FIT', cid, self.n_epoch, len(self.dls.train))
        _hit('fit', cid)
    def before_validate(self):
        if not getattr(self.learn, '_rs_fitting', False):
            self.learn._rs_fitting,self.learn._rs_eval = False,_site('E')
            _say('EVAL', self.learn._rs_eval)
    def after_step(self): _P['steps'] += 1
    def after_batch(self):
        if not getattr(self.learn, '_rs_fitting', False): return _hit('eval', self.learn._rs_eval, self.iter)
        cid = self.learn._rs_call
        if self.training:
            _say('BATCH', cid, self.epoch, self.iter)
            _hit('batch', cid, self.epoch, self.iter)
        else:
            _say('VALID', cid, self.epoch, self.iter)
            _hit('valid', cid, self.epoch, self.iter)
    def after_fit(self):
        if not getattr(self.learn, '_rs_fitting', False) or getattr(self.learn, '_rs_depth', 0): return
        _P['end'] = self.learn._rs_call
        _say('END', self.learn._rs_call)

class Scorer(Callback):
    ("Call the Learner inside a fit call's `after_epoch`, itself removed (issue 48): `get_preds`, `validate` or "
     "`one_batch` (not in a `validate` of the script's: fastai's then waits forever)")
    def __init__(self, how): self.how = how
    def after_epoch(self):
        if not getattr(self.learn, '_rs_fitting', False): return
        learn = self.learn
        with learn.removed_cbs(self):
            if self.how == 'get_preds': learn.get_preds()
            elif self.how == 'validate': learn.validate()
            else: learn.one_batch(0, learn.dls.valid.one_batch())

class Cap(Callback):
    "Cancel where `how` says (issue 48): each epoch after `n` batches, validation of odd epochs, or the step of batch `n`"
    def __init__(self, how, n): self.how,self.n = how,n
    def after_batch(self):
        if self.how == 'epoch' and self.training and self.iter == self.n: raise CancelEpochException()
    def before_validate(self):
        if self.how == 'valid' and self.epoch % 2: raise CancelValidException()
    def before_step(self):
        if self.how == 'step' and self.iter == self.n: raise CancelStepException()

RAISED = 'raised'  # the file, in the run's folder, that says `Flaky` raised: its line, and the weights' digest there

def _digest(model)->str:
    return hashlib.sha1(b''.join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()

class Flaky(Callback):
    ("An error (`exc`) after training batch `at` of the fit call made on the script's `line`, once in a process. `deterministic` (a "
     "bug): it comes back wherever the run is again with the same weights, a rerun that continues the run from a point before it "
     "too (not the retry, at the same batch with other weights); `transient` (a lost connection): once in the run's folder; never "
     "with `RS_NO_ERROR` (the run that never met it). `RAISE` names the weights' digest there")
    def __init__(self, line, at, exc, mode='deterministic'): self.line,self.at,self.exc,self.mode = line,at,exc,mode
    def after_batch(self):
        cid = getattr(self.learn, '_rs_call', None)
        if not (self.training and getattr(self.learn, '_rs_fitting', False) and self.train_iter == self.at): return
        if cid.split('.')[0] != str(self.line) or _state().get('raised') or os.environ.get('RS_NO_ERROR'): return
        f,digest = Path(RAISED),_digest(self.learn.model)
        if f.exists():
            if self.mode == 'transient' or f.read_text().split()[1] != digest: return  # gone, or the retry at the same batch
        else: f.write_text(f'{self.line} {digest}')
        _P['raised'],self.learn._rs_fitting = True,False  # the call ends here: fastai sends no `after_fit`
        _say('RAISE', cid, self.epoch, self.iter, digest[:16])
        raise self.exc(self.mode)

class ReplayStream(IterableDataset):
    ("The digits `items` as a stream whose `__len__` is `hint`, not what an epoch holds (issue 48); each epoch's order drawn "
     "from torch's stream as it starts; no position of its own: `AutoResume(replay=True)` reads it again")
    def __init__(self, items, hint): self.items,self.hint = items,hint
    def __len__(self): return self.hint
    def order(self)->list: return torch.randperm(len(self.items)).tolist()
    def __iter__(self): return (self.items[i] for i in self.order())

class KeptStream(ReplayStream):
    "The same stream, which keeps its epoch's order and its position (`state_dict`/`load_state_dict`)"
    def __init__(self, items, hint): super().__init__(items, hint); self.perm,self.pos,self.loaded = [],0,None
    def __iter__(self):
        self.perm,self.pos = (self.loaded['perm'],self.loaded['pos']) if self.loaded else (self.order(),0)
        self.loaded = None
        while self.pos < len(self.perm):
            self.pos += 1
            yield self.items[self.perm[self.pos-1]]
    def state_dict(self): return dict(perm=list(self.perm), pos=self.pos)
    def load_state_dict(self, sd): self.loaded = sd

def save_results(out, *learners):
    "What the comparison checks, for each Learner: weights, optimizer state, Recorder; and this process's optimizer steps"
    from killrerun import plain
    res = []
    for l in learners:
        r = l.recorder
        res.append(dict(model=l.model.state_dict(), opt=l.opt.state_dict() if l.opt is not None else None, values=r.values,
                        losses=r.losses, lrs=r.lrs, iters=r.iters))
    torch.save(plain(dict(learners=res, steps=_state()['steps'])), out)
    _say('DONE')

# ---------------------------------------------------------------- the generator
SHAPES = ('one', 'two_same', 'two_other', 'per_call', 'cached', 'export')
# issue 48's families, drawn apart from the rest of the script: a callback that calls the Learner inside an event, one that
# cancels, a transient error the script retries or falls back from, a training stream whose `len()` is a hint
FAMILIES = ('nested', 'cancel', 'retry', 'stream')
KINDS = ('fit', 'fit_one_cycle', 'fit_flat_cos', 'fine_tune')
OPS = ('freeze', 'freeze_to', 'unfreeze', 'validate', 'get_preds', 'lr', 'nothing')

HEAD = '''\
import sys
from pathlib import Path
import torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from random_scripts import Probe, Scorer, Cap, Flaky, KeptStream, ReplayStream, save_results

out,resume = sys.argv[1],'--plain' not in sys.argv  # --plain: stock fastai, without the package
if resume: from resumable_train.autoresume import AutoResume
path = Path('.')
defaults.callbacks = [TrainEvalCallback, Recorder]  # no progress bars
set_seed({seed}, reproducible=True)
'''

DIGITS = '''\
from sklearn.datasets import load_digits
x,y = load_digits(return_X_y=True)
items = list(zip(torch.tensor(x[:320], dtype=torch.float32)/16, torch.tensor(y[:320])))
dls = Datasets(items, tfms=[[ItemGetter(0)], [ItemGetter(1)]], splits=[list(range(256)), list(range(256, 320))]
              ).dataloaders(bs=32, num_workers=0)
{data}
def splitter(m): return [list(m[0].parameters()), list(m[1].parameters()), list(m[2].parameters())]

def make_learner(path):
    model = nn.Sequential(nn.Sequential(nn.Linear(64, 32), nn.ReLU()), nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.1)),
                          nn.Linear(32, 10))
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, path=path, splitter=splitter, lr=1e-2,
                   cbs={cbs})
'''

TEXT = '''\
import numpy as np, pandas as pd
from fastai.text.all import *

def corpus(n=96):
    "Short documents over 12 words; the label says whether the first word is one of the first six"
    rs = np.random.RandomState(0)
    words = [f'w{{i}}' for i in range(12)]
    docs = [list(rs.choice(words, rs.randint(4, 16))) for _ in range(n)]
    return pd.DataFrame({{'text': [' '.join(d) for d in docs], 'label': [int(d[0] in words[:6]) for d in docs]}})

dls = TextDataLoaders.from_df(corpus(), text_col='text', label_col='label', valid_pct=0.2, seed=42, bs=8, tok_tfm=BaseTokenizer())

def make_learner(path):
    config = dict(awd_lstm_clas_config, emb_sz=16, n_hid=32, n_layers=2)
    return text_classifier_learner(dls, AWD_LSTM, pretrained=False, seq_len=8, config=config, metrics=accuracy, path=path,
                                   lr=1e-2, cbs={cbs})
'''

def _lr(rng, kind):
    "A learning-rate argument, or none (then `learn.lr`)"
    r = rng.random()
    if r < 0.35: return ''
    if kind == 'fine_tune': return ', ' + rng.choice(['2e-3', '5e-3', 'base_lr=1e-2'])
    v = rng.choice(['1e-2', '3e-3', 'slice(1e-3, 1e-2)' if kind != 'fit' else '5e-3'])
    return f', {v}'

def _fit(rng, app, var, per_call, every, bg):
    "One fit call's statement (in a loop at times), and its description"
    kind = rng.choice(KINDS)
    n = rng.choice([1, 1, 2]) if app == 'digits' else 1
    args = f'{n}{_lr(rng, kind)}'
    if kind == 'fine_tune': args += f', freeze_epochs={rng.choice([1, 1, 0])}'
    if per_call: args += ', cbs=autoresume()'
    stmt = f'{var}.{kind}({args})'
    if rng.random() < 0.12:
        return [f'for i in range(2):', f'    {stmt}'], f'loop 2x {stmt}'
    return [stmt], stmt

def _op(rng, var):
    "A step between two fit calls"
    op = rng.choice(OPS + ('nothing', 'nothing'))
    code = {'freeze': f'{var}.freeze()', 'freeze_to': f'{var}.freeze_to(-2)', 'unfreeze': f'{var}.unfreeze()',
            'validate': f'print({var}.validate())', 'get_preds': f'preds,targs = {var}.get_preds()',
            'lr': f'{var}.lr = {rng.choice(["3e-3", "2e-2"])}', 'nothing': None}[op]
    return ([code] if code else []), (code or '')

_NONE = object()

def _family(seed, family, mixup:bool, app:str, shape:str)->dict:
    ("The family's code, by where it goes in the script (`cbs`: added to the Learner's callbacks; `data`: after the digits' "
     "`dls`; `body`: lines after the main Learner's calls; `replay`: `AutoResume(replay=True)`), and its description; "
     "`family=''` forces none")
    rng = random.Random(seed * 104729 + 3)  # its own draws: a seed's script is the same with the family or without
    # no epoch cancelled with `MixUp` (its `after_train` is skipped, and fastai's next epoch crashes, stock too), no retry with
    # it (a raise in a batch skips its `after_train` too, which puts the loss function back: each retry fails at once, or
    # crashes in its `before_batch`, stock too); a stream in the digits alone, not exported (`export` makes every loader anew,
    # which a PyTorch DataLoader cannot)
    fams = [f for f in FAMILIES if not (f == 'retry' and mixup or f == 'stream' and (app != 'digits' or shape == 'export'))]
    family = (rng.choice(fams) if rng.random() < 0.5 else '') if family is None else family
    out = dict(family=family, cbs='', data='', body=[], replay=False, desc='')
    if family == 'nested':
        how = rng.choice(['get_preds', 'validate', 'one_batch'])
        out.update(cbs=f" + [Scorer({how!r})]", desc=f"nested {how}")
    elif family == 'cancel':
        how,n = rng.choice(['valid', 'step'] if mixup else ['epoch', 'valid', 'step']),rng.randint(0, 5)
        out.update(cbs=f" + [Cap({how!r}, {n})]", desc=f"cancel {how}" + (f" at {n}" if how != 'valid' else ''))
    elif family == 'retry': out.update(_retry(rng, app, shape))
    elif family == 'stream':
        kind,lie = rng.choice(['kept', 'replay']),rng.choice([-2, -1, 1, 2])  # batches that `len()` counts beyond the 8
        cls = 'KeptStream' if kind == 'kept' else 'ReplayStream'
        out.update(data=f"# the training loader over a stream whose len() is a hint (issue 48): 8 batches an epoch\n"
                        f"dls = DataLoaders(torch.utils.data.DataLoader({cls}(items[:256], {256 + 32*lie}), batch_size=32), "
                        f"dls.valid)\n", replay=kind == 'replay',
                   desc=f"stream {kind}-{'short' if lie > 0 else 'long'}: 8 batches an epoch, len() {8 + lie}")
    elif family: raise ValueError(f"no family {family!r} in {FAMILIES}")
    return out

REACTIONS = ('loop', 'fallback', 'raise', 'exit')  # how the script takes the error (issue 60)

def _retry(rng, app, shape)->dict:
    ("A fit call that meets an error (`Flaky`, deterministic or transient), and the script's reaction: the same call again in a "
     "loop, another in its place (caught as a `ValueError`, as the package's refusals are too, or a `RuntimeError`), `raise` "
     "(the process dies of it) or `sys.exit(1)` (a scheduler job; the rerun is the job requeued); `Flaky`'s line (`LINE`) is set "
     "once the script is written")
    how,kind,n = rng.choice(REACTIONS),rng.choice(['fit', 'fit_one_cycle', 'fit_flat_cos']),rng.choice([1, 2])
    mode = rng.choice(['deterministic', 'transient'])
    n = n if app == 'digits' else 1
    at,per_call = rng.randint(1, 8*n - 1),', cbs=autoresume()' * (shape == 'per_call')
    call = f"learn.{kind}({n}{rng.choice(['', ', 1e-2', ', 3e-3'])}{per_call})"
    if how == 'loop':
        body = ["for attempt in range(3):  # the same call again", "    try:", f"        {call}",
                "        break", "    except RuntimeError: print('RETRY', attempt, flush=True)"]
        exc,line = 'RuntimeError',body[2]
    elif how == 'fallback':
        other,exc = f"learn.{rng.choice(['fit_one_cycle', 'fit'])}(1, 1e-3{per_call})",rng.choice(['ValueError', 'RuntimeError'])
        body,line,how = [f"try: {call}", f"except {exc}: {other}  # another call in its place"],f"try: {call}",f'{how}-{exc}'
    else:
        end = 'raise' if how == 'raise' else 'sys.exit(1)  # the job fails; the scheduler requeues it'
        exc,body = 'RuntimeError',[f"try: {call}", f"except RuntimeError: print('FAILED', flush=True); {end}"]
        line = body[0]
    return dict(cbs=f" + [Flaky(LINE, {at}, {exc}, {mode!r})]", body=body, line=line,
                desc=f"retry {how} {mode} {call.replace(per_call, '')}, raise after batch {at}")

def make_script(seed, app=None, shape=None, every_iter=_NONE, background=None, mixup=None, family=None)->tuple:
    "The text of a random script from `seed`, and a dict describing it; the arguments given force what they name"
    rng = random.Random(seed)
    app = app or ('text' if rng.random() < 0.25 else 'digits')
    shape = shape or rng.choice(SHAPES)
    every = rng.choice([None, 1, 2, 3, 3, 4, 5, 7])
    if every_iter is not _NONE: every = every_iter
    bg = rng.random() < 0.15
    if background is not None: bg = background
    mixup = (app == 'digits' and rng.random() < 0.25) if mixup is None else mixup
    n_calls = rng.randint(2 if shape in ('cached', 'export') else 1, 4)
    per_call = shape == 'per_call'
    fam = _family(seed, family, mixup, app, shape)
    cbs = "[Probe()]" + ("" if per_call else f" + ([AutoResume({_ar_args(every, bg, fam['replay'])})] if resume else [])")
    cbs += " + [MixUp()]" if mixup else ""
    cbs += fam['cbs']
    body,desc = [],[]
    fits = [_fit(rng, app, 'learn', per_call, every, bg) for _ in range(n_calls)]
    ops = [_op(rng, 'learn') if (i or rng.random() < 0.3) else ([], '') for i in range(n_calls)]
    split = rng.randint(1, n_calls-1) if shape in ('cached', 'export') else None
    for i,((fcode,fdesc),(ocode,odesc)) in enumerate(zip(fits, ops)):
        if shape == 'cached' and i == 0:
            body += ["if (path/'models'/'stage1.pth').exists(): learn.load('stage1')", "else:"]
            stage = ocode + fcode
            for j in range(1, split): stage += ops[j][0] + fits[j][0]
            body += ['    ' + l for l in stage] + ["    learn.save('stage1')"]
            desc.append(f"[cached stage1: {'; '.join(d for k in range(split) for d in (ops[k][1], fits[k][1]) if d)}]")
        if shape == 'cached' and i < split: continue
        if shape == 'export' and i == split:
            body += ["learn.export('stage.pkl')", "learn = load_learner(path/'stage.pkl')", "learn.dls = dls"]
            desc.append('export+load_learner')
        body += ocode + fcode
        desc += [d for d in (odesc, fdesc) if d]
    body += fam['body']
    learners = ['learn']
    if shape in ('two_same', 'two_other'):
        where = 'path' if shape == 'two_same' else "path/'second'"
        body.append(f"learn2 = make_learner({where})")
        d2 = []
        for i in range(rng.randint(1, 2)):
            (oc,od),(fc,fd) = (_op(rng, 'learn2') if i else ([], '')),_fit(rng, app, 'learn2', False, every, bg)
            body += oc + fc
            d2 += [d for d in (od, fd) if d]
        desc.append(f"learner 2 ({'same folder' if shape == 'two_same' else 'other folder'}): {'; '.join(d2)}")
        learners.append('learn2')
    text = HEAD.format(seed=seed)
    if per_call:
        text += f"def autoresume(): return [AutoResume({_ar_args(every, bg, fam['replay'])})] if resume else []  # one per fit call\n\n"
    text += DIGITS.format(cbs=cbs, data=fam['data']) if app == 'digits' else TEXT.format(cbs=cbs)
    text += "\nlearn = make_learner(path)\n" + '\n'.join(body) + f"\nsave_results(out, {', '.join(learners)})\n"
    info = dict(seed=seed, app=app, shape=shape, every_iter=every, background=bg, mixup=mixup, family=fam['desc'],
                calls='; '.join(desc))
    text = f'"""Random script {seed}: {describe(info)}"""\n' + text
    if 'line' in fam: text = text.replace('Flaky(LINE,', f"Flaky({text.splitlines().index(fam['line']) + 1},")
    return text, info

def _ar_args(every, bg, replay=False):
    return ', '.join([f'every_iter={every}'] * (every is not None) + ['background=True'] * bg + ['replay=True'] * replay)

def describe(info)->str:
    "One line: the app, shape and options, then the calls"
    opts = [info['app'], info['shape'], f"every_iter={info['every_iter']}"] + ['background'] * info['background'] + \
           ['MixUp'] * info['mixup'] + [info['family']] * bool(info.get('family'))
    return f"{', '.join(opts)}: {info['calls']}"

# ---------------------------------------------------------------- edits between a kill and the rerun (issue 60)
EDITS = ('data', 'callback-learner', 'callback-fit', 'metric', 'epochs', 'wd-learner', 'wd-fit')
# what a refusal of each edit names (other data of the same size: `data`; a text corpus drawn anew may change sizes too)
REFUSED = {'data': ('data:', 'n_items', 'n_iter', 'n_params'), 'callback-learner': ('callbacks:',), 'callback-fit': ('callbacks:',),
           'metric': ('metrics:',), 'epochs': ('n_epoch',)}
_FIT = re.compile(r'(learn2?\.(?:fit|fit_one_cycle|fit_flat_cos|fine_tune)\()(\d+)([^\n]*)\)')

def edit_script(text:str, kind:str)->str:
    ("Script `text` edited as a user edits it between a kill and the rerun: `kind` one of `EDITS`: other data of the same size, "
     "`GradientClip` added to the Learner or to the first fit call, a metric added, the first call's epochs, weight decay set in "
     "the Learner or in the first fit call")
    head,rest = text.split('\n', 1)  # the docstring names the calls too
    def first_fit(f): return _FIT.sub(lambda m: f(m), rest, count=1)
    def add(arg): return lambda m: m[0][:-1] + f', {arg})'
    new = {'data': lambda: rest.replace('x[:320]', 'x[1:321]').replace('y[:320]', 'y[1:321]').replace('RandomState(0)', 'RandomState(1)'),
           'callback-learner': lambda: rest.replace('cbs=[Probe()]', 'cbs=[Probe(), GradientClip(0.5)]', 1),
           'callback-fit': lambda: first_fit(lambda m: m[0].replace('cbs=autoresume()', 'cbs=autoresume()+[GradientClip(0.5)]')
                                             if 'cbs=autoresume()' in m[0] else add('cbs=GradientClip(0.5)')(m)),
           'metric': lambda: rest.replace('metrics=accuracy', 'metrics=[accuracy, error_rate]'),
           'epochs': lambda: first_fit(lambda m: f'{m[1]}{int(m[2])+1}{m[3]})'),
           'wd-learner': lambda: rest.replace('lr=1e-2,', 'lr=1e-2, wd=0.5,', 1),
           'wd-fit': lambda: first_fit(add('wd=0.5'))}[kind]()
    assert new != rest, f"the edit {kind} changed nothing"
    return f'{head}\n{new}'

# ---------------------------------------------------------------- kill windows
WINDOWS = ('first', 'epoch_end', 'between', 'valid', 'end_write', 'mid')
FAMILY_WINDOWS = {'retry': ('before_raise', 'retry_start', 'retry'), 'stream': ('past_len',)}

def family_windows(info)->tuple:
    "The kill windows of the script's family (`info` from `make_script`), if it has its own"
    return FAMILY_WINDOWS.get((info.get('family') or 'none').split()[0], ())

def parse(lines)->list:
    "The events a run printed: `(kind, id, *ints)`"
    out = []
    for l in lines:
        p = l.split()
        if p and p[0] in ('FIT', 'BATCH', 'VALID', 'EVAL', 'END', 'SAVED', 'KILL', 'RAISE'): out.append((p[0], *p[1:]))
    return out

def batches(lines)->list: return [tuple(e[1:]) for e in parse(lines) if e[0] == 'BATCH']

def _candidates(events, window, every)->list:
    "`(event index, kill spec)` for each kill point of `window` in an uninterrupted run's `events`"
    fits = {e[1]: (int(e[2]), int(e[3])) for e in events if e[0] == 'FIT'}
    last = {}  # each epoch's last batch, as trained (a stream's `len()` is a hint; a cancel ends an epoch early)
    for e in events:
        if e[0] == 'BATCH': last[e[1], e[2]] = max(last.get((e[1], e[2]), 0), int(e[3]))
    out = []
    for k,e in enumerate(events):
        if e[0] == 'BATCH':
            cid,ep,it = e[1],int(e[2]),int(e[3])
            n_iter,end = fits[cid][1],it == last[cid, e[2]]
            if window == 'first' and ep == 0 and it == 0: out.append((k, f'batch {cid} 0 0'))
            if window == 'epoch_end' and end: out.append((k, f'batch {cid} {ep} {it}'))
            if window == 'mid': out.append((k, f'batch {cid} {ep} {it}'))
            if window == 'past_len' and (it >= n_iter-1 or end): out.append((k, f'batch {cid} {ep} {it}'))
        if window == 'valid' and e[0] == 'VALID': out.append((k, f'valid {e[1]} {e[2]} {e[3]}'))
        if window == 'end_write' and e[0] == 'END' and fits[e[1]][0] > 0:
            out += [(k, f'endwrite {e[1]} half'), (k, f'endwrite {e[1]} whole')]
    if window == 'between':
        ends = [k for k,e in enumerate(events) if e[0] == 'SAVED']
        for k in ends:
            out.append((k, f'saved {events[k][1]}'))
            out += _start(events, k+1, every, evals=True)
    for r in [k for k,e in enumerate(events) if e[0] == 'RAISE' and window in ('before_raise', 'retry_start', 'retry')]:
        cid = events[r][1]
        if window == 'before_raise':
            out += [(k, f'batch {cid} {e[2]} {e[3]}') for k,e in enumerate(events[:r]) if e[0] == 'BATCH' and e[1] == cid]
        else: out += _after_raise(events, r, every)[window == 'retry']
    return out

def _after_raise(events, r, every)->tuple:
    ("The kill points of the call after the raise at event `r` (the retry, or the call in its place): before its first "
     "resume point (its start, its batches up to its first periodic write, or its first epoch with its validation), and after")
    call = next((e[1] for e in events[r+1:] if e[0] == 'FIT'), None)
    start,rest = [],[]
    for k,e in enumerate(events[r+1:], r+1):
        if e[1:2] != (call,): continue
        if e[0] == 'SAVED': break
        if e[0] == 'FIT': start.append((k, f'fit {call}'))
        if e[0] in ('BATCH', 'VALID'):
            ep,it = int(e[2]),int(e[3])
            before = ep == 0 and (not every or e[0] == 'BATCH' and it <= every - 1)
            (start if before and not rest else rest).append((k, f'{e[0].lower()} {call} {ep} {it}'))
    return start,rest

def _start(events, j, every, evals=False)->list:
    ("The kill points from event `j` on up to the next call's first resume point (its first periodic write, or its first "
     "epoch's end): its start, its first batches, and (`evals`) the `validate`/`get_preds` before it")
    out = []
    for k,e in enumerate(events[j:], j):
        if e[0] == 'EVAL' and evals: out.append((k, f'eval {e[1]} 0'))
        if e[0] == 'FIT': out.append((k, f'fit {e[1]}'))
        if e[0] == 'BATCH':
            if int(e[2]) > 0 or int(e[3]) > min(3, (every or 99) - 1): break
            out.append((k, f'batch {e[1]} {e[2]} {e[3]}'))
        if e[0] == 'SAVED': break
    return out

def choose_kills(events, rng, every, windows=None)->list:
    "One or two `(window, spec)` kill points, in the order they happen; `windows` forces the windows"
    windows = list(windows or [rng.choice(WINDOWS)] + ([rng.choice(WINDOWS)] if rng.random() < 0.5 else []))
    out,after = [],-1
    for w in windows:
        c = [(k, s) for k,s in _candidates(events, w, every) if k > after]
        if not c: c = [(k, s) for k,s in _candidates(events, 'mid', every) if k > after]; w = 'mid'
        if not c: break
        k,s = rng.choice(c)
        out.append((w, s)); after = k
    return out

# ---------------------------------------------------------------- one case
def _run(forker, script, args, cwd, env=None, timeout=120):
    "Run `script` in `cwd` as a forked child, at most `timeout` s (its process group killed after); `(rc, lines)`"
    from killrerun import run_until
    Path(cwd).mkdir(parents=True, exist_ok=True)
    try: return run_until(forker, script, args, cwd=cwd, env=env, timeout=timeout, sig=None)
    except AssertionError as e: return 'timeout', str(e).splitlines()

def _diffs(ref, got)->list:
    from helpers import diff_values
    a,b = torch.load(ref, weights_only=True),torch.load(got, weights_only=True)
    return diff_values(a['learners'], b['learners'], 'learners')

def _steps(f): return torch.load(f, weights_only=True)['steps']

def _trace(lines)->str:
    "The exception of a Traceback in `lines` (its message's next line too, when fastai wraps it), and the one it was raised in; or ''"
    text = ''.join(lines)
    if 'Traceback' not in text: return ''
    ls = text.splitlines()
    exc = [i for i,l in enumerate(ls) if re.match(r'^[\w.]+(Error|Exception|Exit|Interrupt)\b', l)]
    if not exc: return [l for l in ls if l.strip()][-1][:200]
    def one(i):
        m = ls[i].strip()
        if m.endswith(':') and i+1 < len(ls) and ls[i+1].strip(): m += ' ' + ls[i+1].strip()
        return m[:240]
    last,first = one(exc[-1]),one(exc[0])
    return last if first == last else f'{last} (raised while handling {first})'

def _last(lines)->str:
    "The last line of a run's output, but the package's hint that follows a refusal: the refusal itself"
    return next((l.strip() for l in reversed(lines) if l.strip() and not l.startswith('(RESUMABLE_TRAIN_DEBUG')), '')[:300]

class Outcome(Exception):
    "How a case ended: `kind` is 'passed', 'refused' or 'failed'"
    def __init__(self, kind, what=''): super().__init__(what); self.kind,self.what = kind,what

def _ended(rc, lines, what):
    "A run that exited non-zero: refused (one message, no Traceback, no batch trained) or failed"
    if rc == 'timeout': raise Outcome('failed', f'{what}: did not finish (timeout)')
    if (t := _trace(lines)): raise Outcome('failed', f'{what}: crashed with {t}')
    if (n := len(batches(lines))): raise Outcome('failed', f'{what}: exited {rc} after training {n} batches: {_last(lines)}')
    raise Outcome('refused', f'{what}: {_last(lines)}')

def _in_order(trained, ref, to_end:bool=True)->bool:
    ("Are the batches `trained` some of `ref`'s, in its order (`to_end`: up to its last)? A call that an error ended is continued "
     "up to the error again")
    it = iter(ref)
    return bool(trained) and (trained[-1] == ref[-1] or not to_end) and all(b in it for b in trained)

def _raises(lines)->list: return [e for e in parse(lines) if e[0] == 'RAISE']

def run_case(forker, seed, folder, windows=None, timeout=120, stock=None, kills=None, edit=None, **force)->dict:
    """Generate script `seed`, run it uninterrupted (with `AutoResume`; with `stock`, a `forked.StockForker`, also as stock fastai in
    a process that never imports the package), kill it at one or two points,
    rerun it to the end and once more; return a dict: `outcome`, `symptom`, `kills`, `info`, `cpu` (children's CPU seconds).
    `kills`: `(window, spec)` pairs to use instead of drawing them (to reproduce a case). `edit` (one of `EDITS`): the script is
    edited after the kills, and the rerun must refuse it naming the change, or continue naming it (weight decay), or end as before
    (an edit the rerun does not reach). An error is a kill (issue 60): a deterministic one comes back where the run met it, a
    transient one does not, and the run ends as the one that never met it (`RS_NO_ERROR`); a script that exits on it (`raise`,
    `sys.exit(1)`) is a job, requeued: the rerun after a deterministic error fails there again, with the same weights"""
    folder = Path(folder); folder.mkdir(parents=True, exist_ok=True)
    text,info = make_script(seed, **force)
    script = folder/'script.py'
    script.write_text(text)
    fam = (info.get('family') or '').split() + ['', '', '']
    errs,job,transient = fam[0] == 'retry',fam[1] in ('raise', 'exit'),fam[2] == 'transient'
    if edit and job: raise ValueError(f'script {seed} exits on its error: a job, which the soak edits not (its rerun fails by design)')
    res = dict(seed=seed, info=info, desc=describe(info), kills=[], outcome=None, symptom='', runs=0, stock=None, edit=edit)
    cpu0,t0 = resource.getrusage(resource.RUSAGE_CHILDREN),time.monotonic()
    def run(name, cwd, out, *args, env=None):
        res['runs'] += 1
        rc,lines = _run(forker, str(script), [out, *args], cwd, env=env, timeout=timeout)
        (folder/f"{res['runs']}-{name.replace(' ', '')}.log").write_text(f"rc={rc} env={env}\n" + ''.join(lines))
        return rc,lines
    failed = lambda rc,lines: job and rc == 1 and 'FAILED' in ''.join(lines)  # the job exited on its error
    try:
        ref,out,never = folder/'ref.pth',folder/'out.pth',folder/'never.pth'
        rc,ref_lines = run('reference', folder/'ref', ref)
        if rc != 0 and not failed(rc, ref_lines): _ended(rc, ref_lines, 'the uninterrupted run')
        events,ref_b = parse(ref_lines),batches(ref_lines)
        if errs and transient:  # the run that never met the error
            rc,lines = run('never met', folder/'never', never, env={'RS_NO_ERROR': '1'})
            if rc != 0: _ended(rc, lines, 'the run that never met the error')
            never_b = batches(lines)
        if stock is not None:
            plain_out = folder/'plain.pth'
            (folder/'plain').mkdir()
            rc,out_text = stock.run(str(script), plain_out, '--plain', timeout=timeout, cwd=folder/'plain')
            lines = out_text.splitlines(keepends=True)
            (folder/'stock.log').write_text(f"rc={rc}\n{out_text}")
            res['stock'] = 'differs'  # until it is seen equal
            if job:  # stock's job fails there too, with the same weights
                if rc != 1 or batches(lines) != ref_b or _raises(lines) != _raises(ref_lines):
                    raise Outcome('failed', f'stock fastai (--plain) exited {rc} after {len(batches(lines))} batches, raising '
                                            f'{_raises(lines)}; with AutoResume {len(ref_b)} batches, raising {_raises(ref_lines)}')
            else:
                if rc != 0: raise Outcome('failed', f'stock fastai (--plain) exited {rc}: {_trace(lines) or _last(lines)}')
                d = _diffs(plain_out, ref)
                if batches(lines) != ref_b or _steps(plain_out) != _steps(ref):
                    raise Outcome('failed', f'uninterrupted run with AutoResume trained {len(ref_b)} batches ({_steps(ref)} steps), '
                                            f'stock fastai {len(batches(lines))} ({_steps(plain_out)} steps)')
                # `AutoResume(replay=True)` reads a stream under random streams of its own: not stock's draws, by design
                apart = info['family'].startswith('stream replay')
                if d and not apart: raise Outcome('failed', f'uninterrupted run with AutoResume differs from stock fastai: {d[0]}')
                res['stock'] = 'apart' if apart else 'equal'
            res['stock'] = res['stock'] if not job else 'equal'
        kills = kills or choose_kills(events, random.Random(seed * 7919 + 1), info['every_iter'], windows)
        res['kills'] = kills
        run_dir,trained = folder/'run',[]
        for n,(w,spec) in enumerate(kills):
            rc,lines = run(f'kill {n+1}', run_dir, out, env={'RS_KILL': spec})
            what = f'kill {n+1} ({w}: {spec})' if n == 0 else f'the rerun after kill {n} (to be killed at {w}: {spec})'
            if failed(rc, lines): trained.append(batches(lines)); continue  # the job failed before: requeued
            if rc == 0:
                if n == 0: raise Outcome('failed', f'the run meant to be killed at {spec} never got there and ended')
                trained.append(batches(lines)); res['edit'] = None  # it did not get there: it is the rerun to the end
                break
            if rc != -signal.SIGKILL: _ended(rc, lines, what)
            if not any(l.startswith('KILL ') for l in lines): raise Outcome('failed', f'{what}: killed by something else')
            trained.append(batches(lines))
        else:
            if edit:  # the same script, edited
                script.write_text(edit_script(text, edit))
            for _ in range(2):  # a job whose transient error came in this rerun (killed before it) is requeued once more
                rc,lines = run('rerun', run_dir, out)
                if not (failed(rc, lines) and transient and not edit): break
            if edit:
                def edited_ref():  # the edited script, uninterrupted, in a folder of its own
                    rc,lines = run('edited reference', folder/'edref', folder/'edref.pth')
                    if rc != 0: _ended(rc, lines, 'the edited script, uninterrupted')
                    return folder/'edref.pth'
                gone = errs and transient and not _raises(lines)  # the error did not come in this rerun
                _edited(edit, rc, lines, never if gone else ref, out, edited_ref)
            if failed(rc, lines) and not transient:  # the bug comes back where the run met it, with the same weights
                if _raises(lines)[-1:] != _raises(ref_lines)[-1:]:
                    raise Outcome('failed', f'the requeued job raised {_raises(lines)}, the uninterrupted one {_raises(ref_lines)}')
                if not _in_order(batches(lines), [b for b in ref_b]): raise Outcome('failed', 'the requeued job trained other batches')
                raise Outcome('passed')
            if rc != 0: _ended(rc, lines, f'the rerun after {len(kills)} kill(s)')
            trained.append(batches(lines))
        # a transient error that is gone: the run that never met it; else the uninterrupted run
        gone = errs and transient and not _raises(lines)
        expect,expect_b = (never,never_b) if gone else (ref,ref_b)
        last,d = trained[-1],_diffs(expect, out)
        tail = expect_b[len(expect_b)-len(last):] if last else []
        if d: raise Outcome('failed', f'exit 0 with other weights ({len(d)} differences; first: {d[0]})')
        # a continued call that raised may resume at its last epoch's end, with nothing left to train: its bits are compared
        if not (last == tail or errs and _in_order(last, expect_b, to_end=False)):
            raise Outcome('failed', f'the rerun to the end trained {len(last)} batches that are not the rest of the uninterrupted run')
        if _steps(out) != len(last): raise Outcome('failed', f'the rerun took {_steps(out)} optimizer steps for {len(last)} batches')
        rc,lines = run('again', run_dir, out)
        if rc != 0: _ended(rc, lines, 'a rerun after the end')
        # a call that an error ended is never done: a rerun continues it, up to the error again (deterministic), or, the
        # error gone (transient), to its end: the run then ends as the one that never met it
        if errs and transient and not gone: expect,expect_b = never,never_b
        if batches(lines) and not (errs and not gone and _in_order(batches(lines), expect_b, to_end=False)):
            raise Outcome('failed', f'a rerun after the end trained {len(batches(lines))} batches')
        if (d := _diffs(expect, out)): raise Outcome('failed', f'a rerun after the end ended with other weights: {d[0]}')
        raise Outcome('passed')
    except Outcome as o: res.update(outcome=o.kind, symptom=o.what)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res.update(cpu=cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, wall=time.monotonic() - t0)
    return res

def _edited(kind, rc, lines, expect, out, edited_ref):
    ("The rerun of an edited script (`edit_script`): refused naming the change (before any batch, one message), or continued "
     "naming it (weight decay), or as before (the rerun does not reach the edit), or as the edited script uninterrupted (the edit "
     "is in calls the run's journal does not hold: they train as usual); `Outcome`")
    text = ''.join(lines)
    if rc != 0:
        if (t := _trace(lines)) or batches(lines): raise Outcome('failed', f'the edit {kind}: exited {rc}, {t or "after training"}')
        if kind in REFUSED and any(k in text for k in REFUSED[kind]):
            raise Outcome('passed', f'the edit {kind}: refused: {_last(lines)}')
        raise Outcome('failed', f'the edit {kind}: refused for another reason: {_last(lines)}')
    if kind not in REFUSED and 'other hyperparameters' in text: raise Outcome('passed', f'the edit {kind}: named')
    if not _diffs(expect, out): raise Outcome('passed', f'the edit {kind}: not reached by the rerun')
    if not _diffs(edited_ref(), out): raise Outcome('passed', f'the edit {kind}: in calls the journal does not hold: as the edited script')
    raise Outcome('failed', f'the edit {kind}: continued in silence, with other weights')

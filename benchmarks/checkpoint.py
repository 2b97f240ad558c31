"2. Checkpoint cost: one `learn.save(with_iter=True)` inside `fit` against a bare `torch.save` of the same model and optimizer state, and where a durable save's time goes"
import io, os, tempfile, time, torch
from pathlib import Path
from fastai.callback.core import Callback, CancelFitException
import fastai.callback.schedule  # noqa: F401 (fit_one_cycle)
from resumable_train.point import checkpoint
from resumable_train.point import _log_history as log_history  # the step `make_point` takes after the record
from resumable_train.store import LocalStore
from resumable_train.files import _compact, resume_record, write_checkpoint
from resumable_train.files import fsync as _fsync
from resumable_train.files import log_ref
from common import *

def _bare(learn, file, fsync=False):
    with open(file, 'wb') as f:
        torch.save({'model': learn.model.state_dict(), 'opt': learn.opt.state_dict()}, f)
        if fsync: f.flush(); os.fsync(f.fileno())

def _steps(learn, d):
    "A durable `learn.save`, step by step as `Learner.save` and `write_checkpoint` take them: the seconds of each"
    t,out = time.perf_counter(),{}
    def lap(k):
        nonlocal t
        now = time.perf_counter(); out[k] = out.get(k, 0) + now - t; t = now
    ck = checkpoint(learn); lap('snapshot')
    start = log_history(learn, resume_record(ck), LocalStore(d), 'steps.history'); lap('history')
    rec = resume_record(ck)
    obj = {**ck, 'opt': {**ck['opt'], 'resume': _compact(rec)}}
    with open(os.devnull, 'wb') as f: torch.save(obj, f)
    lap('serialise')  # pickling, checksums, zip records: the CPU's part
    with open(d/'.steps.tmp', 'wb') as f:
        torch.save(obj, f); f.flush()
        lap('write')
        os.fsync(f.fileno())
        if log_ref(rec): _fsync(d/'steps.history')
        lap('fsync')
    os.replace(d/'.steps.tmp', d/'steps.pth'); lap('rename')
    _fsync(d); lap('fsync')
    if start: start()
    out['write'] -= out['serialise']  # the second torch.save serialised again: what remains is the write itself
    return out

VARIANTS = {'bare': lambda l,d: _bare(l, d/'bare.pth'),
            'bare atomic': lambda l,d: write_checkpoint({'model': l.model.state_dict(), 'opt': l.opt.state_dict()}, d/'atomic.pth', durable=False),
            'bare+fsync': lambda l,d: _bare(l, d/'bare.pth', fsync=True),
            'save': lambda l,d: l.save(d/'save', durable=False, with_iter=True),
            'save durable': lambda l,d: l.save(d/'save', durable=True, with_iter=True),
            'steps': _steps}

class SaveBench(Callback):
    "At each of `reps` training batches, time every variant once (in rotated order); then stop `fit`"
    def __init__(self, folder, reps, history=0): self.folder,self.reps,self.history,self.times = Path(folder),reps,history,{}
    def after_batch(self):
        if not self.training: return
        if self.history and self.iter == 0:  # what the Recorder (and a scheduler) hold after `history` batches of a long run
            r = self.learn.recorder
            r.losses += [torch.tensor(1/(i+1)) for i in range(self.history)]
            r.lrs += [1e-3]*self.history
            for k,v in getattr(getattr(self.learn, 'param_scheduler', None), 'hps', {}).items(): v += [1e-3 if k == 'lr' else .9]*self.history
        vs = list(VARIANTS)
        vs = vs[self.iter % len(vs):] + vs[:self.iter % len(vs)]
        for v in vs:
            os.sync()  # no writeback of the previous variant's file in flight during this one
            if v == 'steps':
                for k,x in _steps(self.learn, self.folder).items(): self.times.setdefault(k, []).append(x)
            else: self.times.setdefault(v, []).append(timed(VARIANTS[v], self.learn, self.folder))
        if self.iter+1 >= self.reps: raise CancelFitException()

def run(quick=False, device=None, reps=None):
    reps = reps or (1 if quick else 5)
    cases = ([('small', 0, 'fit'), ('small', 1000, 'fit_one_cycle')] if quick else
             [('small', 0, 'fit'), ('small', 100_000, 'fit'), ('small', 100_000, 'fit_one_cycle'), ('medium', 0, 'fit'), ('large', 0, 'fit')])
    t = Table('checkpoint', '2. Checkpoint cost: learn.save(with_iter=True) inside fit vs bare torch.save of model+opt state dicts',
              ['model', 'params', 'state MB', 'fit', 'history batches', 'bare ms', 'save ms', 'save / bare', 'target ≤ 1.20', 'bare atomic ms', 'save / bare atomic',
               'bare+fsync ms', 'save durable ms', 'durable / (bare+fsync)', 'snapshot ms', 'history ms', 'serialise ms', 'write ms', 'rename ms', 'fsync ms',
               'bare MB', 'save MB', 'size ratio'],
              [f"median of {reps} saves at successive training batches, variants interleaved (rotated order), each after `os.sync()` (so that "
               "no writeback of another variant's file runs during it); Adam state; files in the temp folder",
               "bare: `torch.save({'model': model.state_dict(), 'opt': opt.state_dict()}, f)` (no fsync); save: `learn.save(f, with_iter=True, durable=False)`; "
               "save durable: `durable=True` (fsync of file and folder)",
               "history batches: the per-batch history of a run that has trained that many batches: the Recorder's loss and learning rate, "
               "and with `fit_one_cycle` its `ParamScheduler`'s lr and mom; the resume point appends the rows since the last save to the "
               "history log next to it (the bare save keeps no history)",
               "bare atomic: the bare save written as every resume point is, to a temporary file renamed over the target (`write_checkpoint`, "
               "not durable): on ext4, renaming over an existing file makes the kernel allocate the new file's blocks at once (auto_da_alloc)",
               "snapshot … fsync: a durable save timed step by step, as learn.save takes them: snapshot (`checkpoint`: resume point, state "
               "dicts), history (rows appended to the log), serialise (`torch.save` to /dev/null: pickling, checksums, zip records), write "
               "(`torch.save` to the temporary file, less serialise), rename (over the previous file), fsync (file, history log, folder)"])
    for size,hist,fit in cases:
        with tempfile.TemporaryDirectory(prefix='bench-ckpt-') as d:
            learn = make_learner(reps+1, bs=8, size=size, device=device, path=d)
            sb = SaveBench(d, reps, hist)
            getattr(learn, fit)(1, cbs=sb)
            m = {v: med(xs) for v,xs in sb.times.items()}
            sz = {n: os.path.getsize(Path(d)/f'{n}.pth') for n in ('bare', 'save')}
            t.add(size, f"{n_params(learn.model):,}", mb(state_bytes(learn)), fit, f"{hist:,}", ms(m['bare']), ms(m['save']), ratio(m['save'], m['bare']),
                  'met' if m['save'] <= 1.2*m['bare'] else 'NOT met', ms(m['bare atomic']), ratio(m['save'], m['bare atomic']), ms(m['bare+fsync']), ms(m['save durable']),
                  ratio(m['save durable'], m['bare+fsync']), *[ms(m[k]) for k in ('snapshot', 'history', 'serialise', 'write', 'rename', 'fsync')],
                  mb(sz['bare']), mb(sz['save']), ratio(sz['save'], sz['bare']))
            t.raw[f'{size}/{hist}/{fit}'] = dict(sb.times, sizes=sz)
    return t

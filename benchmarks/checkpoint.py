"2. Checkpoint cost: one `learn.save(with_iter=True)` inside `fit` against a bare `torch.save` of the same model and optimizer state"
import os, tempfile, torch
from pathlib import Path
from fastai.callback.core import Callback, CancelFitException
from common import *

def _bare(learn, file, fsync=False):
    with open(file, 'wb') as f:
        torch.save({'model': learn.model.state_dict(), 'opt': learn.opt.state_dict()}, f)
        if fsync: f.flush(); os.fsync(f.fileno())

VARIANTS = {'bare': lambda l,d: _bare(l, d/'bare.pth'),
            'bare+fsync': lambda l,d: _bare(l, d/'bare.pth', fsync=True),
            'save': lambda l,d: l.save(d/'save', durable=False),
            'save durable': lambda l,d: l.save(d/'save', durable=True)}

class SaveBench(Callback):
    "At each of `reps` training batches, time every variant once (in rotated order); then stop `fit`"
    def __init__(self, folder, reps, history=0): self.folder,self.reps,self.history,self.times = Path(folder),reps,history,{}
    def after_batch(self):
        if not self.training: return
        if self.history and self.iter == 0:  # what the Recorder holds after `history` batches of a long run
            r = self.learn.recorder
            r.losses += [torch.tensor(1/(i+1)) for i in range(self.history)]
            r.lrs += [1e-3]*self.history; r.iters += list(range(self.history))
        vs = list(VARIANTS)
        vs = vs[self.iter % len(vs):] + vs[:self.iter % len(vs)]
        for v in vs: self.times.setdefault(v, []).append(timed(VARIANTS[v], self.learn, self.folder))
        if self.iter+1 >= self.reps: raise CancelFitException()

def run(quick=False, device=None, reps=None):
    reps = reps or (1 if quick else 5)
    cases = [('small', 0)] if quick else [('small', 0), ('small', 10_000), ('large', 0)]
    t = Table('checkpoint', '2. Checkpoint cost: learn.save(with_iter=True) inside fit vs bare torch.save of model+opt state dicts',
              ['model', 'params', 'state MB', 'Recorder batches', 'bare ms', 'save ms', 'save / bare', 'target ≤ 1.10',
               'fsync ms (save durable − save)', 'bare+fsync ms', 'save durable ms', 'durable / (bare+fsync)', 'bare MB', 'save MB', 'size ratio'],
              [f"median of {reps} saves at successive training batches, variants interleaved (rotated order); Adam state; files in the temp folder",
               "bare: `torch.save({'model': model.state_dict(), 'opt': opt.state_dict()}, f)` (no fsync); save: `learn.save(f, with_iter=True, durable=False)`; "
               "save durable: `durable=True` (fsync of file and folder)",
               "Recorder batches: the Recorder's history of a run that has trained that many batches (its losses are one 0-dim tensor each, "
               "all saved in the resume point; the bare save does not keep them)"])
    for size,hist in cases:
        with tempfile.TemporaryDirectory(prefix='bench-ckpt-') as d:
            learn = make_learner(reps+1, bs=8, size=size, device=device, path=d)
            sb = SaveBench(d, reps, hist)
            learn.fit(1, cbs=sb)
            m = {v: med(xs) for v,xs in sb.times.items()}
            fs = m['save durable'] - m['save']
            sz = {n: os.path.getsize(Path(d)/f'{n}.pth') for n in ('bare', 'save')}
            t.add(size, f"{n_params(learn.model):,}", mb(state_bytes(learn)), f"{hist:,}", ms(m['bare']), ms(m['save']), ratio(m['save'], m['bare']),
                  'met' if m['save'] <= 1.1*m['bare'] else 'NOT met', ms(fs), ms(m['bare+fsync']), ms(m['save durable']),
                  ratio(m['save durable'], m['bare+fsync']), mb(sz['bare']), mb(sz['save']), ratio(sz['save'], sz['bare']))
            t.raw[f'{size}/{hist}'] = dict(sb.times, sizes=sz)
    return t

"1. Fast-forward cost: time from `fit` start to the first trained batch when resuming at batch k of an epoch"
import random, shutil, tempfile, time
from fastai.callback.core import Callback, CancelBatchException, CancelFitException
from resumable_train.all import *
from common import *

class FirstBatch(Callback):
    "Note when the first batch has been trained (and which one it was), then stop `fit`"
    order = 100
    def after_step(self):
        self.t,self.at = time.perf_counter(),self.iter
        raise CancelFitException()

class CancelFirst(Callback):
    "fastai's own way to start at batch `k`: load each batch before it and cancel it"
    order = -20
    def __init__(self, k): self.k = k
    def before_batch(self):
        if self.training and self.iter < self.k: raise CancelBatchException()

class SaveAfterFirst(Callback):
    "Write a resume point after the first trained batch, then stop `fit`"
    def __init__(self, file): self.file = file
    def after_batch(self):
        if not self.training: return
        self.learn.save(self.file, durable=False, with_iter=True)
        raise CancelFitException()

def _first_batch(learn, variant, k, rp):
    "Seconds from `fit` start to the end of the first trained batch, starting at batch `k` the `variant` way"
    fb = FirstBatch()
    cbs = [fb] + ([CancelFirst(k)] if variant == 'cancel' else [])
    if variant == 'resume': learn.load(rp[k], check_setup=False)  # timing only: written without workers, loaded with and without
    t = time.perf_counter()
    learn.fit(1, cbs=cbs, start_iter=k if variant == 'skip' else 0)
    want = 0 if variant == 'fresh' else k
    if fb.at != want: raise RuntimeError(f"{variant} at k={k}: first trained batch was {fb.at}, not {want}")
    return fb.t - t

def run(quick=False, device=None, reps=None):
    ks = (0, 10) if quick else (0, 10, 100, 1000, 10_000, 100_000)
    cancel_max,cancel_reps = (10, 1) if quick else (1000, 2)  # iterate-and-discard costs k batches of loading: measured up to `cancel_max`
    reps = reps or (1 if quick else 5)
    bs,delay,workers = 8,0.002,(0, 2)
    tmp = tempfile.mkdtemp(prefix='bench-ff-')
    try: return _run(ks, cancel_max, cancel_reps, reps, bs, delay, workers, tmp)
    finally: shutil.rmtree(tmp, ignore_errors=True)

def _run(ks, cancel_max, cancel_reps, reps, bs, delay, workers, tmp):
    learns = {nw: make_learner(max(ks)+2, bs=bs, delay=delay, num_workers=nw, path=tmp) for nw in workers}
    rp = {k: f'rp-{k}' for k in ks if k}
    for k in rp: learns[0].fit(1, start_iter=k-1, cbs=SaveAfterFirst(rp[k]))  # a resume point at batch k
    times = {}
    for r in range(reps):
        for nw in workers:
            for k in ks:
                vs = ['fresh', 'skip'] + (['resume'] if k else []) + (['cancel'] if k <= cancel_max and r < cancel_reps else [])
                random.Random(f'{r}{nw}{k}').shuffle(vs)
                for v in vs: times.setdefault((nw, k, v), []).append(_first_batch(learns[nw], v, k, rp))
    t = Table('fastforward', '1. Fast-forward: time from fit start to the first trained batch, resuming at batch k',
              ['workers', 'k', 'fresh ms', 'SkipToIter ms', 'SkipToIter / fresh', 'resume point ms', 'resume point / fresh',
               'CancelBatch ms', 'CancelBatch / fresh', 'target ≤ 1.10'],
              [f"items sleep {delay*1e3:g} ms each, {bs} items a batch, tiny model; median of {reps} runs ({cancel_reps} for CancelBatch), variants interleaved",
               "SkipToIter: `learn.fit(1, start_iter=k)`; resume point: `learn.load(<resume point at batch k>)` then `learn.fit(1)` (load not timed); "
               "CancelBatch: a callback raising CancelBatchException in before_batch for the first k batches (fastai's iterate-and-discard)",
               "target: SkipToIter and resume point within 10% of a fresh start for every k"])
    worst = 0
    for nw in workers:
        for k in ks:
            m = {v: med(times.get((nw, k, v), [])) for v in ('fresh', 'skip', 'resume', 'cancel')}
            rs = [m[v]/m['fresh'] for v in ('skip', 'resume') if m[v] == m[v]]
            worst = max(worst, *rs)
            t.add(nw, k, ms(m['fresh']), ms(m['skip']), ratio(m['skip'], m['fresh']), ms(m['resume']), ratio(m['resume'], m['fresh']),
                  ms(m['cancel']), ratio(m['cancel'], m['fresh']), 'met' if max(rs) <= 1.10 else 'NOT met')
    t.notes.append(f"worst SkipToIter/resume-point ratio: {worst:.2f} ({'met' if worst <= 1.10 else 'NOT met'})")
    t.raw = {f'{nw}/{k}/{v}': xs for (nw, k, v),xs in times.items()}
    return t

"4. Non-blocking writes: how long the training loop stalls per resume point with `AutoResume(background=True)` against a synchronous one"
import random, tempfile, time
from fastai.callback.core import Callback
from resumable_train.autoresume import AutoResume
from common import *

class TimedAutoResume(AutoResume):
    "`AutoResume` that notes the time its batch's end (`_batch_end`, once every callback saw `after_batch`) takes when it writes a resume point, and the time of each write"
    def before_fit(self):
        super().before_fit()
        self.stalls,self.writes,w = [],[],self.writer
        write = w._write
        def _timed(*args):
            t = time.perf_counter()
            write(*args)
            self.writes.append(time.perf_counter() - t)
        w._write = _timed
    def _batch_end(self):
        n,t = self.points.next_num,time.perf_counter()
        super()._batch_end()
        if self.points.next_num != n: self.stalls.append(time.perf_counter() - t)

class Compute(Callback):
    "Stand in for the training compute between two resume points, and as long as a background write takes (a periodic resume point due during one is put off)"
    order = 99
    def __init__(self, secs, ar): self.secs,self.ar = secs,ar
    def after_batch(self):
        if not self.training: return
        time.sleep(self.secs)
        self.ar.writer.wait()

def _one(learn, every, background, secs):
    "Stalls of the first resume point of a fit (host buffers allocated) and of the second (buffers reused)"
    with tempfile.TemporaryDirectory(prefix='bench-stall-') as d:
        learn.path = Path(d)
        ar = TimedAutoResume(every_iter=every, background=background, verbose=False)
        learn.fit(1, cbs=[ar, Compute(secs, ar)])
    return ar.stalls[0],ar.stalls[1],ar.writes[0]

def run(quick=False, device=None, reps=None):
    reps = reps or (1 if quick else 5)
    size,n,secs = ('small', 5, 0.01) if quick else ('large', 5, 0.25)
    learn = make_learner(n, bs=8, size=size, device=device)
    stalls,firsts,writes = {}, {}, {}
    for r in range(reps):
        for bg in random.Random(r).sample([False, True], 2):
            f,s,w = _one(learn, 2, bg, secs)  # resume points after batches 2 and 4; the second is the steady state
            firsts.setdefault(bg, []).append(f); stalls.setdefault(bg, []).append(s); writes.setdefault(bg, []).append(w)
    sync,bg = med(stalls[False]),med(stalls[True])
    t = Table('stall', '4. Non-blocking writes: training-thread stall per resume point, AutoResume(background=True) vs synchronous',
              ['model', 'state MB', 'sync stall ms', 'background stall ms', 'background / sync', 'target ≤ 0.20',
               'first background stall ms (buffers allocated)', 'background write ms (other thread)'],
              [f"stall: time in AutoResume.after_batch at a batch that writes a resume point (durable: fsync of file and folder); "
               f"two periodic resume points per fit, {secs} s of stand-in compute per batch so that no write is in flight at the next one; "
               f"the second (steady state: host buffers reused) is compared; median of {reps} fits, variants interleaved",
               "background stall = copying the state into host buffers + the resume point; the write runs in a thread"])
    t.add(size, mb(state_bytes(learn)), ms(sync), ms(bg), ratio(bg, sync), 'met' if bg <= 0.2*sync else 'NOT met', ms(med(firsts[True])),
          ms(med(writes[True])))
    t.raw = dict(stalls={str(k): v for k,v in stalls.items()}, firsts={str(k): v for k,v in firsts.items()},
                 writes={str(k): v for k,v in writes.items()})
    return t

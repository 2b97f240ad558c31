"4. Non-blocking writes: how long the training loop stalls per resume point with `AutoResume(background=True)` against a synchronous one"
import random, tempfile, time
from resumable_train.autoresume import AutoResume
from common import *

class TimedAutoResume(AutoResume):
    "`AutoResume` that notes the time its `after_batch` takes when it writes a resume point, and the time of each write"
    def before_fit(self):
        super().before_fit()
        self.stalls,self.writes,w = [],[],self.writer
        write = w._write
        def _timed(*args):
            t = time.perf_counter()
            write(*args)
            self.writes.append(time.perf_counter() - t)
        w._write = _timed
    def after_batch(self):
        n,t = self.next_num,time.perf_counter()
        super().after_batch()
        if self.next_num != n: self.stalls.append(time.perf_counter() - t)

def _one(learn, every, background):
    with tempfile.TemporaryDirectory(prefix='bench-stall-') as d:
        learn.path = Path(d)
        ar = TimedAutoResume(every_iter=every, background=background, verbose=False)
        learn.fit(1, cbs=ar)
    return ar.stalls[0],ar.writes[0]

def run(quick=False, device=None, reps=None):
    reps = reps or (1 if quick else 5)
    size,n = ('small', 4) if quick else ('large', 4)
    learn = make_learner(n, bs=8, size=size, device=device)
    stalls,writes = {}, {}
    for r in range(reps):
        for bg in random.Random(r).sample([False, True], 2):
            s,w = _one(learn, n-1, bg)  # one periodic resume point in the epoch, before its last batch
            stalls.setdefault(bg, []).append(s); writes.setdefault(bg, []).append(w)
    sync,bg = med(stalls[False]),med(stalls[True])
    t = Table('stall', '4. Non-blocking writes: training-thread stall per resume point, AutoResume(background=True) vs synchronous',
              ['model', 'state MB', 'sync stall ms', 'background stall ms', 'background / sync', 'target ≤ 0.20', 'background write ms (other thread)'],
              [f"stall: time in AutoResume.after_batch at a batch that writes a resume point (durable: fsync of file and folder); "
               f"one periodic resume point per fit (no write in flight before it); median of {reps} fits, variants interleaved",
               "background stall = copying the state to host memory (`checkpoint(copy=True)`) + the resume point; the write runs in a thread"])
    t.add(size, mb(state_bytes(learn)), ms(sync), ms(bg), ratio(bg, sync), 'met' if bg <= 0.2*sync else 'NOT met', ms(med(writes[True])))
    t.raw = dict(stalls={str(k): v for k,v in stalls.items()}, writes={str(k): v for k,v in writes.items()})
    return t

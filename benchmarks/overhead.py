"3. Training overhead of `AutoResume`: batches per second of a training loop with `AutoResume(every_iter=N)` against the same loop without it"
import contextlib, os, random, tempfile, time
import torch
from fastai.callback.core import Callback
from resumable_train.autoresume import AutoResume
from resumable_train.checkpoints import RunPoints
from common import *

def _serialise_only(self, ck, name, start=None):
    with open(os.devnull, 'wb') as f: torch.save(ck, f)

# background writes that stop short, to tell where the time of a background resume point goes
PARTS = {'snapshot': lambda self, ck, name, start=None: None,  # the training thread's part only: snapshot and host copy
         'serialise': _serialise_only}                         # and the writer's pickling, to /dev/null: no disk, no pruning

@contextlib.contextmanager
def _part(bg):
    "With `bg` a key of `PARTS`: AutoResume's writes do only that part"
    if bg not in PARTS: yield; return
    old = RunPoints._write,RunPoints.prune
    RunPoints._write,RunPoints.prune = PARTS[bg],lambda self: None
    try: yield
    finally: RunPoints._write,RunPoints.prune = old

class TrainTimer(Callback):
    "Time the training phase of the epoch (the periodic resume points fall in it; the end-of-epoch one does not)"
    order = -100
    def before_train(self): self.t = time.perf_counter()
    def after_train(self): self.secs,self.n = time.perf_counter() - self.t,self.n_iter

def _secs_per_batch(learn, every, background, threads):
    torch.set_num_threads(threads)
    tt = TrainTimer()
    with tempfile.TemporaryDirectory(prefix='bench-ar-') as d:
        learn.path = Path(d)  # a fresh folder: AutoResume would continue a previous run's resume points
        cbs = [tt] + ([] if every == 'none' else [AutoResume(every_iter=every, background=bool(background), verbose=False)])
        with _part(background): learn.fit(1, cbs=cbs)
    return tt.secs/tt.n

def run(quick=False, device=None, reps=None):
    reps = reps or (1 if quick else 5)
    n,size = (30, 'medium') if quick else (400, 'medium')
    cores = torch.get_num_threads()
    threads = [cores] + ([cores-1] if cores > 1 and not quick else [])  # torch on every core; and one core left for the writer
    variants = [('none', False), (None, False), (10, False), (10, True), (10, 'snapshot'), (10, 'serialise')] if quick else \
               [('none', False), (None, False), (10, False), (50, False), (200, False), (10, True), (50, True), (200, True),
                (10, 'snapshot'), (10, 'serialise')]
    learn = make_learner(n, bs=64, size=size, device=device)
    times = {}
    for r in range(reps):
        vs = [(*v, th) for v in variants for th in threads]
        random.Random(r).shuffle(vs)
        for v in vs: times.setdefault(v, []).append(_secs_per_batch(learn, *v))
    torch.set_num_threads(cores)
    t = Table('overhead', '3. Training overhead of AutoResume: batches/s with AutoResume(every_iter=N) vs without',
              ['torch threads', 'AutoResume', 'background', 'ms/batch', 'batches/s', 'slowdown', 'seconds between saves', 'target < 3%'],
              [f"{size} MLP ({n_params(learn.model):,} params, {mb(state_bytes(learn))} MB of state with Adam), bs 64, {n} batches an epoch, "
               f"in-memory data; training phase only (the end-of-epoch resume point is not timed); median of {reps} fits, variants interleaved",
               "every_iter=None: no periodic resume points, only AutoResume's per-batch bookkeeping (SeedBatches, which AutoResume adds only for DataLoaders with workers, is not in this loop)",
               "background 'snapshot' and 'serialise': where background=True's time goes, measured by writes that stop short: 'snapshot' writes nothing "
               "(what remains is the training thread's snapshot and host copy), 'serialise' pickles the resume point to /dev/null (adding the "
               "writer thread's pickling, which holds the GIL); the rest of 'yes' is the disk write, fsync and pruning of old files"])
    for th in threads:
        base,picked = med(times[('none', False, th)]),None
        for every,bg in variants:
            s = med(times[(every, bg, th)])
            slow = s/base - 1
            if every not in ('none', None) and slow < 0.03 and (picked is None or every < picked[0]) and not bg: picked = (every, every*s, slow)
            t.add(th, '—' if every == 'none' else f'every_iter={every}', bg if isinstance(bg, str) else 'yes' if bg else 'no', f"{s*1e3:.2f}", f"{1/s:.0f}", f"{slow:+.1%}",
                  '—' if every in ('none', None) else f"{every*s:.2f}", '' if every == 'none' else 'met' if slow < 0.03 else 'NOT met')
        t.notes.append(f"{th} torch threads: smallest synchronous interval under 3%: every_iter={picked[0]} (a save every {picked[1]:.2f} s; {picked[2]:+.1%})"
                       if picked else f"{th} torch threads: no synchronous interval measured is under 3%")
    t.raw = {f'{e}/{b}/{th}': xs for (e, b, th),xs in times.items()}
    return t

@contextlib.contextmanager
def _stock_loop(on=True):
    "With `on`: fastai's own `fit`, `_call_one`, `_with_events` and `one_batch`, as in a process without the package"
    from fastai.learner import Learner
    from resumable_train import hooks
    mine = {n: Learner.__dict__[n] for n in ('fit', '_call_one', '_with_events', 'one_batch')} if on else {}
    for n,f in mine.items(): setattr(Learner, n, f._fastai)
    try: yield
    finally:
        for n,f in mine.items(): setattr(Learner, n, f)

def _fit_secs(learn, ar, init=None):
    """Seconds of the training phase of one epoch of `learn`, with `AutoResume(**ar)` (no AutoResume when `ar` is None, fastai's own
    loop when it is 'stock'); from the weights `init` and a new optimizer, if given"""
    if init is not None: learn.model.load_state_dict(init); learn.opt = None
    tt = TrainTimer()
    with tempfile.TemporaryDirectory(prefix='bench-ar-') as d, _stock_loop(ar == 'stock'):
        learn.path = Path(d)
        learn.fit(1, cbs=[tt] + ([] if ar in (None, 'stock') else [AutoResume(verbose=False, **ar)]))
    return tt.secs, tt.n

def run_secs(quick=False, device=None, reps=None):
    "AutoResume's cost per batch as a user sets it: every_secs=10 and the default, on a loop of at least 20 s, one torch thread"
    reps,n = reps or (1 if quick else 2),(300 if quick else 8000)  # quick: a smoke run, the table made
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    learn = make_learner(n, bs=64, size='small', device=device)
    # every fit from the same weights: fits that go on training the same weights get slower (2.1 ms a batch in the first fit of this
    # MLP, 2.5-2.8 ms in the next ones, with or without AutoResume), which made the variant that happened to run first look cheapest
    init = {k: v.clone() for k,v in learn.model.state_dict().items()}
    variants = {'stock fastai': 'stock', 'the package imported, no AutoResume': None, 'AutoResume() (epoch ends only)': {},
                'AutoResume(every_secs=10)': dict(every_secs=10)}
    times = {k: [] for k in variants}
    for r in range(reps):
        ks = list(variants); random.Random(r).shuffle(ks)
        for k in ks: times[k].append(_fit_secs(learn, variants[k], init)[0])
    torch.set_num_threads(threads)
    t = Table('overhead_secs', "3b. AutoResume's cost per batch: every_secs=10 and the default against no AutoResume",
              ['AutoResume', 'seconds', 'ms/batch', 'cost µs/batch', 'slowdown', 'goal ≤ 1% and ≤ 20 µs'],
              [f"small MLP ({n_params(learn.model):,} params), bs 64, one epoch of {n} batches, one torch thread, in-memory data; the "
               f"training phase timed (the end-of-epoch resume point is not); best of {reps} fits, variants interleaved, each fit from the same "
               "initial weights and a new optimizer"])
    base = min(times['stock fastai'])
    for k,ts in times.items():
        s = min(ts); cost = (s - base)/n*1e6; slow = s/base - 1; stock = k == 'stock fastai'
        t.add(k, f"{s:.2f}", f"{s/n*1e3:.3f}", '—' if stock else f"{cost:.1f}", '—' if stock else f"{slow:+.2%}",
              '' if stock else 'met' if slow <= 0.01 and cost <= 20 else 'NOT met')
    own = {k: _loop_cost(learn, init, n, ar) for k,ar in (('stock', 'stock'), ('none', None), ('every_secs=10', dict(every_secs=10)))}
    st = own['stock']['loop']
    for k in ('none', 'every_secs=10'):
        o = own[k]; extra = o['loop'] - st
        t.notes.append(f"timed inside the loop, against fastai's own loop in this process ({st:.1f} µs a batch outside the callbacks' "
                       f"own work: the event dispatch): {'the package imported, no AutoResume' if k == 'none' else 'AutoResume(' + k + ')'} "
                       f"{o['loop']:.1f} µs a batch (the dispatch {o['dispatch']:.1f}, the package's callbacks {o['package']:.1f}, its "
                       f"wrappers of `one_batch` and `_with_events` {o['wrappers']:.1f}): {extra:+.1f} µs a batch, "
                       f"{extra/(base/n*1e6):+.2%} of a batch, "
                       f"{'met' if extra <= 20 and extra/(base/n*1e6) <= 0.01 else 'NOT met'} (goal ≤ 1% and ≤ 20 µs)")
    ev = _events_cost(learn, quick)
    t.notes.append(f"a batch's eight events alone (`before_batch` ... `after_batch`, sent {ev['n']:,} times in a row inside a training "
                   "phase, the Recorder's tensor work off: the same in every variant; best of 5 blocks in each of "
                   f"{ev['reps']} fits a variant, interleaved): stock fastai {ev['stock']:.1f} µs, the package imported "
                   f"{ev['none']:.1f} µs ({ev['none']-ev['stock']:+.1f}), AutoResume(every_secs=10) {ev['ar']:.1f} µs "
                   f"({ev['ar']-ev['stock']:+.1f} against stock, {ev['ar']-ev['none']:+.1f} against the package's loop alone): "
                   f"{'met' if ev['ar']-ev['stock'] <= 20 else 'NOT met'} (≤ 20 µs)")
    t.notes.append("the end-to-end columns compare whole fits, and identical fits of this loop differ by several percent on this machine; "
                   "the in-loop figures take the callbacks' own work (the Recorder's tensor work, the same in both) out of the "
                   "comparison and leave what the package adds")
    t.raw = dict(times, own=own, events=ev)
    return t

_EVENTS = ('before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step', 'after_batch')

def _events_cost(learn, quick=False)->dict:
    """µs of a training batch's events alone, sent to the Learner's callbacks from inside a training phase (its first batches trained
    for real: the loss, the counters), in fastai's own loop ('stock'), with the package imported ('none') and with
    `AutoResume(every_secs=10)` ('ar'): what each adds to a batch, without the model's work and its noise"""
    from fastai.learner import Learner
    (n,reps),got = (200, 1) if quick else (5000, 3),{}
    def timed(self):
        if not self.training: return old(self)
        self.n_iter = len(self.dl)
        for i,b in zip(range(2), self.dl): self.one_batch(i, b)
        self.recorder.run = False  # its tensor work (the smoothed loss), the same in every variant
        try:
            best = []
            for _ in range(5):
                t = time.perf_counter_ns()
                for _ in range(n):
                    for e in _EVENTS: self(e)
                best.append((time.perf_counter_ns() - t)/n/1e3)
        finally: self.recorder.run = True
        got.setdefault(self.variant, []).append(min(best))
    old = Learner.all_batches
    Learner.all_batches = timed
    try:
        for r in range(reps):
            ks = ['stock', 'none', 'ar']; random.Random(r).shuffle(ks)
            for k in ks:
                learn.variant = k
                with tempfile.TemporaryDirectory(prefix='bench-ev-') as d, _stock_loop(k == 'stock'), learn.no_logging():
                    learn.path = Path(d)
                    learn.fit(1, cbs=[AutoResume(verbose=False, every_secs=10)] if k == 'ar' else [])
    finally: Learner.all_batches = old; learn.__dict__.pop('variant', None)
    return dict(n=n, reps=reps, **{k: min(v) for k,v in got.items()})

def _loop_cost(learn, init, n, ar)->dict:
    """µs a batch of the training phase spent in the loop's machinery rather than in a callback's own work: the event dispatch
    (`Learner._call_one` less the non-package callbacks it calls), the package's callbacks and its wrappers of fastai's loop methods;
    `ar='stock'` runs fastai's own `fit`, `_call_one`, `_with_events` and `one_batch`, as in a process without the package"""
    from fastai.learner import Learner
    from fastai.callback.core import Callback as Cb
    from resumable_train import hooks
    spent,depth = {},[0]
    def add(key, t): spent[key] = spent.get(key, 0) + t
    def timed(owner, name, key, by_cb=False):
        f = owner.__dict__[name] if isinstance(owner, type) else owner[name]
        def g(*args, **kwargs):
            if by_cb and depth[0]: return f(*args, **kwargs)  # a LeanCallback's `__call__` calls `Callback.__call__`: the outer one
            depth[0] += by_cb; t = time.perf_counter_ns()
            try: return f(*args, **kwargs)
            finally:
                d = time.perf_counter_ns() - t; depth[0] -= by_cb
                if not by_cb: add(key, d)
                else: add('package' if type(args[0]).__module__.startswith('resumable_train') else 'user', d)
        if isinstance(owner, type): setattr(owner, name, g)
        else: owner[name] = g
        return lambda: (setattr(owner, name, f) if isinstance(owner, type) else owner.__setitem__(name, f))
    class Phase(Cb):
        "Time only the training phase: AutoResume's end-of-epoch point is not a batch's"
        order = -101
        def before_train(self): spent.clear()
        def after_train(self): self.got = dict(spent)
    stock,ph = ar == 'stock',Phase()
    with tempfile.TemporaryDirectory(prefix='bench-ar-') as d, _stock_loop(stock):
        undo = [] if stock else [u for name in ('_with_events', 'one_batch')  # the package's wrappers, and what they call
                                 for u in (timed(Learner, name, 'wrapped'), timed(hooks._fastai, name, 'inner'))]
        undo += [timed(Learner, '_call_one', 'events')]
        undo += [timed(c, '__call__', None, by_cb=True) for c in (Cb, hooks.LeanCallback)]
        try:
            learn.path = Path(d); learn.model.load_state_dict(init); learn.opt = None
            learn.fit(1, cbs=[ph] + ([] if ar in (None, 'stock') else [AutoResume(verbose=False, **ar)]))
        finally:
            for u in reversed(undo): u()
    us = {k: v/1e3/n for k,v in ph.got.items()}
    got = lambda k: us.get(k, 0.)
    out = dict(dispatch=got('events') - got('user') - got('package'), package=got('package'),
               wrappers=got('wrapped') - got('inner'), user=got('user'))
    out['loop'] = out['dispatch'] + out['package'] + out['wrappers']
    return out

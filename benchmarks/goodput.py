"""Time to finish under preemption: `AutoResume` (defaults, and a hand-tuned interval) beside fastai's own way and no checkpoint.

One training (an MLP with dropout on random data, a shuffled fastai DataLoader with 2 workers, `fit_one_cycle`) runs to its end while
its process is preempted at seeded random moments, as clouds and schedulers do it: SIGKILL with a mean interval of 20, 40 and 80 s
(spot machines), and SIGTERM with a 30 s grace, then SIGKILL (Slurm, Kubernetes). Each preemption starts a fresh process at once; the
moments are the same for every contender. The contenders:

- `AutoResume()` with no arguments (`Cadence`: Young and Daly's interval from the run's story), rerun after each preemption;
- `AutoResume(every_secs=2)`, an interval tuned by hand;
- fastai's own way: `SaveModelCallback(every_epoch=True, with_opt=True)`, and a restart that loads the newest epoch's file and calls
  the same fit with `start_epoch` (what fastai's docs and forums offer);
- no checkpoint: each process trains from scratch, stopped at `CAP` times the uninterrupted run's time ("never finished").

For each: wall time to finish / the uninterrupted run's, batches trained more than once, restart (process start to its first batch),
bytes written (the processes' `write` calls, `/proc/PID/io`), and whether the final weights equal the uninterrupted run's
(`torch.equal` on every tensor of the model). Only the `AutoResume` processes import the package; the others are stock fastai.

    python benchmarks/goodput.py [--quick] [--out benchmarks/results]
"""
import argparse, json, math, os, queue, random, signal, statistics, subprocess, sys, tempfile, time, shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
EPOCHS,N_BATCHES,BS,WIDTH = 3, 900, 64, 512  # about 13 s an epoch on one core of a 2-core VM
SCHEDULES = [('SIGKILL', 20), ('SIGKILL', 40), ('SIGKILL', 80), ('SIGTERM', 40)]  # (signal, mean seconds between preemptions)
GRACE = 30  # SIGTERM's grace, then SIGKILL
CAP = 3.0  # a contender still training at CAP x the uninterrupted run's time never finishes
TUNED = 2.  # the hand-tuned `every_secs`
CONTENDERS = ['auto', 'tuned', 'epoch', 'none']
NAMES = dict(auto='`AutoResume()` (defaults)', tuned=f'`AutoResume(every_secs={TUNED:g})`',
             epoch='fastai: `SaveModelCallback(every_epoch=True, with_opt=True)` + `start_epoch`', none='no checkpoint')

# ---- the training process (`--child MODE DIR`): only `auto` and `tuned` import resumable_train
def child(mode, d):
    t_start = float(os.environ.get('GOODPUT_T0', time.time()))
    import torch
    from torch import nn
    from fastai.basics import Learner, DataLoaders, set_seed, MSELossFlat
    from fastai.data.load import DataLoader
    from fastai.callback.core import Callback
    from fastai.callback.schedule import fit_one_cycle  # noqa: F401 (patches Learner)
    from fastai.callback.tracker import SaveModelCallback
    from fastai.callback.progress import ProgressCallback
    d = Path(d)
    counts = os.open(d/'batches', os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # a byte per batch trained, by any process

    class Count(Callback):
        "Count the batches trained; note the first one's time"
        order = 0
        def after_batch(self):
            if not self.training: return
            if self.first:
                with open(d/'starts.jsonl', 'a') as f: f.write(json.dumps(dict(start=t_start, first=time.time())) + '\n')
                self.first = False
            os.write(counts, b'.')
        first = True

    set_seed(42, reproducible=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_BATCHES*BS, 64, generator=g)
    y = (x[:, :8].sum(1, keepdim=True) + 0.1*torch.randn(N_BATCHES*BS, 1, generator=g))
    ds = list(zip(x, y))
    dls = DataLoaders(DataLoader(ds, bs=BS, shuffle=True, drop_last=True, num_workers=2),
                      DataLoader(ds[:4*BS], bs=BS, num_workers=0))
    model = nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Dropout(0.2), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                          nn.Dropout(0.2), nn.Linear(WIDTH, 1))
    learn = Learner(dls, model, loss_func=MSELossFlat(), path=d, cbs=Count())
    learn.remove_cb(ProgressCallback); learn.logger = lambda *a, **k: None
    start = 0
    if mode in ('auto', 'tuned'):
        from resumable_train.autoresume import AutoResume
        learn.add_cb(AutoResume(verbose=False, **({'every_secs': TUNED} if mode == 'tuned' else {})))
    elif mode == 'epoch':
        learn.add_cb(SaveModelCallback(every_epoch=True, with_opt=True, fname='model'))
        done = sorted(int(p.stem.split('_')[1]) for p in (d/'models').glob('model_*.pth'))
        if done:  # the newest epoch's file, as fastai's forums have it
            learn.load(f'model_{done[-1]}', with_opt=True)
            start = done[-1] + 1
    learn.fit_one_cycle(EPOCHS, 1e-3, start_epoch=start)
    torch.save({k: v.clone() for k,v in learn.model.state_dict().items()}, d/'final.pth')

# ---- the driver
def wchar(pid)->int:
    "Bytes the process `pid` has passed to `write` so far (0 once it is gone)"
    try: return int(next(l.split()[1] for l in Path(f'/proc/{pid}/io').read_text().splitlines() if l.startswith('wchar')))
    except (OSError, StopIteration): return 0

def tree_wchar(pid)->int:
    "`wchar` of `pid` and its children (the DataLoader's workers)"
    kids = Path(f'/proc/{pid}/task/{pid}/children')
    try: ks = [int(k) for k in kids.read_text().split()]
    except OSError: ks = []
    return wchar(pid) + sum(tree_wchar(k) for k in ks)

def moments(sig, mean, seed, horizon)->list:
    "Seeded preemption moments (seconds from the job's start) up to `horizon`"
    r,t,out = random.Random(f'{sig}{mean}{seed}'),0.,[]
    while t < horizon: t += r.expovariate(1/mean); out.append(t)
    return out

def job(mode, at:list, sig, cap, d, say, core:int)->dict:
    "Run contender `mode` in folder `d` on CPU `core` to its end, preempting it at the moments `at`; what it cost"
    # its temporary files in its folder: a killed process's DataLoader workers leave theirs (`pymp-*`)
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(HERE.parent), TMPDIR=str(d))
    t0,at,written,preempted,procs = time.time(),list(at),0,0,0
    while True:
        env['GOODPUT_T0'] = repr(time.time())
        p = subprocess.Popen([sys.executable, __file__, '--child', mode, str(d)], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=open(d/'stderr.log', 'a'),
                             preexec_fn=lambda: os.sched_setaffinity(0, {core}))  # its workers too
        procs,io = procs + 1,0
        while p.poll() is None:
            now = time.time() - t0
            if now > cap: break
            if at and now >= at[0]:
                at.pop(0); preempted += 1
                io = tree_wchar(p.pid)
                if sig == 'SIGKILL': os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.send_signal(signal.SIGTERM)
                    end = time.time() + GRACE
                    while p.poll() is None and time.time() < end: io = max(io, tree_wchar(p.pid)); time.sleep(0.05)
                    if p.poll() is None: os.killpg(p.pid, signal.SIGKILL)
                p.wait(); break
            io = max(io, tree_wchar(p.pid))
            time.sleep(0.05)
        if p.poll() is None: os.killpg(p.pid, signal.SIGKILL); p.wait()
        try: os.killpg(p.pid, signal.SIGKILL)  # what is left of its tree (workers)
        except ProcessLookupError: pass
        written += io
        while at and at[0] <= time.time() - t0: at.pop(0)  # moments that fell while it stopped: the machine was gone
        if (d/'final.pth').exists() or time.time() - t0 > cap: break
    secs = time.time() - t0
    starts = [json.loads(l) for l in (d/'starts.jsonl').read_text().splitlines()] if (d/'starts.jsonl').exists() else []
    trained = (d/'batches').stat().st_size if (d/'batches').exists() else 0
    say(f"   {d.name:20s} (CPU {core}) {'finished' if (d/'final.pth').exists() else 'never finished'} in {secs:.1f} s, {preempted} "
        f"preemptions, {procs} processes, {trained} batches trained")
    return dict(secs=secs, finished=(d/'final.pth').exists(), preempted=preempted, procs=procs, trained=trained,
                restart=[s['first'] - s['start'] for s in starts], written=written)

def same_weights(a, b)->bool:
    import torch
    sa,sb = (torch.load(p, weights_only=True) for p in (a, b))
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

def main(quick=False, out=HERE/'results', seed=0):
    t_begin = time.time()
    def say(msg): print(f"[{time.time() - t_begin:5.0f}s] {msg}", flush=True)
    work = Path(tempfile.mkdtemp(prefix='goodput-'))
    try:
        cores = sorted(os.sched_getaffinity(0))[:2]
        schedules = SCHEDULES[:1] if quick else SCHEDULES
        say(f"uninterrupted runs (stock fastai, no checkpoint), one on each of CPUs {cores}")
        with ThreadPoolExecutor(len(cores)) as ex:
            bases = list(ex.map(lambda c: job('none', [], 'SIGKILL', math.inf, _mk(work/f'base{c}'), say, c), cores))
        base = dict(bases[0], secs=statistics.median(b['secs'] for b in bases), each=[b['secs'] for b in bases])
        ref = work/f'base{cores[0]}'/'final.pth'
        assert all(same_weights(ref, work/f'base{c}'/'final.pth') for c in cores)
        # every contender at every schedule, two at a time, each pinned to a CPU of its own (with its DataLoader workers)
        todo = [(sig, mean, mode) for sig,mean in schedules for mode in CONTENDERS]
        free = queue.Queue(); [free.put(c) for c in cores]
        def one(k):
            sig,mean,mode = k
            core = free.get()
            try:
                d = _mk(work/f'{sig}-{mean}-{mode}')
                r = job(mode, moments(sig, mean, seed, CAP*base['secs'] + 60), sig, CAP*base['secs'], d, say, core)
                r['same'] = r['finished'] and same_weights(ref, d/'final.pth')
                return r
            finally: free.put(core)
        with ThreadPoolExecutor(len(cores)) as ex: res = dict(zip(todo, ex.map(one, todo)))
        report(base, res, schedules, out, quick)
        say(f"done in {time.time() - t_begin:.0f} s")
    finally: shutil.rmtree(work, ignore_errors=True)

def _mk(d): d.mkdir(); return d

def report(base, res, schedules, out, quick):
    sys.path.insert(0, str(HERE))
    from common import Table, machine_info
    need = EPOCHS*N_BATCHES
    t = Table('goodput', f"Time to finish under preemption ({EPOCHS} epochs x {N_BATCHES} batches; uninterrupted "
              f"{base['secs']:.1f} s)",
              ['preemption', 'contender', 'time to finish / uninterrupted', 'preemptions', 'batches trained again',
               'restart (s, median)', 'MB written', 'final weights = uninterrupted'],
              notes=[f"The uninterrupted run: one process of stock fastai, no checkpoint, {base['secs']:.1f} s from process "
                     f"start to exit (median of one on each CPU: {', '.join(f'{x:.1f}' for x in base['each'])} s); its "
                     f"restart (process start to first batch) {base['restart'][0]:.1f} s.",
                     "Two contenders run at a time, each pinned with its DataLoader workers to one CPU of its own (the "
                     "uninterrupted run too), so that the 2-core machine gives each the same.",
                     f"Preemption: SIGKILL, or SIGTERM then SIGKILL after {GRACE} s, at seeded exponential moments of the "
                     "given mean; a fresh process starts at once; the same moments for every contender.",
                     f"Never finished: still training at {CAP:g} x the uninterrupted time.",
                     "MB written: the bytes the processes passed to `write` (`/proc/PID/io`'s wchar), resume points and "
                     "logs included."])
    for (sig,mean),mode in ((s, m) for s in schedules for m in CONTENDERS):
        r = res[sig, mean, mode]
        rs = sorted(r['restart'])
        t.add(f"{sig} every {mean} s", NAMES[mode],
              f"{r['secs']/base['secs']:.2f}" if r['finished'] else f"never finished (>{CAP:g})",
              r['preempted'], max(0, r['trained'] - need) if r['finished'] else '—',
              f"{rs[len(rs)//2]:.1f}" if rs else '—', f"{r['written']/2**20:.1f}",
              'yes' if r['same'] else ('no' if r['finished'] else '—'))
    t.raw = dict(base=base, runs={f'{s}-{m}-{c}': r for (s,m,c),r in res.items()})
    info = machine_info(quick, None)
    print(t.markdown(info))
    if not quick: t.save(out, info); plot(base, res, schedules, Path(out)/'goodput.png')

def plot(base, res, schedules, path):
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig,ax = plt.subplots(figsize=(7, 4.6), layout='constrained')
    kills = [s for s in schedules if s[0] == 'SIGKILL']
    for mode,mark in zip(CONTENDERS, 'osD^'):
        rs = [res[(*s, mode)] for s in kills]
        ys = [r['secs']/base['secs'] if r['finished'] else CAP for r in rs]
        ax.plot([m for _,m in kills], ys, marker=mark, label=NAMES[mode].replace('`', ''))
        for (_,m),y,r in zip(kills, ys, rs):
            if not r['finished']: ax.annotate('never finished', (m, y), textcoords='offset points', xytext=(6, -3), fontsize=7)
    ax.axhline(1, color='grey', lw=0.8, ls=':')
    ax.set_xscale('log', base=2); ax.set_xticks([m for _,m in kills], [str(m) for _,m in kills])
    ax.set_xlabel('mean seconds between SIGKILLs'); ax.set_ylabel('time to finish / uninterrupted')
    ax.set_title(f"Time to finish under preemption (uninterrupted: {base['secs']:.0f} s)")
    fig.legend(fontsize=7, loc='outside lower center', ncols=2, frameon=False)  # below the plot: it covers no point
    fig.savefig(path, dpi=110)

def replot(out):
    "Draw the PNG again from the JSON a run kept"
    raw = json.loads((Path(out)/'goodput.json').read_text())['raw']
    res = {(s, int(m), c): r for k,r in raw['runs'].items() for s,m,c in [k.split('-')]}
    plot(raw['base'], res, SCHEDULES, Path(out)/'goodput.png')

if __name__ == '__main__':
    if len(sys.argv) > 1 and sys.argv[1] == '--child': child(*sys.argv[2:4]); sys.exit()
    if len(sys.argv) > 1 and sys.argv[1] == '--replot': replot(sys.argv[2] if len(sys.argv) > 2 else HERE/'results'); sys.exit()
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--quick', action='store_true', help="one schedule, nothing saved")
    ap.add_argument('--out', default=str(HERE/'results'), help="where the table and the plot go")
    ap.add_argument('--seed', type=int, default=0, help="the preemption moments' seed")
    a = ap.parse_args()
    main(a.quick, a.out, a.seed)

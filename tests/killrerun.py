"""Kill a training script at seeded batches, rerun it to the end, and compare with an uninterrupted run bit for bit.

A script used with this harness:
- adds `Report()` to its `Learner` (it prints `BATCH fit epoch iter` after every training batch and counts optimizer steps),
- calls `save_result(learn, out)` at its end (the weights, the optimizer state and the `Recorder`, for `compare`),
- takes its output file as the first argument, and sleeps `KILLRERUN_SLEEP` seconds per batch when it is set (to leave time for a kill).
It runs in children forked by `forked.Forker`, so `import fastai` is paid once per test module.
"""
import hashlib, os, queue, random, signal, subprocess, sys, threading, time
from pathlib import Path
import numpy as np, torch
from fastai.callback.core import Callback
from helpers import diff_values

class Report(Callback):
    "Print every trained batch as `BATCH fit epoch iter`, and count fit calls and optimizer steps"
    order = -20
    def before_fit(self):
        rs = getattr(self.learn, 'resume', None)  # the script's own fit calls: not one a callback makes inside an event
        if rs is None or rs.fitting and not rs.nested: self.learn.n_fit = getattr(self.learn, 'n_fit', -1) + 1
    def after_step(self): self.learn.steps = getattr(self.learn, 'steps', 0) + 1
    def after_batch(self):
        if not self.training: return
        print('BATCH', self.learn.n_fit, self.epoch, self.iter, flush=True)
        if os.environ.get('KILLRERUN_SLEEP'): time.sleep(float(os.environ['KILLRERUN_SLEEP']))

class Draws(Callback):
    "Draw from python's and numpy's global streams in every training batch, as a callback of a user's might"
    def after_batch(self):
        if self.training: random.random(); np.random.rand()

def say(what):
    "Print `what`, and slow down there when the test kills the script (`KILLRERUN_SLEEP`), so that a kill can land in that window"
    print(what, flush=True)
    if os.environ.get('KILLRERUN_SLEEP'): time.sleep(4*float(os.environ['KILLRERUN_SLEEP']))

class Windows(Callback):
    "Say `VALID` at each epoch's first validation batch, and `END` once every callback's `after_epoch` ran: windows to kill in"
    order = 10_000
    def after_batch(self):
        if not self.training and self.iter == 0: say('VALID')
    def after_epoch(self): say('END')

def nth(word:str, n:int):
    "The `n`-th line that is `word`, for `run_until(until=...)` (counted by each call's own list: make one for each run)"
    seen = []
    def until(line):
        if line.strip() == word: seen.append(line)
        return len(seen) == n and line.strip() == word
    return until

def plain(o):
    "`o` as `torch.load(weights_only=True)` reads it, without the package (a stock run's script imports none of it)"
    if isinstance(o, torch.Tensor): return o.detach().cpu().as_subclass(torch.Tensor)
    if isinstance(o, dict): return {k: plain(v) for k,v in o.items()}
    if isinstance(o, (list, tuple)) or type(o).__name__ == 'L': return [plain(v) for v in o]
    return o.item() if isinstance(o, np.generic) else o

def save_result(learn, out):
    "Save what `compare` checks: weights, optimizer state, `Recorder` history, the Learner's counters, step count"
    rec = learn.recorder
    attrs = {k: getattr(learn, k, None) for k in ('epoch', 'iter', 'train_iter', 'n_epoch')}
    torch.save(plain(dict(model=learn.model.state_dict(), opt=learn.opt.state_dict(), values=rec.values, losses=rec.losses,
                             lrs=rec.lrs, iters=rec.iters, attrs=attrs, steps=getattr(learn, 'steps', 0))), out)

def batches(lines)->list:
    "The `(fit, epoch, iter)` of every batch a run trained"
    return [tuple(map(int, l.split()[1:4])) for l in lines if l.startswith('BATCH ')]

ORPHANS = 20  # seconds the processes a child left (DataLoader workers) may hold its output after it ended: they end within 5 s

def _lines(p, deadline, script):
    "The lines `p` prints, until its output ends; a `TimeoutExpired` at `deadline`, an `AssertionError` for workers that outlive it"
    q = queue.Queue()
    threading.Thread(target=lambda: [*map(q.put, p.stdout), q.put(None)], daemon=True).start()
    ended = None
    while True:
        try: line = q.get(timeout=1)
        except queue.Empty:
            if time.monotonic() > deadline: raise subprocess.TimeoutExpired(script, 0) from None
            if ended is None and p.poll() is not None: ended = time.monotonic()
            if ended is not None and time.monotonic() - ended > ORPHANS:
                raise AssertionError(f"{script} ended ({p.returncode}), but processes it left hold its output {ORPHANS} s later: "
                                     "DataLoader workers that did not end")
            continue
        if line is None: return
        yield line

def run_until(forker, script, args, stop_after=None, sig=signal.SIGKILL, timeout=120, env=None, cwd=None, until=None, then=None):
    """Run `script`; after its `stop_after`-th trained batch, or at the first line that `until(line)` holds for, send `sig` (never if
    `None`) or call `then()`; return `(returncode, lines)`"""
    env = dict(env or {}, **({'KILLRERUN_SLEEP': '0.05'} if stop_after else {}))
    p,lines,n,sent = forker.start(script, *args, env=env, cwd=cwd),[],0,False
    deadline = time.monotonic() + timeout
    try:
        for line in _lines(p, deadline, script):
            lines.append(line)
            n += line.startswith('BATCH ')
            due = (stop_after and line.startswith('BATCH ') and n == stop_after) or (until is not None and until(line))
            if due and not sent:
                sent = True
                if then is not None: then()
                elif sig == signal.SIGKILL: p.kill_group()
                elif sig is not None: p.send_signal(sig)
            if time.monotonic() > deadline: raise subprocess.TimeoutExpired(script, timeout)
        p.wait(max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill_group()
        raise AssertionError(f"{script} {args} did not finish within {timeout}s:\n{''.join(lines[-40:])}")
    finally: p.kill_group()
    return p.returncode, lines

def run_to_end(forker, script, args, **kwargs)->list:
    "Run `script` to its end, asserting it succeeded; return its output lines"
    rc,lines = run_until(forker, script, args, **kwargs)
    assert rc == 0, f"{script} {args} exited with {rc}:\n{''.join(lines[-40:])}"
    return lines

def snapshot(folder)->dict:
    "Every file under `folder` with its size, mtime and sha256: equal snapshots mean nothing was written"
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(Path(folder).rglob('*')) if p.is_file()}

def compare(ref, got, keys=('model', 'opt', 'values', 'losses', 'lrs', 'iters'))->list:
    "Where two results of `save_result` differ, bitwise (`torch.equal`); `[]` when identical"
    a,b = torch.load(ref, weights_only=True),torch.load(got, weights_only=True)
    return [d for k in keys for d in diff_values(a[k], b[k], k)]

class StockRun:
    "`script OUT --stock ARGS` (stock fastai: the package never imported) in a real process of its own, started now; its results"
    def __init__(self, script, out, *args, timeout=300):
        from helpers import test_env
        self.out,self.timeout,self.log = Path(out),timeout,open(Path(out)/'log', 'w')
        self.p = subprocess.Popen([sys.executable, str(script), str(out), '--stock', *map(str, args)], stdout=self.log,
                                  stderr=subprocess.STDOUT, env=test_env(), start_new_session=True)
    def result(self, name:str)->Path:
        "The result `OUT/name.pth`, once the run ended well (waited for at the first result asked)"
        try: rc = self.p.wait(self.timeout)
        except subprocess.TimeoutExpired: self.close(); rc = self.p.wait()
        assert rc == 0, f"the stock run exited with {rc}:\n{(self.out/'log').read_text()[-3000:]}"
        return self.out/f'{name}.pth'
    def close(self):
        try: os.killpg(self.p.pid, signal.SIGKILL)  # its DataLoader workers too
        except (ProcessLookupError, PermissionError): pass
        self.log.close()

def same_as_stock(stock_out, ref_out):
    "Assert the uninterrupted run with AutoResume (`ref_out`) is bitwise stock fastai's (`stock_out`), optimizer steps included"
    d = compare(stock_out, ref_out, keys=('model', 'opt', 'values', 'losses', 'lrs', 'iters', 'attrs', 'steps'))
    assert not d, f"AutoResume changed an uninterrupted run: {len(d)} differences from stock fastai, first:\n" + '\n'.join(d[:10])

def stock_reference(forker, stock, tmp_path, script, args, keys=None, env=None)->list:
    """Run `script tmp_path/ref.pth ARGS` in `ref/` with `AutoResume`, and `--no-resume` in `stock/` as stock fastai (a process that
    never imports the package), both with `env` added: the same bits and steps (`keys`: which results to compare); the batches it
    trained"""
    for d in ('ref', 'stock'): (tmp_path/d).mkdir()
    ref = batches(run_to_end(forker, script, [tmp_path/'ref.pth', *args], cwd=tmp_path/'ref', env=env))
    rc,out = stock.run(script, tmp_path/'stock.pth', *args, '--no-resume', timeout=120, cwd=tmp_path/'stock', env=env)
    assert rc == 0, f"stock fastai exited {rc}:\n{out[-3000:]}"
    if keys is None: same_as_stock(tmp_path/'stock.pth', tmp_path/'ref.pth')
    else:
        d = compare(tmp_path/'stock.pth', tmp_path/'ref.pth', keys=keys)
        assert not d, f"AutoResume changed an uninterrupted run: {len(d)} differences from stock fastai:\n" + '\n'.join(d[:10])
    return ref

def kill_and_rerun(forker, script, args, folder, out, kills, timeout=120, env=None):
    """Run `script args` in `folder` killed by SIGKILL after each number of batches in `kills` (counted in that run), then to its end,
    then once more; return `(trained, last)`: the batches of each run, and the `snapshot` before and after the run after completion"""
    Path(folder).mkdir(parents=True, exist_ok=True)
    trained = []
    for k in kills:
        rc,lines = run_until(forker, script, [out, *args], stop_after=k, timeout=timeout, env=env, cwd=folder)
        assert rc == -signal.SIGKILL, f"run was meant to be killed after batch {k} but exited with {rc}:\n{''.join(lines[-30:])}"
        trained.append(batches(lines))
    trained.append(batches(run_to_end(forker, script, [out, *args], timeout=timeout, env=env, cwd=folder)))
    before = snapshot(folder)
    again = run_to_end(forker, script, [out, *args], timeout=timeout, env=env, cwd=folder)
    trained.append(batches(again))
    return trained, (before, snapshot(folder))

def check_kill_and_rerun(ref_batches, trained, snaps, ref_out, out):
    "Assert a `kill_and_rerun` ended bitwise like the uninterrupted run, resumed where it stopped, and left a finished run untouched"
    assert not trained[-1], f"a rerun after completion trained {len(trained[-1])} batches"
    assert snaps[0] == snaps[1], f"a rerun after completion changed files: {set(snaps[0].items()) ^ set(snaps[1].items())}"
    for prev,nxt in zip(trained[:-2], trained[1:-1]):
        assert prev, "a killed run trained no batch"
        assert nxt and ref_batches.index(nxt[0]) <= ref_batches.index(prev[-1]) + 1, "a rerun skipped batches"
    last = trained[-2]
    assert last == ref_batches[len(ref_batches)-len(last):], "the final rerun did not train exactly the rest of the uninterrupted run"
    d = compare(ref_out, out)
    assert not d, f"{len(d)} differences from the uninterrupted run, first:\n" + '\n'.join(d[:10])

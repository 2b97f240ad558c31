"""8. Stopping: time from SIGTERM to a durable resume point on disk and the exit of the process, small and large model.

Each measurement is a child forked from a server process that has imported fastai but trained nothing (so no OpenMP threads exist at
the fork): the child trains with `AutoResume()` (synchronous, durable), tells the server when it is in the middle of training, and the
server sends SIGTERM and waits for its exit. The resume point is then read back and checked."""
import json, os, select, signal, subprocess, sys, tempfile, time
from pathlib import Path
from common import *

HERE = Path(__file__).resolve().parent
BATCHES = 3  # trained batches before the signal

def _child(size, d, wfd, device):
    from fastai.callback.core import Callback
    from resumable_train.autoresume import AutoResume
    class Ready(Callback):
        "Tell the server after `BATCHES` training batches; keep the batch times"
        def before_fit(self): self.times,self.t = [],None
        def before_batch(self): self.t = time.perf_counter()
        def after_batch(self):
            if not self.training: return
            self.times.append(time.perf_counter() - self.t)
            if len(self.times) == BATCHES: os.write(wfd, b'r')
        def after_cancel_fit(self): (Path(d)/'batches.json').write_text(json.dumps(self.times))
    learn = make_learner(10_000, bs=64 if size != 'large' else 8, size=size, device=device, path=d)
    learn.fit(1, cbs=[AutoResume(verbose=False), Ready()])

def serve(size, reps, device=None)->list:
    "In a process that has trained nothing: for each repetition fork a training child, SIGTERM it mid-training, time until it exits"
    from resumable_train.checkpoints import list_checkpoints
    from resumable_train.files import read_checkpoint, resume_record
    out = []
    for _ in range(reps):
        d = tempfile.mkdtemp(prefix='bench-sigterm-')
        rfd,wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd); os.setsid()
            code = 1
            try: _child(size, d, wfd, device)
            except SystemExit as e: code = e.code if isinstance(e.code, int) else 1
            finally: os._exit(code)
        os.close(wfd)
        try:
            if not select.select([rfd], [], [], 300)[0]: raise TimeoutError(f"the {size} child did not start training within 300 s")
            t = time.perf_counter()
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 300
            while (st := os.waitpid(pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline: raise TimeoutError(f"the {size} child did not stop within 300 s of SIGTERM")
                time.sleep(0.0005)
            secs = time.perf_counter() - t
        except BaseException:
            os.killpg(pid, signal.SIGKILL); os.waitpid(pid, 0)
            raise
        finally: os.close(rfd)
        code = os.waitstatus_to_exitcode(st[1])
        files = list_checkpoints(Path(d)/'models')
        rec = resume_record(read_checkpoint(files[0])) if files else None
        if code != 128 + signal.SIGTERM or rec is None or not rec['iter']:
            raise RuntimeError(f"the {size} child exited {code} with resume points {list(files)}: not a stop by SIGTERM with a resume point")
        batches = json.loads((Path(d)/'batches.json').read_text())
        out.append(dict(secs=secs, iter=rec['iter'], batch=med(batches)))
        subprocess.run(['rm', '-rf', d])
    return out

def run(quick=False, device=None, reps=None):
    reps = reps or (1 if quick else 5)
    sizes = ('small',) if quick else ('small', 'large')
    t = Table('sigterm', '8. Stopping: time from SIGTERM to a durable resume point on disk and the exit of the process',
              ['model', 'params', 'model MB', 'median s', 'max s', 'median batch ms', 'stopped after batch'],
              [f"{reps} stops per model, each in a fresh child process forked from a server that trained nothing; AutoResume() synchronous "
               f"and durable (fsync of the file and folder); the signal arrives after {BATCHES} training batches, the run stops at the end of "
               "the batch in progress; the time is from `kill` to the end of `waitpid`; the resume point is then read back and checked"])
    for size in sizes:
        cmd = [sys.executable, str(HERE/'run.py'), '--sigterm-server', size, str(reps)] + (['--device', device] if device else [])
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS='ignore'))
        if p.returncode: raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
        res = json.loads(p.stdout.strip().splitlines()[-1])
        learn = make_learner(1, bs=8, size=size, device=device)
        secs = [r['secs'] for r in res]
        t.add(size, f"{n_params(learn.model):,}", mb(tensor_bytes(learn.model.state_dict())), f"{med(secs):.3f}", f"{max(secs):.3f}",
              ms(med([r['batch'] for r in res])), ', '.join(str(r['iter']) for r in res))
        t.raw[size] = res
    return t

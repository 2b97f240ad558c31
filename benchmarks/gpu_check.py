#!/usr/bin/env python
"""The CUDA paths a CPU-only machine cannot run (issue 19), as one script for a GPU machine; a few minutes on one GPU.

    python benchmarks/gpu_check.py [--out DIR] [--quick]     # on a machine with a GPU
    python benchmarks/gpu_check.py --device cpu             # the same logic on a CPU (no CUDA streams; gloo for the two ranks)

1. `to_fp16` on the GPU with `set_seed(reproducible=True)` and `AutoResume(every_iter=5)`, killed by SIGKILL twice and rerun: the weights,
   the optimizer state, the Recorder and the `GradScaler` (its scale, growth tracker and the scale of every step) equal to an uninterrupted
   run's, bitwise; a rerun after the end trains nothing.
2. Two processes with `DDPTrainer` under `torchrun` (nccl), one rank killed by SIGKILL and the job relaunched: both ranks' weights and
   Recorders bitwise those of an uninterrupted run. On one GPU, a world of one rank (nccl puts one rank on a GPU).
3. CUDA's random streams: `rng_state`/`set_rng_state` give back every device's generator.
4. Save cost and the stall of a background save with the model on the GPU (the host copy): `benchmarks/run.py --only checkpoint stall`.
5. Issue 32, what a resume point costs the training loop at 0.6 and 2.4 GB of state, side by side in one process: bare `torch.save`,
   `learn.save`, Accelerate `save_state`, DCP `async_save` (default and pinned-memory stagers), `AutoResume(background=True)` with the host
   copy and with the device snapshot; the limits (a copy into pinned host buffers, a clone on the device). `benchmarks/device_saves.py`.
6. Issue 32, from process start to the first training batch of a resumed run, against a fresh start plus `cat file > /dev/null`.
7. Issue 31, fastai's own `DistributedTrainer` (`with learn.distrib_ctx(): ...`, over Accelerate) with `AutoResume`, fp16, every rank
   killed by SIGKILL and the job relaunched: each rank's weights, optimizer state and Recorder bitwise those of an uninterrupted run. On
   one GPU a world of one rank launched by torchrun (`accelerate launch` with one process starts no process group, so `distrib_ctx`
   would add nothing); on 2+ GPUs two ranks under `accelerate launch --multi_gpu`; with `--device cpu`, two gloo ranks under
   `accelerate launch` with `ACCELERATE_USE_CPU=1`.
8. Issue 40, `resumable-train check` on a CUDA script with a layer that sums with `index_add_` (atomic adds on CUDA): its verdict, as
   printed (exact where the adds happen to come in one order; else named as training that is not deterministic, with the operation).

Check 1 runs with `AutoResume(background=True)`, in fp16 and in fp32: on a GPU with room, its resume points are device snapshots.
`--checks 5 1 6` runs only those, in that order.

Prints a report (also written to OUT/gpu_check.md) and exits 1 if a check failed. The tests skip it without a GPU (tests/test_benchmarks.py).
"""
import argparse, os, signal, subprocess, sys, tempfile, time
from pathlib import Path
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT/'tests'), str(ROOT/'benchmarks')]
PATH = [str(ROOT), str(ROOT/'tests'), *filter(None, os.environ.get('PYTHONPATH', '').split(os.pathsep))]  # the caller's too
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', PYTHONPATH=os.pathsep.join(PATH))
EVERY = 5

def child(device, out, kill_at, precision):
    "One training run (`--child`): a digits MLP in `precision` on `device`, background resume points, SIGKILLed after each batch in `kill_at`"
    import warnings
    import torch
    from torch import nn
    from fastai.basics import Learner, DataLoaders, CrossEntropyLossFlat, accuracy, set_seed, Callback
    import fastai.callback.all  # noqa: F401 (fit_one_cycle, to_fp16)
    from sklearn.datasets import load_digits
    from resumable_train.autoresume import AutoResume
    from resumable_train.state import to_plain
    warnings.filterwarnings('ignore', message='.*CUDA is not available.*')

    class Keep(Callback):
        "Count trained batches; keep the scaler as the last step left it; SIGKILL this process after training batch `kill_at`"
        order,trained,device_path = AutoResume.order+1,0,False  # after the resume point of the batch; a fit that finished earlier trains none
        def after_step(self):
            s = getattr(self.learn, 'scaler', None)
            if s is not None: self.last = (s.state_dict(), list(self.learn.mixed_precision.scales))
        def after_batch(self):
            if not self.training: return
            self.trained += 1
            self.device_path |= bool(getattr(ar.points.snapshot, 'on_device', False))
            if self.train_iter in kill_at: os.kill(os.getpid(), signal.SIGKILL)

    set_seed(3, reproducible=True)
    x,y = load_digits(return_X_y=True)
    x,y = torch.tensor(x, dtype=torch.float32)/16, torch.tensor(y)
    dls = DataLoaders.from_dsets(list(zip(x[:512], y[:512])), list(zip(x[512:640], y[512:640])), bs=16, num_workers=2, device=device)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 10))
    keep,ar = Keep(),AutoResume(every_iter=EVERY, background=True)
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=[keep, ar], path=Path(out).parent/'run')
    if precision == 'fp16': learn = learn.to_fp16()
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(3, 1e-2)
    res = dict(model=learn.model.state_dict(), opt=learn.opt.state_dict()['state'], values=learn.recorder.values,
               losses=learn.recorder.losses, trained=keep.trained, device_path=keep.device_path)
    if hasattr(keep, 'last'): res['scaler'],res['scales'] = keep.last
    torch.save(to_plain(res), out)

def run(cmd, timeout=300, env=None):
    "Run `cmd` in its own session (with `env` added), killed with its children after `timeout` seconds; returns `(returncode, output)`"
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(ENV, **(env or {})),
                         start_new_session=True)
    try: out,_ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out,_ = p.communicate()
        return -signal.SIGKILL, out + f'\n[killed after {timeout}s]'
    finally:
        try: os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError: pass
    return p.returncode, out

def killed(device, d, precision):
    "Check 1: `precision` killed twice and rerun, against an uninterrupted run"
    import torch
    from helpers import diff_values
    me = [sys.executable, __file__, '--device', device, '--precision', precision, '--child']
    rc,out = run(me + [str(d/'ref'/'out.pt')])
    if rc: return False, f"the uninterrupted run failed ({rc}): {out[-1500:]}"
    for k in (13, 27):
        rc,out = run(me + [str(d/'run'/'out.pt'), '--kill-at', str(k)])
        if rc != -signal.SIGKILL: return False, f"the run meant to be killed after batch {k} ended with {rc}: {out[-1500:]}"
    rc,out = run(me + [str(d/'run'/'out.pt')])
    if rc: return False, f"the rerun failed ({rc}): {out[-1500:]}"
    a,b = torch.load(d/'ref'/'out.pt', weights_only=True),torch.load(d/'run'/'out.pt', weights_only=True)
    trained = b.pop('trained'); total = a.pop('trained')
    paths = {a.pop('device_path'), b.pop('device_path')}
    bad = diff_values(a, b)
    if bad: return False, f"{len(bad)} differences from the uninterrupted run: {bad[:5]}"
    rc,out = run(me + [str(d/'run'/'again.pt')])  # the same run folder (`run` next to the output)
    again = torch.load(d/'run'/'again.pt', weights_only=True)['trained'] if rc == 0 else None
    if again != 0: return False, f"a rerun after the end trained {again} batches (rc {rc})"
    scaler = a.get('scaler') or {}
    snap = 'device snapshots' if paths == {True} else 'host copies' if paths == {False} else 'device snapshots and host copies'
    return True, (f"bitwise after 2 kills ({total} batches, the last rerun trained {trained}; background resume points: {snap}); scaler "
                  f"{'scale ' + str(scaler.get('scale')) if scaler else 'disabled (no CUDA or fp32)'}, {len(a.get('scales') or [])} steps")

def killed_both(device, d):
    "Check 1 in fp16 (`to_fp16`) and in fp32"
    res = [(p, *killed(device, d/p, p)) for p in ('fp16', 'fp32')]
    return all(ok for _,ok,_ in res), '; '.join(f"{p}: {what}" for p,_,what in res)

def issue32(device, d, quick, which):
    "Checks 5 and 6: the table of save stalls, or of resume times (`benchmarks/device_saves.py`)"
    import device_saves as ds
    from common import machine_info
    reps = 1 if quick else 3
    t = ds.save_table(device, quick, reps, d) if which == 'saves' else ds.resume_table(device, quick, reps, d, __file__, ENV)
    info = machine_info(quick, device)
    t.save(d, info)
    return True, 'table below\n\n' + t.markdown(info)

def nccl(device, d):
    "Check 2: two DDPTrainer ranks, one killed, relaunched"
    import torch
    from helpers import diff_values
    n = min(2, torch.cuda.device_count()) if device == 'cuda' else 2  # nccl puts one rank on a GPU: on one GPU, a world of one
    tr = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={n}', str(ROOT/'tests'/'dist_train.py')]
    args = ['--every', '3', '--fp16', '--timeout', '60']
    rc,out = run(tr + [str(d/'ref'), *args])
    if rc: return False, f"the uninterrupted run failed ({rc}): {out[-1500:]}"
    rc,out = run(tr + [str(d/'run'), *args, '--kill-rank', str(n-1), '--kill-at', '8'])
    if rc == 0: return False, f"the run meant to lose rank {n-1} finished"
    rc,out = run(tr + [str(d/'run'), *args])
    if rc: return False, f"the relaunch failed ({rc}): {out[-1500:]}"
    bad = []
    for r in range(n):
        a,b = torch.load(d/'ref'/f'rank{r}.pt', weights_only=False),torch.load(d/'run'/f'rank{r}.pt', weights_only=False)
        bad += diff_values(a['model'], b['model'], f'rank{r}.model') + diff_values(a['values'], b['values'], f'rank{r}.values')
    backend = 'nccl' if device == 'cuda' else 'gloo'
    ranks = 'both ranks' if n == 2 else 'a world of one rank (one GPU)'
    return (False, f"{len(bad)} differences: {bad[:5]}") if bad else (True, f"bitwise on {ranks} after a killed rank ({backend}, fp16)")

def fastai_ddp(device, d):
    "Check 7: fastai's `distrib_ctx` with `AutoResume`, every rank killed, relaunched"
    import torch
    from helpers import diff_values
    from test_elastic import free_port
    n = min(2, torch.cuda.device_count()) if device == 'cuda' else 2
    script = [str(ROOT/'tests'/'fastai_ddp_train.py')]
    if n == 1: launch = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=1']
    else: launch = [sys.executable, '-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', str(n), '--num_machines', '1',
                    '--mixed_precision', 'no', '--dynamo_backend', 'no', '--main_process_port', str(free_port())]
    env = dict(ACCELERATE_USE_CPU='1') if device == 'cpu' else {}
    args = ['--fp16', '--every', '2', '--timeout', '60']
    go = lambda folder, *more: run(launch + script + [str(folder), *args, *more], env=env)
    rc,out = go(d/'ref')
    if rc: return False, f"the uninterrupted run failed ({rc}): {out[-1500:]}"
    rc,out = go(d/'run', '--kill-rank', '-2', '--kill-at', '7')
    if rc == 0: return False, "the run meant to be killed finished"
    rc,out = go(d/'run')
    if rc or 'AutoResume: continuing from' not in out: return False, f"the relaunch failed ({rc}): {out[-1500:]}"
    bad = []
    for r in range(n):
        a,b = torch.load(d/'ref'/f'rank{r}.pt', weights_only=False),torch.load(d/'run'/f'rank{r}.pt', weights_only=False)
        bad += [x for k in ('model', 'opt', 'values') for x in diff_values(a[k], b[k], f'rank{r}.{k}')]
    how = 'torchrun, a world of one rank (one GPU)' if n == 1 else f"accelerate launch, {n} ranks"
    backend = 'nccl' if device == 'cuda' else 'gloo'
    return (False, f"{len(bad)} differences: {bad[:5]}") if bad else (True, f"bitwise after every rank was killed ({how}, {backend}, fp16)")

def check_command(device, d):
    "Check 8: `resumable-train check` on a script with `index_add_` on `device`: the verdict as printed"
    cmd = [str(Path(sys.executable).parent/'resumable-train'), 'check', '--', sys.executable, str(ROOT/'tests'/'check_script.py'),
           str(d/'run'), '--defect', 'index_add']
    rc,out = run(cmd, timeout=500)
    said = [l for l in out.splitlines() if l and not l.startswith(('check: ', 'fix: '))]
    return rc in (0, 1) and bool(said), f"exit {rc}: " + ' / '.join(said)

def cuda_rng(device, d):
    "Check 3: CUDA's generators given back by `set_rng_state`"
    import torch
    if device != 'cuda': return None, "no CUDA"
    from resumable_train.state import rng_state, set_rng_state
    torch.rand(1, device='cuda')  # CUDA in use: its streams are part of the state
    s = rng_state()
    a = [torch.rand(4, device=f'cuda:{i}') for i in range(torch.cuda.device_count())]
    set_rng_state(s)
    b = [torch.rand(4, device=f'cuda:{i}') for i in range(torch.cuda.device_count())]
    ok = all(torch.equal(x, y) for x,y in zip(a, b))
    return ok, f"{torch.cuda.device_count()} device(s): {'the same draws after set_rng_state' if ok else 'other draws after set_rng_state'}"

def costs(device, d, quick):
    "Check 4: the checkpoint and stall benchmarks with the model on `device`"
    rc,out = run([sys.executable, str(ROOT/'benchmarks'/'run.py'), '--only', 'checkpoint', 'stall', '--device', device,
                  '--out', str(d), *(['--quick'] if quick else ['--reps', '5'])], timeout=400)
    if rc: return False, f"benchmarks/run.py failed ({rc}): {out[-1500:]}"
    tables = '\n\n'.join((d/f'{n}.md').read_text() for n in ('checkpoint', 'stall') if (d/f'{n}.md').exists())
    return True, 'tables below\n\n' + tables

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default='cuda', choices=['cuda', 'cpu'])
    p.add_argument('--out', default=None, help='folder for gpu_check.md (default: a temporary folder)')
    p.add_argument('--quick', action='store_true', help='the cost benchmarks in their quick sizes')
    p.add_argument('--child', default=None, help=argparse.SUPPRESS)
    p.add_argument('--checks', type=int, nargs='+', default=None, help='run only these checks (numbers above)')
    p.add_argument('--kill-at', type=int, nargs='*', default=[], help=argparse.SUPPRESS)
    p.add_argument('--precision', default='fp16', help=argparse.SUPPRESS)
    p.add_argument('--resume-child', default=None, help=argparse.SUPPRESS)
    p.add_argument('--width', type=int, help=argparse.SUPPRESS)
    p.add_argument('--layers', type=int, help=argparse.SUPPRESS)
    p.add_argument('--save', action='store_true', help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child: return child(a.device, a.child, set(a.kill_at), a.precision)
    if a.resume_child:
        import device_saves
        return device_saves.child(a.resume_child, a.width, a.layers, a.device, a.save)
    import torch
    if a.device == 'cuda' and not torch.cuda.is_available(): sys.exit("gpu_check: no GPU here (torch.cuda.is_available() is False); "
                                                                      "`--device cpu` runs the same logic on the CPU")
    if a.device == 'cpu': ENV['CUDA_VISIBLE_DEVICES'] = ''
    out = Path(a.out or tempfile.mkdtemp(prefix='gpu_check-'))
    lines = [f"# GPU check ({a.device}: {torch.cuda.get_device_name(0) if a.device == 'cuda' else 'cpu'}, "
             f"{torch.cuda.device_count() if a.device == 'cuda' else 0} GPU(s), torch {torch.__version__})", '']
    failed = False
    checks = [('to_fp16 and fp32 killed and resumed (background resume points)', killed_both),
              ('DDPTrainer under torchrun killed and relaunched', nccl), ('CUDA random streams', cuda_rng),
              ('save cost and background stall', lambda dev, d: costs(dev, d, a.quick)),
              ('what a resume point costs the training loop (issue 32)', lambda dev, d: issue32(dev, d, a.quick, 'saves')),
              ('resume time (issue 32)', lambda dev, d: issue32(dev, d, a.quick, 'resumes')),
              ("fastai's distrib_ctx with AutoResume killed and relaunched (issue 31)", fastai_ddp),
              ("resumable-train check on a script with index_add_ (issue 40)", check_command)]
    for i in a.checks or range(1, len(checks)+1):  # in the order asked for
        name,f = checks[i-1]
        t = time.perf_counter()
        d = out/f'check{i}'; d.mkdir(parents=True, exist_ok=True)
        try: ok,what = f(a.device, d)
        except Exception as e: ok,what = False, f"{type(e).__name__}: {e}"
        failed |= ok is False
        lines.append(f"{i}. **{name}**: {'ok' if ok else 'SKIPPED' if ok is None else 'FAILED'} ({time.perf_counter()-t:.0f} s): {what}")
        print(lines[-1], flush=True)
        (out/'gpu_check.md').write_text('\n'.join(lines) + '\n')  # after each check: a run stopped at its limit keeps what it did
    print(f"\nreport: {out/'gpu_check.md'}")
    sys.exit(1 if failed else 0)

if __name__ == '__main__': main()

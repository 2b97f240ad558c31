"""DDPTrainer with two ranks on CPU (gloo): identical weights, a stop on one rank, output and files from rank 0 only, validation
numbers, a killed rank, a hung rank, another world size. The ranks are children forked from the test process (fastai imported once, see
forked.py) that join the process group as torchrun's workers do (test_elastic.py); SIGTERM to the launcher, which torchrun passes on to its
workers, is tested on a real `torchrun --standalone`. Every launch is bounded and its processes killed on timeout."""
import glob, os, re, signal, subprocess, time
from pathlib import Path
import pytest
from helpers import PY, TESTS, made_once, start, finish, load_result, diff_values
from resumable_train.checkpoints import newest_valid
from resumable_train.files import resume_record
from test_elastic import free_port
from killrerun import snapshot

SCRIPT = TESTS/'dist_train.py'
TIMEOUT = 20  # the process-group timeout the script gives DDPTrainer

def start_ranks(forker, out, *args, n=2, script=SCRIPT, env=None):
    "Fork `n` ranks of `script` (dist_train.py), with the environment torchrun gives its workers (and `env`)"
    port = free_port()
    renv = lambda r: {**dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port)),
                      **(env or {})}
    return [forker.start(script, out, '--timeout', TIMEOUT, *args, env=renv(r)) for r in range(n)]

def wait_ranks(ps, timeout=120)->list:
    "Wait for every rank, at most `timeout` seconds in all (then kill them all); `(returncode, output)` of each"
    outs,end = [],time.monotonic() + timeout
    try:
        for p in ps:
            try: outs.append(p.communicate(timeout=max(1, end - time.monotonic()))[0])
            except subprocess.TimeoutExpired: outs.append(f'[killed: the ranks ran past the {timeout}s timeout]')
    finally:
        for p in ps: p.kill_group()
    return [(p.returncode, o) for p,o in zip(ps, outs)]

def ranks(forker, out, *args, ok=True, timeout=120, **kwargs)->list:
    "Run 2 forked ranks of dist_train.py (or `script`) to their end; `(returncode, output)` of each"
    res = wait_ranks(start_ranks(forker, out, *args, **kwargs), timeout)
    if ok: assert all(rc == 0 for rc,_ in res), why(res)
    return res

def why(res)->str: return '\n'.join(f"--- rank {r} rc={rc}\n{o[-3000:]}" for r,(rc,o) in enumerate(res))

def results(out): return [load_result(out/f'rank{r}.pt') for r in (0, 1)]

def assert_same_run(ref, got):
    for a,b in zip(ref, got):
        d = diff_values(a['model'], b['model'], 'model') + diff_values(a['values'], b['values'], 'values')
        assert not d and a['train_iter'] == b['train_iter'], d[:5]

def wait_for(f, alive, secs):
    "Wait until file `f` exists, while `alive()` and at most `secs` seconds"
    end = time.monotonic() + secs
    while not f.exists():
        assert alive() and time.monotonic() < end, f"{f} did not appear"
        time.sleep(0.05)

@pytest.fixture(scope='module')
def reference(forker, tmp_path_factory):
    "An uninterrupted 2-rank run with AutoResume(every_iter=3), CSVLogger and SaveModelCallback"
    out = tmp_path_factory.mktemp('ref')
    res = ranks(forker, out, '--every', '3')
    return out, results(out), [o for _,o in res]

@pytest.fixture(scope='module')
def uninterrupted(forker, tmp_path_factory):
    "`uninterrupted(*args)`: the folder of the uninterrupted 2-rank run with `args`, made once, at the first test that asks for it"
    return made_once(tmp_path_factory, lambda d, *args: ranks(forker, d, *args))

def test_two_ranks(reference):
    out,(r0,r1),(o0,o1) = reference
    assert_same_run([r0], [r1])                      # identical weights and Recorder on both ranks
    assert r0['world_size'] == 2 and r0['epochs'] == 3 and r0['train_iter'] == 12   # 105 items: 53 per rank, 4 batches of 15
    # rank 0 alone shows progress and writes files
    assert 'train_loss' in o0 and 'train_loss' not in o1
    run_dir = str(out/'run')
    assert not [f for f in r1['writes'] if f.startswith(run_dir)], r1['writes']
    assert any(f.endswith('history.csv') for f in r0['writes']) and any('autoresume-' in f for f in r0['writes'])
    assert len((out/'run'/'history.csv').read_text().splitlines()) == 4
    # validation in fit (rank 0, broadcast) equals a single-process evaluation of the final weights on each rank, bit for bit
    for r in (r0, r1): assert r['validate'] == r['values'][-1][1:], (r['validate'], r['values'][-1])

def test_every_secs(forker, tmp_path):
    """AutoResume(every_secs) on 2 ranks: a resume point each time `every_secs` have passed, on every rank's clock; not one a batch
    once the first was due (a rank other than 0 that never restarted its clock made every later batch due for all)"""
    every = 0.5
    ranks(forker, tmp_path, '--every-secs', every, '--sleep', '0.1', '--epochs', '2', '--n-train', '14')
    r0,r1 = results(tmp_path)
    assert r0['train_iter'] == r1['train_iter'] == 14  # 210 items: 105 a rank, 7 batches of 15
    points = {m for f in r0['writes'] for m in re.findall(r'autoresume-(\d{4})\.pth', f)}
    # 1.4 s of sleep alone: at least 2 periodic points; at most one per `every` seconds the fit took, and the 2 epochs' ends
    assert 2 + 2 <= len(points) <= 2 + r0['secs']/every + 1, (sorted(points), r0['secs'])

@pytest.mark.parametrize('ar', [[], ['--every', '3']])
def test_stop_on_rank0_stops_both(forker, tmp_path, ar):
    "`CancelFitException` on rank 0 alone, in a callback ordered after `AutoResume`: both ranks stop there, with the same weights"
    ranks(forker, tmp_path, '--epochs', '4', '--stop-rank0-at', '1', *ar)
    r0,r1 = results(tmp_path)
    assert r0['epochs'] == r1['epochs'] == 2 and r0['train_iter'] == r1['train_iter'] == 8
    assert_same_run([r0], [r1])

def torchrun_logs(out, rank, stream='stdout'):
    return ''.join(Path(f).read_text(errors='replace') for f in sorted(glob.glob(f'{out}/logs/*/attempt_*/{rank}/{stream}.log')))

def no_orphans(p):
    try: os.killpg(p.pid, 0)
    except ProcessLookupError: return True
    return False

def test_sigterm_kill_relaunch(forker, tmp_path, reference):
    "SIGTERM to torchrun, relaunch, SIGKILL of one rank, relaunch: the end is the uninterrupted run's, bit for bit"
    p = start([PY, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', '--redirects', '3', '--log-dir', str(tmp_path/'logs'),
               str(SCRIPT), str(tmp_path), '--timeout', str(TIMEOUT), '--every', '3', '--sleep', '0.3', '--mark-at', '5'])
    wait_for(tmp_path/'marker', lambda: p.poll() is None, 90)
    os.kill(p.pid, signal.SIGTERM)   # torchrun passes it on to both workers
    rc,o,e = finish(p, 60)
    log = torchrun_logs(tmp_path, 0)
    assert rc != 0 and no_orphans(p), (rc, (o+e)[-3000:], torchrun_logs(tmp_path, 0, 'stderr')[-3000:])
    assert 'AutoResume: stopped by SIGTERM at epoch 2/' in log, log[-3000:]   # saved at the batch it was at
    (tmp_path/'marker').unlink()
    ps = start_ranks(forker, tmp_path, '--every', '3', '--kill-rank', '1', '--kill-at', '11', '--mark-at', '10')
    wait_for(tmp_path/'marker', lambda: all(q.poll() is None for q in ps), 90)
    t = time.monotonic()
    res = wait_ranks(ps, 60)
    assert res[1][0] == -signal.SIGKILL and res[0][0] != 0 and time.monotonic() - t < TIMEOUT + 10, why(res)
    assert 'AutoResume: continuing from' in res[0][1] and 'DDPTrainer: rank 0 of 2 could not' in res[0][1], why(res)  # a clear error
    # another world size is refused
    rc,o = forker.run(SCRIPT, tmp_path, '--every', '3', timeout=60)
    assert rc != 0 and 'holds resume points of a different run (fit call 1 world_size: saved 2, now 1' in o, o[-3000:]
    res = ranks(forker, tmp_path, '--every', '3')
    assert 'AutoResume: continuing from' in res[0][1] and 'skipping' not in res[0][1], why(res)
    assert_same_run(reference[1], results(tmp_path))

def every_process(pid)->list:
    "`pid` and all its descendants: what Slurm signals when it preempts or cancels a job step"
    import psutil
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]

def test_sigterm_every_process(forker, tmp_path):
    "SIGTERM to every process of a torchrun job (launcher, ranks, their DataLoader workers), as Slurm sends it: each rank stops at the same batch with 143; the relaunch ends bitwise"
    args = ('--every', '100', '--workers', '2', '--n-train', '14', '--epochs', '2', '--timeout', str(TIMEOUT))
    ref,run = tmp_path/'ref',tmp_path/'run'
    ranks(forker, ref, *args)
    p = start([PY, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', '--redirects', '3', '--log-dir', str(run/'logs'),
               str(SCRIPT), str(run), *args, '--mark-at', '3'])
    wait_for(run/'marker', lambda: p.poll() is None, 90)
    procs = every_process(p.pid)
    for q in procs: q.send_signal(signal.SIGTERM)
    rc,o,e = finish(p, 60)
    logs = torchrun_logs(run, 0) + torchrun_logs(run, 0, 'stderr') + torchrun_logs(run, 1, 'stderr')
    assert len(procs) >= 7, f"expected the launcher, 2 ranks and their 2 workers each, signalled {len(procs)} processes"
    exits = [(run/f'exit{r}').read_text().split() if (run/f'exit{r}').exists() else None for r in (0, 1)]
    assert exits[0] == exits[1] and exits[0][0] == '143', (exits, (o+e)[-2000:], logs[-3000:])
    assert 'AutoResume: stopped by SIGTERM at epoch' in logs and 'exited unexpectedly' not in logs, logs[-3000:]
    assert 'Exception ignored' not in logs, logs[-3000:]
    f,state = newest_valid(run/'run'/'models')
    assert resume_record(state)['train_iter'] == int(exits[0][1]), (f, exits)
    res = ranks(forker, run, *args)
    assert 'AutoResume: continuing from' in res[0][1], why(res)
    assert_same_run(results(ref), results(run))

def test_fp16_kill_relaunch(forker, tmp_path):
    "`to_fp16` under DDPTrainer: one rank killed mid-run, relaunched: bitwise the uninterrupted run"
    ref,run = tmp_path/'ref',tmp_path/'run'
    ranks(forker, ref, '--every', '3', '--fp16')
    res = ranks(forker, run, '--every', '3', '--fp16', '--kill-rank', '1', '--kill-at', '8', ok=False)
    assert res[1][0] == -signal.SIGKILL and res[0][0] != 0, why(res)
    res = ranks(forker, run, '--every', '3', '--fp16')
    assert 'AutoResume: continuing from' in res[0][1], why(res)
    assert_same_run(results(ref), results(run))

def test_cached_stage_kill_relaunch(forker, tmp_path):
    """A first fit call cached as a stage (`learn.save('stage1')`, loaded when found), a draw, then the main fit call, each rank with its
    own random streams: killed at the main call's first batch (the stage and the first call's end written, no resume point of the main
    call yet) and relaunched, the ranks load the stage instead of training it and end bitwise as the uninterrupted run"""
    ref,run = tmp_path/'ref',tmp_path/'run'
    ranks(forker, ref, '--every', '3', '--cached', '--epochs', '2')
    res = ranks(forker, run, '--every', '3', '--cached', '--epochs', '2', '--kill-rank', '1', '--kill-at', '1', ok=False)
    assert res[1][0] == -signal.SIGKILL and res[0][0] != 0, why(res)
    assert (run/'run'/'models'/'stage1.pth').exists()
    res = ranks(forker, run, '--every', '3', '--cached', '--epochs', '2')
    assert_same_run(results(ref), results(run))

@pytest.mark.parametrize('who', [1, 2])
def test_nested_call_kill_relaunch(forker, uninterrupted, tmp_path, who):
    """A callback that calls `get_preds` over a shuffled loader in each `after_epoch`, under DDPTrainer: one rank killed inside that call
    in epoch 2 (rank 0, then rank 1), relaunched: bitwise the uninterrupted run, the call neither ending the fit call nor moving it"""
    ref,run = uninterrupted('--every', '3', '--nested', '3'),tmp_path/'run'  # no rank 2: nothing killed
    assert_same_run(*[[r] for r in results(ref)])
    res = ranks(forker, run, '--every', '3', '--nested', str(who), ok=False)
    assert res[who-1][0] == -signal.SIGKILL and res[2-who][0] != 0, why(res)
    res = ranks(forker, run, '--every', '3', '--nested', '3')
    assert 'AutoResume: continuing from' in res[0][1], why(res)
    assert_same_run(results(ref), results(run))

def test_hung_rank(forker, tmp_path):
    "A rank that hangs (SIGSTOP) rather than dies: rank 0 fails with a clear error within the process-group timeout"
    secs = 5
    ps = start_ranks(forker, tmp_path, '--timeout', secs, '--hang-rank', '1', '--hang-at', '5', '--mark-at', '5', '--sleep', '0.2')
    try:
        wait_for(tmp_path/'marker', lambda: all(q.poll() is None for q in ps), 90)
        t = time.monotonic()
        try: out = ps[0].communicate(timeout=secs + 20)[0]
        except subprocess.TimeoutExpired: out = f'rank 0 still running {secs + 20}s after rank 1 hung'
        print(f"rank 0 reported the hung rank {time.monotonic() - t:.1f} s after it stopped")
        assert ps[0].returncode != 0 and 'DDPTrainer: rank 0 of 2 could not' in out, out[-3000:]
        assert time.monotonic() - t < secs + 10
    finally:
        for q in ps: q.kill_group()

def test_torch_dataloader_refused(forker, tmp_path):
    "A training DataLoader that is not fastai's (a stream, a stateful loader) is refused on every rank before the first batch, with what to do"
    res = ranks(forker, tmp_path, '--torch-dl', '--every', '3', ok=False)
    for rc,o in res:
        assert rc != 0 and 'DDPTrainer shards fastai DataLoaders' in o and 'DataLoader' in o, why(res)
    assert not list((tmp_path/'run').rglob('*.pth')), 'a resume point was written'

def test_stream_kill_relaunch(forker, tmp_path):
    "A stream that keeps its position, under 2 ranks: killed inside an epoch twice (rank 1, then rank 0), relaunched, ends as the uninterrupted run (each rank's position restored); another world size is refused with the reason"
    ref = tmp_path/'ref'
    ranks(forker, ref, '--stream', '--every', '3')
    ps = start_ranks(forker, tmp_path, '--stream', '--every', '3', '--kill-rank', '1', '--kill-at', '7')  # the newest resume point: epoch 2, batch 2 of 4
    res = wait_ranks(ps, 60)
    assert res[1][0] == -signal.SIGKILL and res[0][0] != 0, why(res)
    rc,o = forker.run(SCRIPT, tmp_path, '--stream', '--every', '3', '--elastic', timeout=60)
    assert rc != 0 and 'whose training data is a stream (DataLoader)' in o and 'Relaunch with 2 process(es)' in o, o[-3000:]
    ps = start_ranks(forker, tmp_path, '--stream', '--every', '3', '--kill-rank', '0', '--kill-at', '10')  # a second kill, of rank 0
    res = wait_ranks(ps, 60)
    assert res[0][0] == -signal.SIGKILL and res[1][0] != 0, why(res)
    assert 'AutoResume: continuing from' in res[0][1] and '(epoch 2/3, batch 2/4)' in res[0][1], why(res)
    res = ranks(forker, tmp_path, '--stream', '--every', '3')
    assert 'AutoResume: continuing from' in res[0][1] and '(epoch 3/3, batch 1/4)' in res[0][1], why(res)
    assert_same_run(results(ref), results(tmp_path))

@pytest.mark.parametrize('source', ['hf_buffer', 'sdl_map', 'replay_gen'])
def test_sources_kill_relaunch(forker, tmp_path, source):
    "Issue 29's sources under 2 ranks, 2 workers each: a Hugging Face stream with a shuffle buffer, torchdata over map-style data, a replayed stream drawing from torch's stream; killed twice (rank 1, then rank 0), relaunched on the same size: the uninterrupted run; run again after its end: it trains nothing"
    pytest.importorskip('torchdata'); pytest.importorskip('datasets')
    ref,args = tmp_path/'ref',['--source', source, '--every', '3']
    ranks(forker, ref, *args, timeout=300)
    res = wait_ranks(start_ranks(forker, tmp_path, *args, '--kill-rank', '1', '--kill-at', '7'), 300)
    assert res[1][0] == -signal.SIGKILL and res[0][0] != 0, why(res)
    res = wait_ranks(start_ranks(forker, tmp_path, *args, '--kill-rank', '0', '--kill-at', '11'), 300)
    assert res[0][0] == -signal.SIGKILL and 'AutoResume: continuing from' in res[0][1], why(res)
    res = ranks(forker, tmp_path, *args, timeout=300)
    assert 'AutoResume: continuing from' in res[0][1], why(res)
    assert_same_run(results(ref), results(tmp_path))
    before = snapshot(tmp_path/'run')
    ranks(forker, tmp_path, *args, timeout=300)   # once more, after the end: nothing trained, nothing written, the same weights
    again = results(tmp_path)
    assert [r['trained'] for r in again] == [0, 0], [r['trained'] for r in again]
    for r,g in zip(results(ref), again): assert (g['epoch'], g['n_epoch'], g['pct_train']) == (r['epoch'], r['n_epoch'], r['pct_train'])
    assert snapshot(tmp_path/'run') == before, set(before.items()) ^ set(snapshot(tmp_path/'run').items())
    assert_same_run(results(ref), again)

def test_hf_elastic_at_epoch_end(forker, tmp_path):
    "A Hugging Face stream split by node (4 shards): a 2-rank run killed after an epoch's end continues on 1 process (`elastic=True`) to the end; killed inside an epoch, it is refused with the reason"
    pytest.importorskip('torchdata'); pytest.importorskip('datasets')
    args = ['--source', 'hf_buffer', '--every', '4']  # 4 batches an epoch on 2 ranks: resume points at epoch ends
    res = wait_ranks(start_ranks(forker, tmp_path, *args, '--kill-rank', '1', '--kill-at', '5'), 300)
    assert res[1][0] == -signal.SIGKILL, why(res)
    rc,o = forker.run(SCRIPT, tmp_path, *args, '--elastic', timeout=300)
    assert rc == 0 and 'AutoResume: continuing from' in o, o[-3000:]
    mid,args = tmp_path/'mid',['--source', 'hf_buffer', '--every', '3']
    res = wait_ranks(start_ranks(forker, mid, *args, '--kill-rank', '1', '--kill-at', '4'), 300)
    assert res[1][0] == -signal.SIGKILL, why(res)
    rc,o = forker.run(SCRIPT, mid, *args, '--elastic', timeout=300)
    assert rc != 0 and "changes size at an epoch's end, not inside one" in o, o[-3000:]

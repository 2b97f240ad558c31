"""DistributedTrainer with two ranks on CPU (gloo) under `torchrun --standalone`: identical weights, a stop on one rank, output and files
from rank 0 only, validation numbers, a killed worker, SIGTERM to the launcher, another world size. Every launch is bounded and its
whole process group killed on timeout (helpers.run/finish)."""
import glob, os, signal, time
from pathlib import Path
import pytest
from helpers import PY, TESTS, run, start, finish, check_rc, load_result, diff_values

TIMEOUT = 20  # the process-group timeout the script gives DistributedTrainer

def torchrun(out, *args, n=2):
    return [PY, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={n}', '--redirects', '3', '--log-dir', str(out/'logs'),
            str(TESTS/'dist_train.py'), str(out), '--timeout', str(TIMEOUT), *args]

def logs(out, rank, stream='stdout'):
    return ''.join(Path(f).read_text(errors='replace') for f in sorted(glob.glob(f'{out}/logs/*/attempt_*/{rank}/{stream}.log')))

def why(res, out):
    rc,o,e = res
    return f"rc={rc}\n--- launcher\n{(o+e)[-3000:]}\n--- rank 0\n{logs(out,0,'stderr')[-3000:]}\n--- rank 1\n{logs(out,1,'stderr')[-3000:]}"

def results(out): return [load_result(out/f'rank{r}.pt') for r in (0, 1)]

def assert_same_run(ref, got):
    for a,b in zip(ref, got):
        d = diff_values(a['model'], b['model'], 'model') + diff_values(a['values'], b['values'], 'values')
        assert not d and a['train_iter'] == b['train_iter'], d[:5]

def wait_for(f, p, secs):
    end = time.monotonic() + secs
    while not f.exists():
        assert p.poll() is None and time.monotonic() < end, f"{f} did not appear"
        time.sleep(0.05)

def no_orphans(p):
    try: os.killpg(p.pid, 0)
    except ProcessLookupError: return True
    return False

@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    "An uninterrupted 2-rank run with AutoResume(every_iter=3), CSVLogger and SaveModelCallback"
    out = tmp_path_factory.mktemp('ref')
    res = run(torchrun(out, '--every', '3'), timeout=120)
    assert res[0] == 0, why(res, out)
    return out, results(out)

def test_two_ranks(reference):
    out,(r0,r1) = reference
    assert_same_run([r0], [r1])                      # identical weights and Recorder on both ranks
    assert r0['world_size'] == 2 and r0['epochs'] == 3 and r0['train_iter'] == 12   # 105 items: 53 per rank, 4 batches of 15
    # rank 0 alone shows progress and writes files
    assert 'train_loss' in logs(out, 0) and 'train_loss' not in logs(out, 1)
    run_dir = str(out/'run')
    assert not [f for f in r1['writes'] if f.startswith(run_dir)], r1['writes']
    assert any(f.endswith('history.csv') for f in r0['writes']) and any('autoresume-' in f for f in r0['writes'])
    assert len((out/'run'/'history.csv').read_text().splitlines()) == 4
    # validation in fit (rank 0, broadcast) equals a single-process evaluation of the final weights on each rank, bit for bit
    for r in (r0, r1): assert r['validate'] == r['values'][-1][1:], (r['validate'], r['values'][-1])

def test_stop_on_rank0_stops_both(tmp_path):
    res = run(torchrun(tmp_path, '--epochs', '4', '--stop-rank0-at', '1'), timeout=120)
    assert res[0] == 0, why(res, tmp_path)
    r0,r1 = results(tmp_path)
    assert r0['epochs'] == r1['epochs'] == 2 and r0['train_iter'] == r1['train_iter'] == 8
    assert_same_run([r0], [r1])

def test_sigterm_kill_relaunch(tmp_path, reference):
    "SIGTERM to the launcher, relaunch, SIGKILL of one worker, relaunch: the end is the uninterrupted run's, bit for bit"
    p = start(torchrun(tmp_path, '--every', '3', '--sleep', '0.3', '--mark-at', '5'))
    wait_for(tmp_path/'marker', p, 90)
    os.kill(p.pid, signal.SIGTERM)
    res = finish(p, 60)
    assert res[0] != 0 and no_orphans(p), why(res, tmp_path)
    assert 'AutoResume: stopped by SIGTERM at epoch 2/' in logs(tmp_path, 0), why(res, tmp_path)   # saved at the batch it was at
    (tmp_path/'marker').unlink()
    p = start(torchrun(tmp_path, '--every', '3', '--kill-rank', '1', '--kill-at', '11', '--mark-at', '10'))
    wait_for(tmp_path/'marker', p, 90)
    t = time.monotonic()
    res = finish(p, 60)
    assert res[0] != 0 and time.monotonic() - t < TIMEOUT + 10 and no_orphans(p), why(res, tmp_path)
    assert 'AutoResume: continuing from' in logs(tmp_path, 0)
    assert 'DistributedTrainer: rank 0 of 2 could not' in logs(tmp_path, 0, 'stderr'), why(res, tmp_path)   # a clear error
    # another world size is refused (AutoResume sees another setup first: the shards have other lengths)
    rc,o,e = run([PY, str(TESTS/'dist_train.py'), str(tmp_path), '--every', '3'], timeout=60)
    assert rc != 0 and 'holds resume points of a different run (fit call 1 n_iter: saved 4, now 7' in e, e[-3000:]
    res = run(torchrun(tmp_path, '--every', '3'), timeout=120)
    assert res[0] == 0, why(res, tmp_path)
    assert 'AutoResume: continuing from' in logs(tmp_path, 0) and 'skipping' not in logs(tmp_path, 0, 'stderr')
    assert_same_run(reference[1], results(tmp_path))

def test_hung_rank(tmp_path):
    "A rank that hangs (SIGSTOP) rather than dies: rank 0 fails with a clear error within the process-group timeout"
    secs = 5
    p = start(torchrun(tmp_path, '--timeout', str(secs), '--hang-rank', '1', '--hang-at', '5', '--mark-at', '5', '--sleep', '0.2'))
    try:
        wait_for(tmp_path/'marker', p, 90)
        t,err = time.monotonic(),''
        while time.monotonic() - t < secs + 20 and 'DistributedTrainer: rank 0 of 2 could not' not in err:
            time.sleep(0.2)
            err = logs(tmp_path, 0, 'stderr')
        assert 'DistributedTrainer: rank 0 of 2 could not' in err, err[-3000:]
        print(f"rank 0 reported the hung rank {time.monotonic() - t:.1f} s after it stopped"); assert time.monotonic() - t < secs + 10
    finally: finish(p, 1)
    assert no_orphans(p)

"""fastai's own `DistributedTrainer` (`with learn.distrib_ctx(): ...`, over Accelerate) with `AutoResume`, two ranks on CPU (gloo):
killed on every rank twice, on one rank, Ctrl-C (SIGINT to every rank), SIGTERM to every process (as Slurm sends it), another
number of processes. The ranks are children forked from the test process as in test_distributed.py; the two launchers, `torchrun`
and `accelerate launch`, are real. The uninterrupted runs are also compared with stock fastai's (2 ranks forked from a process that
never imports the package). Each uninterrupted run is made once, for every test that compares with it. Every launch is bounded and its
processes killed on timeout."""
import os, signal, time
import pytest
from forked import stock_server
from helpers import PY, TESTS, made_once, start, finish, diff_values
from test_distributed import start_ranks, wait_ranks, why, wait_for, every_process, TIMEOUT
from test_elastic import free_port
from resumable_train.checkpoints import newest_valid
from resumable_train.files import resume_record
import fastai.distributed, fastai.vision.all  # noqa: F401 (imported once here, not in every forked rank)

SCRIPT = TESTS/'fastai_ddp_train.py'
CPU = dict(ACCELERATE_USE_CPU='1')  # Accelerate on a machine without GPUs: a gloo process group on the CPU

def ranks(forker, out, *args, ok=True, timeout=120):
    "Run 2 forked ranks of fastai_ddp_train.py to their end; `(returncode, output)` of each"
    res = wait_ranks(start_ranks(forker, out, *args, script=SCRIPT, env=CPU), timeout)
    if ok: assert all(rc == 0 for rc,_ in res), why(res)
    return res

@pytest.fixture(scope='module')
def stock():
    "Stock fastai's ranks: children of a process that imported the script's modules and never the package (see forked.py)"
    yield from stock_server(('fastai.basics', 'fastai.callback.all', 'fastai.distributed', 'fastai.vision.all', 'accelerate',
                             'sklearn.datasets', 'apps_script', 'helpers'))

def stock_ranks(stock, out, *args, n=2, timeout=120)->list:
    "Run `n` ranks of the script as stock fastai (children of a process that never imports the package) to their end; the results of each"
    port = free_port()
    env = lambda r: dict(CPU, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    res = stock.start(*[dict(script=SCRIPT, args=[out, '--timeout', '60', *args, '--stock'], env=env(r)) for r in range(n)])
    res = res.result(timeout)
    assert all(rc == 0 for rc,_ in res), '\n'.join(f"rank {r}: exit {rc}\n{o[-2000:]}" for r,(rc,o) in enumerate(res))
    return results(out, n)

@pytest.fixture(scope='module')
def reference(forker, tmp_path_factory):
    "`reference(*args)`: the folder of the uninterrupted 2-rank run with `args`, made once, at the first test that asks for it"
    return made_once(tmp_path_factory, lambda d, *args: ranks(forker, d, *args))

def results(out, n=2): return [torch_load(out/f'rank{r}.pt') for r in range(n)]

def torch_load(f):
    import torch
    return torch.load(f, weights_only=False)

def assert_same(ref, got):
    "Every rank's weights, optimizer state and Recorder values bitwise those of the reference, and as many steps"
    for a,b in zip(ref, got):
        d = [x for k in ('model', 'opt', 'values', 'lrs', 'train_iter') for x in diff_values(a[k], b[k], k)]
        assert not d, d[:5]

@pytest.mark.parametrize('model,fit', [('mlp', 'one_cycle'), ('xresnet', 'fine_tune')])
def test_kill_every_rank_twice(forker, stock, reference, tmp_path, model, fit):
    "SIGKILL of every rank at one batch, Ctrl-C at another, SIGKILL again, then relaunched: bitwise the uninterrupted 2-rank run; a rerun after the end trains 0"
    a = ('--model', model, '--fit', fit)
    ref,run = reference(*a),tmp_path/'run'
    assert_same(stock_ranks(stock, tmp_path/'stock', *a), results(ref))   # with AutoResume, uninterrupted: stock fastai's bits
    r0,r1 = results(ref)
    assert any('autoresume-' in f for f in r0['writes']) and not [f for f in r1['writes'] if f.startswith(str(ref/'run'))], r1['writes']
    kill = lambda at: ranks(forker, run, *a, '--kill-rank', '-2', '--kill-at', str(at), ok=False)
    res = kill(3)   # epoch 1 batch 3 (fine_tune: of the frozen call)
    assert all(rc == -signal.SIGKILL for rc,_ in res), why(res)
    # Ctrl-C: SIGINT to every rank while rank 0 waits after batch 5 (rank 1 waits for it in the gate): both stop where they next
    # agree, after epoch 2 batch 2 (fine_tune: at the end of its frozen call's epoch), and end as Python ends on Ctrl-C: killed by SIGINT
    ps = start_ranks(forker, run, *a, '--mark-at', '5', '--hold', script=SCRIPT, env=CPU)
    wait_for(run/'marker', lambda: all(q.poll() is None for q in ps), 90)
    for q in ps: q.send_signal(signal.SIGINT)
    res = wait_ranks(ps, 60)
    assert all(rc == -signal.SIGINT for rc,_ in res), why(res)
    assert res[0][1].count('AutoResume: stopped by SIGINT at') == 1 and 'stopped by SIGINT' not in res[1][1], why(res)   # rank 0 alone speaks
    exits = [(run/f'exit{r}').read_text().split() for r in (0, 1)]
    assert exits[0] == exits[1] and exits[0][0] == 'KeyboardInterrupt', exits
    f,state = newest_valid(run/'run'/'models')
    assert resume_record(state)['train_iter'] == int(exits[0][1]), (f, exits)
    # from there: epoch 2 batch 3 (fine_tune: its unfrozen call, batch 3), a batch after a periodic point (every 2: the kill lands
    # before its batch's own point, which is written once every callback saw `after_batch`)
    res = kill(7 if fit == 'one_cycle' else 8)
    assert all(rc == -signal.SIGKILL for rc,_ in res), why(res)
    res = ranks(forker, run, *a)
    assert 'AutoResume: continuing from' in res[0][1] and 'continuing' not in res[1][1], why(res)   # rank 0 alone speaks
    assert_same(results(ref), results(run))
    res = ranks(forker, run, *a)
    assert "the last the run's files hold, and nothing is trained" in res[0][1], why(res)
    assert all(r['trained'] is None for r in results(run))
    assert_same(results(ref), results(run))

def test_kill_one_rank(forker, tmp_path):
    "`to_fp16()` under fastai's trainer, one rank SIGKILLed: the other stops with a clear error within its timeout; relaunched with torchrun, bitwise the uninterrupted run"
    ref,run = tmp_path/'ref',tmp_path/'run'
    ranks(forker, ref, '--fp16')
    ps = start_ranks(forker, run, '--fp16', '--kill-rank', '1', '--kill-at', '5', '--mark-at', '4', script=SCRIPT, env=CPU)
    wait_for(run/'marker', lambda: all(q.poll() is None for q in ps), 90)
    t = time.monotonic()
    res = wait_ranks(ps, 60)
    assert res[1][0] == -signal.SIGKILL and res[0][0] not in (0, -signal.SIGKILL) and time.monotonic() - t < TIMEOUT + 10, why(res)
    assert 'DistributedTrainer (fastai): rank 0 of 2 could not' in res[0][1] and 'DDPTrainer' not in res[0][1], why(res)   # the trainer in use
    p = start([PY, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', str(SCRIPT), str(run), '--timeout', str(TIMEOUT), '--fp16'],
              env=CPU)
    rc,o,e = finish(p, 120)
    assert rc == 0 and 'AutoResume: continuing from' in o, (o+e)[-3000:]
    assert_same(results(ref), results(run))

def test_two_nodes_without_shared_disk(forker, reference, tmp_path):
    "Each rank a node with its own folder: every rank killed, then relaunched with rank 0 on the node that holds no resume point: the newest is sent to it, and the run ends bitwise as the uninterrupted one"
    ref,run = reference('--model', 'mlp', '--fit', 'one_cycle'),tmp_path/'run'   # the script's defaults
    nodes = dict(CPU, LOCAL_RANK='0')   # two nodes of one process each: both look in their own folder
    res = wait_ranks(start_ranks(forker, run, '--nodes', 'own', '--kill-rank', '-2', '--kill-at', '6', script=SCRIPT, env=nodes))
    assert all(rc == -signal.SIGKILL for rc,_ in res), why(res)
    assert list((run/'run0'/'models').glob('*.pth')) and not list((run/'run1').rglob('*.pth'))   # rank 0 wrote them, on its node
    res = wait_ranks(start_ranks(forker, run, '--nodes', 'swapped', script=SCRIPT, env=nodes))
    assert all(rc == 0 for rc,_ in res) and 'AutoResume: continuing from' in res[0][1], why(res)
    assert_same(results(ref), results(run))

def test_sigterm_every_process_accelerate(forker, reference, tmp_path):
    "SIGTERM to every process of an `accelerate launch` job, as Slurm sends it: both ranks stop at the same batch with 143; relaunched the same way, bitwise the uninterrupted run"
    ref,run = reference('--model', 'mlp', '--fit', 'one_cycle'),tmp_path/'run'   # the script's defaults
    launch = [PY, '-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1', '--mixed_precision', 'no',
              '--dynamo_backend', 'no', '--main_process_port', str(free_port()), str(SCRIPT), str(run), '--timeout', str(TIMEOUT)]
    p = start(launch + ['--mark-at', '5', '--sleep', '0.5'], env=CPU)
    wait_for(run/'marker', lambda: p.poll() is None, 90)
    for q in every_process(p.pid): q.send_signal(signal.SIGTERM)
    rc,o,e = finish(p, 60)
    exits = [(run/f'exit{r}').read_text().split() if (run/f'exit{r}').exists() else None for r in (0, 1)]
    assert exits[0] == exits[1] and exits[0][0] == '143', (exits, (o+e)[-3000:])
    assert 'AutoResume: stopped by SIGTERM at epoch 2/2' in o, (o+e)[-3000:]
    f,state = newest_valid(run/'run'/'models')
    assert resume_record(state)['train_iter'] == int(exits[0][1]), (f, exits)
    rc,o,e = finish(start(launch, env=CPU), 120)
    assert rc == 0 and 'AutoResume: continuing from' in o, (o+e)[-3000:]
    assert_same(results(ref), results(run))

def test_elastic(forker, tmp_path):
    "Another number of processes: inside an epoch refused before training, with the reason; from an epoch's end (2 -> 1, 1 -> 2) the run ends as the new size's: its batches, its last learning rate"
    one,two,run = tmp_path/'one',tmp_path/'two',tmp_path/'run'
    rc,o = forker.run(SCRIPT, one, '--every', '0', timeout=120)
    assert rc == 0, o[-3000:]
    ranks(forker, two, '--every', '0')
    (r1,),(r2,_) = results(one, 1),results(two)
    # 2 -> 1 inside an epoch
    res = ranks(forker, run, '--kill-rank', '-2', '--kill-at', '7', ok=False)   # the newest resume point: epoch 2, batch 2 of 4
    assert all(rc == -signal.SIGKILL for rc,_ in res), why(res)
    rc,o = forker.run(SCRIPT, run, '--elastic', timeout=120)
    assert rc != 0 and "is inside an epoch of a run on 2 process(es), and this run on 1 has no trainer" in o, o[-3000:]
    assert 'train_loss' not in o and not (run/'rank0.pt').exists()   # refused before training
    # 2 -> 1 from the end of epoch 1
    for f in (run/'run'/'models').glob('*'): f.unlink()
    ranks(forker, run, '--every', '0', '--kill-rank', '-2', '--kill-at', '6', ok=False)
    rc,o = forker.run(SCRIPT, run, '--every', '0', '--elastic', timeout=120)
    assert rc == 0 and 'AutoResume: continuing from' in o, o[-3000:]
    (got,) = results(run, 1)
    n1,n2 = r1['train_iter']//2,r2['train_iter']//2   # batches an epoch on 1 and on 2 processes
    assert got['train_iter'] == n2 + n1 and got['lrs'][-1] == r1['lrs'][-1] and len(got['lrs']) == n2 + n1, (got['train_iter'], n1, n2)
    # 1 -> 2 from the end of epoch 1
    for f in (run/'run'/'models').glob('*'): f.unlink()
    rc,o = forker.run(SCRIPT, run, '--every', '0', '--kill-rank', '0', '--kill-at', str(n1+1), timeout=120)
    assert rc == -signal.SIGKILL, o[-3000:]
    res = ranks(forker, run, '--every', '0', '--elastic')
    assert 'AutoResume: continuing from' in res[0][1], why(res)
    got = results(run)
    assert got[0]['train_iter'] == n1 + n2 and got[0]['lrs'][-1] == r2['lrs'][-1], (got[0]['train_iter'], n1, n2)
    assert_same([got[0]], [got[1]])
    # fine_tune, 2 -> 1 from the end of its first fit call: the completed call's end, written on 2 processes, loads on 1
    ft = ('--fit', 'fine_tune', '--every', '0')
    rc,o = forker.run(SCRIPT, one/'ft', *ft, timeout=120)
    assert rc == 0, o[-3000:]
    ranks(forker, run/'ft', *ft, '--kill-rank', '-2', '--kill-at', '6', ok=False)
    rc,o = forker.run(SCRIPT, run/'ft', *ft, '--elastic', timeout=120)
    assert rc == 0 and 'fit call 1 finished in an earlier run' in o, o[-3000:]
    (ft1,),(got,) = results(one/'ft', 1),results(run/'ft', 1)
    assert got['train_iter'] == ft1['train_iter'] and got['lrs'][-1] == ft1['lrs'][-1], (got['train_iter'], ft1['train_iter'])
    # 1 -> 2 inside an epoch: fastai's trainer on the new size refuses it, with the reason
    for f in (run/'run'/'models').glob('*'): f.unlink()
    rc,o = forker.run(SCRIPT, run, '--kill-rank', '0', '--kill-at', str(n1+3), timeout=120)
    assert rc == -signal.SIGKILL, o[-3000:]
    res = ranks(forker, run, '--elastic', ok=False)
    assert all(rc not in (0, -signal.SIGKILL) for rc,_ in res), why(res)
    assert "is inside an epoch of a run on 1 process(es); under fastai's DistributedTrainer" in res[0][1], why(res)
    assert 'train_loss' not in res[0][1], why(res)   # refused before training

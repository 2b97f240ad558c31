"""Resuming on another number of processes (`elastic=True`): 1 -> 2, 2 -> 1, 2 -> 3 ranks, with and without DataLoader workers.

Ranks are children forked by `forked.Forker` (fastai imported once) that join a gloo process group on a free loopback port, as torchrun's
workers do (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). `elastic_train.py` logs every trained batch's sample indices (the
ledger): the test checks that, across the interrupted run and the resumed one, every sample of each epoch is trained once (plus the
documented padding), in one global order that does not depend on the number of processes, and that the schedule ends where it should."""
import json, shutil, socket
from collections import Counter
from pathlib import Path
import pytest, torch
from helpers import TESTS, load_result, diff_values

SCRIPT = TESTS/'elastic_train.py'
N,BS,EPOCHS = 30,4,3

def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def run(forker, n, out, *args, ok=True):
    res = [(p.returncode, o) for p,o in _run(forker, n, out, *args)]
    if ok: assert all(rc == 0 for rc,_ in res), '\n'.join(f"--- rank {r} rc={rc}\n{o[-3000:]}" for r,(rc,o) in enumerate(res))
    return res

def _run(forker, n, out, *args, timeout=150):
    port = free_port()
    env = lambda r: dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    ps = [forker.start(SCRIPT, out, *args, env=env(r) if n > 1 else {}) for r in range(n)]
    outs = []
    try:
        for p in ps: outs.append(p.communicate(timeout=timeout)[0])
    except Exception:
        for p in ps: p.kill_group()
        raise
    return list(zip(ps, outs))

def ledger(out, tag, n)->list:
    "Every trained batch of a launch: dicts with rank, epoch, iter, train_iter, pct, lr, idx"
    rows = []
    for r in range(n):
        f = Path(out)/f'ledger-{tag}-rank{r}.jsonl'
        rows += [dict(json.loads(l), rank=r) for l in f.read_text().splitlines()] if f.exists() else []
    return rows

def global_order(rows, n)->dict:
    "Per epoch, the samples in the order the ranks trained them together: batch by batch, position k of rank r at k*n + r"
    res = {}
    for e in sorted({r['epoch'] for r in rows}):
        seq = []
        for it in sorted({r['iter'] for r in rows if r['epoch'] == e}):
            b = {r['rank']: r['idx'] for r in rows if r['epoch'] == e and r['iter'] == it}
            seq += [b[r][k] for k in range(max(map(len, b.values()))) for r in range(n) if k < len(b[r])]
        res[e] = seq
    return res

def padded(seq, n): return seq + (seq*n)[:-len(seq) % n]

@pytest.fixture(scope='module')
def refs(forker, tmp_path_factory):
    "Uninterrupted runs on 1, 2 and 3 processes: the global order of each epoch is the same"
    out,res = tmp_path_factory.mktemp('refs'),{}
    for n in (1, 2, 3):
        run(forker, n, out, '--tag', f'ref{n}', '--run', f'run{n}')
        res[n] = dict(order=global_order(ledger(out, f'ref{n}', n), n), result=load_result(out/f'result-ref{n}-rank0.pt'))
    return res

def test_one_global_order(refs):
    order = refs[1]['order']
    assert sorted(order) == list(range(EPOCHS)) and all(sorted(order[e]) == list(range(N)) for e in order)
    assert order[0] != order[1]                                       # shuffled anew each epoch
    for n in (2, 3):                                                  # padded with the epoch's first samples, as before
        assert refs[n]['order'] == {e: padded(o, n) for e,o in order.items()}, n
    for n in (1, 2, 3): assert abs(refs[n]['result']['pct_train'] - 1) < 1e-9

def shared_epoch(order, out, before, after, kill, e)->tuple:
    """Check the ledgers of a run on `before` processes killed after batch `kill` (in epoch `e`) and its resume on `after`: every sample of
    each epoch trained once (plus each run's padding), in the global `order`; the first run's rows up to `kill`, and the second's"""
    a = [r for r in ledger(out, 'a', before) if r['train_iter'] <= kill]   # what the resume point holds
    b = ledger(out, 'b', after)
    ga,gb = global_order(a, before),global_order(b, after)
    assert a[-1]['epoch'] == e and min(r['epoch'] for r in b) == e
    c = len(ga[e])
    assert ga[e] == order[e][:c] and c < N                            # the first run trained a prefix of the epoch's order ...
    assert gb[e] == padded(order[e][c:], after)                       # ... the second the rest of it, shared among its ranks
    assert not set(ga[e]) & set(gb[e]) and sorted(set(ga[e]) | set(gb[e])) == list(range(N))   # every sample once
    for ep in range(e): assert ga[ep] == padded(order[ep], before)
    for ep in range(e+1, len(order)): assert gb[ep] == padded(order[ep], after)
    trained = sum(len(s) for s in ga.values()) + sum(len(s) for s in gb.values())
    assert trained == len(order)*N + sum(len(padded(order[ep], before)) - N for ep in range(e)) + len(gb[e]) - (N-c) \
                      + sum(len(padded(order[ep], after)) - N for ep in range(e+1, len(order)))
    return a, b

CASES = [(1, 2, 11), (2, 1, 6), (2, 3, 6)]   # (processes before, after, the training batch the first run is killed after)

@pytest.mark.parametrize('workers', [0, 2])
@pytest.mark.parametrize('before,after,kill', CASES)
def test_elastic(forker, refs, tmp_path, before, after, kill, workers):
    w = ['--workers', str(workers)]
    res = run(forker, before, tmp_path, '--tag', 'a', '--kill-at', str(kill), *w, ok=False)
    assert all(rc == -9 for rc,_ in res), res
    # without elastic=True another world size is refused, naming both sizes and the option
    (rc,o), *_ = run(forker, after, tmp_path, '--tag', 'refused', *w, ok=False)
    assert rc != 0 and f'world_size: saved {before}, now {after}' in o and 'AutoResume(elastic=True)' in o, o[-2000:]
    run(forker, after, tmp_path, '--tag', 'b', '--elastic', *w)
    a,b = shared_epoch(refs[1]['order'], tmp_path, before, after, kill, 1)
    # the schedule: continues from the saved position, grows, ends where an uninterrupted run on `after` does
    pcts = [r['pct'] for r in sorted(a, key=lambda r: r['train_iter']) if r['rank'] == 0] + \
           [r['pct'] for r in sorted(b, key=lambda r: r['train_iter']) if r['rank'] == 0]
    assert all(x < y for x,y in zip(pcts, pcts[1:])), pcts
    rb,ref = [load_result(tmp_path/f'result-b-rank{r}.pt') for r in range(after)],refs[after]['result']
    assert abs(rb[0]['pct_train'] - 1) < 1e-9
    last = [r['lr'] for r in sorted(b, key=lambda r: r['train_iter']) if r['rank'] == 0 and r['epoch'] == EPOCHS-1]
    assert last == ref['lrs'][-len(last):]                             # the last epoch's learning rates, bit for bit
    # the Recorder and the tracker continue: the first epoch is the uninterrupted `before` run's, bit for bit
    assert len(rb[0]['values']) == EPOCHS and rb[0]['values'][0] == refs[before]['result']['values'][0]
    assert rb[0]['best'] == min(v[1] for v in rb[0]['values'])
    for r in rb[1:]: assert not diff_values(rb[0]['model'], r['model']) and r['values'] == rb[0]['values']

def test_elastic_then_same_size(forker, tmp_path):
    "A run resumed on 3 processes from 2, killed inside the epoch it continued and resumed on 3 again, ends bit for bit as without the second kill"
    a,b = tmp_path/'a',tmp_path/'b'
    assert all(rc == -9 for rc,_ in run(forker, 2, a, '--tag', 'a', '--kill-at', '6', ok=False))
    shutil.copytree(a, b)
    run(forker, 3, a, '--tag', 'full', '--elastic')
    assert all(rc == -9 for rc,_ in run(forker, 3, b, '--tag', 'b1', '--elastic', '--kill-at', '7', ok=False))
    assert [r['iter'] for r in ledger(b, 'b1', 3) if r['rank'] == 0] == [1]   # killed after the first of the two batches that continue epoch 1
    run(forker, 3, b, '--tag', 'b2', '--elastic')
    for r in range(3):
        full,b2 = load_result(a/f'result-full-rank{r}.pt'),load_result(b/f'result-b2-rank{r}.pt')
        d = diff_values(full['model'], b2['model'], 'model') + diff_values(full['values'], b2['values'], 'values') + \
            diff_values(full['lrs'], b2['lrs'], 'lrs')
        assert not d and full['pct_train'] == b2['pct_train'] and full['train_iter'] == b2['train_iter'], d[:5]

@pytest.fixture(scope='module')
def refs2(forker, tmp_path_factory):
    "Uninterrupted runs of 2 epochs on 1 and 2 processes"
    out,res = tmp_path_factory.mktemp('refs2'),{}
    for n in (1, 2):
        run(forker, n, out, '--tag', f'ref{n}', '--run', f'run{n}', '--epochs', '2')
        rows = [r for r in ledger(out, f'ref{n}', n) if r['rank'] == 0]
        res[n] = dict(order=global_order(ledger(out, f'ref{n}', n), n), result=load_result(out/f'result-ref{n}-rank0.pt'),
                      pcts=[r['pct'] for r in sorted(rows, key=lambda r: r['train_iter'])])
    return res

# killed in the last epoch (of 2): 1 process trains 8 batches an epoch (batches 9-16), 2 processes 4 (batches 5-8); the rest of the
# epoch on the other size is 2 batches (after 13), 1 batch (after 15), 4 batches (after 6), 2 batches (after 7)
LAST = [(1, 2, 13), (1, 2, 15), (2, 1, 6), (2, 1, 7)]

@pytest.mark.parametrize('before,after,kill', LAST)
def test_elastic_last_epoch(forker, refs2, tmp_path, before, after, kill):
    "Killed in the last epoch and resumed on another size: every sample once, and the schedule ends as the uninterrupted run on the new size"
    assert all(rc == -9 for rc,_ in run(forker, before, tmp_path, '--tag', 'a', '--kill-at', str(kill), '--epochs', '2', ok=False))
    run(forker, after, tmp_path, '--tag', 'b', '--elastic', '--epochs', '2')
    a,b = shared_epoch(refs2[1]['order'], tmp_path, before, after, kill, 1)
    ref,rb = refs2[after]['result'],load_result(tmp_path/f'result-b-rank0.pt')
    # fastai schedules the last batch of an epoch at (epoch+1)/n_epoch - 1/(n_iter*n_epoch), however few samples it holds: the resumed
    # run's last batch is scheduled there too, and the fit ends on the new size's last learning rate and pct_train, bit for bit
    assert rb['lrs'][-1] == ref['lrs'][-1] and rb['pct_train'] == ref['pct_train'], (rb['lrs'][-3:], ref['lrs'][-3:])
    pa = [r['pct'] for r in sorted(a, key=lambda r: r['train_iter']) if r['rank'] == 0]
    pb = [r['pct'] for r in sorted(b, key=lambda r: r['train_iter']) if r['rank'] == 0]
    # up to its last batch the schedule goes on from the saved position (a rest of one batch is that last batch)
    up = pa + pb[:-1]
    assert pb[-1] == refs2[after]['pcts'][-1] and all(x < y for x,y in zip(up, up[1:])), (pa, pb)
    for r in range(1, after):
        assert not diff_values(rb['model'], load_result(tmp_path/f'result-b-rank{r}.pt')['model'])

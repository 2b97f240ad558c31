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
    order = refs[1]['order']
    a = [r for r in ledger(tmp_path, 'a', before) if r['train_iter'] <= kill]   # what the resume point holds
    b = ledger(tmp_path, 'b', after)
    ga,gb = global_order(a, before),global_order(b, after)
    e = a[-1]['epoch']
    assert e == 1 and min(r['epoch'] for r in b) == e
    c = len(ga[e])
    assert ga[e] == order[e][:c] and c < N                            # the first run trained a prefix of the epoch's order ...
    assert gb[e] == padded(order[e][c:], after)                       # ... the second the rest of it, shared among its ranks
    assert not set(ga[e]) & set(gb[e]) and sorted(set(ga[e]) | set(gb[e])) == list(range(N))   # every sample once
    for ep in range(e): assert ga[ep] == padded(order[ep], before)
    for ep in range(e+1, EPOCHS): assert gb[ep] == padded(order[ep], after)
    trained = sum(len(s) for s in ga.values()) + sum(len(s) for s in gb.values())
    assert trained == EPOCHS*N + sum(len(padded(order[ep], before)) - N for ep in range(e)) + len(gb[e]) - (N-c) \
                      + sum(len(padded(order[ep], after)) - N for ep in range(e+1, EPOCHS))
    # the schedule: continues from the saved position, grows with the samples, ends where an uninterrupted run on `after` does
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

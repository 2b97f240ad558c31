"""Exact mid-epoch resume (issue 2), in real second processes.

Three processes run every scenario (`exact_script.py`; importing fastai costs seconds, so each runs many small fits):
1. with `resumable_train` (a child forked from the test process, see forked.py): the uninterrupted reference runs, and the runs that
   save a resume point with `learn.save` and stop;
2. with `resumable_train`, another forked child: `learn.load` then the same fit call, for every resume point; then the error cases;
3. stock fastai (package not imported: a child of the stock server, see forked.py), at the same time as 2: the reference runs again
   (bit-identical to 1), and `learn.load` of a file written with `with_iter=True`.
Every comparison is bitwise (`torch.equal` on every tensor), and the optimizer steps of both halves add up to the uninterrupted count.
"""
import json, os, random, subprocess, time
from pathlib import Path
import pytest, torch
from helpers import TESTS, run, check_rc, load_result, compare_results, diff_values

SCRIPT = str(TESTS/'exact_script.py')
N_ITER = 6  # batches per epoch of the default setup: 48 items, bs 8
N_EPOCH = 3
SCHEDS = ['fit', 'fit_one_cycle', 'fit_flat_cos', 'fit_sgdr']

def _points(sched):
    "Epoch boundaries, the first and last batches of epochs, the end of the run, and two random points inside epochs"
    pts = [(1,0), (2,0), (3,0), (0,1), (1,1), (1,N_ITER-1), (1,N_ITER), (2,N_ITER)]
    r = random.Random(f'exact-{sched}')
    while len(pts) < 10:
        p = (r.randrange(N_EPOCH), r.randrange(2, N_ITER-1))
        if p not in pts: pts.append(p)
    return pts

# name -> (cfg, points). Trackers (SaveModelCallback, EarlyStoppingCallback, ReduceLROnPlateau), shuffle, dropout and accuracy are
# in every configuration; the extra ones add one thing each.
CONFIGS = {s: (dict(sched=s), _points(s)) for s in SCHEDS}
CONFIGS.update({
    'ga': (dict(cbs=['save','early','plateau','ga']), [(0,1), (1,1), (1,2), (1,4), (2,0)]),  # steps every 3rd batch
    'csv': (dict(cbs=['save','early','plateau','csv']), [(1,0), (1,3), (2,N_ITER)]),
    'astats': (dict(cbs=['save','early','plateau','astats']), [(1,0), (1,3), (2,N_ITER-1)]),  # every batch's activation statistics
    'train_metrics_bar': (dict(train_metrics=True, bar=True, sched='fit'), [(1,3), (2,0)]),
    'drop_last': (dict(n_train=50, drop_last=True), [(1,3), (2,0)]),
    'workers2': (dict(workers=2), [(1,0), (1,3), (1,N_ITER)]),
    'tfm_workers2': (dict(workers=2, tfm=True, seed_batches=True), [(1,0), (1,3), (2,N_ITER-1)]),
    'tfm_workers0': (dict(tfm=True, seed_batches=True), [(1,3)]),
    'seedbatches_no_tfm': (dict(seed_batches=True), []),  # SeedBatches without item randomness changes nothing (vs stock)
    'tfm_workers2_streams': (dict(workers=2, tfm=True), [(0,1), (1,0), (1,3), (2,N_ITER-1)]),  # WorkerStreams: stock's draws kept
    'tfm_workers2_noseed': (dict(workers=2, tfm=True, streams=False), []),  # random item tfm in workers, package imported, no callback
})
# Configurations whose uninterrupted run must be bit-identical with and without the package imported
STOCK_COMPAT = [*SCHEDS, 'ga', 'csv', 'astats', 'train_metrics_bar', 'drop_last', 'workers2', 'tfm_workers2_streams',
                'tfm_workers2_noseed']
STOCK_SAME_AS = {'seedbatches_no_tfm': 'fit_one_cycle'}  # (package run, stock run of this config)
ERR_CFG,ERR_AT = 'fit_one_cycle',(1,3)
SETUPS = {'n_epoch': dict(n_epoch=4), 'bs': dict(bs=6), 'n_items': dict(n_train=44), 'n_iter': dict(n_train=46, drop_last=True)}

SCENARIOS = [(n, tuple(p)) for n,(c,pts) in CONFIGS.items() for p in pts]
def _sid(n, p): return f"{n}-e{p[0]}i{p[1]}"

@pytest.fixture(scope='module')
def results(tmp_path_factory, forker, stock):
    "Run the three processes once; return the paths of every result"
    d = tmp_path_factory.mktemp('exact')
    def jobs(name, lst):
        f = d/f'{name}.json'; f.write_text(json.dumps(lst)); return str(f)
    out = lambda *k: str(d/('-'.join(map(str, k))+'.pt'))
    first,second,stock_jobs = [],[],[]
    for n,(cfg,pts) in CONFIGS.items():
        first.append(dict(mode='ref', name=n, cfg=cfg, dir=str(d/'ref'/n), out=out('ref', n)))
        for p in pts:
            sid = _sid(n, p)
            first.append(dict(mode='stop', name=sid, cfg=cfg, at=p, ckpt='rp', dir=str(d/'run'/sid), out=out('stop', sid)))
            second.append(dict(mode='resume', name=sid, cfg=cfg, ckpt='rp', dir=str(d/'run'/sid), out=out('resume', sid)))
    err_dir = str(d/'run'/_sid(ERR_CFG, ERR_AT))
    second.append(dict(mode='errors', name='errors', cfg=CONFIGS[ERR_CFG][0], ckpt='rp', dir=err_dir, out=out('errors'),
                       setups=SETUPS))
    for n in STOCK_COMPAT + list(STOCK_SAME_AS.values()):
        stock_jobs.append(dict(mode='ref', name=n, cfg=CONFIGS[n][0], dir=str(d/'stock'/n), out=out('stock', n)))
    stock_jobs.append(dict(mode='stockload', name='stockload', cfg=CONFIGS[ERR_CFG][0], ckpt='rp', dir=err_dir, out=out('stockload')))
    times = {}
    t = time.time()
    rc,log = forker.run(SCRIPT, jobs('first', first), timeout=150)
    check_rc((rc, log, ''), 'first process (reference + stop runs)')
    times['first'] = time.time()-t; t = time.time()
    marker = d/'evil_ran'
    p3 = stock.start(dict(script=SCRIPT, args=[jobs('stock', stock_jobs), '--stock']))  # beside the second process
    p2 = forker.start(SCRIPT, jobs('second', second), env=dict(EVIL_MARKER=str(marker)))
    try: r2 = (*p2.communicate(timeout=150), )
    except subprocess.TimeoutExpired: r2 = (f'[forked] killed after 150s timeout', '')
    r3 = (*p3.result(150)[0], '')
    times['second+stock'] = time.time()-t
    check_rc((p2.returncode, *r2), 'second process (resume runs)'); check_rc(r3, 'stock fastai process')
    print('process times', times)
    return dict(dir=d, out=out, evil_marker=marker, err_ckpt=Path(err_dir)/'models'/'rp.pth')

def _get(f):
    r = load_result(f)
    assert 'error' not in r, r['error']
    return r

@pytest.mark.parametrize('name,at', SCENARIOS, ids=[_sid(*s) for s in SCENARIOS])
def test_resume_exact(results, name, at):
    "Resumed in a new process, the run ends bitwise where the uninterrupted run ends; no batch trained twice or skipped"
    out = results['out']
    ref,stop,got = _get(out('ref', name)),_get(out('stop', _sid(name, at))),_get(out('resume', _sid(name, at)))
    diffs = compare_results(ref, got)
    assert not diffs, f"{len(diffs)} differences, first:\n" + '\n'.join(diffs[:10])
    assert stop['steps'] + got['steps'] == ref['steps'], (stop['steps'], got['steps'], ref['steps'])

@pytest.mark.parametrize('name', STOCK_COMPAT)
def test_stock_compat(results, name):
    "An ordinary run with the package imported (its callbacks present, never interrupted) is bit-identical to stock fastai"
    out = results['out']
    diffs = compare_results(_get(out('ref', name)), _get(out('stock', name)))
    assert not diffs, f"{len(diffs)} differences, first:\n" + '\n'.join(diffs[:10])

def test_seedbatches_without_item_randomness(results):
    "SeedBatches changes nothing when item transforms draw no random numbers"
    out = results['out']
    for n,s in STOCK_SAME_AS.items():
        diffs = compare_results(_get(out('ref', n)), _get(out('stock', s)))
        assert not diffs, f"{n} vs stock {s}: " + '\n'.join(diffs[:10])

def test_stock_fastai_loads_resume_file(results):
    "Stock fastai (package not imported) loads weights and optimizer of a `with_iter=True` file, without a warning"
    got = _get(results['out']('stockload'))
    ck = torch.load(results['err_ckpt'], weights_only=True)  # plain torch, weights_only: the format contract
    assert isinstance(ck['opt'].get('resume'), dict) and ck['opt']['resume']['epoch'] == ERR_AT[0]
    assert not got['warnings'], got['warnings']
    assert not diff_values(ck['model'], got['model'], 'model')
    assert not diff_values({k:v for k,v in ck['opt'].items() if k != 'resume'}, got['opt'], 'opt')

@pytest.fixture(scope='module')
def errors(results): return _get(results['out']('errors'))

@pytest.mark.parametrize('name,words', [
    ('truncated.pth', ['truncated']), ('empty.pth', ['empty']), ('corrupt.pth', ['corrupt']),
    ('text.pth', ['not a PyTorch checkpoint']), ('list.pth', ['list']),
    ('evil_zip.pth', ['refusing']), ('evil_pickle.pth', ['refusing']), ('evil_nested.pth', ['refusing'])])
def test_bad_files(results, errors, name, words):
    "Damaged, foreign and hostile files raise an error that names the file and says what is wrong; no hostile code runs"
    msg = errors[name]
    assert msg.startswith('Checkpoint'), msg  # a `CheckpointError`, e.g. `CheckpointOSError`: also what fastai raises (issue 49)
    assert errors['file_paths'][name] in msg, msg
    for w in words: assert w.lower() in msg.lower(), msg
    assert not results['evil_marker'].exists(), 'a hostile pickle ran code'

def test_mismatch_messages(errors):
    "A model or optimizer that does not match the Learner: the error says which keys/shapes differ"
    m = errors['model_mismatch']
    # a `CheckpointError` that is also the `RuntimeError` fastai's `load_state_dict` raises (issue 49)
    assert m.startswith('CheckpointRuntimeError') and 'rp.pth' in m and 'size mismatch' in m and '0.weight' in m, m
    o = errors['opt_groups_mismatch']
    assert o.startswith('CheckpointRuntimeError') and 'rp.pth' in o and 'groups' in o, o

def test_all_exports_public_names(errors):
    "`from resumable_train.all import *` brings the names a user calls"
    assert not errors['missing_from_all'], f"missing from `from resumable_train.all import *`: {errors['missing_from_all']}"

@pytest.mark.parametrize('key', list(SETUPS))
def test_other_setup_refused(errors, key):
    "A resume point from a run with another setup is refused, naming what differs, unless check_setup=False"
    m = errors[f'setup_{key}']
    assert m.startswith('CheckpointError') and 'rp.pth' in m and f'{key}:' in m and 'check_setup=False' in m, m
    assert errors[f'setup_{key}_override'] == 'NO ERROR', errors[f'setup_{key}_override']

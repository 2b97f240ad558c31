"""Invisible until it resumes (issue 37): with the package imported, a workflow that never resumes ends bit for bit as stock fastai's.

Each workflow of `invisible_script.py` (one row of the issue each) runs twice: in a child of a process that never imports the package
(`--stock`: the stock server's), and in children forked from the test process, which imported it (see forked.py). The two sides run at
the same time.
Jobs `X_b` need the files of `X_a` and run in a second process of each side; the `AUTORESUME` jobs (the package side with `AutoResume`)
run alone on the package side, then twice more, as finished scripts run again: those reruns train nothing and end as stock did.
"""
import subprocess, time
from pathlib import Path
import pytest, torch
from helpers import TESTS, load_result, package_files

SCRIPT = str(TESTS/'invisible_script.py')
ENV = dict(MPLBACKEND='Agg')  # `lr_find` plots
TIMEOUT = 120  # seconds, for each process
FIRST = ['course', 'freezeload', 'foreign', 'wdchange', 'xproc_a', 'bestfile_a', 'strict', 'withoptnone', 'persistent', 'midsave',
         'export', 'startepoch_onecycle', 'startepoch_flatcos', 'lrfind', 'pair_a', 'failures', 'failures_ar']
SECOND = ['xproc_b', 'bestfile_b', 'pair_b', 'pair_c', 'pair_d']  # in another process, after FIRST: they load files of the `_a` jobs
OTHER = ['pair_b', 'pair_c', 'pair_d']  # of those, the jobs of another script in script A's folder: run under another name
# the package side with AutoResume: run alone, then run again as finished scripts
AUTORESUME = ['autoresume_smc', 'autoresume_ft', 'autoresume_course', 'autoresume_eafp', 'autoresume_strict']
JOBS = FIRST + SECOND + AUTORESUME
RERUNS = 2
# What is compared, in this order (the first difference reported is the most telling): the job's own extras come after
FIELDS = ('error', 'steps', 'warnings', 'model', 'opt', 'values', 'losses', 'lrs', 'train_iter', 'lr', 'wd', 'requires_grad',
          'frozen_idx', 'rng')
EXTRAS = ('between', 'opt_after_load', 'suggestion', 'loaded', 'raised')
RERUN_FIELDS = ('error', 'model', 'between', 'opt', 'values')  # a rerun that trains nothing: the end state of the run, as stock's
RERUN_WARNS = {'autoresume_strict'}  # reruns that warn as stock's run did (the load with strict=False: issue 49)

def _start_stock(server, out, jobs):
    "Stock fastai's run of `jobs`, a child of the stock `server` (beside the package side); `_finish_stock` it"
    r = server.start(dict(script=SCRIPT, args=[out, *jobs, '--stock'], env=ENV))
    r.jobs = jobs
    return r

def _finish_stock(r):
    "Wait for a run of `_start_stock` at most `TIMEOUT` seconds (then killed, with its children); return (rc, output)"
    return r.result(TIMEOUT)[0]

def _results(out, jobs, rc, log, what):
    "The results of one process: a process that ended badly fails every job of it, with its output"
    assert rc == 0, f"{what} ({' '.join(jobs)}) failed with rc={rc}\n{log[-5000:]}"
    return {j: load_result(out/f'{j}.pth') for j in jobs}

@pytest.fixture(scope='module')
def runs(tmp_path_factory, request):
    "Both sides of every job; returns {'stock': {job: result}, 'package': {job: result}, 'reruns': [result, ...], 'times': ...}"
    d = tmp_path_factory.mktemp('invisible')
    (d/'stock').mkdir(); (d/'package').mkdir()
    t0,times = time.time(),{}
    server = request.getfixturevalue('stock')
    stock = _start_stock(server, d/'stock', FIRST + AUTORESUME)
    forker = request.getfixturevalue('forker')
    def package(*jobs, script=SCRIPT, env={}):
        p = forker.start(script, d/'package', *jobs, env=dict(ENV, **env))
        try: log,_ = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired: log = f'[forked] killed after {TIMEOUT}s timeout'
        return _results(d/'package', jobs, p.returncode, log, 'the package side')
    res = dict(stock={}, package={}, reruns=[], times=times)
    res['package'].update(package(*FIRST))
    pair = d/'package'/'pair'/'models'  # script A's files, which B, C and D leave as they are (issue 49)
    res['pair_files'] = [package_files(pair)]
    res['stock'].update(_results(d/'stock', stock.jobs, *_finish_stock(stock), 'the stock side'))
    times['first'] = time.time()-t0
    stock = _start_stock(server, d/'stock', SECOND)
    # scripts B, C and D: another script than A (the package tells runs apart by the script's name alone)
    res['package'].update(package(*[j for j in SECOND if j not in OTHER]))
    res['package'].update(package(*OTHER, script=str(TESTS/'another_script.py'), env={'RT_SCRIPT': Path(SCRIPT).name}))
    res['pair_files'].append(package_files(pair))
    res['pair_a_again'] = package('pair_a')['pair_a']  # A run again after them: it had finished
    res['pair_files'].append(package_files(pair))
    for j in AUTORESUME: res['package'].update(package(j))
    res['reruns'] = [{j: package(j)[j] for j in AUTORESUME} for _ in range(RERUNS)]
    res['stock'].update(_results(d/'stock', stock.jobs, *_finish_stock(stock), 'the stock side'))
    times['all'] = time.time()-t0
    print('process times', times)
    return res

def _raised(tb):
    "A traceback, its exception first: 'raised TypeError: ...' then the traceback's last lines"
    if not tb: return 'raised nothing'
    lines = tb.rstrip().splitlines()
    last_frame = max([i for i,l in enumerate(lines) if l.startswith('  File ')], default=-1)
    first = next((i for i,l in enumerate(lines) if i > last_frame and l and not l[0].isspace()), len(lines)-1)
    return f"raised {' '.join(lines[first:])}\n  ({'...' if len(tb) > 1500 else ''}{tb[-1500:]})"

def _diff(a, b, path)->list:
    "Where plain nested values differ, each as 'path: stock value vs package value' (tensors with `torch.equal`, dtype included)"
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape: return [f"{path}: stock {a.dtype}{tuple(a.shape)} vs package {b.dtype}{tuple(b.shape)}"]
        if torch.equal(a, b): return []
        ne = (a != b).nonzero()
        if not len(ne): return [f"{path}: tensors differ (NaN)"]
        i = tuple(ne[0].tolist())
        return [f"{path}: {len(ne)} of {a.numel()} elements differ, first at {list(i)}: stock {a[i].item()!r} vs package {b[i].item()!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        only = [f"{path}: keys only in stock {sorted(map(str, set(a)-set(b)))}, only in the package {sorted(map(str, set(b)-set(a)))}"]
        return (only if set(a) != set(b) else []) + [d for k in a if k in b for d in _diff(a[k], b[k], f"{path}.{k}")]
    if type(a).__name__ == 'L': a = list(a)  # fastcore's `L`
    if type(b).__name__ == 'L': b = list(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        n = [f"{path}: stock has {len(a)} items vs package {len(b)}"] if len(a) != len(b) else []
        return n + [d for i,(x,y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    comparable = type(a) == type(b) or isinstance(a, (int, float)) and isinstance(b, (int, float))
    return [] if comparable and a == b else [f"{path}: stock {a!r} vs package {b!r}"]

def _differences(ref, got, fields):
    "Where the package side differs from stock, field by field"
    out = []
    for k in fields:
        if k not in ref and k not in got: continue
        if k == 'raised': out += _raised_differently(ref[k], got[k])
        elif k == 'error' and got.get(k) != ref.get(k):
            out.append(f"error: stock {_raised(ref.get(k))} vs the package {_raised(got.get(k))}")
        elif k == 'warnings' and got.get(k) != ref.get(k):
            out.append(f"warnings: stock {ref.get(k)} vs package {got.get(k)}")
        else: out += _diff(ref.get(k), got.get(k), k)
    return out

def _raised_differently(ref:dict, got:dict)->list:
    "The failures where the package's exception is not of the type stock fastai raised (a subclass of it is: issue 49)"
    return [f"raised[{k}]: stock {(r or ['nothing'])[0]} vs package {' > '.join((got[k] or ['nothing'])[:4])}"
            for k,r in ref.items() if (r is None) != (got[k] is None) or r and r[0] not in got[k]]

def exception_table(runs)->str:
    "Issue 49's table: each failure of `learn.load`, the type stock fastai raises, the package's (without, with AutoResume)"
    ref,plain,ar = (runs[side][job]['raised'] for side,job in (('stock', 'failures'), ('package', 'failures'), ('package', 'failures_ar')))
    name = lambda r: 'nothing (warns)' if r is None else r[0]
    rows = [f"| {k} | {name(r)} | {name(plain[k])} | {name(ar[k])} |" for k,r in ref.items()]
    return '\n'.join(['| failure | stock fastai | package | package, AutoResume |', '|---|---|---|---|', *rows])

def _check_stock(job, ref):
    "The stock side is the reference: it must itself have worked"
    assert not ref['error'], f"{job}: stock fastai itself raised (a bug of the test script):\n{ref['error']}"
    if job == 'export':
        assert ref['loaded']['ok'], f"stock fastai's own export does not load (a bug of the test script):\n{ref['loaded']['error']}"

@pytest.mark.parametrize('job', JOBS)
def test_never_resumed(runs, job):
    "The package imported, a workflow that never resumes: weights, optimizer, Recorder, random states, steps, warnings all as stock"
    ref,got = runs['stock'][job],runs['package'][job]
    _check_stock(job, ref)
    if job == 'export':
        ld = got['loaded']
        assert ld['ok'] and not ld['imported'], (
            f"export: fastai alone (the package never imported) must load the Learner exported with the package imported; "
            f"load_learner {'worked' if ld['ok'] else 'failed'}, the package imported: {ld['imported'] or 'no'}\n{ld['error'] or ''}")
    diffs = _differences(ref, got, FIELDS + EXTRAS)
    assert not diffs, f"{job}: {len(diffs)} differences (stock vs package), first:\n" + '\n'.join(diffs[:8])

@pytest.mark.parametrize('job', AUTORESUME)
@pytest.mark.parametrize('n', range(1, RERUNS+1))
def test_finished_script_rerun(runs, job, n):
    "A job with AutoResume run again after its end (package side): trains nothing, ends as stock's run ended"
    ref,got = runs['stock'][job],runs['reruns'][n-1][job]
    _check_stock(job, ref)
    diffs = _differences(ref, got, RERUN_FIELDS + (('warnings',) if job in RERUN_WARNS else ()))
    if got['steps']: diffs.insert(0, f"steps: 0 expected (a finished script run again trains nothing), got {got['steps']}")
    assert not diffs, f"{job} rerun {n}: {len(diffs)} differences (stock vs package), first:\n" + '\n'.join(diffs[:8])

def test_exception_table(runs):
    "Each failure raises, with the package (and with AutoResume), a type stock fastai's `except` catches: printed as issue 49's table"
    print(exception_table(runs))
    for job in ('failures', 'failures_ar'):
        diffs = _raised_differently(runs['stock'][job]['raised'], runs['package'][job]['raised'])
        assert not diffs, f"{job}: " + '\n'.join(diffs)

def test_first_script_again(runs):
    """Issue 49: scripts B, C and D in script A's folder (another script's name), each with `AutoResume()` leave A's files byte for
    byte; A run again after them trains nothing, writes none of the package's files, and ends as stock's A"""
    first,after_bcd,after_a = runs['pair_files']
    assert first, "script A wrote its files"
    assert after_bcd == first, f"B, C and D changed A's files: {sorted(k for k in first if after_bcd.get(k) != first[k])}"
    assert after_a == first, f"A run again changed its files: {sorted(k for k in first if after_a.get(k) != first[k])}"
    ref,got = runs['stock']['pair_a'],runs['pair_a_again']
    diffs = _differences(ref, got, RERUN_FIELDS)
    if got['steps']: diffs.insert(0, f"steps: 0 expected (a finished script run again trains nothing), got {got['steps']}")
    assert not diffs, '\n'.join(diffs[:8])

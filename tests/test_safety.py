"""No silent wrong result (issues 14 and 20): fit-call identity and its ledger, checked records, changed hyperparameters, a callback added
or a model changed in the rerun, one process per run, bounded reads, file modes, export size, one Ctrl-C counted once, and the messages a
user reads.

Every run is a child forked by `forked.Forker` from this process (fastai imported once); `safety_script.py` makes two fit calls and
saves what the code between them sees.
"""
import os, re, resource, signal, subprocess, time, zipfile
from pathlib import Path
import pytest, torch
from forked import Forker
from helpers import TESTS, diff_values
from killrerun import run_until, run_to_end, batches, compare, kill_and_rerun, check_kill_and_rerun

SCRIPT = str(TESTS/'safety_script.py')
PER_CALL = 12  # 2 epochs of 6 batches

@pytest.fixture(scope='module')
def forker(): return Forker()

def between_diff(a, b)->list:
    "Where two `--between` files differ, bitwise"
    x,y = torch.load(a, weights_only=True),torch.load(b, weights_only=True)
    d = diff_values(x, y, 'between')
    sa,sb = torch.load(Path(a).with_suffix('.stage1.pth'), weights_only=True),torch.load(Path(b).with_suffix('.stage1.pth'), weights_only=True)
    return d + diff_values(sa['model'], sb['model'], 'stage1.model')

def text(lines): return ''.join(lines)

@pytest.fixture(scope='module')
def refs(forker, tmp_path_factory):
    "Uninterrupted runs: two calls, one call, and the same call twice, saving what the code between the calls saw; and two calls, plain"
    d,res = tmp_path_factory.mktemp('refs'),{}
    for name,args in (('two', []), ('one', ['--calls', '1']), ('same', ['--second', 'same']), ('plain', None)):
        (d/name).mkdir()
        args = [] if args is None else ['--between', d/f'{name}.between.pth', *args]
        lines = run_to_end(forker, SCRIPT, [d/f'{name}.pth', *args], cwd=d/name)
        res[name] = (d/f'{name}.pth', d/f'{name}.between.pth', batches(lines))
    assert len(res['two'][2]) == 2*PER_CALL and len(res['one'][2]) == PER_CALL
    return res

def test_killed_in_second_call(forker, refs, tmp_path):
    "Killed in the second fit call, rerun: the first call is skipped and leaves what it left (the code between sees it), the end is exact"
    ref,ref_between,ref_batches = refs['two']
    out,between = tmp_path/'out.pth',tmp_path/'between.pth'
    trained,snaps = kill_and_rerun(forker, SCRIPT, ['--between', between], tmp_path/'run', out, kills=[PER_CALL+3])
    check_kill_and_rerun(ref_batches, trained, snaps, ref, out)
    assert {b[0] for b in trained[1]} == {1}, "the rerun trains only the second call"
    d = between_diff(ref_between, between)
    assert not d, f"between the calls, the rerun sees another state than the uninterrupted run:\n" + '\n'.join(d[:10])

def test_keep_one_never_prunes_the_ledger(forker, refs, tmp_path):
    "keep=1: the end state of the first call survives the second call's resume points, so a rerun can still skip the first call exactly"
    ref,ref_between,ref_batches = refs['two']
    out,between = tmp_path/'out.pth',tmp_path/'between.pth'
    trained,snaps = kill_and_rerun(forker, SCRIPT, ['--between', between, '--keep', '1', '--every', '1'], tmp_path/'run', out, kills=[PER_CALL+5])
    check_kill_and_rerun(ref_batches, trained, snaps, ref, out)
    assert not between_diff(ref_between, between)
    assert len(list((tmp_path/'run'/'models').glob('autoresume-*.pth'))) == 2, "the newest resume point and the first call's end"

def test_second_call_removed(forker, refs, tmp_path):
    "Killed in the second call, then the second call is removed from the script: the rerun ends as the one-call script does"
    ref1,ref1_between,_ = refs['one']
    run,out,between = tmp_path/'run',tmp_path/'out.pth',tmp_path/'between.pth'
    run.mkdir()
    rc,_ = run_until(forker, SCRIPT, [out, '--between', between], stop_after=PER_CALL+3, cwd=run)
    assert rc == -signal.SIGKILL
    lines = run_to_end(forker, SCRIPT, [out, '--between', between, '--calls', '1'], cwd=run)
    assert batches(lines) == [], "the first call completed before"
    assert 'AutoResume: fit call 1 finished in an earlier run' in text(lines)
    d = compare(ref1, out) + between_diff(ref1_between, between)
    assert not d, '\n'.join(d[:10])

def test_fresh_process_after_calls_in_another(forker, refs, tmp_path):
    "A notebook ran the same fit cell twice; after a kernel restart, running it once gives the first call's result, twice the second's"
    run = tmp_path/'run'; run.mkdir()
    run_to_end(forker, SCRIPT, [tmp_path/'a.pth', '--second', 'same', '--between', tmp_path/'a.between.pth'], cwd=run)
    lines = run_to_end(forker, SCRIPT, [tmp_path/'b.pth', '--calls', '1', '--between', tmp_path/'b.between.pth'], cwd=run)
    assert batches(lines) == []
    assert not compare(refs['one'][0], tmp_path/'b.pth') and not between_diff(refs['one'][1], tmp_path/'b.between.pth')
    lines = run_to_end(forker, SCRIPT, [tmp_path/'c.pth', '--second', 'same', '--between', tmp_path/'c.between.pth'], cwd=run)
    assert batches(lines) == [] and not compare(refs['same'][0], tmp_path/'c.pth')
    assert "the last the run's files hold, and nothing is trained: a fit call after it trains on" in text(lines)

def test_ctrl_c_then_same_fit_in_same_process(forker, refs, tmp_path):
    """Ctrl-C in a fit call, then the same call again in the same process (a notebook cell re-run): a new fit call, as in stock
    fastai (issue 60: one rule); the kernel restarted (a new process) and the call made once: continues exactly, no batch twice"""
    ref,_,ref_batches = refs['plain']
    run = tmp_path/'run'; run.mkdir()
    lines = run_to_end(forker, SCRIPT, [tmp_path/'out.pth', '--sigint-at', 7], cwd=run)
    t = text(lines)
    assert 'INTERRUPTED' in t and 'AutoResume: stopped by SIGINT at epoch 2/2, batch 1/6' in t, t[-2000:]
    trained = [b[1:] for b in batches(lines)]
    assert trained == [b[1:] for b in ref_batches[:7]] + [b[1:] for b in ref_batches], "the cell run again trains its call anew"
    lines = run_to_end(forker, SCRIPT, [tmp_path/'out.pth'], cwd=run)  # the kernel restarted
    assert [b[1:] for b in batches(lines)] == [b[1:] for b in ref_batches[7:]], "the stopped call continues, each batch once"
    d = compare(ref, tmp_path/'out.pth')
    assert not d, '\n'.join(d[:10])

def test_one_sigint_to_a_group_counts_once(forker, refs, tmp_path):
    "SIGINT delivered twice within a moment (a kill to a process group, a timeout wrapper) is one Ctrl-C: the batch is saved"
    ref,_,ref_batches = refs['plain']
    run = tmp_path/'run'; run.mkdir()
    p,lines,n = forker.start(SCRIPT, tmp_path/'out.pth', cwd=run, env={'KILLRERUN_SLEEP': '0.05'}),[],0
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith('BATCH ') and (n := n+1) == 4:
                os.killpg(p.pid, signal.SIGINT); os.killpg(p.pid, signal.SIGINT)
        p.wait(60)
    finally: p.kill_group()
    t = text(lines)
    assert p.returncode == -signal.SIGINT and 'AutoResume: stopped by SIGINT at epoch 1/2, batch 4/6; resume point saved' in t, t[-2000:]
    lines = run_to_end(forker, SCRIPT, [tmp_path/'out.pth'], cwd=run)
    assert batches(lines) == ref_batches[4:]
    assert not compare(ref, tmp_path/'out.pth')

def tamper(f, **fields):
    "Rewrite the record of `f` with `fields` changed (`a.b` for a nested field); the file stays checksum-valid"
    st = torch.load(f, weights_only=True)
    for k,v in fields.items():
        *path,last = k.split('.')
        o = st['opt']['resume']
        for p in path: o = o[p]
        o[last] = v
    torch.save(st, f)

BAD = {'epoch': 10**9, 'iter': '3', 'pct_train': 2.0, 'train_iter': -1, 'setup.n_iter': 'x', 'fits': [], 'hypers': [{'lr': 'fast'}]}

@pytest.mark.parametrize('field', list(BAD))
def test_crafted_record(forker, refs, tmp_path, field):
    "A checksum-valid resume point whose record is out of range or of a wrong type is skipped with a warning naming file and field"
    ref,_,ref_batches = refs['plain']
    run,out = tmp_path/'run',tmp_path/'out.pth'
    run.mkdir()
    rc,_ = run_until(forker, SCRIPT, [out], stop_after=5, cwd=run)
    assert rc == -signal.SIGKILL
    newest = sorted((run/'models').glob('autoresume-*.pth'))[-1]
    tamper(newest, **{field: BAD[field]})
    lines = run_to_end(forker, SCRIPT, [out], cwd=run)
    t = text(lines)
    assert re.search(rf"{re.escape(str(newest.name))} holds a damaged resume record \(`{re.escape(field)}", t), t[-3000:]
    assert 'skipping it' in t and 'Traceback' not in t
    assert not compare(ref, out)

def test_keep_zero_refused(forker, tmp_path):
    rc,lines = run_until(forker, SCRIPT, [tmp_path/'out.pth', '--keep', '0'], cwd=tmp_path)
    assert rc != 0 and 'keep at least 1 resume point' in text(lines)

def test_changed_lr(forker, refs, tmp_path):
    "A changed learning rate is named when continuing; strict_hypers refuses and leaves the files as they were"
    run,out = tmp_path/'run',tmp_path/'out.pth'
    run.mkdir()
    rc,_ = run_until(forker, SCRIPT, [out], stop_after=5, cwd=run)
    assert rc == -signal.SIGKILL
    files = {p.name: p.read_bytes() for p in (run/'models').glob('*.pth')}
    rc,lines = run_until(forker, SCRIPT, [out, '--lr', '3e-2', '--strict'], cwd=run)
    t = text(lines)
    assert rc != 0 and 'was asked for other hyperparameters' in t and '(lr_max: saved 0.01, now 0.03)' in t, t[-2000:]
    assert 'To continue it, undo the change; to start fresh, run `resumable-train clean' in t and batches(lines) == []
    assert {p.name: p.read_bytes() for p in (run/'models').glob('*.pth')} == files
    lines = run_to_end(forker, SCRIPT, [out, '--lr', '3e-2'], cwd=run)
    assert '(lr_max: saved 0.01, now 0.03)' in text(lines) and 'matches neither run' in text(lines)

def test_two_launches_one_folder(forker, refs, tmp_path):
    "A second launch in the folder of a running one is refused at once, naming the process; with `wait` it waits, then trains nothing"
    ref = refs['plain'][0]
    run = tmp_path/'run'; run.mkdir()
    a = forker.start(SCRIPT, tmp_path/'a.pth', cwd=run, env={'KILLRERUN_SLEEP': '0.05'})
    try:
        assert next(l for l in a.stdout if l.startswith('BATCH '))
        rc,lines = run_until(forker, SCRIPT, [tmp_path/'b.pth'], cwd=run, timeout=30)
        assert rc != 0 and f"is in use: another process (pid {a.pid}" in text(lines) and batches(lines) == [], text(lines)[-2000:]
        w = forker.start(SCRIPT, tmp_path/'w.pth', '--wait', '120', cwd=run)
        a.communicate(timeout=120)
        assert a.returncode == 0
        out,_ = w.communicate(timeout=120)
        assert w.returncode == 0 and not batches(out.splitlines()), out[-2000:]
    finally: a.kill_group()
    assert not compare(ref, tmp_path/'a.pth') and not compare(ref, tmp_path/'w.pth')

def test_prefix_sharing_runs(forker, refs, tmp_path):
    "Runs `exp` and `exp-lr3` in one folder at once: neither touches the other's files; a stale temporary file is removed only by its own run"
    ref = refs['plain'][0]
    run = tmp_path/'run'; (run/'models').mkdir(parents=True)
    for n in ('.exp-0009.pth.deadbeef.tmp', '.exp-lr3-0009.pth.deadbeef.tmp'): (run/'models'/n).touch()
    env = {'KILLRERUN_SLEEP': '0.02'}
    ps = [forker.start(SCRIPT, tmp_path/f'{n}.pth', '--fname', n, '--every', '1', cwd=run, env=env) for n in ('exp', 'exp-lr3')]
    try:
        outs = [p.communicate(timeout=120)[0] for p in ps]
    finally:
        for p in ps: p.kill_group()
    assert [p.returncode for p in ps] == [0, 0], [o[-1500:] for o in outs]
    for n in ('exp', 'exp-lr3'): assert not compare(ref, tmp_path/f'{n}.pth'), n
    assert not list((run/'models').glob('.*.tmp')), "each run removed its own stale temporary file"

def test_hostile_compressed_record(forker, tmp_path):
    "A small file whose zip record expands to hundreds of MB is refused before anything is expanded: bounded memory"
    big = tmp_path/'big.pth'
    torch.save({'model': {'w': torch.zeros(100_000_000)}, 'opt': {'state': [], 'hypers': []}}, big)
    bomb = tmp_path/'models'/'autoresume-0001.pth'
    bomb.parent.mkdir()
    with zipfile.ZipFile(big) as zin, zipfile.ZipFile(bomb, 'w') as zout:
        for i in zin.infolist(): zout.writestr(i.filename, zin.read(i), compress_type=zipfile.ZIP_DEFLATED)
    big.unlink()
    assert bomb.stat().st_size < 2_000_000
    probe = tmp_path/'probe.py'
    probe.write_text(f"""import resource, sys
from resumable_train.files import read_checkpoint, CheckpointError
def rss_kb(): return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])
before = rss_kb()
try: read_checkpoint({str(bomb)!r}); print('LOADED')
except CheckpointError as e: print('REFUSED', e)
print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
""")
    rc,out = forker.run(str(probe), timeout=60)
    assert rc == 0 and 'REFUSED' in out and 'holds compressed records' in out, out
    assert int(out.split('PEAK_KB')[1]) < 50_000, f"reading the 400 MB bomb raised the peak memory by {out.split('PEAK_KB')[1].strip()} kB"

def test_file_modes(forker, tmp_path):
    "Resume points follow the umask, as torch.save's files do"
    for umask,mode in (('022', 0o644), ('077', 0o600)):
        run = tmp_path/umask; run.mkdir()
        run_to_end(forker, SCRIPT, [tmp_path/'out.pth', '--calls', '1', '--umask', umask], cwd=run)
        modes = {oct(p.stat().st_mode & 0o777) for p in (run/'models').glob('*.pth')}
        assert modes == {oct(mode)}, (umask, modes)

def test_export_size(forker, tmp_path):
    "learn.export after a run with AutoResume is the size of stock fastai's (no resume record carried along)"
    sizes = {}
    for name,args in (('stock', ['--no-resume']), ('auto', [])):
        run = tmp_path/name; run.mkdir()
        run_to_end(forker, SCRIPT, [tmp_path/f'{name}.pth', '--export', tmp_path/f'{name}.pkl', *args], cwd=run)
        sizes[name] = (tmp_path/f'{name}.pkl').stat().st_size
    assert sizes['auto'] - sizes['stock'] < 3000, sizes

def test_messages_numbered_as_the_bar(forker, refs, tmp_path):
    "With a progress bar on a terminal, the stop message starts on its own line; every message numbers epochs and batches as the bar does"
    run = tmp_path/'run'; run.mkdir()
    p,lines,n = forker.start(SCRIPT, tmp_path/'out.pth', '--bar', cwd=run, env={'KILLRERUN_SLEEP': '0.05'}),[],0
    try:
        for line in p.stdout:  # the bar has no line ends: a batch's report starts inside the bar's line
            lines.append(line)
            if 'BATCH ' in line and (n := n+1) == PER_CALL+3: p.send_signal(signal.SIGTERM)
        p.wait(60)
    finally: p.kill_group()
    t = text(lines)
    assert p.returncode == 128 + signal.SIGTERM, t[-2000:]
    stop = [l for l in t.split('\n') if 'AutoResume: stopped' in l]
    assert stop == ['AutoResume: stopped by SIGTERM at epoch 1/2, batch 3/6; resume point saved, run the same command again to continue'], stop
    before = t.split('AutoResume: stopped')[0]
    assert before.endswith('\n') and '[3/6 ' in before[:-1].rsplit('\n', 1)[-1], "the message follows the bar's line, which shows 3/6"
    lines = run_to_end(forker, SCRIPT, [tmp_path/'out.pth'], cwd=run)
    assert 'AutoResume: fit call 1 finished in an earlier run' in text(lines)
    assert re.search(r'AutoResume: continuing from \S+autoresume-\d+\.pth \(fit call 2, epoch 1/2, batch 3/6\)', text(lines)), text(lines)[-2000:]

def test_missing_ledger_end_refused(forker, tmp_path):
    "The end state of a completed call deleted by hand: the call cannot be skipped exactly, so the rerun is refused, saying how to start fresh"
    run,out = tmp_path/'run',tmp_path/'out.pth'
    run.mkdir()
    rc,_ = run_until(forker, SCRIPT, [out], stop_after=PER_CALL+3, cwd=run)
    assert rc == -signal.SIGKILL
    newest = sorted((run/'models').glob('autoresume-*.pth'))[-1]
    end0 = run/'models'/torch.load(newest, weights_only=True)['opt']['resume']['ends'][0]
    end0.unlink()
    rc,lines = run_until(forker, SCRIPT, [out], cwd=run)
    t = text(lines)
    assert rc != 0 and batches(lines) == [], t[-2000:]
    assert f'fit call 1 is in the run\'s journal, but the file it names cannot be loaded: models/{end0.name} does not exist' in t, t[-2000:]
    assert 'To start fresh, run `resumable-train clean models --fname autoresume`' in t

def refused_rerun(forker, run, out, *args)->str:
    "Kill the script after 5 batches, then run it again with `args`: refused before any batch; returns its output"
    run.mkdir()
    rc,_ = run_until(forker, SCRIPT, [out], stop_after=5, cwd=run)
    assert rc == -signal.SIGKILL
    rc,lines = run_until(forker, SCRIPT, [out, *args], cwd=run)
    t = text(lines)
    assert rc != 0 and batches(lines) == [], t[-2000:]
    return t

@pytest.mark.parametrize('cb,key', [('early', 'early_stopping'), ('csv', 'csv_logger')])
def test_callback_added_in_rerun(forker, refs, tmp_path, cb, key):
    "A callback with state added only in the rerun is refused before any batch, naming it and how to accept it; accepted, the run goes on"
    run,out = tmp_path/'run',tmp_path/'out.pth'
    t = refused_rerun(forker, run, out, '--add-cb', cb)
    assert f"This Learner has callbacks with a state that the resume point does not hold: ['{key}']" in t, t[-2000:]
    assert f"accept them with fresh_callbacks=['{key}']" in t, t[-2000:]
    lines = run_to_end(forker, SCRIPT, [out, '--add-cb', cb, '--fresh', key], cwd=run)
    assert batches(lines)[0] == (0, 0, 4), "accepted, the run continues from its resume point"

@pytest.mark.parametrize('args,diff', [(['--act', 'gelu'], "model 0.1: saved ReLU(), now GELU(approximate='none')"),
                                       (['--p', '0.5'], 'model 0.2: saved Dropout(p=0.2, inplace=False), now Dropout(p=0.5, inplace=False)')])
def test_model_changed_in_rerun(forker, refs, tmp_path, args, diff):
    "A model with the same parameter shapes but another activation or dropout is another run: refused, naming the module that differs"
    run,out = tmp_path/'run',tmp_path/'out.pth'
    t = refused_rerun(forker, run, out, *args)
    assert f'holds resume points of a different run (fit call 1 {diff})' in t and 'To start fresh, run `resumable-train clean models --fname autoresume`' in t, t[-2000:]

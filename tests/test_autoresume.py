"Kill a training script that uses AutoResume (SIGKILL, SIGTERM, during a write), rerun it: it ends bitwise where an uninterrupted run ends."
import random, re, signal, sys
from pathlib import Path
import pytest, torch
import killrerun as kr
from helpers import TESTS, diff_values, package_files, run

SCRIPT = str(TESTS/'autoresume_script.py')
CLI = str(Path(sys.executable).parent/'resumable-train')

FORKER = None  # set by the `_forker` fixture: the script runs in children forked from the test process (see forked.py)

@pytest.fixture(scope='module', autouse=True)
def _forker(forker):
    global FORKER
    FORKER = forker

def run_until(d, out, pred, sig, *args, timeout=90, script=SCRIPT):
    "Run `script` in folder `d` until an output line satisfies `pred`, then send `sig` (none if `None`); return (rc, lines)"
    return kr.run_until(FORKER, script, ['--dir', d, '--out', out, *args], sig=sig, until=pred, timeout=timeout, env=OTHER)

def run_to_end(d, out, *args, script=SCRIPT):
    "Run `script` to its end; return its output lines"
    rc,lines = run_until(d, out, None, None, *args, script=script)
    assert rc == 0, f"rc={rc}\n{''.join(lines[-40:])}"
    return lines

def batches(lines): return [l.split()[1:] for l in lines if l.startswith('BATCH')]

def same(ref, f):
    a,b = torch.load(ref, weights_only=True),torch.load(f, weights_only=True)
    bad = diff_values({k:a[k] for k in ('model','opt','values','losses')}, {k:b[k] for k in ('model','opt','values','losses')})
    assert not bad, bad[:10]

def csv_rows(d): return [l.rsplit(',', 1)[0] for l in (Path(d)/'history.csv').read_text().splitlines()]

@pytest.fixture(scope='module')
def refs(stock, tmp_path_factory):
    "Uninterrupted runs of each schedule, with AutoResume and as stock fastai in a process that never imports the package (the same bits)"
    d = tmp_path_factory.mktemp('ref')
    res = {}
    for sched in ('one_cycle', 'fine_tune', 'two'):
        res[sched] = d/f'{sched}.pth'
        lines = run_to_end(d/sched, res[sched], '--sched', sched)
        res[sched+'_batches'] = len(batches(lines))
        res[sched+'_csv'] = csv_rows(d/sched)
        plain = d/f'{sched}-stock'
        rc,out = stock.run(SCRIPT, '--dir', plain, '--out', f'{plain}.pth', '--sched', sched, '--no-resume', timeout=90)
        assert rc == 0, f"stock fastai exited {rc}:\n{out[-3000:]}"
        same(f'{plain}.pth', res[sched])
    return res

def test_kills_one_cycle(refs, tmp_path):
    "SIGKILL at a random batch, SIGKILL during a checkpoint write, a truncated newest file, SIGTERM, rerun, rerun after the end"
    d,out,rng = tmp_path/'run',tmp_path/'out.pth',random.Random(0)
    k1 = rng.randrange(2, 10)
    rc,lines = run_until(d, out, lambda l: l.startswith('BATCH') and int(l.split()[3]) + 6*int(l.split()[2]) >= k1, signal.SIGKILL, '--sleep', '0.05')
    assert rc == -signal.SIGKILL
    rc,lines = run_until(d, out, lambda l: l.startswith('WRITING'), signal.SIGKILL, '--slow-write', '5')
    assert rc == -signal.SIGKILL and any(l.startswith('AutoResume: continuing') for l in lines)
    models = d/'models'
    assert list(models.glob('.autoresume-*.tmp')), "the interrupted write leaves only a temporary file"
    newest = sorted(models.glob('autoresume-*.pth'))[-1]
    newest.write_bytes(newest.read_bytes()[:1000])
    rc,lines = run_until(d, out, lambda l: l.startswith('BATCH') and l.split()[2] == '2', signal.SIGTERM, '--sleep', '0.05')
    text = ''.join(lines)
    assert rc == 128 + signal.SIGTERM, (rc, text[-2000:])   # how long it takes is measured in benchmarks/sigterm.py
    assert f'{newest} is truncated' in text, "the rerun names the damaged file it passed over"
    stop = [l for l in lines if l.startswith('AutoResume: stopped by SIGTERM')][0]
    m = re.search(r'at epoch (\d+)/4, batch (\d+)/6;', stop) or re.search(r'at end of epoch (\d+)/4;()', stop)
    ep,bt = (int(m.group(1))-1, int(m.group(2))) if m.group(2) else (int(m.group(1)), 0)
    lines = run_to_end(d, out)
    assert batches(lines)[0] == ['0', str(ep), str(bt)], "the rerun starts at the batch after the one SIGTERM finished"
    assert len(batches(lines)) == refs['one_cycle_batches'] - (ep*6 + bt)
    same(refs['one_cycle'], out)
    assert csv_rows(d) == refs['one_cycle_csv']
    lines = run_to_end(d, out)
    assert batches(lines) == [] and torch.load(out, weights_only=True)['steps'] == 0
    same(refs['one_cycle'], out)

def test_fine_tune_background(refs, tmp_path):
    "fine_tune killed in each stage, writing in the background: the rerun resumes in the right fit call"
    d,out = tmp_path/'run',tmp_path/'out.pth'
    for fit in ('0', '1'):
        rc,lines = run_until(d, out, lambda l, f=fit: l.startswith('BATCH') and l.split()[1] == f and l.split()[3] == '4',
                               signal.SIGKILL, '--sched', 'fine_tune', '--background', '--sleep', '0.05')
        assert rc == -signal.SIGKILL
    lines = run_to_end(d, out, '--sched', 'fine_tune', '--background')
    assert batches(lines)[0][0] == '1', "the first fit call completed before and is not trained again"
    same(refs['fine_tune'], out)

def test_fit_calls_of_no_epochs(tmp_path):
    """fit(0), then fine_tune(2, freeze_epochs=0): killed in the last of the three calls, the rerun continues it exactly, and run
    again after the end it trains nothing (before: every file of such a run was 'damaged', and each rerun trained everything again)"""
    ref = tmp_path/'ref.pth'
    lines = run_to_end(tmp_path/'ref', ref, '--sched', 'zero')
    total = len(batches(lines))
    assert total == 12 and {b[0] for b in batches(lines)} == {'2'}, "12 batches, all in the third fit call"
    d,out = tmp_path/'run',tmp_path/'out.pth'
    rc,_ = run_until(d, out, lambda l: l.startswith('BATCH') and l.split()[1:4] == ['2', '1', '2'], signal.SIGKILL,
                     '--sched', 'zero', '--sleep', '0.05')
    assert rc == -signal.SIGKILL
    lines = run_to_end(d, out, '--sched', 'zero')
    text = ''.join(lines)
    assert 'damaged' not in text and any(l.startswith('AutoResume: continuing') for l in lines), text[-2000:]
    assert 0 < len(batches(lines)) <= total - 6, "continued inside the last call's second epoch, not trained again"
    same(ref, out)
    lines = run_to_end(d, out, '--sched', 'zero')
    assert batches(lines) == [] and torch.load(out, weights_only=True)['steps'] == 0
    same(ref, out)

def test_two_fits(refs, tmp_path):
    "A script with two fit_one_cycle calls, killed in the second"
    d,out = tmp_path/'run',tmp_path/'out.pth'
    rc,_ = run_until(d, out, lambda l: l.startswith('BATCH') and l.split()[1:3] == ['1', '1'], signal.SIGKILL, '--sched', 'two', '--sleep', '0.05')
    assert rc == -signal.SIGKILL
    lines = run_to_end(d, out, '--sched', 'two')
    assert {b[0] for b in batches(lines)} == {'1'}
    same(refs['two'], out)

def own_files(lines)->str:
    "The name of its files that a script in another run's folder says it keeps (issue 49)"
    said = [l for l in lines if "are another run's" in l]
    assert said, ''.join(lines)[-2000:]
    return re.search(r'keeps its own as (\S+)-\*\.pth', said[0]).group(1)

def other_script(tmp_path)->str: return str(TESTS/'another_script.py')  # script B: A's code under another script name
OTHER = {'RT_SCRIPT': 'autoresume_script.py'}  # what `another_script.py` runs

def test_second_script_in_the_folder(stock, tmp_path):
    """Issue 49: script B (another script name; another lr, another schedule) loads script A's file in A's folder, both with AutoResume: B is its own run,
    not A's continued, in files of its own; A's are left byte for byte. Uninterrupted, and killed in its second fit call then rerun, B
    ends as stock fastai's B; run again, it trains nothing; A run again trains nothing and writes nothing"""
    d,out,ref,a_out = tmp_path/'run',tmp_path/'out.pth',tmp_path/'ref.pth',tmp_path/'a.pth'
    b,B = ('--lr', '3e-3', '--sched', 'two', '--load', 'pretrained'),other_script(tmp_path)
    for f in (d, tmp_path/'ref'): run_to_end(f, a_out, '--save', 'pretrained')  # script A, in both folders
    a_files = package_files(d/'models')
    rc,o = stock.run(B, '--dir', tmp_path/'ref', '--out', ref, *b, '--no-resume', timeout=90, env=OTHER)
    assert rc == 0, o[-3000:]
    rc,lines = run_until(d, out, lambda l: l.startswith('BATCH') and l.split()[1:3] == ['1', '1'], signal.SIGKILL, *b, '--sleep', '0.05',
                         script=B)
    assert rc == -signal.SIGKILL
    lines = run_to_end(d, out, *b, script=B)
    assert {x[0] for x in batches(lines)} == {'1'} and any(l.startswith('AutoResume: continuing') for l in lines), ''.join(lines)[-2000:]
    same(ref, out)
    lines = run_to_end(d, out, *b, script=B)
    assert batches(lines) == [] and torch.load(out, weights_only=True)['steps'] == 0
    same(ref, out)
    assert package_files(d/'models') == a_files, "B left A's files as they were"
    mine = own_files(lines)
    assert (d/'models'/f'{mine}.runlog').exists() and list((d/'models').glob(f'{mine}-*.pth'))
    a_ref = torch.load(a_out, weights_only=True)
    lines = run_to_end(d, a_out, '--save', 'pretrained')  # A again: finished, it trains nothing and writes nothing of the package's
    assert batches(lines) == [] and torch.load(a_out, weights_only=True)['steps'] == 0, ''.join(lines)[-2000:]
    assert not diff_values(a_ref['model'], torch.load(a_out, weights_only=True)['model'])
    assert package_files(d/'models') == a_files

def test_killed_script_then_another(refs, stock, tmp_path):
    """Issue 49: script A killed in its second fit call, then script B (another script name, another lr) in the same folder: B trains as stock fastai's B, in
    files of its own, and leaves A's byte for byte; A run again continues exactly, as the uninterrupted A; B run again trains nothing"""
    d,a_out,b_out,ref = tmp_path/'run',tmp_path/'a.pth',tmp_path/'b.pth',tmp_path/'ref.pth'
    b,B = ('--lr', '3e-3', '--tag', 'b'),other_script(tmp_path)
    rc,o = stock.run(B, '--dir', tmp_path/'ref', '--out', ref, *b, '--no-resume', timeout=90, env=OTHER)
    assert rc == 0, o[-3000:]
    rc,_ = run_until(d, a_out, lambda l: l.startswith('BATCH') and l.split()[1:3] == ['1', '1'], signal.SIGKILL, '--sched', 'two',
                     '--sleep', '0.05')
    assert rc == -signal.SIGKILL
    a_files = package_files(d/'models')
    lines = run_to_end(d, b_out, *b, script=B)
    assert len(batches(lines)) == refs['one_cycle_batches'] and not any('continuing' in l for l in lines), ''.join(lines)[-2000:]
    same(ref, b_out)
    assert package_files(d/'models') == a_files, "B left A's files as they were"
    mine = own_files(lines)
    lines = run_to_end(d, b_out, *b, script=B)
    assert batches(lines) == [] and torch.load(b_out, weights_only=True)['steps'] == 0
    same(ref, b_out)
    lines = run_to_end(d, a_out, '--sched', 'two')
    assert {x[0] for x in batches(lines)} == {'1'} and any(l.startswith('AutoResume: continuing') for l in lines), ''.join(lines)[-2000:]
    assert not any("another run's" in l for l in lines)
    same(refs['two'], a_out)
    assert list((d/'models').glob(f'{mine}-*.pth')) and (d/'models'/f'{mine}.runlog').exists(), "A left B's files"
    rc,out,err = run([CLI, 'ls', d], 60)  # both runs, each with its identity
    assert rc == 0 and 'run autoresume (autoresume.runlog):\n  run of script autoresume_script.py\n' in out, out + err
    assert f'run {mine} ({mine}.runlog):\n  run of script another_script.py\n' in out, out
    a_files = package_files(d/'models')
    rc,out,err = run([CLI, 'clean', d, '--fname', mine], 60)  # B's files alone
    assert rc == 0 and package_files(d/'models') == a_files and not list((d/'models').glob(f'{mine}*')), out + err

def test_lr_edit_is_the_same_run(tmp_path):
    """Issue 60: `Learner(lr=)` changed after a kill is the same script edited, not another run: it continues from the newest resume
    point, the change named in one warning, as the same change in the fit call is"""
    d,out = tmp_path/'run',tmp_path/'out.pth'
    rc,_ = run_until(d, out, lambda l: l.startswith('BATCH') and l.split()[1:3] == ['1', '1'], signal.SIGKILL, '--sched', 'two', '--sleep', '0.05')
    assert rc == -signal.SIGKILL
    t = ''.join(run_to_end(d, out, '--sched', 'two', '--lr', '3e-3'))
    assert 'AutoResume: continuing' in t and 'other hyperparameters' in t and "another run's" not in t, t[-3000:]

@pytest.mark.parametrize('per_call', [False, True])
def test_cached_stage_whose_branch_sets_lr(tmp_path, per_call):
    """A stage cached with save and load, whose branch (skipped in a rerun) sets `learn.lr`, then a fit call killed and rerun: the rerun
    continues exactly, with AutoResume in the Learner or given to each fit call (issue 49: the identity is the Learner's as it was made)"""
    args = ('--sched', 'stage', *(['--per-call'] if per_call else []))
    ref,d,out = tmp_path/'ref.pth',tmp_path/'run',tmp_path/'out.pth'
    run_to_end(tmp_path/'ref', ref, *args)
    rc,_ = run_until(d, out, lambda l: l.startswith('BATCH') and l.split()[1:4] == ['1', '0', '3'], signal.SIGKILL, *args, '--sleep', '0.05')
    assert rc == -signal.SIGKILL
    lines = run_to_end(d, out, *args)
    assert any(l.startswith('AutoResume: continuing') for l in lines) and len(batches(lines)) < 12, ''.join(lines)[-2000:]
    same(ref, out)

def test_stage_puts_back_defaults_named(tmp_path):
    """Issue 60: the Learner's lr edited after a kill, in a script whose cached stage is loaded on the rerun: the stage puts back the
    lr it was saved with, as the run that saved it went on, and says so, naming both values: never undone in silence"""
    d,out = tmp_path/'run',tmp_path/'out.pth'
    rc,_ = run_until(d, out, lambda l: l.startswith('BATCH') and l.split()[1:4] == ['1', '0', '3'], signal.SIGKILL, '--sched', 'stage',
                     '--sleep', '0.05')
    assert rc == -signal.SIGKILL
    t = ''.join(run_to_end(d, out, '--sched', 'stage', '--lr', '5e-3'))
    assert ("stage1.pth is a stage of this run, saved with other Learner defaults than the script sets now (lr: the script's 0.005, "
            "the stage's 0.03;") in t and 'AutoResume: continuing' in t, t[-3000:]

def test_stage_without_autoresume_loads_as_fastai(stock, tmp_path):
    """The same script run again without `AutoResume` (the package imported) in the folder of a run that had it in the Learner: its
    `learn.load` of the run's cached stage loads as fastai's (weights and optimizer), not the run's random state and lr: stock's bits"""
    import shutil
    args = ('--sched', 'stage')
    run_to_end(tmp_path/'a', tmp_path/'a.pth', *args)
    shutil.copytree(tmp_path/'a', tmp_path/'b')
    run_to_end(tmp_path/'a', tmp_path/'mine.pth', *args, '--no-ar')
    rc,o = stock.run(SCRIPT, '--dir', tmp_path/'b', '--out', tmp_path/'stock.pth', *args, '--no-resume', timeout=90)
    assert rc == 0, o[-3000:]
    same(tmp_path/'stock.pth', tmp_path/'mine.pth')

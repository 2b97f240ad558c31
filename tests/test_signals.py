"""Signals are never lost and never leak, and the stop message tells the truth (issue 20).

`signal_script.py` signals itself at a chosen moment: during a resume point's write (periodic, epoch end, end of a fit call), during
the stop's own write (a second and a third Ctrl-C), with the writer busy or the folder refusing writes, and after `fit` ended by an
exception the code caught. Every run is a child forked by `forked.Forker`; each result is compared bitwise with an uninterrupted run,
which is bitwise stock fastai's (a child of `forked.StockForker`, which never imports the package).
"""
import re, signal
from pathlib import Path
import pytest, torch
from helpers import TESTS
from killrerun import run_until, run_to_end, batches, compare, same_as_stock

SCRIPT = str(TESTS/'signal_script.py')
PER_FIT = {'one': 12, 'fine_tune': 6}  # batches per fit call: 2 epochs, or 1, of 6 batches

def text(lines): return ''.join(lines)

def batch_count(pos:str)->int:
    "The training batches before a position as the messages write it: `epoch 2/2, batch 3/6` or `end of epoch 1/2`"
    e,b = re.fullmatch(r'epoch (\d)/2, batch (\d)/6', pos).groups() if pos.startswith('epoch') else (int(pos.split()[3][0])+1, 0)
    return (int(e)-1)*6 + int(b)

@pytest.fixture(scope='module')
def refs(forker, stock, tmp_path_factory):
    "The uninterrupted runs, each bitwise stock fastai's (`--stock`: no `AutoResume`, the package never imported)"
    d,res = tmp_path_factory.mktemp('refs'),{}
    for sched in PER_FIT:
        (d/sched).mkdir(); (d/f'{sched}-stock').mkdir()
        res[sched] = (d/f'{sched}.pth', batches(run_to_end(forker, SCRIPT, [d/f'{sched}.pth', '--sched', sched], cwd=d/sched, timeout=90)))
        rc,out = stock.run(SCRIPT, d/f'{sched}-stock.pth', '--sched', sched, '--stock', timeout=90, cwd=d/f'{sched}-stock')
        assert rc == 0, f"stock fastai exited {rc}:\n{out[-3000:]}"
        same_as_stock(d/f'{sched}-stock.pth', d/f'{sched}.pth')
    return res

def rerun_exact(forker, refs, sched, run, out, after:list):
    "Run the script again to its end in `run`: it trains exactly the batches the uninterrupted run trains after `after`, and ends as it does"
    lines = run_to_end(forker, SCRIPT, [out, '--sched', sched], cwd=run, timeout=90)
    ref,ref_batches = refs[sched]
    left = ref_batches[len(after):] if sched == 'one' else [b for b in ref_batches if b[0] >= (after[-1][0] if after else 0)][len([b for b in after if b[0] == after[-1][0]]):]
    got = batches(lines)
    assert [b[1:] for b in got] == [b[1:] for b in left], f"the rerun trained {got}, the uninterrupted run goes on with {left}"
    d = compare(ref, out)
    assert not d, f"{len(d)} differences from the uninterrupted run, first:\n" + '\n'.join(d[:10])
    assert not list(Path(run).rglob('.*.tmp')), "no temporary file is left"
    return lines

@pytest.mark.parametrize('sched,during,sig,bg', [('fine_tune', 'end0', 'SIGTERM', False), ('fine_tune', 'end0', 'SIGUSR1', True),
                                                 ('one', 'end', 'SIGTERM', False), ('one', 'epoch', 'SIGTERM', True),
                                                 ('one', 'periodic', 'SIGUSR1', False)])
def test_signal_during_a_write(forker, refs, tmp_path, sched, during, sig, bg):
    "A signal during any resume point's write stops the run at the next safe point, with 128+signal; the rerun ends exactly"
    out = tmp_path/'out.pth'
    rc,lines = run_until(forker, SCRIPT, [out, '--sched', sched, '--during', during, '--sig', sig] + (['--background'] if bg else []),
                         cwd=tmp_path, timeout=90)
    t = text(lines)
    assert 'SIGNALLED during' in t and rc == 128 + getattr(signal, sig), f"rc={rc}\n{t[-3000:]}"
    assert 'DONE' not in t, "the code after fit does not run"
    trained = batches(lines)
    if during.startswith('end'):
        assert f'AutoResume: stopped by {sig} at the end of fit call {1 if during == "end0" else len(set(b[0] for b in refs[sched][1]))}; the end state of this fit call is saved' in t, t[-2000:]
    else:
        assert f'AutoResume: stopped by {sig} at epoch' in t and 'resume point saved' in t, t[-2000:]
    rerun_exact(forker, refs, sched, tmp_path, out, trained)

@pytest.mark.parametrize('how', ['error', 'ctrl-c'])
def test_handlers_put_back(forker, tmp_path, how):
    "After `fit` ended by an exception the code caught, or by a Ctrl-C stop, SIGTERM does what it does without the package: it kills"
    args = ['--error-at', '3'] if how == 'error' else ['--stop-at', '3']
    rc,lines = run_until(forker, SCRIPT, [tmp_path/'out.pth', *args, '--catch'], cwd=tmp_path, timeout=90)
    t = text(lines)
    assert 'CAUGHT' in t and 'SURVIVED' not in t and rc == -signal.SIGTERM, f"rc={rc}\n{t[-3000:]}"

@pytest.mark.parametrize('bg', [False, True])
def test_ctrl_c_twice_during_the_stop(forker, refs, tmp_path, bg):
    "A second Ctrl-C while the stop writes says so and lets the write finish: the resume point is saved and the rerun exact"
    out = tmp_path/'out.pth'
    rc,lines = run_until(forker, SCRIPT, [out, '--stop-at', '5', '--presses', '1'] + (['--background'] if bg else []), cwd=tmp_path, timeout=90)
    t = text(lines)
    assert rc == -signal.SIGINT and 'still writing the resume point to stop at; interrupt once more to abandon it' in t, f"rc={rc}\n{t[-3000:]}"
    assert 'AutoResume: stopped by SIGINT at epoch 1/2, batch 5/6; resume point saved' in t and 'Segmentation' not in t, t[-3000:]
    rerun_exact(forker, refs, 'one', tmp_path, out, batches(lines))

def test_ctrl_c_three_times_during_the_stop(forker, refs, tmp_path):
    "A third Ctrl-C abandons the stop's write: its temporary file is removed, the message names the resume point a rerun continues from"
    out = tmp_path/'out.pth'
    rc,lines = run_until(forker, SCRIPT, [out, '--stop-at', '5', '--presses', '2'], cwd=tmp_path, timeout=90)
    t = text(lines)
    assert rc == -signal.SIGINT and 'abandoning the resume point being written' in t, f"rc={rc}\n{t[-3000:]}"
    assert 'resume point saved' not in t, t[-3000:]
    assert 'AutoResume: stopped by SIGINT at epoch 1/2, batch 5/6; no resume point was written there: a rerun continues from models/autoresume-' in t
    assert '(epoch 1/2, batch 4/6)' in t, t[-3000:]
    rerun_exact(forker, refs, 'one', tmp_path, out, batches(lines)[:4])

@pytest.mark.parametrize('case', ['busy', 'read-only'])
def test_stop_without_its_resume_point(forker, refs, tmp_path, case):
    "The writer busy past `stop_wait`, or a folder that refuses the write: the stop says no resume point was saved, and which one a rerun uses"
    out = tmp_path/'out.pth'
    args = ['--busy', '--background', '--stop-wait', '0.2'] if case == 'busy' else ['--stop-at', '5', '--fail-stop']
    rc,lines = run_until(forker, SCRIPT, [out, *args], cwd=tmp_path, timeout=90)
    t = text(lines)
    assert rc == (128 + signal.SIGTERM if case == 'busy' else -signal.SIGINT), f"rc={rc}\n{t[-3000:]}"
    pos = r'(epoch \d/2, batch \d/6|end of epoch \d/2)'
    m = re.search(rf'AutoResume: stopped by SIG\w+ at {pos}; no resume point was written there: a rerun continues from models/autoresume-\d+\.pth \({pos}\)', t)
    assert m and 'resume point saved' not in t, t[-3000:]
    stop,kept = batch_count(m.group(1)),batch_count(m.group(2))
    assert kept < stop and (case == 'busy' or kept == 4), (stop, kept)
    rerun_exact(forker, refs, 'one', tmp_path, out, batches(lines)[:kept])

"""A notebook cell interrupted (Ctrl-C, or an exception) and run again in the same process makes new fit calls, as in stock fastai
(issue 60: one rule, no cell inference); the kernel restarted (a new process) and the cell run as before, the interrupted call continues
and the result is the uninterrupted cell's, bit for bit.

`cell_script.py` stands for the notebook: its cell is run (by IPython, or as code a script runs), interrupted at a chosen batch (Ctrl-C
or a caught exception), and run again. Every run is a child forked by `forked.Forker`. Each uninterrupted cell is bitwise the same
cell run by stock fastai (a child of `forked.StockForker`, which never imports the package).
"""
import pytest, torch
from forked import Forker
from helpers import TESTS
from killrerun import run_until, run_to_end, batches, compare, same_as_stock

SCRIPT = str(TESTS/'cell_script.py')
PER_CALL = 6  # 1 epoch of 6 batches

@pytest.fixture(scope='module')
def forker(): return Forker()

def text(lines): return ''.join(lines)
def steps(out): return torch.load(out, weights_only=True)['steps']

@pytest.fixture(scope='module')
def refs(forker, stock, tmp_path_factory):
    """The uninterrupted cell of each kind, run once (the one-call cell three times: three fit calls in turn, as stock fastai makes
    them), each bitwise the same cell run by stock fastai"""
    d,res = tmp_path_factory.mktemp('refs'),{}
    for cell,runs in (('two', 1), ('same', 1), ('loop', 1), ('fine_tune', 1), ('one', 3)):
        (d/cell).mkdir(); (d/f'{cell}-stock').mkdir()
        lines = run_to_end(forker, SCRIPT, [d/f'{cell}.pth', '--cell', cell, '--runs', runs], cwd=d/cell, timeout=90)
        res[cell] = d/f'{cell}.pth'
        assert len(batches(lines)) == steps(res[cell]) == (2*PER_CALL if cell != 'one' else 3*PER_CALL)
        rc,out = stock.run(SCRIPT, d/f'{cell}-stock.pth', '--cell', cell, '--runs', runs, '--stock', timeout=90, cwd=d/f'{cell}-stock')
        assert rc == 0, f"stock fastai exited {rc}:\n{out[-3000:]}"
        same_as_stock(d/f'{cell}-stock.pth', res[cell])
    return res

CASES = [(cell, stop, at, False) for cell in ('two', 'fine_tune') for stop in ('sigint', 'error') for at in (3, PER_CALL+3)]
CASES += [('two', 'error', PER_CALL+1, False), ('same', 'sigint', PER_CALL+2, False), ('loop', 'sigint', PER_CALL+2, False), ('loop', 'error', 2, False)]
CASES += [('two', 'sigint', PER_CALL+3, True), ('same', 'error', PER_CALL+2, True), ('loop', 'sigint', PER_CALL+2, True), ('fine_tune', 'error', 3, True)]
CASES += [('one', 'sigint', 2*PER_CALL+3, False), ('one', 'error', 2*PER_CALL+3, True)]

@pytest.mark.parametrize('cell,stop,at,ipython', CASES)
def test_cell_run_again(forker, refs, tmp_path, cell, stop, at, ipython):
    """Interrupted at batch `at` of the process: the cell run again in that process trains its calls anew, as stock fastai does; the
    kernel restarted and the cell run as before: the uninterrupted cell's bits, each batch trained once more at most"""
    out,runs,ipy = tmp_path/'out.pth',3 if cell == 'one' else 1,['--ipython']*ipython
    per_run = 2*PER_CALL if cell != 'one' else PER_CALL
    lines = run_to_end(forker, SCRIPT, [out, '--cell', cell, '--stop', stop, '--at', at, '--runs', runs] + ipy, cwd=tmp_path, timeout=90)
    t = text(lines)
    assert 'INTERRUPTED' in t and 'REFUSED' not in t, t[-3000:]
    if stop == 'sigint':  # how to continue, said where it is done (issue 61): in IPython the kernel lives on
        said = 'restart the kernel and run the notebook again to continue' if ipython else 'run the same command again to continue'
        assert said in t, t[-3000:]
    # the interrupted run's batches, then the cell's calls trained anew from the Learner as the interruption left it
    assert steps(out) == at + per_run*(runs - (at-1)//per_run), f"{steps(out)} optimizer steps in the process:\n{t[-3000:]}"
    lines = run_to_end(forker, SCRIPT, [out, '--cell', cell, '--runs', runs] + ipy, cwd=tmp_path, timeout=90)  # the kernel restarted
    t = text(lines)
    again = 0 if stop == 'sigint' else 1  # Ctrl-C saves the batch it stops at; an exception loses the batch it happened in
    n = runs*per_run
    assert steps(out) <= n - at + again + 1, f"{steps(out)} optimizer steps after the restart, of {n}:\n{t[-3000:]}"
    d = compare(refs[cell], out)
    assert not d, f"{len(d)} differences from the uninterrupted cell, first:\n" + '\n'.join(d[:10]) + '\n' + t[-3000:]

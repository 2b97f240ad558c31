"""A notebook cell re-run in the same process after an interruption (issue 20): the completed calls' end states are loaded in turn,
the interrupted call continues, and the result is the uninterrupted run's, bit for bit; or the call is refused, saying why.

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
    "Interrupted at batch `at` of the process, the cell run again ends as the uninterrupted cell, each batch trained once more at most"
    out,runs = tmp_path/'out.pth',3 if cell == 'one' else 1
    lines = run_to_end(forker, SCRIPT, [out, '--cell', cell, '--stop', stop, '--at', at, '--runs', runs] + ['--ipython']*ipython, cwd=tmp_path, timeout=90)
    t = text(lines)
    assert 'INTERRUPTED' in t, t[-3000:]
    again = 0 if stop == 'sigint' else 1  # Ctrl-C saves the batch it stops at; an exception loses the batch it happened in
    n = runs*2*PER_CALL if cell != 'one' else runs*PER_CALL
    assert steps(out) == n + again, f"{steps(out)} optimizer steps, the uninterrupted cell makes {n}:\n{t[-3000:]}"
    d = compare(refs[cell], out)
    assert not d, f"{len(d)} differences from the uninterrupted cell, first:\n" + '\n'.join(d[:10]) + '\n' + t[-3000:]
    if cell != 'one' and at > PER_CALL: assert 'AutoResume: fit call 1 finished before the interruption' in t, t[-3000:]

@pytest.mark.parametrize('ipython', [False, True])
def test_other_cell_refused(forker, tmp_path, ipython):
    "After an interruption in fit call 2, a cell whose first call is none of the interrupted cell's calls is refused, saying why"
    rc,lines = run_until(forker, SCRIPT, [tmp_path/'out.pth', '--cell', 'two', '--stop', 'sigint', '--at', PER_CALL+3, '--again', 'fine_tune']
                         + ['--ipython']*ipython, cwd=tmp_path, timeout=90)
    t = text(lines)
    assert rc == 3 and 'REFUSED' in t, t[-3000:]
    assert 'fit call 2 was interrupted in this process, and this fit call is none of the calls that running its cell again makes (fit calls 1 to 2)' in t
    assert 'it differs from fit call 2 (called from' in t and 'Run the cell again as it was to continue' in t, t[-3000:]

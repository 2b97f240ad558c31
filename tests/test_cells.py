"""A notebook cell re-run in the same process after an interruption (issue 20): the completed calls' end states are loaded in turn,
the interrupted call continues, and the result is the uninterrupted run's, bit for bit; or the call is refused, saying why.

`cell_script.py` stands for the notebook: its `cell()` is run, interrupted at a chosen batch (Ctrl-C or a caught exception), and run
again. Every run is a child forked by `forked.Forker`.
"""
import pytest, torch
from forked import Forker
from helpers import TESTS
from killrerun import run_to_end, batches, compare

SCRIPT = str(TESTS/'cell_script.py')
PER_CALL = 6  # 1 epoch of 6 batches

@pytest.fixture(scope='module')
def forker(): return Forker()

def text(lines): return ''.join(lines)
def steps(out): return torch.load(out, weights_only=True)['steps']

@pytest.fixture(scope='module')
def refs(forker, tmp_path_factory):
    "The uninterrupted cell of each kind"
    d,res = tmp_path_factory.mktemp('refs'),{}
    for cell in ('two', 'same', 'loop', 'fine_tune'):
        (d/cell).mkdir()
        lines = run_to_end(forker, SCRIPT, [d/f'{cell}.pth', '--cell', cell], cwd=d/cell, timeout=90)
        res[cell] = d/f'{cell}.pth'
        assert len(batches(lines)) == steps(res[cell]) == 2*PER_CALL
    return res

CASES = [(cell, stop, at) for cell in ('two', 'fine_tune') for stop in ('sigint', 'error') for at in (3, PER_CALL+3)]
CASES += [('two', 'error', PER_CALL+1), ('same', 'sigint', PER_CALL+2), ('loop', 'sigint', PER_CALL+2), ('loop', 'error', 2)]

@pytest.mark.parametrize('cell,stop,at', CASES)
def test_cell_run_again(forker, refs, tmp_path, cell, stop, at):
    "Interrupted at batch `at` of the process, the cell run again ends as the uninterrupted cell, each batch trained once more at most"
    out = tmp_path/'out.pth'
    lines = run_to_end(forker, SCRIPT, [out, '--cell', cell, '--stop', stop, '--at', at], cwd=tmp_path, timeout=90)
    t = text(lines)
    assert 'INTERRUPTED' in t, t[-3000:]
    again = 0 if stop == 'sigint' else 1  # Ctrl-C saves the batch it stops at; an exception loses the batch it happened in
    assert steps(out) == 2*PER_CALL + again, f"{steps(out)} optimizer steps, the uninterrupted cell makes {2*PER_CALL}:\n{t[-3000:]}"
    d = compare(refs[cell], out)
    assert not d, f"{len(d)} differences from the uninterrupted cell, first:\n" + '\n'.join(d[:10]) + '\n' + t[-3000:]
    if at > PER_CALL: assert 'AutoResume: fit call 1 finished before the interruption' in t, t[-3000:]

"""Kill text training at seeded batches and rerun it: a language model (AWD-LSTM hidden state, `LMDataLoader` order), a classifier trained
with ULMFiT's gradual unfreezing and with `fine_tune` (`SortedDL`): each ends bitwise where the uninterrupted run ends."""
import functools, random
import pytest
from forked import Forker, StockForker
from helpers import TESTS
from killrerun import run_to_end, batches, same_as_stock, kill_and_rerun, check_kill_and_rerun

SCRIPT = str(TESTS/'text_script.py')
TASKS = ('lm', 'ulmfit', 'fine_tune')

@pytest.fixture(scope='module')
def forker(): return Forker(modules=('fastai.basics', 'fastai.callback.all', 'fastai.text.all', 'resumable_train'))

@pytest.fixture(scope='module')
def stock():
    "Runs of the script in processes that never import the package"
    s = StockForker(modules=('fastai.basics', 'fastai.callback.all', 'fastai.text.all', 'killrerun'))
    yield s
    s.close()

def stock_run(stock, folder, out, *args):
    "The script run by stock fastai in `folder`, to `out`"
    folder.mkdir()
    rc,text = stock.run(SCRIPT, out, *args, '--no-resume', timeout=120, cwd=folder)
    assert rc == 0, f"{args}: stock fastai exited {rc}:\n{text[-3000:]}"

@pytest.fixture(scope='module')
def uninterrupted(forker, tmp_path_factory):
    "`uninterrupted(*args)`: the batches and the result of the run with `args` and `AutoResume`, made once, at the first test that asks"
    @functools.cache
    def run(*args):
        d = tmp_path_factory.mktemp('ref')
        return batches(run_to_end(forker, SCRIPT, [d/'ref.pth', *args], cwd=d)),d/'ref.pth'
    return run

@pytest.fixture(scope='module')
def refs(uninterrupted, stock, tmp_path_factory):
    """Each task run uninterrupted, with `AutoResume` and as stock fastai in a process that never imports the package (the same bits):
    its batches and its result"""
    d,res = tmp_path_factory.mktemp('stock'),{}
    for task in TASKS:
        res[task] = uninterrupted('--task', task)
        stock_run(stock, d/task, d/f'{task}.pth', '--task', task)
        same_as_stock(d/f'{task}.pth', res[task][1])
    return res

def _epoch_end(ref, b): return b == ref[-1] or ref[ref.index(b)+1][:2] != b[:2]

def _kills(ref, task):
    "Two seeded kill points: the first in the first fit call (epoch, for the language model), the second in a later one"
    rng = random.Random(TASKS.index(task))
    first = sum(b[:2] == (0, 0) if task == 'lm' else b[0] == 0 for b in ref)
    k1 = rng.randrange(2, first)
    g2 = rng.randrange(first + 4, len(ref) - 2)  # a rerun starts at most 3 batches before the last kill (every_iter=3)
    return [k1, g2 - k1 + 1]

@pytest.mark.parametrize('task', TASKS)
def test_kill_twice_and_rerun(forker, refs, task, tmp_path):
    "SIGKILL twice at seeded batches, rerun to the end: bitwise the uninterrupted run; a rerun after completion trains nothing, writes nothing"
    ref_batches,ref_out = refs[task]
    kills = _kills(ref_batches, task)
    trained,snaps = kill_and_rerun(forker, SCRIPT, ['--task', task], tmp_path/'run', tmp_path/'out.pth', kills)
    check_kill_and_rerun(ref_batches, trained, snaps, ref_out, tmp_path/'out.pth')
    stops = [t[-1] for t in trained[:len(kills)]]
    assert any(not _epoch_end(ref_batches, b) for b in stops), f"no kill inside an epoch: {stops}"
    if task != 'lm': assert stops[-1][0] >= 1, f"the second kill was not in a later fit call: {stops}"
    else: assert stops[-1][1] >= 1, f"the second kill was not in a later epoch: {stops}"

@pytest.mark.parametrize('task', TASKS + ('ulmfit_docs',))
def test_kill_between_calls(forker, uninterrupted, tmp_path, task):
    """SIGKILL at the first batch of each later fit call (after the previous call's end is written, before this call's first
    resume point), rerun: the completed calls are skipped (their end state loaded), and the result is bitwise the uninterrupted
    run's (issue 28). `ulmfit_docs` freezes, in fit call 2, layers that fit call 1 trained: their zeroed gradients are state the
    skip must load too."""
    args = ['--task', task] + (['--then'] if task == 'lm' else [])  # the language model's one fit call, and another
    ref,ref_out = uninterrupted(*args)  # `ulmfit`'s and `fine_tune`'s are the runs of `refs`
    for f in sorted({b[0] for b in ref} - {0}):
        out = tmp_path/f'out{f}.pth'
        kill = ref.index((f, 0, 0)) + 1  # every_iter=3: no resume point of call f yet
        trained,snaps = kill_and_rerun(forker, SCRIPT, args, tmp_path/f'run{f}', out, [kill])
        assert trained[0][-1] == trained[1][0] == (f, 0, 0), f"not killed at fit call {f+1}'s first batch: {trained[:2]}"
        check_kill_and_rerun(ref, trained, snaps, ref_out, out)

def test_cached_stage(forker, stock, tmp_path):
    """A language model's fit call cached with `learn.save('stage1')`, killed right after it (the stage and the call's end written, no
    resume point of the next call): the rerun loads the stage instead of training it, and ends bitwise as the uninterrupted run, which
    is stock fastai's. The `LMDataLoader`'s document order, which each epoch shuffles further, is part of the stage."""
    args = ['--task', 'lm', '--cached', '--then']
    (tmp_path/'ref').mkdir()
    ref = batches(run_to_end(forker, SCRIPT, [tmp_path/'ref.pth', *args], cwd=tmp_path/'ref'))
    assert (tmp_path/'ref'/'models'/'stage1.pth').exists()
    stock_run(stock, tmp_path/'stock', tmp_path/'stock.pth', *args)
    same_as_stock(tmp_path/'stock.pth', tmp_path/'ref.pth')
    kill = ref.index((1, 0, 0)) + 1  # every_iter=3: no resume point of the second call yet
    trained,snaps = kill_and_rerun(forker, SCRIPT, args, tmp_path/'run', tmp_path/'out.pth', [kill])
    assert trained[0][-1] == trained[1][0] == (1, 0, 0), f"not killed at the second call's first batch: {trained[:2]}"
    check_kill_and_rerun(ref, trained, snaps, tmp_path/'ref.pth', tmp_path/'out.pth')

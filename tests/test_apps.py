"""fastai's applications, a plain Dataset with workers and plain PyTorch DataLoaders, killed twice by SIGKILL with AutoResume and rerun:
bitwise the uninterrupted run, which is bitwise stock fastai's (a real process that never imports the package)."""
import random
import pytest, torch
from forked import Forker
from helpers import TESTS
import killrerun as kr

SCRIPT = str(TESTS/'apps_script.py')
APPS = ('vision', 'tabular', 'collab', 'dataset', 'torchdl')
EVERY = 3  # apps_script.py's AutoResume(every_iter=3)

@pytest.fixture(scope='module')
def forker():
    return Forker(('fastai.basics', 'fastai.callback.all', 'resumable_train', 'fastai.vision.all', 'fastai.tabular.all',
                   'fastai.collab', 'sklearn.datasets', 'apps_script'))

@pytest.fixture(scope='module')
def data(tmp_path_factory):
    import apps_script
    return str(apps_script.digits_folder(tmp_path_factory.mktemp('digits')))

@pytest.fixture(scope='module')
def stock(request, data, tmp_path_factory):
    "The apps of the selected tests run by stock fastai, without and with `--then`, in a real process of their own (started now)"
    apps = [a for a in APPS if any(getattr(i, 'callspec', None) and i.callspec.params.get('app') == a and i.module is request.module
                                   for i in request.session.items)]
    run = kr.StockRun(SCRIPT, tmp_path_factory.mktemp('stock'), '--data', data, '--apps', *apps)
    yield lambda app, then=False: run.result(f"{app}{'-then'*then}")
    run.close()

def resume_starts(ref)->set:
    "The indices in `ref` (the batches of an uninterrupted run) where a rerun can start: after every `EVERY`-th batch of a fit, and at each epoch"
    starts,n = set(),0
    for i,(f,e,it) in enumerate(ref):
        n = n+1 if i and ref[i-1][0] == f else 1
        if n % EVERY == 0: starts.add(i+1)
        if i == 0 or ref[i-1][:2] != (f,e): starts.add(i)
    return starts

@pytest.mark.parametrize('app', APPS)
def test_kill_and_rerun(forker, stock, data, tmp_path, app):
    """Uninterrupted, bitwise stock fastai; killed at two seeded random batches and rerun: same weights, optimizer state and Recorder,
    resumed at the newest resume point, finished run untouched"""
    args = [app, '--data', data]
    ref_out = tmp_path/'ref.pth'
    ref = kr.batches(kr.run_to_end(forker, SCRIPT, [ref_out, *args], cwd=tmp_path))
    kr.same_as_stock(stock(app), ref_out)
    rng = random.Random(app)
    kills = [rng.randint(EVERY+1, len(ref)//2) for _ in range(2)]  # each killed run saves a resume point
    out = tmp_path/'out.pth'
    trained,snaps = kr.kill_and_rerun(forker, SCRIPT, args, tmp_path/'run', out, kills)
    kr.check_kill_and_rerun(ref, trained, snaps, ref_out, out)
    starts = resume_starts(ref)
    for prev,nxt in zip(trained[:-2], trained[1:-1]):
        last = ref.index(prev[-1])
        newest = {max(s for s in starts if s <= last+1), max(s for s in starts if s <= last)}  # the save after the last batch may not have finished
        assert ref.index(nxt[0]) in newest, f"rerun started at {nxt[0]}, after the killed run trained up to {prev[-1]}"
    assert len(trained[-2]) < len(ref), "the killed runs saved no resume point: nothing was resumed"
    assert torch.load(out, weights_only=True)['steps'] == 0, "the rerun after completion took optimizer steps"

@pytest.mark.parametrize('app', APPS)
def test_kill_between_calls(forker, stock, data, tmp_path, app):
    """SIGKILL at the first batch of each later fit call (after the previous call's end is written, before this call's first
    resume point), rerun: the completed calls are skipped (their end state loaded), and the result is bitwise the uninterrupted
    run's (issue 28)"""
    args = [app, '--data', data, '--then']
    ref_out = tmp_path/'ref.pth'
    ref = kr.batches(kr.run_to_end(forker, SCRIPT, [ref_out, *args], cwd=tmp_path))
    kr.same_as_stock(stock(app, then=True), ref_out)
    for f in sorted({b[0] for b in ref} - {0}):
        out = tmp_path/f'out{f}.pth'
        trained,snaps = kr.kill_and_rerun(forker, SCRIPT, args, tmp_path/f'run{f}', out, [ref.index((f, 0, 0)) + 1])
        assert trained[0][-1] == trained[1][0] == (f, 0, 0), f"not killed at fit call {f+1}'s first batch: {trained[:2]}"
        kr.check_kill_and_rerun(ref, trained, snaps, ref_out, out)

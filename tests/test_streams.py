"""Streams and stateful loaders (issue 19), killed twice by SIGKILL with AutoResume and rerun: bitwise the uninterrupted run, which is
stock fastai's but for the replay opt-in (a real process that never imports the package); a stream without the replay opt-in
is refused before its first batch."""
import random
import pytest, torch
from forked import Forker
from helpers import TESTS
import killrerun as kr

SCRIPT = str(TESTS/'stream_script.py')
SOURCES = ('sdl_map', 'sdl_noisy', 'sdl_iter', 'hf_state', 'hf_long', 'hf_short', 'hf_replay', 'hf_buffer', 'gen', 'fastai_state', 'fastai_gen', 'gen_buffer', 'gen_workers', 'fastai_buffer', 'wds')
EVERY = 3  # stream_script.py's AutoResume(every_iter=3)
LIES = ('hf_long', 'hf_short')  # streams whose epochs hold 6 batches, where `len()` says 5 and 7
# Not compared with stock fastai: the replays (`AutoResume(replay=True)`, an opt-in whose streams draw apart from the training's); torchdata's
# StatefulDataLoader over a map-style dataset drawing in its workers (`sdl_noisy`) is, its workers' streams kept by `WorkerStreams`
NOT_STOCK = ('hf_replay', 'gen', 'fastai_gen', 'gen_buffer', 'gen_workers', 'fastai_buffer', 'wds')

@pytest.fixture(scope='module')
def forker():
    pytest.importorskip('torchdata'); pytest.importorskip('datasets'); pytest.importorskip('webdataset')
    return Forker(('fastai.basics', 'fastai.callback.all', 'resumable_train', 'resumable_train.autoresume', 'torchdata.stateful_dataloader',
                   'datasets', 'webdataset', 'stream_script'))

@pytest.fixture(scope='module')
def stock(tmp_path_factory):
    "The sources compared with stock fastai, trained by it in a real process of its own (started now, waited for when needed)"
    run = kr.StockRun(SCRIPT, tmp_path_factory.mktemp('stock'), '--sources', *[s for s in SOURCES if s not in NOT_STOCK])
    yield run.result
    run.close()

@pytest.mark.parametrize('source', SOURCES)
def test_kill_and_rerun(forker, stock, tmp_path, source):
    """Uninterrupted, bitwise stock fastai (but for `NOT_STOCK`); killed at two seeded random batches and rerun: same weights, optimizer
    state and Recorder; a finished run is left untouched"""
    ref_out = tmp_path/'ref.pth'
    ref = kr.batches(kr.run_to_end(forker, SCRIPT, [ref_out, source], cwd=tmp_path))
    if source not in NOT_STOCK: kr.same_as_stock(stock(source), ref_out)
    rng = random.Random(source)
    kills = [rng.choice([EVERY+1, EVERY+2]), rng.randint(EVERY+1, len(ref)//2)]  # the first rerun starts at batch 3 of the first epoch
    # a stream whose `len()` lies: killed at the last batch of the first epoch (past the 5 `hf_long` says it holds), where its
    # newest resume point is, and at the same batch of the next
    if source in LIES: kills = [6, 6]
    out = tmp_path/'out.pth'
    trained,snaps = kr.kill_and_rerun(forker, SCRIPT, [source], tmp_path/'run', out, kills)
    kr.check_kill_and_rerun(ref, trained, snaps, ref_out, out)
    assert len(trained[-2]) < len(ref), "the killed runs saved no resume point: nothing was resumed"
    assert any(t[0][2] for t in trained[1:-1] if t), "no rerun started inside an epoch"
    assert torch.load(out, weights_only=True)['steps'] == 0, "the rerun after completion took optimizer steps"

@pytest.mark.parametrize('source,args,words', [
    ('gen', ['--no-replay'], ['AutoResume(replay=True)', 'Generated']),  # a stream without the replay opt-in
    ('persistent', [], ['persistent_workers=True', 'epoch']),            # persistent workers: not even at epoch ends
    ('wds_unseeded', [], ['seed=', 'clock'])])                           # a webdataset shuffle without a seed
def test_refused_before_fit(forker, tmp_path, source, args, words):
    "A loader the package cannot resume exactly is refused at `before_fit`, with the reason and the option, before any batch is trained"
    rc,lines = kr.run_until(forker, SCRIPT, [tmp_path/'out.pth', source, *args], cwd=tmp_path)
    out = ''.join(lines)
    assert rc != 0 and not kr.batches(lines), out[-3000:]
    assert 'Traceback' not in out and all(w in out for w in words), out[-3000:]  # its message alone

"Streams and stateful loaders (issue 19), killed twice by SIGKILL with AutoResume and rerun: bitwise the uninterrupted run; a stream without the replay opt-in is refused before its first batch."
import random
import pytest, torch
from forked import Forker
from helpers import TESTS
import killrerun as kr

SCRIPT = str(TESTS/'stream_script.py')
SOURCES = ('sdl_map', 'sdl_noisy', 'sdl_iter', 'hf_state', 'hf_replay', 'hf_buffer', 'gen', 'fastai_state', 'fastai_gen', 'gen_buffer', 'gen_workers', 'fastai_buffer', 'wds')
EVERY = 3  # stream_script.py's AutoResume(every_iter=3)

@pytest.fixture(scope='module')
def forker():
    pytest.importorskip('torchdata'); pytest.importorskip('datasets'); pytest.importorskip('webdataset')
    return Forker(('fastai.basics', 'fastai.callback.all', 'resumable_train', 'resumable_train.autoresume', 'torchdata.stateful_dataloader',
                   'datasets', 'webdataset', 'stream_script'))

@pytest.mark.parametrize('source', SOURCES)
def test_kill_and_rerun(forker, tmp_path, source):
    "Killed at two seeded random batches and rerun: same weights, optimizer state and Recorder; a finished run is left untouched"
    ref_out = tmp_path/'ref.pth'
    ref = kr.batches(kr.run_to_end(forker, SCRIPT, [ref_out, source], cwd=tmp_path))
    rng = random.Random(source)
    kills = [rng.choice([EVERY+1, EVERY+2]), rng.randint(EVERY+1, len(ref)//2)]  # the first rerun starts at batch 3 of the first epoch
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

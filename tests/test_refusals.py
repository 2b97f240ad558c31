"""What a user sees when the package refuses or stops a script: its message and the fix in a few lines, no traceback through fastai;
`RESUMABLE_TRAIN_DEBUG=1` brings the traceback back. Real `python` processes: the forked children of other tests print their own."""
import os, signal, time
import pytest
from helpers import PY, TESTS, start, finish, kill_group, run

SCRIPT = str(TESTS/'refusal_script.py')

def short(err:str)->list:
    "The lines of `err` that are not Python's own warnings"
    return [l for l in err.splitlines() if l.strip() and 'Warning' not in l and not l.startswith('  warnings.warn')]

def test_refusal_is_its_message(tmp_path):
    "A finished run asked for more epochs: refused in a few lines that say how to go on, exit 1"
    rc,out,err = run([PY, SCRIPT, tmp_path, '1'], timeout=120)
    assert rc == 0 and 'DONE' in out, err[-3000:]
    rc,out,err = run([PY, SCRIPT, tmp_path, '2'], timeout=120)
    lines = short(err)
    assert rc == 1 and 'BATCH' not in out, (rc, out[-2000:], err[-3000:])
    assert len(lines) <= 3 and 'Traceback' not in err and 'Exception occured' not in err, err[-3000:]
    assert 'holds resume points of a different run (fit call 1 n_epoch: saved 1, now 2' in lines[0], lines
    assert 'add another fit call after it' in lines[0] and 'RESUMABLE_TRAIN_DEBUG=1' in lines[-1], lines
    rc,out,err = run([PY, SCRIPT, tmp_path, '2'], timeout=120, env={'RESUMABLE_TRAIN_DEBUG': '1'})
    assert rc == 1 and 'Traceback' in err and 'holds resume points of a different run' in err, err[-3000:]

@pytest.mark.parametrize('sig', ['SIGINT', 'SIGTERM', 'SIGUSR1'])
def test_stop_is_one_line(tmp_path, sig):
    "Every stop signal: one line on stdout saying where it stopped and what a rerun does; nothing on stderr, no hint, no traceback"
    p = start([PY, SCRIPT, tmp_path, '3'])
    deadline = time.monotonic() + 120
    for line in p.stdout:
        if line.startswith('BATCH 3') or time.monotonic() > deadline: break
    os.kill(p.pid, getattr(signal, sig))
    rc,out,err = finish(p, 60)
    said = [l for l in out.splitlines() if not l.startswith('BATCH')]
    # Ctrl-C ends as Python ends on it (killed by SIGINT); the others with 128 + the signal's number
    assert rc == (-signal.SIGINT if sig == 'SIGINT' else 128 + getattr(signal, sig)), (rc, err[-3000:])
    assert short(err) == [], err[-3000:]
    assert len(said) == 1 and said[0].startswith(f'AutoResume: stopped by {sig} at epoch') and 'resume point saved' in said[0], said
    assert 'run the same command again to continue' in said[0] and 'RESUMABLE_TRAIN_DEBUG' not in out + err

def test_locked_folder_is_its_message(tmp_path):
    "A second launch on the folder of a running one: refused in a few lines naming the process and the options, exit 1"
    p = start([PY, SCRIPT, tmp_path, '200'])  # 200 epochs of 8 batches paced at 0.05 s: still running when the second one starts
    try:
        deadline = time.monotonic() + 120
        for line in p.stdout:
            if line.startswith('BATCH 1') or time.monotonic() > deadline: break
        rc,out,err = run([PY, SCRIPT, tmp_path, '200'], timeout=120)
        lines = short(err)
        assert p.poll() is None, "the first run ended before the second one started"
        assert rc == 1 and 'BATCH' not in out, (rc, out[-2000:], err[-3000:])
        assert len(lines) <= 3 and 'Traceback' not in err and 'Exception occured' not in err, err[-3000:]
        assert f"is in use: another process (pid {p.pid})" in lines[0] and 'AutoResume(wait=...)' in lines[0], lines
    finally: kill_group(p)

def test_misspelled_keyword_refused(tmp_path):
    "`learn.load('mid', with_itr=False)`: a TypeError, as fastai's own `load` gives (before: ignored, and the next fit resumed)"
    code = ("from fastai.test_utils import synth_learner\nimport resumable_train.learner\n"
            f"learn = synth_learner(path={str(tmp_path)!r})\nlearn.save('mid')\nlearn.load('mid', with_itr=False)\nprint('LOADED')")
    rc,out,err = run([PY, '-c', code], timeout=120)
    assert rc == 1 and 'LOADED' not in out and "unexpected keyword argument 'with_itr'" in err, (rc, err[-2000:])

def test_full_disk_is_its_message(tmp_path):
    """A disk that fills up at the second resume point: one message (no space left on the folder, what was kept, what a rerun does),
    no torch text; the rerun, with room again, continues from the kept resume point"""
    script = str(TESTS/'full_disk_script.py')
    rc,out,err = run([PY, script, tmp_path, '3'], timeout=120, env={'FULL_AFTER': '3'})  # the first epoch's point and log are written
    lines = short(err)
    assert rc == 1 and 'DONE' not in out and 'Traceback' not in err and 'enforce fail' not in err, (rc, err[-3000:])
    models = tmp_path/'models'
    assert lines[0] == (f"no space left on {models} to write autoresume-0002.pth; nothing was written; a rerun continues from "
                        f"{models}/autoresume-0001.pth (end of epoch 1/3) once there is room"), lines
    assert len(lines) == 2 and 'RESUMABLE_TRAIN_DEBUG=1' in lines[1], lines
    rc,out,err = run([PY, script, tmp_path, '3'], timeout=120, env={'FULL_AFTER': '1000'})
    assert rc == 0 and f'AutoResume: continuing from {models}/autoresume-0001.pth' in out and 'DONE' in out, (rc, out[-2000:], err[-2000:])

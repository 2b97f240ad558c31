"""A stop signal sent to the whole process group (Slurm, systemd, `timeout`, `kill -TERM -- -PGID`) reaches the DataLoader workers too:
the run must still stop at the next safe point with a resume point there, exit 128+signal, and continue bitwise (issue 23). The
uninterrupted run is bitwise stock fastai's (a process that never imports the package)."""
import random, signal
from concurrent.futures import ThreadPoolExecutor
import pytest
from helpers import TESTS
from killrerun import compare, same_as_stock
from resumable_train.checkpoints import newest_valid
from resumable_train.files import resume_record

SCRIPT = TESTS/'group_signal_script.py'
N_TRAIN,N_VALID,EPOCHS = 20,6,2   # batches per epoch of the script, and its epochs
TIMEOUT = 120

def _run(forker, d, out, *args):
    "Run the script in a forked child (its own session: the group holds its DataLoader workers); returns (rc, output)"
    rc,text = forker.run(SCRIPT, '--dir', d, '--out', out, *args, timeout=TIMEOUT)
    assert 'killed after' not in text, text[-3000:]
    return rc,text

def _trained(text): return sum(l.startswith('BATCH ') for l in text.splitlines())

@pytest.fixture(scope='module')
def reference(forker, stock, tmp_path_factory):
    "The uninterrupted run, bitwise stock fastai's (`--stock`: in a child of a process that never imports the package)"
    d = tmp_path_factory.mktemp('ref')
    rc,text = _run(forker, d/'run', d/'ref.pt')
    assert rc == 0 and f'TRAINED {N_TRAIN*EPOCHS}' in text, text[-3000:]
    rc,text = stock.run(SCRIPT, '--dir', d/'stock', '--out', d/'stock.pt', '--stock', timeout=TIMEOUT)
    assert rc == 0 and f'TRAINED {N_TRAIN*EPOCHS}' in text, f"stock fastai exited {rc}:\n{text[-3000:]}"
    same_as_stock(d/'stock.pt', d/'ref.pt')
    return d/'ref.pt'

def _batches(seed):
    "20 batches (counted over training and validation) to signal after: the last of an epoch and a validation batch among them"
    n = (N_TRAIN+N_VALID)*EPOCHS
    must = [N_TRAIN-1, N_TRAIN+2, n-N_VALID-1, n-1]  # last training batch of each epoch, inside validation, the very last batch
    rest = random.Random(seed).sample([i for i in range(n) if i not in must], 20-len(must))
    return must + rest

def _stop_range(at):
    "The training batches done when a stop signalled after batch `at` can take effect: at the next batch or a few later"
    e,i = divmod(at, N_TRAIN+N_VALID)
    done = e*N_TRAIN + min(i+1, N_TRAIN)   # in validation the stop waits for the end of the epoch
    return done, min(done+6, N_TRAIN*EPOCHS)

EXIT = {'SIGTERM': 128+signal.SIGTERM, 'SIGUSR1': 128+signal.SIGUSR1, 'SIGINT': -signal.SIGINT}  # Ctrl-C: killed by SIGINT, as python

def _trials(forker, reference, tmp_path, sig):
    "Signal the group after each of 20 batches, check the stop and its resume point, rerun and compare; returns the failures"
    rnd = random.Random(sig)
    for k,at in enumerate(_batches(sig)):
        d,out = tmp_path/f'{sig}-{k}',tmp_path/f'{sig}-{k}.pt'
        delay = rnd.choice([0.0, 0.002, 0.01, 0.03])   # the signal lands while the main process waits for data, or computes
        if at >= (N_TRAIN+N_VALID)*EPOCHS - N_VALID: delay = 0.0  # in the last validation: a later signal could come after `fit`
        rc,text = _run(forker, d, out, '--signal', sig, '--at', at, '--delay', delay)
        where = f"{sig} after batch {at} (+{delay}s)"
        assert rc == EXIT[sig], f"{where}: rc={rc}\n{text[-3000:]}"
        assert 'Exception ignored' not in text and 'exited unexpectedly' not in text, f"{where}: noise\n{text[-3000:]}"
        assert f'stopped by {sig}' in text and 'resume point saved' in text, f"{where}\n{text[-3000:]}"
        stopped = _trained(text)
        lo,hi = _stop_range(at)
        assert lo <= stopped <= hi, f"{where}: stopped after {stopped} training batches, not {lo} to {hi}"
        f,state = newest_valid(d/'models')
        got = resume_record(state)['train_iter']
        assert got == stopped, f"{where}: the newest resume point, {f}, is at training batch {got}, not {stopped}"
        rc,text = _run(forker, d, out)
        assert rc == 0, f"{where}, rerun: rc={rc}\n{text[-3000:]}"
        assert _trained(text) == N_TRAIN*EPOCHS - stopped, f"{where}: the rerun trained {_trained(text)} batches"
        bad = compare(reference, out)
        assert not bad, f"{where}: differs from the uninterrupted run: {bad[:5]}"

def test_group_signal(forker, reference, tmp_path):
    "20 trials for each of SIGTERM, SIGUSR1 and SIGINT, the three signals side by side (the runs mostly wait for their data)"
    with ThreadPoolExecutor(len(EXIT)) as ex: futs = {s: ex.submit(_trials, forker, reference, tmp_path, s) for s in EXIT}
    errors = {s: f.exception() for s,f in futs.items() if f.exception()}
    assert not errors, '\n\n'.join(f'{s}: {e}' for s,e in errors.items())

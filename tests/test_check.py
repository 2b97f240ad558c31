"""`resumable-train check -- CMD` (issue 40) on a user's own script: exact where training is (digits, a vision `fine_tune` with
DataLoader workers, two ranks), and each planted defect caught and named: a Dataset drawing from an unseeded generator, a callback's
counter without `state_dict`, an operation without a deterministic kernel, a loader the package refuses; a script without `AutoResume`
said in one line. The command runs as a user runs it (real processes) on the digits script and under torchrun; the other checks fork
the script's runs from the test process (`run=`)."""
import re
from pathlib import Path
import pytest
from helpers import PY, TESTS, run as run_command
from test_cli import CMD
from resumable_train.check import check

SCRIPT = str(TESTS/'check_script.py')

def forked(forker):
    "A `run` for `check`: each run of the script forked from the test process, which imported fastai once"
    def run(cmd, env, timeout):
        assert cmd[:2] == [PY, SCRIPT], cmd
        return forker.run(SCRIPT, *cmd[2:], env=env, timeout=timeout)
    return run

def verdict(run, tmp_path, *args, **kwargs)->tuple:
    "`check` on check_script.py with `args`: its exit status and what it said"
    lines = []
    rc = check([PY, SCRIPT, str(tmp_path/'run'), *args], run=run, say=lines.append, timeout=120, **kwargs)
    return rc, '\n'.join(lines)

def test_command_exact(tmp_path):
    "The command, as a user runs it on the digits script: killed at a random batch, resumed, exact; the run's own folder untouched"
    rc,out,err = run_command([CMD, 'check', '--', PY, SCRIPT, tmp_path/'run'], timeout=300, cwd=tmp_path)
    assert rc == 0, out + err
    assert re.search(r'^exact: killed after batch \d+, resumed from batch \d+, equal at batch 40 in every tensor \(\d+ tensors, \d+ s\)$',
                     out, re.M), out
    assert out.count('check: ') == 3 and not list(tmp_path.rglob('*.pth')), out

def test_command_torchrun(tmp_path):
    "The command on `torchrun --nproc_per_node=2` (DDPTrainer, gloo): every rank stopped, then killed and relaunched; exact"
    torchrun = [PY, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2']
    rc,out,err = run_command([CMD, 'check', '--', *torchrun, SCRIPT, tmp_path/'run', '--model', 'ddp'], timeout=300, cwd=tmp_path)
    assert rc == 0 and re.search(r'^exact: killed after batch \d+, resumed from batch \d+, equal at batch 35 in every tensor', out, re.M), \
        out + err[-3000:]

def test_vision_fine_tune(forker, tmp_path):
    "A vision fine_tune with 2 DataLoader workers and random crops: exact"
    rc,out = verdict(forked(forker), tmp_path, '--model', 'vision')
    assert rc == 0 and out.splitlines()[-1].startswith('exact: killed after batch '), out

@pytest.mark.parametrize('defect,why', [
    ('random', 'why: training is not deterministic here: two uninterrupted runs differ'),
    ('counter', 'why: AutoResume: callback Counter changed its attributes n while training, but has no state_dict'),
    ('nondet', 'why: Planted.forward does not have a deterministic implementation (torch.use_deterministic_algorithms(True) raised)'),
    ('loader', 'not checked: refused by resumable_train (the check writes resume points inside the epoch): Cannot resume inside an '
               'epoch of a fastai DataLoader over an iterable dataset (Stream)')])
def test_defect_named(forker, tmp_path, defect, why):
    "Each planted defect: exit 1, and the cause named, with its fix"
    rc,out = verdict(forked(forker), tmp_path, '--defect', defect, kill_at=25)
    assert rc == 1 and why in out, out
    if defect != 'loader': assert 'not exact: killed after batch 25, resumed from batch 20; at batch 40 it differs' in out and 'fix: ' in out
    if defect == 'counter': assert 'the resume lost something' in out, out

def test_without_autoresume(forker, tmp_path):
    "A script without AutoResume: said in one line"
    rc,out = verdict(forked(forker), tmp_path, '--no-autoresume')
    assert rc == 1 and out.splitlines()[-1] == ("not checked: the script trained no fit call with AutoResume: add AutoResume() to the "
                                                "Learner's callbacks"), out

def test_stop_too_early(forker, tmp_path):
    "A stop (`--batches`) before there is room for a kill after the first resume point: said in one line, nothing killed"
    rc,out = verdict(forked(forker), tmp_path, batches=5)
    assert rc == 1 and out.splitlines()[-1] == ("not checked: the stop (batch 5) leaves no batch to kill at after the first resume "
                                                "point (batch 10)"), out

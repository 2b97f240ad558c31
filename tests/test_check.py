"""`resumable-train check -- CMD` (issue 40) on a user's own script: exact where training is (digits, a vision `fine_tune` with
DataLoader workers, two ranks), and each planted defect caught and named: a Dataset drawing from an unseeded generator, a callback's
counter without `state_dict` (a number, or a dict changed in place), an operation without a deterministic kernel, a loader the package refuses; a script without `AutoResume`
said in one line. The command runs as a user runs it (real processes) on the digits script and under torchrun; the other checks fork
the script's runs from the test process (`run=`)."""
import hashlib, re
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
    "`check` on check_script.py with `args`, its scratch folder in `tmp_path/'tmp'`: its exit status and what it said"
    lines = []
    (tmp_path/'tmp').mkdir(exist_ok=True)
    rc = check([PY, SCRIPT, str(tmp_path/'run'), *args], run=run, say=lines.append, timeout=120, scratch=tmp_path/'tmp', **kwargs)
    return rc, '\n'.join(lines)

def tree(d:Path)->dict:
    "Every file and folder below `d`: a file's sha256, a folder's `None`"
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None for p in sorted(d.rglob('*'))}

def test_command_exact(tmp_path):
    ("The command, as a user runs it on the digits script with every writer of a Learner's files (SaveModelCallback, CSVLogger, "
     "TensorBoard, export, save, W&B) in a project that its last run left files in: killed at a random batch, resumed, exact at the "
     "end of the fit call; the project's tree byte for byte the same, nothing left in the temporary folder, and nothing in the "
     "user's W&B folders (its cache and logs, its staged artifacts)")
    project,tmp,user = tmp_path/'project',tmp_path/'tmp',tmp_path/'user'
    (project/'run'/'models').mkdir(parents=True); tmp.mkdir(); user.mkdir()
    (project/'run'/'models'/'model.pth').write_bytes(b'the last run\'s best model')
    (project/'run'/'history.csv').write_text('epoch,train_loss\n0,1.0\n')
    (project/'run'/'models'/'epoch1.pth').write_bytes(b'the last run\'s learn.save')
    (project/'run'/'export.pkl').write_bytes(b'the last run\'s learn.export')
    before = tree(project)
    env = dict(TMPDIR=str(tmp), WANDB_CACHE_DIR=str(user/'wandb-cache'), WANDB_DATA_DIR=str(user/'wandb-data'))
    rc,out,err = run_command([CMD, 'check', '--', PY, SCRIPT, 'run', '--writers'], timeout=300, cwd=project, env=env)
    assert rc == 0, out + err
    assert re.search(r'^exact: killed after batch \d+, resumed from batch \d+, equal at batch 72, the end of fit call 1 in every tensor '
                     r'\(\d+ tensors, \d+ s\)$', out, re.M), out
    assert out.count('check: ') == 3 and tree(project) == before, (out, tree(project))
    assert not list(tmp.iterdir()) and not list(user.iterdir()), (list(tmp.iterdir()), list(user.rglob('*')))

def test_command_torchrun(tmp_path):
    "The command on `torchrun --nproc_per_node=2` (DDPTrainer, gloo): every rank stopped, then killed and relaunched; exact"
    torchrun = [PY, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2']
    (tmp_path/'tmp').mkdir()
    rc,out,err = run_command([CMD, 'check', '--', *torchrun, SCRIPT, tmp_path/'run', '--model', 'ddp'], timeout=300, cwd=tmp_path,
                             env=dict(TMPDIR=str(tmp_path/'tmp')))
    assert rc == 0 and re.search(r'^exact: killed after batch \d+, resumed from batch \d+, equal at batch 36, the end of fit call 1 in '
                                 r'every tensor', out, re.M), out + err[-3000:]
    assert not list((tmp_path/'tmp').glob('resumable-train-check-*'))  # torchrun leaves its killed ranks' torchelastic_* folders

def test_vision_fine_tune(forker, tmp_path):
    "A vision fine_tune with 2 DataLoader workers and random crops: exact"
    rc,out = verdict(forked(forker), tmp_path, '--model', 'vision')
    assert rc == 0 and out.splitlines()[-1].startswith('exact: killed after batch '), out

@pytest.mark.parametrize('defect,why', [
    ('random', 'why: training is not deterministic here: two uninterrupted runs differ'),
    ('counter', 'why: AutoResume: callback Counter changed its attributes n while training, but has no state_dict'),
    ('dict_counter', 'why: AutoResume: callback DropLR changed its attributes seen while training, but has no state_dict'),
    ('nondet', 'why: Planted.forward does not have a deterministic implementation (torch.use_deterministic_algorithms(True) raised)'),
    ('loader', 'not checked: refused by resumable_train (the check writes resume points inside the epoch): Cannot resume inside an '
               'epoch of a fastai DataLoader over an iterable dataset (Stream)')])
def test_defect_named(forker, tmp_path, defect, why):
    "Each planted defect: exit 1, and the cause named, with its fix; the runs' folders kept and named where not exact, else none"
    rc,out = verdict(forked(forker), tmp_path, '--defect', defect, kill_at=25)
    assert rc == 1 and why in out, out
    kept = list((tmp_path/'tmp').iterdir())
    if defect == 'loader': assert not kept, kept
    else:
        assert 'not exact: killed after batch 25, resumed from batch 20; at batch 72, the end of fit call 1 it differs' in out, out
        assert 'fix: ' in out, out
        assert len(kept) == 1 and out.splitlines()[-1].endswith(f"the runs' folders are in {kept[0]})"), (out, kept)
    if defect in ('counter', 'dict_counter'): assert 'the resume lost something' in out, out
    if defect == 'random':  # the deterministic-algorithms run found nothing to name: said, with where the runs first differ
        assert re.search(r'^why: with torch\.use_deterministic_algorithms\(True\) the script ran to the stop: every operation it ran '
                         r'has a deterministic kernel, .*the first difference is where to look: \S', out, re.M), out
    assert not re.search(r'\(\d+ s\)', out) and '(elapsed: ' in out, out  # times are labelled as elapsed

def test_without_autoresume(forker, tmp_path):
    "A script without AutoResume: said in one line"
    rc,out = verdict(forked(forker), tmp_path, '--no-autoresume')
    assert rc == 1 and out.splitlines()[-1] == ("not checked: the script trained no fit call with AutoResume: add AutoResume() to the "
                                                "Learner's callbacks"), out

def test_bound(forker, tmp_path):
    "A bound set on the batches the check covers: said in the verdict"
    rc,out = verdict(forked(forker), tmp_path, batches=30)
    assert rc == 0 and re.search(r'^exact: killed after batch \d+, resumed from batch \d+, equal at batch 30 \(the bound set; fit call 1 '
                                 r'trains 72 batches\) in every tensor', out, re.M), out
    assert not list((tmp_path/'tmp').iterdir())

def test_stop_too_early(forker, tmp_path):
    "A stop (`--batches`) before there is room for a kill after the first resume point: said in one line, nothing killed"
    rc,out = verdict(forked(forker), tmp_path, batches=5)
    assert rc == 1 and out.splitlines()[-1] == ("not checked: the stop (batch 5) leaves no batch to kill at after the first resume "
                                                "point (batch 10)"), out

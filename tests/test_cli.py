"""The installed `resumable-train` command: `inspect` and `ls` answer without importing fastai, with one verdict per kind of file, and
in about the time `torch.load` alone takes (measured in `benchmarks/cli.py`, not asserted); the demo interrupted by SIGINT and rerun ends with the digest of an uninterrupted run."""
import json, os, random, re, signal, subprocess, sys, textwrap, time
from pathlib import Path
import pytest, torch
from helpers import PY, run, check_rc
CLI = str(Path(sys.executable).parent/"resumable-train")  # the installed command

CMD = str(Path(sys.executable).parent/'resumable-train')

def digest(out):
    m = re.search(r'weights ([0-9a-f]{12})', out)
    assert m, out[-2000:]
    return m.group(1)

@pytest.fixture(scope='module')
def runs(tmp_path_factory, forker):
    "An uninterrupted demo run, and one stopped by SIGINT in its second epoch, then rerun: forked children of one process"
    tmp = tmp_path_factory.mktemp('cli')
    assert Path(CMD).exists(), f"{CMD} is not installed: pip install -e ."
    fk = forker
    ref = fk.start(CMD, 'demo', '--no-kill', '--dir', tmp/'ref', '--epochs', '2', '--pause', '0')
    cut = fk.start(CMD, 'demo', '--no-kill', '--dir', tmp/'cut', '--epochs', '2')
    seen,deadline = [],time.monotonic() + 90
    for line in cut.stdout:  # the bar, drawn into the pipe too: wait until a batch of the second epoch has trained
        seen.append(line)
        if re.search(r'Epoch 2/2 .*\[([1-9]\d*)/\d+', line) or time.monotonic() > deadline: break
    cut.send_signal(signal.SIGINT)
    res = dict(ref=(ref, *ref.communicate(timeout=90)[:1]), cut=(cut, ''.join(seen) + cut.communicate(timeout=60)[0]))
    newest = sorted((tmp/'cut'/'models').glob('autoresume-*.pth'))[-1]
    saved = torch.load(newest, weights_only=True)['opt']['resume']
    (tmp/'stopped.pth').write_bytes(newest.read_bytes())  # the resume point SIGINT saved, before the rerun prunes it
    rerun = fk.run(CMD, 'demo', '--no-kill', '--dir', tmp/'cut', '--epochs', '2', timeout=90)
    again = fk.run(CMD, 'demo', '--no-kill', '--dir', tmp/'ref', '--epochs', '2', timeout=90)
    return dict(tmp=tmp, saved=saved, rerun=rerun, again=again, **res)

def test_demo_resumes_after_sigint(runs):
    (ref,ref_out),(cut,cut_out) = runs['ref'],runs['cut']
    assert ref.returncode == 0, ref_out[-2000:]
    assert '█\r' not in ref_out and 'epoch     train_loss' in ref_out, ref_out[:2000]  # output to a pipe: the table, no stray probe of the bar
    assert cut.returncode == 130, f"rc={cut.returncode}\n{cut_out[-2000:]}"
    assert runs['saved']['epoch'] == 1, "stopped in the second epoch, after the first epoch's resume point"
    rc,out = runs['rerun']
    assert rc == 0 and 'AutoResume: continuing' in out, out[-2000:]
    assert digest(out) == digest(ref_out), "the interrupted and resumed run ends with the uninterrupted run's weights"
    rc,out = runs['again']
    assert rc == 0 and digest(out) == digest(ref_out), out[-2000:]
    assert out.count('to train again') == 1, out[-2000:]  # AutoResume's line says how to train again, and nothing repeats it
    assert "the last the run's files hold, and nothing is trained" in out and 'train_loss' not in out and '█' not in out, out[-2000:]  # no bar, no table

# What each kind of file is, for `inspect`: (exit status, words its message must hold)
KINDS = {
    'resume.pth': (0, ['epoch 2/2', 'numbered as the progress bar']),
    'finished.pth': (0, ['finished run']),
    'stock.pth': (0, ["no resume point: fastai's model and optimizer"]),
    'tensors.pth': (0, ['model weights only, not a fastai checkpoint', "keys 'a'"]),
    'folder': (2, ['is a folder, not a checkpoint file', 'resumable-train ls']),
    'missing.pth': (2, ['does not exist']),
    'notes.pth': (2, ['is a text file, not a PyTorch checkpoint']),
    'noise.pth': (2, ['neither a zip archive nor a pickle']),
    'other.pth': (2, ["holds a dictionary (keys 'model', 'epoch') that is neither a fastai checkpoint"]),
    'cut.pth': (2, ['is truncated']),
    'list.pth': (2, ['holds a list']),
    'nolog/resume.pth': (2, ['keeps the history of its', 'autoresume-fit1.history, which is not in', 'with_iter=False']),
}

@pytest.fixture(scope='module')
def files(runs):
    "One file of each kind in KINDS"
    d = runs['tmp']/'kinds'; d.mkdir()
    models = runs['tmp']/'cut'/'models'
    rp = runs['tmp']/'stopped.pth'
    assert torch.load(rp, weights_only=True)['opt']['resume']['iter'] > 0
    (d/'resume.pth').write_bytes(rp.read_bytes())
    (d/'finished.pth').write_bytes(sorted(models.glob('autoresume-*.pth'))[-1].read_bytes())
    (d/'autoresume-fit1.history').write_bytes((models/'autoresume-fit1.history').read_bytes())  # their Recorder histories: appended to since
    (d/'nolog').mkdir()
    (d/'nolog'/'resume.pth').write_bytes(rp.read_bytes())  # copied without its history log
    ck = torch.load(rp, weights_only=True)
    torch.save({'model': ck['model'], 'opt': {k:v for k,v in ck['opt'].items() if k != 'resume'}}, d/'stock.pth')
    torch.save({'a': torch.ones(3)}, d/'tensors.pth')
    (d/'folder').mkdir()
    (d/'notes.pth').write_text('not a checkpoint\n')
    (d/'noise.pth').write_bytes(random.Random(0).randbytes(2000))
    torch.save({'model': ck['model'], 'epoch': 3}, d/'other.pth')
    data = rp.read_bytes()
    (d/'cut.pth').write_bytes(data[:len(data)//2])
    torch.save([1, 2], d/'list.pth')
    return d

CHILD = textwrap.dedent('''
    import contextlib, io, json, sys
    from resumable_train.cli import main
    res = {}
    for args in json.loads(sys.argv[1]):
        out,err = io.StringIO(),io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try: rc = main(args)
            except SystemExit as e: rc = e.code
        res[' '.join(args)] = (rc, out.getvalue(), err.getvalue())
    late = sorted(m for m in sys.modules if m.split('.')[0] in ('fastai', 'matplotlib'))  # `plot` alone
    print(json.dumps(dict(res=res, fastai=late)))
''')

@pytest.fixture(scope='module')
def answers(files):
    "`inspect`, `inspect --json` and `ls` on every kind of file, in one fresh process that must not import fastai"
    calls = [a for k in KINDS for a in (['inspect', str(files/k)], ['inspect', '--json', str(files/k)])] + [['ls', str(files)], ['--help']]
    rc,out,err = run([PY, '-c', CHILD, json.dumps(calls)], timeout=120)
    check_rc((rc, out, err), 'resumable_train.cli.main')
    return json.loads(out.splitlines()[-1])

def test_no_fastai(answers):
    "`inspect`, `ls` and `--help` read checkpoints with torch only (no fastai, no matplotlib)"
    assert answers['fastai'] == [], answers['fastai']

@pytest.mark.parametrize('name', list(KINDS))
def test_inspect_verdict(files, answers, name):
    "One verdict per file: exit status, the message's words, `--json` consistent with the exit status, errors on stdout only with --json"
    want,words = KINDS[name]
    rc,out,err = answers['res'][f"inspect {files/name}"]
    text = out if want == 0 else err
    assert rc == want and (err == '' if want == 0 else out == ''), (rc, out, err)
    for w in words: assert w in text, text
    assert 'weights_only=False' not in text and 'set to `False`' not in text, text
    rc,out,err = answers['res'][f"inspect --json {files/name}"]
    info = json.loads(out)
    assert rc == want and err == '' and info['valid'] == (want == 0), (rc, out, err)
    if want: assert all(w in info['error'] for w in words), info
    if name == 'resume.pth': assert info['position']['epoch'] == 2 and 'as the text' in info['numbering'], info

def test_ls(files, answers):
    "`ls` gives each file the verdict `inspect` gives it"
    rc,out,err = answers['res'][f"ls {files}"]
    assert rc == 0, (rc, out, err)
    rows = {l.split()[-1]: l for l in out.splitlines()[2:]}
    for name,(want,_) in KINDS.items():
        if name.endswith('.pth') and name != 'missing.pth' and '/' not in name: assert (' valid ' if want == 0 else ' invalid ') in rows[name], out

def test_installed(files):
    "The installed command answers from a fresh process (its time against `torch.load` alone is measured in `benchmarks/cli.py`)"
    rc,out,err = run([CMD, 'inspect', str(files/'resume.pth')], timeout=60)
    assert rc == 0 and 'epoch 2/2' in out and err == '', (rc, out, err)

BIG = textwrap.dedent('''
    import resource, sys
    from resumable_train.cli import main
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rc = main(['inspect', sys.argv[1]])
    print(rc, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)//1024)  # kB to MB (Linux)
''')

@pytest.mark.skipif(sys.platform != 'linux', reason="ru_maxrss is in kB on Linux")
def test_huge_history_log(tmp_path):
    "`inspect` of a 3 GB history log (a sparse file) reads its header and size: its peak memory grows by less than 200 MB"
    from resumable_train.files import LOG_MAGIC
    head = LOG_MAGIC + b'[["recorder/losses", "stack", "float32", []]]\n'
    f = tmp_path/'big.history'
    with open(f, 'wb') as o: o.write(head); o.truncate(3*10**9)
    rc,out,err = run([PY, '-c', BIG, str(f)], timeout=120)
    check_rc((rc, out, err), 'inspect of a 3 GB history log')
    status,grown = map(int, out.split()[-2:])
    assert status == 0 and f"{(3*10**9 - len(head))//4:,} rows" in out, out
    assert grown < 200, f"peak memory grew by {grown} MB"

# The packages of the `dev` extra (pyproject.toml), which a user's `pip install .` does not install
DEV = ('nbdev', 'pytest', 'moto', 's3fs', 'accelerate', 'torchdata', 'datasets', 'tensorboard', 'wandb')
SELF_CHECK = textwrap.dedent('''
    import sys
    DEV = %r
    class NoDev:
        "A user's install: importing a package of the dev extra fails"
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in DEV: raise ImportError(f"{name} belongs to the dev extra")
    sys.meta_path.insert(0, NoDev())
    if sys.argv[2] == 'lose-opt-state':  # resume broken: the optimizer state a resume point holds is lost when it is loaded
        import resumable_train.learner
        from fastai.learner import Learner
        load = Learner.load
        def lossy(self, *args, **kwargs):
            load(self, *args, **kwargs)
            self.opt.clear_state()
            return self
        Learner.load = lossy
    from resumable_train.cli import main
    sys.exit(main(['demo', '--dir', sys.argv[1], '--epochs', '3']))
''') % (DEV,)

@pytest.mark.parametrize('resume', ['exact', 'lose-opt-state'])
def test_demo_self_check(tmp_path, resume):
    """`demo` kills its run with SIGKILL, reruns it and compares it with an uninterrupted run: `yes` and exit 0, without any package
    of the dev extra; `no` and exit 1 when resuming loses the optimizer state"""
    rc,out,err = run([PY, '-c', SELF_CHECK, str(tmp_path), resume], timeout=240)
    assert 'it kills itself with SIGKILL after batch' in out and 'Killed by SIGKILL after batch' in out, (rc, out[-3000:], err[-3000:])
    assert 'AutoResume: continuing from' in out, out[-3000:]  # killed after the first epoch's resume point
    if resume == 'exact':
        assert rc == 0 and re.search(r'same weights as an uninterrupted run: yes \(digest [0-9a-f]{12}\)\n', out), (rc, out[-3000:], err[-3000:])
    else:
        assert rc == 1 and re.search(r'same weights as an uninterrupted run: no \(digest [0-9a-f]{12}, uninterrupted [0-9a-f]{12}\)', out), (rc, out[-3000:], err[-3000:])

def _interrupt(tmp_path, cmd, when)->tuple:
    "Start `cmd demo` in a session of its own, wait until `when(pid, output so far)`, Ctrl-C its group: exit status, output"
    p = subprocess.Popen([*cmd, 'demo', '--dir', tmp_path/'demo', '--epochs', '2'], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED='1'))
    out,deadline = b'',time.monotonic() + 120
    os.set_blocking(p.stdout.fileno(), False)
    try:
        while not when(p.pid, out) and p.poll() is None and time.monotonic() < deadline:
            out += p.stdout.read() or b''; time.sleep(0.02)
        os.killpg(p.pid, signal.SIGINT)
        os.set_blocking(p.stdout.fileno(), True)
        return p.wait(timeout=60), (out + p.stdout.read()).decode()
    finally:
        try: os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError: pass

def _importing_torch(pid, out)->bool: return 'libtorch' in Path(f'/proc/{pid}/maps').read_text()
def _child_training(pid, out)->bool: return b'Epoch 1/2' in out

@pytest.mark.parametrize('when', [_importing_torch, _child_training])
@pytest.mark.parametrize('cmd', [[CMD], [PY, '-m', 'resumable_train.cli']], ids=['command', 'python-m'])
def test_demo_ctrl_c(tmp_path, cmd, when):
    ("Ctrl-C while the command (`resumable-train`, or `python -m resumable_train.cli`) imports torch, or while a child of the demo "
     "trains: one line, exit 130, no traceback")
    rc,out = _interrupt(tmp_path, cmd, when)
    assert rc == 130 and re.fullmatch(r'(?s)(.*\n)?resumable-train: interrupted \(Ctrl-C\)\n', out), (rc, out[-3000:])
    assert 'Traceback' not in out and 'AutoResume' not in out, out[-3000:]

def test_closed_pipe_and_clean(runs, tmp_path):
    """Issue 61: `ls` into a pipe that its reader closed is quiet, as `git log | head` is; `clean` of a run the folder does not hold
    (a misspelled name) names the runs it holds and exits non-zero; `clean` counts the lock file it removes"""
    import shutil
    d = tmp_path/'run'
    shutil.copytree(runs['tmp']/'cut'/'models', d)
    for args in (['ls', d], ['ls', '--json', d]):
        p = subprocess.Popen([CLI, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        p.stdout.close()  # the reader went away before the first line (`| head -1` after it)
        try: err = p.communicate(timeout=60)[1]
        finally: p.kill()
        assert p.returncode == 0 and err == '', (args, p.returncode, err)
    rc,out,err = run([CLI, 'clean', d, '--fname', 'nosuch'], 60)
    assert rc != 0 and out == '' and "holds no files of run 'nosuch'; the runs it holds: 'autoresume'" in err, (rc, out, err)
    (d/'.autoresume.lock').touch()  # left by the run
    n = len(list(d.glob('autoresume*')))
    rc,out,err = run([CLI, 'clean', d], 60)
    assert rc == 0 and f'removed {n+1} files' in out and '.autoresume.lock' in out and not list(d.glob('*autoresume*')), (rc, out, err)

BROKEN_TORCHVISION = "raise RuntimeError('operator torchvision::nms does not exist')  # a CUDA torchvision beside a CPU torch\n"

def test_torch_and_torchvision_checked_first(tmp_path):
    """With a torchvision that does not load beside this torch (pip's fallback to PyPI's torchvision next to a CPU torch), the demo and
    the README's test command stop in seconds, pointing at the README's set-up, before training or running any test"""
    (tmp_path/'torchvision').mkdir(); (tmp_path/'torchvision'/'__init__.py').write_text(BROKEN_TORCHVISION)
    env = dict(PYTHONPATH=os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parent.parent), os.environ.get('PYTHONPATH', '')]))
    t = time.monotonic()
    rc,out,err = run([PY, '-m', 'resumable_train.cli', 'demo', '--dir', str(tmp_path/'demo'), '--epochs', '1'], timeout=120, env=env)
    assert rc == 2 and 'torch and torchvision do not load together' in err and "operator torchvision::nms does not exist" in err, (rc, out, err)
    assert "README.md, 'Fresh setup'" in err and not (tmp_path/'demo').exists() and 'Training' not in out, (out, err)
    # the test command: the same check is its first step (bounded: were the check gone, this would be the whole suite)
    rc,out,err = run(['bash', str(Path(__file__).parent/'run.sh')], timeout=120, env=env)
    assert rc == 1 and 'FAIL: torch and torchvision do not load together' in out + err and '== pytest' not in out, (rc, out[-2000:], err[-2000:])
    assert time.monotonic() - t < 110

def test_torch_check_leaves_nothing(tmp_path):
    "The check that torch and torchvision load together leaves no file in the system's temporary folder (torchvision's import makes torch's compile cache)"
    (tmp_path/'tmp').mkdir()  # torch's cache goes to the temporary folder where the suite's own setting (run.sh) is unset
    rc,out,err = run(['env', '-u', 'TORCHINDUCTOR_CACHE_DIR', PY, '-c', 'from resumable_train.cli import torch_problem; print(torch_problem())'],
                     timeout=120, env=dict(TMPDIR=str(tmp_path/'tmp')))
    assert rc == 0 and out.strip() == 'None', (rc, out, err)
    assert not list((tmp_path/'tmp').iterdir()), list((tmp_path/'tmp').iterdir())

"""Shared utilities for the process-level tests: bounded subprocesses, bitwise comparison of saved results, library warnings filtered, W&B
offline in a test's folder"""
import builtins, functools, os, re, signal, subprocess, sys, warnings
from pathlib import Path
import torch

PY = sys.executable
TESTS = Path(__file__).parent
ROOT = TESTS.parent

# Warnings of installed libraries that the package's own code does not cause, filtered once, here: in pytest (conftest.py), in the
# notebook runner (notebooks.py) and, through PYTHONWARNINGS, in every process they start. (message prefix, category, why)
LIBRARY_WARNINGS = [
    ('`torch.jit.script` is deprecated', 'FutureWarning', "fastai's import scripts functions with it; torch deprecates it"),
    ("The 'mode.chained_assignment' option is deprecated", 'Warning',
     "fastai.tabular sets a pandas option that pandas 3 deprecates (a Pandas4Warning)"),
]

def own_temporary_folder(prefix:str)->str:
    """Point the system's temporary folder (`TMPDIR`) of this process and its children at a new folder of its own, removed when this
    process exits; returns it. A process the tests kill cannot clean up (DataLoader workers' `pymp-*`, torchrun's `torchelastic_*`, a
    killed script's `TemporaryDirectory`): what it leaves goes there, so the tests leave nothing in the system's temporary folder. A
    process whose parent made one already (`RESUMABLE_TRAIN_TMPDIR`) uses that one and leaves it to the parent."""
    import atexit, shutil, tempfile
    if os.environ.get('RESUMABLE_TRAIN_TMPDIR') == os.environ.get('TMPDIR') != None: return os.environ['TMPDIR']
    d = tempfile.mkdtemp(prefix=prefix)
    os.environ['TMPDIR'] = os.environ['RESUMABLE_TRAIN_TMPDIR'] = d
    tempfile.tempdir = None  # `tempfile` reads TMPDIR again
    pid = os.getpid()
    atexit.register(lambda: os.getpid() == pid and shutil.rmtree(d, ignore_errors=True))  # not in forked children
    return d

def quiet_library_warnings():
    "Filter `LIBRARY_WARNINGS` in this process and, through PYTHONWARNINGS, in the processes it starts"
    for msg,cat,_ in LIBRARY_WARNINGS: warnings.filterwarnings('ignore', re.escape(msg), getattr(builtins, cat))
    opts = [f'ignore:{msg}:{cat}' for msg,cat,_ in LIBRARY_WARNINGS]  # a message prefix, without ':' or ','
    os.environ['PYTHONWARNINGS'] = ','.join(filter(None, [os.environ.get('PYTHONWARNINGS'), *opts]))

def wandb_env(folder)->dict:
    "W&B offline and silent, with every file it writes in `folder`: its runs, logs, cache, and temporary files (for a run's `env`)"
    folder = Path(folder)
    for d in ('cache', 'data', 'tmp'): (folder/d).mkdir(parents=True, exist_ok=True)
    return dict(WANDB_MODE='offline', WANDB_SILENT='true', WANDB_DIR=str(folder), WANDB_CACHE_DIR=str(folder/'cache'),
                WANDB_DATA_DIR=str(folder/'data'), TMPDIR=str(folder/'tmp'))  # a killed run leaves wandb's temporary folders

def wandb_config_fix():
    """Let fastai's `WandbCallback` log its config: fastai 2.8.12's `_format_config_value` calls fastcore 2.2.41's `init_args`, whose
    `vars` raises `TypeError` in `before_fit` for a value without `__dict__` (a tuple). Their bug, not the package's: such a value is
    passed on as it is (where wandb still cannot serialize the config, fastai says so and trains on, as it means to). Called alike
    in stock runs and the package's, so it cannot hide a difference the package makes"""
    import fastai.callback.wandb as fw
    f = fw._format_config_value
    if getattr(f, 'fixed', False): return
    def fixed(v): return f(v) if isinstance(v, list) or hasattr(v, '__dict__') else v
    fixed.fixed,fw._format_config_value = True,fixed

def test_env(env=None):
    "The environment for a test subprocess: one thread per op, the repo importable, no progress bars"
    e = dict(os.environ, OMP_NUM_THREADS='1', MKL_NUM_THREADS='1', PYTHONHASHSEED='0', PYTHONUNBUFFERED='1')
    e['PYTHONPATH'] = os.pathsep.join([str(ROOT), str(TESTS)] + ([e['PYTHONPATH']] if e.get('PYTHONPATH') else []))
    e.update(env or {})
    return e

def run(cmd, timeout, env=None, cwd=None):
    "Run `cmd` in its own process group, wait at most `timeout` seconds (killing the whole group then), return (rc, stdout, stderr)"
    return finish(start(cmd, env=env, cwd=cwd), timeout)

def start(cmd, env=None, cwd=None):
    "Start `cmd` in its own process group (finish it with `finish`)"
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=test_env(env), cwd=cwd,
                            start_new_session=True)

def finish(p, timeout):
    "Wait for a process from `start` at most `timeout` seconds, as `run` does"
    try: out,err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(p)
        out,err = p.communicate()
        return -signal.SIGKILL, out, (err or '') + f'\n[helpers.finish] killed after {timeout}s timeout'
    finally: kill_group(p)
    return p.returncode, out, err

def kill_group(p):
    "Kill the process group of `p` (started with `start_new_session=True`)"
    try: os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError): pass

def check_rc(res, what='process'):
    "Assert a (rc, out, err) result succeeded, showing its output otherwise"
    rc,out,err = res
    assert rc == 0, f"{what} failed with rc={rc}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-6000:]}"

def load_result(f): return torch.load(f, weights_only=False)

def package_files(folder, fname='autoresume')->dict:
    "The files the package wrote for the run `fname` in `folder`, with their bytes and times (issue 49: another run's are not among them)"
    pat = rf'\.?{re.escape(fname)}(-\d+\.pth|-fit\d+\.history|\.runlog|\.reach|\.lock)'
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path(folder).iterdir() if re.fullmatch(pat, p.name)}

def stock_digits_learner():
    """`resumable_train.cli.digits_learner` for a process that never imports the package (stock fastai): its own code, read from
    cli.py with `ast` and run without its `import resumable_train.learner` (the package's patches of `Learner`)"""
    import ast
    from torch import nn
    path = ROOT/'resumable_train'/'cli.py'
    fn = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == 'digits_learner')
    patches = lambda s: isinstance(s, ast.Import) and [a.name for a in s.names] == ['resumable_train.learner']
    n,fn.body = len(fn.body),[s for s in fn.body if not patches(s)]
    assert len(fn.body) == n-1, "digits_learner no longer has the statement `import resumable_train.learner`"
    ns = dict(torch=torch, nn=nn)  # cli.py's imports that digits_learner uses; it imports the rest itself
    exec(compile(ast.Module([fn], type_ignores=[]), str(path), 'exec'), ns)
    return ns['digits_learner']

def diff_values(a, b, path='')->list:
    "Where plain nested values `a` and `b` differ (tensors compared with `torch.equal`, dtype included)"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)): return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape: return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        if not torch.equal(a, b):
            d = (a.double()-b.double()).abs().max().item() if a.is_floating_point() else 'n/a'
            return [f"{path}: tensors differ (max abs diff {d})"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b): return [f"{path}: keys {sorted(map(str,set(a)^set(b)))} in only one"]
        return [d for k in a for d in diff_values(a[k], b[k], f"{path}.{k}")]
    if type(a).__name__ == 'L': a = list(a)  # fastcore's `L`: the resumed optimizer's `hypers` is a plain list (see test_exact.py)
    if type(b).__name__ == 'L': b = list(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b): return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i,(x,y) in enumerate(zip(a, b)) for d in diff_values(x, y, f"{path}[{i}]")]
    if type(a) != type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return [f"{path}: {type(a).__name__} {a!r} vs {type(b).__name__} {b!r}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]

EXACT_KEYS = ('model', 'model_pre', 'opt', 'values', 'losses', 'lrs', 'iters', 'hps', 'train_iter', 'pct_train', 'epoch',
              'trackers', 'csv', 'astats')

def compare_results(ref, got, keys=EXACT_KEYS)->list:
    "Differences between two results written by `exact_script.py` (files or dicts), bitwise; `[]` when identical"
    if not isinstance(ref, dict): ref = load_result(ref)
    if not isinstance(got, dict): got = load_result(got)
    return [d for k in keys if k in ref or k in got for d in diff_values(ref.get(k), got.get(k), k)]

def assert_same(ref, got, what=''):
    "Assert two results are bitwise identical"
    d = compare_results(ref, got)
    assert not d, f"{what}: {len(d)} differences, first: " + '\n'.join(d[:8])

_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

class Writes(list):
    "The paths this process opens for writing, renames to, links or removes while `on`, by any of python's file functions"
    # Audit events, not replaced functions: a module that kept its own reference to `open` is seen too (python 3.10's pathlib:
    # `Path.open` calls the `io.open` it bound at import, and fastai's CSVLogger opens history.csv with it)
    def __init__(self):
        super().__init__()
        self.on = False
        sys.addaudithook(self._audit)
        save = torch.save
        def _save(obj, f, *args, **kwargs):
            "`torch.save`, recording `f` if it is a path: torch writes to a path from C++, which raises no audit event"
            if self.on and isinstance(f, (str, Path)): self.append(str(f))
            return save(obj, f, *args, **kwargs)
        torch.save = _save

    def _audit(self, event, args):
        if not self.on: return
        if event == 'open' and not isinstance(args[0], int) and args[2] & _WRITE: self.append(os.fsdecode(args[0]))
        elif event in ('os.rename', 'os.link', 'os.symlink'): self.append(os.fsdecode(args[1]))   # os.rename: os.replace's too
        elif event in ('os.remove', 'os.truncate') and not isinstance(args[0], int): self.append(os.fsdecode(args[0]))

class Sized(torch.utils.data.IterableDataset):
    "A Hugging Face IterableDataset of (x, y) examples with the length fastai needs; its position (`state_dict`) and epoch passed through"
    def __init__(self, ds, n): self.ds,self.n = ds,n
    def __len__(self): return self.n
    def __iter__(self): return ((torch.tensor([ex['x']]), torch.tensor([ex['y']])) for ex in self.ds)
    def state_dict(self): return self.ds.state_dict()
    def load_state_dict(self, sd): self.ds.load_state_dict(sd)
    def set_epoch(self, e): self.ds.set_epoch(e)

def made_once(tmp_path_factory, make):
    "`ref(*args)`: a new folder in which `make(folder, *args)` ran (a reference run), made once for each `args`, at its first use"
    @functools.cache
    def ref(*args):
        make(d := tmp_path_factory.mktemp('ref'), *args)
        return d
    return ref

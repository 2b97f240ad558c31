"refusal_script.py on a disk that fills up: from the `FULL_AFTER`-th file `write_atomic` writes, each write fails with ENOSPC (test_refusals.py)"
import errno, os, runpy, sys
from pathlib import Path

class _Full:
    "A file on a full disk"
    def __init__(self, f): self.f = f
    def write(self, b): raise OSError(errno.ENOSPC, 'No space left on device')
    def __getattr__(self, k): return getattr(self.f, k)
    def __enter__(self): return self
    def __exit__(self, *exc): self.f.close()

_fdopen,_n = os.fdopen,[0]
def _fdopen_full(fd, mode='r', *args, **kwargs):
    f = _fdopen(fd, mode, *args, **kwargs)
    if sys._getframe(1).f_globals.get('__name__') != 'resumable_train.files': return f
    _n[0] += 1
    return _Full(f) if _n[0] >= int(os.environ['FULL_AFTER']) else f
os.fdopen = _fdopen_full
sys.argv = [str(Path(__file__).parent/'refusal_script.py'), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name='__main__')

"Fixtures shared by the process-level tests"
import pytest, torch
from forked import Forker

@pytest.fixture(scope='session')
def forker():
    "Forks real child processes from this one, which imports fastai and the package once (see forked.py)"
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 gives the real subprocesses: runs compared bitwise use the same thread count
    return Forker()

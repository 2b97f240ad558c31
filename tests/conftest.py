"Fixtures shared by the process-level tests"
import re
import pytest, torch
from forked import Forker
from helpers import LIBRARY_WARNINGS, quiet_library_warnings

quiet_library_warnings()  # the processes the tests start

def pytest_configure(config):
    "pytest's own filters for `LIBRARY_WARNINGS` (it puts its filters back around collection and each test)"
    for msg,cat,_ in LIBRARY_WARNINGS: config.addinivalue_line('filterwarnings', f'ignore:{re.escape(msg)}:{cat}')

@pytest.fixture(scope='session')
def forker():
    "Forks real child processes from this one, which imports fastai and the package once (see forked.py)"
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 gives the real subprocesses: runs compared bitwise use the same thread count
    return Forker()

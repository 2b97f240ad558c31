"Fixtures shared by the process-level tests"
import re
import pytest, torch
from forked import Forker, stock_server
from helpers import LIBRARY_WARNINGS, own_temporary_folder, quiet_library_warnings

quiet_library_warnings()  # the processes the tests start
own_temporary_folder('resumable-train-tests-')  # what the processes the tests start and kill leave, removed at the end

def pytest_configure(config):
    "pytest's own filters for `LIBRARY_WARNINGS` (it puts its filters back around collection and each test)"
    for msg,cat,_ in LIBRARY_WARNINGS: config.addinivalue_line('filterwarnings', f'ignore:{re.escape(msg)}:{cat}')

@pytest.fixture(scope='session')
def forker():
    "Forks real child processes from this one, which imports fastai and the package once (see forked.py)"
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 gives the real subprocesses: runs compared bitwise use the same thread count
    return Forker()

@pytest.fixture(scope='session')
def stock():
    "Stock fastai's runs of the scripts that take `--stock`: children of a process that never imports the package (see forked.py)"
    yield from stock_server(('fastai.basics', 'fastai.callback.all', 'fastai.test_utils', 'sklearn.datasets', 'killrerun'))

class Progress:
    """What the suite says while it runs (tests/run.sh gives it a file descriptor in `RESUMABLE_TRAIN_PROGRESS_FD`): each test file's
    counts as its last test ends, and every `every` seconds without one, what is still running, so that no stretch is silent"""
    def __init__(self, fd:int, every:float=25):
        import os, threading, time
        self.out,self.every,self.t0,self.last = os.fdopen(fd, 'w', buffering=1),every,time.monotonic(),time.monotonic()
        self.todo,self.done,self.lock = {},{},threading.Lock()
        threading.Thread(target=self._beat, daemon=True).start()

    def _say(self, msg):
        import time
        with self.lock:
            self.out.write(f"   [{time.monotonic()-self.t0:4.0f}s] {msg}\n"); self.last = time.monotonic()

    def _beat(self):
        import time
        while True:
            time.sleep(1)
            if time.monotonic() - self.last < self.every: continue
            busy = [f for f,n in self.todo.items() if 0 < sum(self.done.get(f, {}).values()) < n] or [
                f for f in self.todo if f not in self.done]
            self._say(f"running: {', '.join(busy[:4]) or '...'}; {sum(sum(c.values()) for c in self.done.values())} tests done")

    def collected(self, ids):
        for i in ids:
            f = i.split('::')[0]
            self.todo[f] = self.todo.get(f, 0) + 1

    def report(self, rep):
        if rep.when != 'call' and not (rep.when == 'setup' and not rep.passed): return
        f,outcome = rep.nodeid.split('::')[0],rep.outcome
        c = self.done.setdefault(f, {})
        c[outcome] = c.get(outcome, 0) + 1
        if sum(c.values()) == self.todo.get(f, -1):
            self._say(f"{f}: " + ', '.join(f"{n} {k}" for k,n in sorted(c.items())))

_progress = None

def pytest_sessionstart(session):
    "The process that reports (the controller, under xdist) says what runs"
    global _progress
    import os
    fd = os.environ.get('RESUMABLE_TRAIN_PROGRESS_FD')
    if fd and not hasattr(session.config, 'workerinput'): _progress = Progress(int(fd))

def pytest_collection_finish(session):
    if _progress is not None and not session.config.pluginmanager.hasplugin('dsession'):
        _progress.collected([i.nodeid for i in session.items])

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if _progress is not None and not _progress.todo: _progress.collected(ids)  # every worker collects every file: count once

def pytest_runtest_logreport(report):
    if _progress is not None: _progress.report(report)

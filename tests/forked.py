"""Real child processes without paying for `import fastai` each time.

`Forker` imports fastai and `resumable_train` once in the test process, then forks one child per run. A child is a real process:
it has its own pid and session (`os.setsid`), it can be killed with SIGKILL or stopped with SIGTERM, its DataLoader workers are its
own children, and nothing it does reaches the test process. It runs a script as `python script args...` would (`runpy`, `sys.argv`,
`__main__`), with the environment and working directory given. The object it returns behaves like `subprocess.Popen` for what the
tests use: `pid`, `stdout` (text lines, stderr merged), `poll`, `wait`, `communicate`, `send_signal`, `returncode` (negative for a
signal, as Popen reports it).

Fork only from a process that has not trained anything (no OpenMP threads started): the test process only imports.
"""
import atexit, io, json, os, queue, runpy, shutil, signal, subprocess, sys, tempfile, threading, time, traceback, warnings

class ForkedChild:
    "A forked child running a script; the subset of `subprocess.Popen` the tests use"
    def __init__(self, pid, fd):
        self.pid,self.returncode = pid,None
        self.stdout = io.TextIOWrapper(io.FileIO(fd, 'r'), encoding='utf-8', errors='replace')

    def _status(self, st):
        self.returncode = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
        return self.returncode

    def poll(self):
        if self.returncode is None:
            pid,st = os.waitpid(self.pid, os.WNOHANG)
            if pid: self._status(st)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline: raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None: os.kill(self.pid, sig)

    def kill_group(self):
        "SIGKILL the child's whole session (its DataLoader workers too)"
        try: os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError): pass

    def communicate(self, timeout=None):
        "Read all output and wait, at most `timeout` seconds; returns `(out, '')` (stderr is merged into stdout)"
        out,done = [],threading.Event()
        def pump():
            try: out.append(self.stdout.read())
            finally: done.set()
        threading.Thread(target=pump, daemon=True).start()
        try: self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            self.wait(10)
            done.wait(5)
            raise
        self.kill_group()  # workers the child left behind
        done.wait(10)
        return ''.join(out), ''

def _show_warning(msg):
    "Python's own way of showing a warning: on stderr"
    try: (msg.file or sys.stderr).write(warnings._formatwarnmsg(msg))
    except (OSError, AttributeError): pass

def _fresh_warnings():
    "Warnings as a new python process has them: the test process's (pytest records them instead of printing) would hide the child's"
    warnings.resetwarnings()
    for c in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning): warnings.simplefilter('ignore', c)
    warnings.filterwarnings('default', category=DeprecationWarning, module='__main__')
    warnings._showwarnmsg_impl,warnings.showwarning = _show_warning,warnings._showwarning_orig

def _without_torch_library_finalizers():
    """Leave out, at a forked child's exit, the finalizers of torch.library: they take the operators it registered out of this process's
    own dispatcher, which nothing outside the process sees, and each child paid ~30 ms of CPU for them (copies of the parent's pages they
    touch). Every other exit function runs, as python runs it (`TemporaryDirectory`'s removal, W&B's, the package's own)"""
    import weakref
    for info in list(weakref.finalize._registry.values()):  # `weakref.finalize`'s own table: the objects `atexit` would run
        if getattr(info.func, '__module__', None) == 'torch.library': info.atexit = False

def _child(script, args, env, cwd, w):
    "Run in the forked child: become a new session, send output to `w`, run `script` as `__main__`, never return"
    code = 1
    try:
        os.setsid()
        os.dup2(w, 1); os.dup2(w, 2); os.close(w)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, 'w', closefd=False), encoding='utf-8', line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, 'w', closefd=False), encoding='utf-8', line_buffering=True)
        sys.stdin = open(os.devnull)
        for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP): signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _fresh_warnings()
        os.environ.update(env or {})
        tempfile.tempdir = None  # the temporary folder the environment names (TMPDIR), as a new process finds it
        if cwd: os.chdir(cwd)
        for k in ('last_type', 'last_value', 'last_traceback', 'last_exc'): sys.__dict__.pop(k, None)  # a new process has none
        sys.argv = [str(script), *map(str, args)]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        try:
            runpy.run_path(str(script), run_name='__main__')
            code = 0
        except SystemExit as e: code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except KeyboardInterrupt:
            traceback.print_exc()
            sys.stdout.flush(); sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)  # as python itself reports an uncaught Ctrl-C: killed by SIGINT
        except BaseException:  # as python reports it (the package's hook shows a refusal alone), and keeps it for `atexit`
            sys.last_type,sys.last_value,sys.last_traceback = sys.exc_info()
            sys.excepthook(*sys.exc_info())
        _without_torch_library_finalizers()
        atexit._run_exitfuncs()  # as python does at exit (a forked child leaves by `os._exit`)
    finally:
        try: sys.stdout.flush(); sys.stderr.flush()
        except BaseException: pass
        os._exit(code)

class Forker:
    "Forks children that run scripts, from a process that imported `modules` once"
    def __init__(self, modules=('fastai.basics', 'fastai.callback.all', 'resumable_train.all')):
        import gc, importlib
        for m in modules: importlib.import_module(m)
        gc.freeze()  # the imported objects out of the collector's reach: a child's collections then leave their pages shared (~70% fewer
                     # page copies, ~25% less CPU for a small run)

    def start(self, script, *args, env=None, cwd=None)->ForkedChild:
        "Fork a child running `script` with `args`; like `Popen([python, script, *args], start_new_session=True)`"
        r,w = os.pipe()
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(script, args, env, cwd, w)
        os.close(w)
        return ForkedChild(pid, r)

    def run(self, script, *args, timeout, env=None, cwd=None):
        "Run `script` to its end (killed after `timeout` seconds); returns `(returncode, output)`"
        p = self.start(script, *args, env=env, cwd=cwd)
        try: out,_ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired: return -signal.SIGKILL, f'[forked] killed after {timeout}s timeout'
        return p.returncode, out

class StockForker:
    """`Forker.run` from a process of its own that imported `modules` and never the package: stock fastai's runs (a child that imports
    the package fails), without paying for `import fastai` each time. One request at a time: a run, or the runs of one job at once"""
    def __init__(self, modules=('fastai.basics', 'fastai.callback.all'), timeout=120):
        from helpers import test_env
        self.p = subprocess.Popen([sys.executable, __file__, *modules], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=test_env(), start_new_session=True)
        self.lines = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(l) for l in self.p.stdout], daemon=True).start()
        assert self._line(timeout) == 'READY', "the stock server did not start"

    def _line(self, timeout)->str:
        try: return self.lines.get(timeout=timeout).strip()
        except queue.Empty: raise subprocess.TimeoutExpired('stock server', timeout) from None

    def start(self, *runs)->'StockRuns':
        """Start each of `runs` (dicts of `script`, `args`, `env`, `cwd`) in a child of the stock server, all at once (the ranks of one
        job); wait for them with `.result` before the next request. They run beside whatever this process does meanwhile, without a
        thread of its own waiting on them (with one, a child forked meanwhile by `Forker` once hung in its DataLoader)"""
        return StockRuns(self, runs)

    def run(self, script, *args, timeout, env=None, cwd=None):
        "Run `script` to its end in a child of the stock server (killed after `timeout` seconds); returns `(returncode, output)`"
        return self.start(dict(script=script, args=args, env=env, cwd=cwd)).result(timeout)[0]

    def close(self):
        try: os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError): pass
        self.p.wait(10)

class StockRuns:
    "Runs started in children of a stock server (`StockForker.start`)"
    def __init__(self, server, runs):
        self.server,self.dir = server,tempfile.mkdtemp(prefix='stock-run-')  # the children's output, gone once read
        self.logs = [os.path.join(self.dir, f'out{i}') for i in range(len(runs))]
        req = [dict(script=str(r['script']), args=list(map(str, r.get('args', ()))), env=r.get('env') or {},
                    cwd=str(r['cwd']) if r.get('cwd') else None, log=log) for r,log in zip(runs, self.logs)]
        server.p.stdin.write(json.dumps(req) + '\n'); server.p.stdin.flush()
        self.pids = list(map(int, server._line(30).split()))

    def _kill(self):
        for pid in self.pids:
            try: os.killpg(pid, signal.SIGKILL)  # with the workers the child left behind
            except (ProcessLookupError, PermissionError): pass

    def result(self, timeout)->list:
        "Wait for the runs to end (all killed after `timeout` seconds); `(returncode, output)` of each"
        try:
            try: rcs = list(map(int, self.server._line(timeout).split()))
            except subprocess.TimeoutExpired:
                self._kill()
                rcs = list(map(int, self.server._line(30).split()))
            finally: self._kill()
            outs = []
            for log in self.logs:
                with open(log) as f: outs.append(f.read())
            return list(zip(rcs, outs))
        finally: shutil.rmtree(self.dir, ignore_errors=True)

def stock_server(modules):
    "A `StockForker` importing `modules` for a pytest fixture: yielded, then closed"
    s = StockForker(modules=modules)
    yield s
    s.close()

def _serve(modules):
    """The stock server: import `modules`, then for each request line (a list of runs) fork a child for each run; print their pids, then
    once every one ended their return codes"""
    import gc, importlib
    for m in modules: importlib.import_module(m)
    gc.freeze()
    out = sys.stdout
    print('READY', file=out, flush=True)
    for line in sys.stdin:
        pids = []
        for req in json.loads(line):
            w = os.open(req['log'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            pid = os.fork()
            if pid == 0: _child(req['script'], req['args'], req['env'], req['cwd'], w)
            os.close(w)
            pids.append(pid)
        print(*pids, file=out, flush=True)
        sts = [os.waitpid(pid, 0)[1] for pid in pids]
        print(*[-os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st) for st in sts], file=out, flush=True)

class _NoPackage:
    "In a stock child: importing the package fails"
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'resumable_train': raise ImportError("a stock fastai run (StockForker) imported resumable_train")

if __name__ == '__main__':
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.meta_path.insert(0, _NoPackage())
    _serve(sys.argv[1:])

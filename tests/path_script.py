"""The path of one resume point from whoever writes it to the disk: each chain of the package's modules on the call stack while
`AutoResume._save` (one in the foreground) or `Learner.save(with_iter=True)` runs, printed as JSON (see test_path.py)"""
import json, os, sys, tempfile, warnings
from fastai.test_utils import synth_learner
import resumable_train
from resumable_train.all import *
from resumable_train.autoresume import AutoResume as _AutoResume

PKG = os.path.dirname(resumable_train.__file__)

def traced(f):
    "Run `f()`; the chains of package modules (consecutive frames of one module as one) on the stack at each call, and at the write"
    stack,chains,write = [],[],[]
    def prof(frame, event, arg):
        if event == 'return' and stack: stack.pop()
        if event != 'call': return
        fn = frame.f_code.co_filename
        stack.append(os.path.basename(fn)[:-3] if fn.startswith(PKG) else None)
        chain = _chain(stack)
        if chain not in chains: chains.append(chain)
        if frame.f_code.co_name == 'save' and frame.f_globals.get('__name__') == 'torch.serialization': write.append(chain)
    sys.setprofile(prof)
    try: f()
    finally: sys.setprofile(None)
    return dict(chains=chains, write=write)

def _chain(stack)->list:
    "The package's modules in `stack`, outermost first, each run of frames of one module (or of other code between) once"
    out = []
    for m in stack:
        if m and (not out or out[-1] != m): out.append(m)
    return out

out = {}
def save_traced(self, *args, **kwargs):
    "`AutoResume._save`, its first call traced"
    if 'autoresume' in out: return _save(self, *args, **kwargs)
    res = []
    out['autoresume'] = traced(lambda: res.append(_save(self, *args, **kwargs)))
    return res[0]
_save,_AutoResume._save = _AutoResume._save,save_traced

warnings.simplefilter('ignore')
learn = synth_learner(path=tempfile.mkdtemp())
with learn.no_logging(): learn.fit(1, cbs=AutoResume(every_iter=3))
out['learner'] = traced(lambda: learn.save('stage', with_iter=True))
print(json.dumps(out))

"""A notebook cell with fit calls, interrupted and run again in the same process: `python cell_script.py OUT [options]`.

The cell is run `--runs` times; a run that is interrupted (Ctrl-C, or an exception) is run once more, as a notebook user runs the cell
again. With `--ipython` the cell is run by IPython, as in a notebook; otherwise it is a function, called again after the exception is
caught. The result (weights, optimizer, `Recorder`, optimizer steps) goes to OUT for `killrerun.compare`. `--stock` runs the cell as
stock fastai: the package never imported, no `AutoResume`, never interrupted.
"""
import argparse, os, signal, sys
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from fastai.test_utils import synth_dbunch
from killrerun import Report, save_result

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('--cell', default='two', choices=['two', 'same', 'loop', 'fine_tune', 'one'],
               help='two calls with other hyperparameters; the same call on two lines; the same call twice in a loop; fine_tune; one call')
p.add_argument('--runs', type=int, default=1, help='how many times the cell is run')
p.add_argument('--again', default=None, help='the cell run after the interruption, if another one (a changed cell)')
p.add_argument('--ipython', action='store_true', help='run the cell in IPython')
p.add_argument('--stop', default=None, choices=['sigint', 'error'], help='how the first run of the cell is interrupted')
p.add_argument('--at', type=int, default=None, help='the training batch (counted in the process, from 1) that is interrupted')
p.add_argument('--every', type=int, default=1)
p.add_argument('--stock', action='store_true', help='stock fastai: the package never imported (no --stop)')
a = p.parse_args()
if a.stock and a.stop: p.error('a --stock run is never interrupted')
if not a.stock:
    from resumable_train.autoresume import AutoResume

    class Interrupt(Callback):
        "After the `n`-th training batch of the process, send this process SIGINT (as Ctrl-C does) or raise"
        order = AutoResume.order-1
        def __init__(self, n, how): self.n,self.how,self.seen = n,how,0
        def after_batch(self):
            if not self.training: return
            self.seen += 1
            if self.seen != self.n: return
            if self.how == 'sigint': os.kill(os.getpid(), signal.SIGINT)
            else: raise RuntimeError('boom')

set_seed(11, reproducible=True)
dls = synth_dbunch(bs=8, n_train=6, n_valid=2)
model = nn.Sequential(nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Dropout(0.2)), nn.Linear(16, 1))
cbs = [Report()] + ([] if a.stock else [AutoResume(every_iter=a.every)] + ([Interrupt(a.at, a.stop)] if a.stop else []))
learn = Learner(dls, model, loss_func=MSELossFlat(), metrics=mae, cbs=cbs, path='.', lr=1e-2,
                splitter=lambda m: [list(m[0].parameters()), list(m[1].parameters())])

CELLS = {'two': "learn.fit_one_cycle(1)\nlearn.fit_one_cycle(1, lr_max=3e-3)", 'same': "learn.fit_one_cycle(1)\nlearn.fit_one_cycle(1)",
         'loop': "for _ in range(2): learn.fit_one_cycle(1)", 'fine_tune': "learn.fine_tune(1, freeze_epochs=1)", 'one': "learn.fit_one_cycle(1)"}

if a.ipython:
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.user_ns['learn'] = learn
    def run(cell):
        "Run the cell as a notebook does; the error that interrupted it, if any"
        return shell.run_cell(CELLS[cell], store_history=True).error_in_exec
else:
    def run(cell):
        "Call the cell's code as a function; the error that interrupted it, if any"
        try: exec(compile(CELLS[cell], 'cell', 'exec'), dict(learn=learn))
        except (KeyboardInterrupt, Exception) as e: return e

with learn.no_bar():
    for _ in range(a.runs):
        if (e := run(a.cell)) is None: continue
        print('INTERRUPTED', type(e).__name__, e, flush=True)
        if (e := run(a.again or a.cell)) is not None: print('REFUSED', type(e).__name__, e, flush=True); sys.exit(3)
save_result(learn, a.out)
print('STEPS', learn.steps, flush=True)
print('DONE', flush=True)

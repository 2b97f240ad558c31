"""The digits CNN of `resumable-train demo` with `AutoResume` and the trackers of issue 21, for `killrerun`.

`python trackers_script.py OUT [tb] [wandb] [stock]` trains 3 epochs (`AutoResume(every_iter=5)`), logging to TensorBoard (`tb`,
a default `log_dir` under `runs/`) and to W&B (`wandb`, the run id from `wandb_id`; the test sets `WANDB_MODE=offline`
and `WANDB_DIR`), then writes `save_result`. `stock` trains the same run as stock fastai: the package never imported, no
`AutoResume`, the Learner built by `digits_learner`'s own code (`helpers.stock_digits_learner`), a fixed W&B run id.
"""
import sys, warnings
import torch
from fastai.callback.schedule import *  # noqa: F401,F403 (fit_one_cycle)
from killrerun import Report, save_result

warnings.filterwarnings('ignore')
out,kinds = sys.argv[1],sys.argv[2:]
stock = 'stock' in kinds
torch.set_num_threads(1)
if stock:
    from helpers import stock_digits_learner
    digits_learner,cbs = stock_digits_learner(),[Report()]
else:
    from resumable_train.autoresume import AutoResume
    from resumable_train.cli import digits_learner

    class LateReport(Report):
        "`Report` after `AutoResume`: a kill in its pause finds the batch it printed in the reach mark (see `runlog`)"
        order = AutoResume.order+1
    cbs = [AutoResume(every_iter=5), LateReport()]
if 'tb' in kinds:
    from fastai.callback.tensorboard import TensorBoardCallback
    cbs.append(TensorBoardCallback(trace_model=False, log_preds=False))
learn = digits_learner('.', cbs=cbs)
if 'wandb' in kinds:
    import wandb
    from fastai.callback.wandb import WandbCallback
    if not stock: from resumable_train.trackers import wandb_id
    wandb.init(project='resumable-train-tests', id='stockrun' if stock else wandb_id(learn), resume='allow')  # offline: see test_trackers.py
    from helpers import wandb_config_fix
    wandb_config_fix()
    learn.add_cb(WandbCallback(log_preds=False))
with learn.no_bar(): learn.fit_one_cycle(3, 3e-2)  # no bar: `LateReport` prints after it, on lines of its own
save_result(learn, out)
if 'wandb' in kinds: wandb.finish()  # the forked child ends without running atexit
if not stock: print('RESUMED_ITER', learn.auto_resume.resumed_iter)

"""Each callback fastai ships, with its defaults, on the data it is meant for (issue 48's matrix): `python matrix_script.py OUT
--cb CB [--no-resume]`.

A small classifier of random 3x8x8 images (two classes, 9 training batches and 3 validation batches an epoch) is trained with
`fit_one_cycle(4)` and the callback `CB`, with `AutoResume(every_iter=3)` unless `--no-resume` (stock fastai: the package never
imported). Lines for a test to kill the script at: `VALID` at each epoch's first validation batch, `END` once every callback's
`after_epoch` ran, `NESTED` after a call a callback makes inside an event (`mcdropout`: `get_preds` with `MCDropoutCallback` in
`after_epoch`, as a user scores uncertainty each epoch; `wandb`: inside the predictions `WandbCallback(log_preds=True)` makes in each
`after_validate`, whose first batch says `VALID` too). `wandb` trains on fastai's types (`TensorImage`, `Categorize`), which its
predictions table needs; the test's environment runs W&B offline. The result (`save_result`) holds, beside the weights, the optimizer
and the `Recorder`: the random streams at the end, and every plain attribute (numbers, strings, tensors) of each fastai callback.
"""
import argparse, random
from functools import partialmethod
import numpy as np, torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from helpers import wandb_config_fix
from killrerun import Report, Windows, plain, save_result, say

CBS = {'csv': lambda: CSVLogger(), 'graph': lambda: ShowGraphCallback(), 'stats': lambda: ActivationStats(),
       'save': lambda: SaveModelCallback(), 'early': lambda: EarlyStoppingCallback(),
       'plateau': lambda: ReduceLROnPlateau(), 'nan': lambda: TerminateOnNaNCallback(), 'accum': lambda: GradientAccumulation(),
       'clip': lambda: GradientClip(), 'bnfreeze': lambda: BnFreeze(), 'mixup': lambda: MixUp(), 'cutmix': lambda: CutMix(),
       'channels': lambda: ChannelsLast(), 'short': lambda: ShortEpochCallback(), 'mcdropout': None, 'cancels': None,
       'cancel-fit': None, 'wandb': None, 'late': None}
p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('--cb', required=True, choices=list(CBS))
p.add_argument('--no-resume', action='store_true', help='stock fastai: the package never imported')
a = p.parse_args()

class Uncertainty(Callback):
    "Score the validation set with dropout on (`MCDropoutCallback`) at each epoch's end"
    def after_epoch(self):
        learn = self.learn
        with learn.removed_cbs(self): learn.scores = learn.get_preds(dl=learn.dls.valid, cbs=MCDropoutCallback())[0].sum()
        say('NESTED')

class Late(Callback):
    "A user's callback ordered after `AutoResume`, which draws at each batch's and epoch's end: its draws are in the resume points"
    order = 100
    def after_batch(self):
        if not self.training: return
        if self.train_iter % 3 == 0: say('LATE')  # after `AutoResume`'s periodic point would be written at its own place
        self.learn.drawn = torch.rand(1)
    def after_epoch(self):
        say('LATE_EPOCH')
        learn = self.learn
        with learn.removed_cbs(self): learn.scores = learn.get_preds(dl=learn.dls.valid.new(shuffle=True))[0].sum()

class Predicting(Callback):
    "Say `NESTED` at the 2nd batch of the predictions `WandbCallback(log_preds=True)` makes in each `after_validate` (without itself)"
    def after_batch(self):
        if not self.training and self.iter == 1 and not any(type(c).__name__ == 'WandbCallback' for c in self.learn.cbs): say('NESTED')

# `cancels`: each `Cancel*Exception` raised in each event where fastai's loop catches it, at `(epoch, iter)` (`None`: any);
# validation's batches are told by `valid` (the event's phase); 12 epochs
C = dict(batch=CancelBatchException, step=CancelStepException, backward=CancelBackwardException, train=CancelTrainException,
         valid=CancelValidException, epoch=CancelEpochException, fit=CancelFitException)
CANCELS = [(0, 1, 'after_pred', 'batch'), (0, 3, 'before_batch', 'train'), (0, None, 'before_validate', 'valid'),
           (1, 2, 'before_backward', 'batch'), (1, 5, 'after_loss', 'train'), (1, 'valid1', 'after_pred', 'valid'),
           (2, 4, 'before_step', 'step'), (2, 6, 'after_step', 'batch'), (2, None, 'after_train', 'epoch'),
           (3, 1, 'before_backward', 'backward'), (3, 6, 'after_batch', 'train'), (3, 'valid0', 'after_batch', 'valid'),
           (4, 3, 'after_backward', 'batch'), (4, 7, 'after_batch', 'epoch'),
           (5, 5, 'before_step', 'train'), (5, None, 'before_validate', 'epoch'),
           (6, None, 'before_epoch', 'epoch'), (7, None, 'before_train', 'train'), (7, 'valid2', 'after_loss', 'valid'),
           (8, 0, 'after_loss', 'batch'), (8, 2, 'before_batch', 'batch'), (8, 4, 'after_backward', 'train'),
           (8, None, 'after_validate', 'epoch'), (9, 2, 'after_pred', 'train'), (9, 'valid1', 'after_batch', 'epoch'),
           (10, 3, 'before_step', 'batch'), (10, 7, 'after_step', 'train'), (10, 'valid1', 'before_batch', 'valid'),
           (11, 4, 'before_backward', 'train'), (11, None, 'before_train', 'epoch')]

class Cancels(Callback):
    "Raise `CANCELS`'s exceptions where they say (`cancel-fit`: `CancelFitException` at batch 4 of epoch 2)"
    def __init__(self, table): self.table = table
    def _at(self, event):
        it = getattr(self.learn, 'iter', None)  # at an epoch's or a phase's start: the last phase's (`None` in the table)
        it = it if self.training else f"valid{it}"
        for e,i,ev,k in self.table:
            if ev == event and e == self.epoch and i in (None, it): raise C[k]()
for _ev in {ev for *_,ev,_ in CANCELS} | {'after_batch'}: setattr(Cancels, _ev, partialmethod(Cancels._at, _ev))

set_seed(7, reproducible=True)
x = torch.randn(96, 3, 8, 8)
items = [(x[i], int(x[i, 0].mean() > 0)) for i in range(96)]
dls = DataLoaders.from_dsets(items[:72], items[72:], bs=8, num_workers=0, device='cpu')
if a.cb == 'wandb':  # the same items as fastai's image and category types, which `log_preds` decodes and draws (`wandb_process`)
    dls = Datasets(range(96), [lambda i: TensorImage(x[i]), [lambda i: items[i][1], Categorize()]],
                   splits=[range(72), range(72, 96)]).dataloaders(bs=8, num_workers=0, device='cpu')
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3),
                      nn.Linear(8, 2))
if a.cb == 'bnfreeze': model[1].requires_grad_(False)  # a frozen body's BatchNorm, whose statistics BnFreeze keeps
cb = (Uncertainty() if a.cb == 'mcdropout' else Late() if a.cb == 'late' else Cancels(CANCELS) if a.cb == 'cancels'
      else Cancels([(2, 4, 'after_batch', 'fit')]) if a.cb == 'cancel-fit' else Predicting() if a.cb == 'wandb' else CBS[a.cb]())
ar = []
if not a.no_resume:
    from resumable_train.autoresume import AutoResume
    ar = [AutoResume(every_iter=3, verbose=False)]
learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, path='.', cbs=[Report(), Windows(), cb, *ar])
if a.cb == 'wandb':  # offline: the test's environment says where; one W&B run across the reruns (`wandb_id`)
    import wandb
    from fastai.callback.wandb import WandbCallback
    wandb_config_fix()
    if not a.no_resume: from resumable_train.trackers import wandb_id
    wandb.init(project='resumable-train-tests', id='stockrun' if a.no_resume else wandb_id(learn), resume='allow')
    learn.add_cb(WandbCallback())  # its defaults: `log_preds=True`, predictions at each `after_validate`, logged in `after_fit`
if a.cb == 'graph':  # it draws on the progress bar, which prints nothing here: `Report`'s lines stay whole
    import fastprogress.fastprogress as fp
    fp.printing = lambda: False
    learn.fit_one_cycle(4, 1e-2)
else:
    with learn.no_bar(): learn.fit_one_cycle(12 if a.cb == 'cancels' else 4, 1e-2)
save_result(learn, a.out)
if a.cb == 'wandb': wandb.finish()
# the random streams, and the fastai callbacks' plain attributes, beside `save_result`'s
r = torch.load(a.out, weights_only=True)
r['streams'] = [torch.get_rng_state(), torch.tensor(random.getstate()[1]), torch.from_numpy(np.random.get_state()[1].astype(np.int64))]
def attrs(c):  # but the wall-clock times: the `Recorder`'s, and `WandbCallback`'s at a batch's start
    return plain({k: v for k,v in vars(c).items() if isinstance(v, (int, float, str, bool, torch.Tensor))
                  and k not in ('start_epoch', 'ti_batch')})
r['cbs'] = {type(c).__name__: attrs(c) for c in learn.cbs if type(c).__module__.startswith('fastai.')}
torch.save(r, a.out)
print('DONE', flush=True)

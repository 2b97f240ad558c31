"""Scripts whose callbacks nest, cancel and retry fastai's events (issue 48): `python owned_script.py OUT --shape SHAPE [--no-resume]`.

Shapes (each `fit_one_cycle(4)` on 9 batches an epoch, unless it says otherwise; a line `NESTED` is printed after each call a
callback makes inside an event, and `VALID` at each epoch's first validation batch, so that a test can kill the script there):
- `one-batch`: a callback runs `learn.one_batch` on a validation batch in `after_epoch`, as `TensorBoardCallback(log_preds=True)` does;
- `get-preds`: a callback scores a test set in `after_epoch` with `removed_cbs(self)` and `get_preds` (fastai's `FetchPredsCallback`);
- `validate`: a callback runs `learn.validate()` in `after_epoch`, itself removed;
- `fit-inside`: a callback fits one more epoch inside `after_epoch`, itself removed (a `fit` inside an event);
- `after-fit`: two fit calls, and a callback whose `after_fit` runs `get_preds` over the shuffled, augmented training loader;
- `cancel-epoch`: a callback ends every epoch after 5 batches (`CancelEpochException` in `after_batch`);
- `cancel-valid`: validation on even epochs only (`CancelEpochException` in `after_train`), and a callback that acts on `learn.iter`;
- `retry`: a transient `RuntimeError` at the 14th batch (once per folder), caught by the script, which calls `fit_one_cycle(4)` again;
- `fallback`: the same error, and the script falls back to `fit_one_cycle(2, 1e-3)`;
- `exit`: the same error, and the script exits 1 (a scheduler job, requeued);
- `retry-fails`: the error at the 14th batch of every attempt, and the script tries `fit_one_cycle(4)` 3 times, then gives up;
- `tensorboard`: fastai's `TensorBoardCallback()` and `AutoResume()` with their defaults (the model traced; `log_preds`: `one_batch` and
  `show_results` inside `after_epoch`) on an image `DataBlock` of random 16x16 images, `fit_one_cycle(3)` of 6 batches an epoch;
- `gan`: fastai's `GANLearner.wgan` (its `GANTrainer` switches generator and critic with `FixedGANSwitcher`) on random 16x16
  images, `fit(3)` of 8 batches an epoch; `gan-adaptive`: the same with `AdaptiveGANSwitcher()`;
- `events`: a callback calls the Learner inside many events: `validate` in `before_epoch`, `one_batch` in `after_train`,
  `predict` in `before_validate`, `get_preds` with `MCDropoutCallback` in `after_validate` (a call inside a training batch
  leaves fastai's loop in validation mode for the rest of the epoch: not a shape users write).
"""
import argparse, os, sys
from pathlib import Path
import torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from killrerun import Report, Windows, save_result, say

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('--shape', required=True, choices=['one-batch', 'get-preds', 'validate', 'fit-inside', 'after-fit', 'cancel-epoch',
                                                  'cancel-valid', 'retry', 'fallback', 'retry-fails', 'exit', 'gan', 'tensorboard',
                                                  'gan-adaptive', 'events'])
p.add_argument('--no-resume', action='store_true', help='stock fastai: the package never imported')
a = p.parse_args()

def noise(t): return t + 0.01*torch.randn(t.shape)  # an item transform that draws from torch's stream
set_seed(5, reproducible=True)
x = torch.randn(96, 1)
items = [(x[i], 2*x[i]+1) for i in range(96)]
dls = DataLoaders.from_dsets(items[:72], items[72:], bs=8, after_item=[noise], num_workers=0, device='cpu')
test_dl = dls.test_dl(items[72:], with_labels=True)

class Nested(Callback):
    "Call the Learner inside `after_epoch`, as the shape says"
    def after_epoch(self):
        learn = self.learn  # `removed_cbs` takes it from the callback
        if a.shape == 'one-batch': learn.one_batch(0, self.dls.valid.one_batch())
        else:
            with learn.removed_cbs(self):  # `validate` and `get_preds` send `after_epoch` too: without it, this again
                if a.shape == 'validate': learn.validate()
                elif a.shape == 'get-preds': learn.scores = learn.get_preds(dl=test_dl)[0].sum()
                else: learn.fit(1, 1e-3)
        say('NESTED')  # the call inside the event is over; the event is not

class Everywhere(Callback):
    "Call the Learner inside many events, itself removed"
    def _nested(self, f):
        learn = self.learn
        with learn.removed_cbs(self): f(learn)
        say('NESTED')
    def before_epoch(self):
        if self.epoch: self._nested(lambda l: l.validate())
    def after_train(self): self._nested(lambda l: l.one_batch(0, l.dls.valid.one_batch()))
    def before_validate(self): self._nested(lambda l: l.predict(items[80]))
    def after_validate(self): self._nested(lambda l: l.get_preds(dl=test_dl, cbs=MCDropoutCallback()))

class DrawsAtEnd(Callback):
    "Predict on the shuffled, augmented training loader at the end of each fit call: its order and its items draw"
    def after_fit(self):
        learn = self.learn
        with learn.removed_cbs(self): learn.get_preds(dl=learn.dls.train.new(shuffle=True))
        say('NESTED')

class CancelAfter5(Callback):
    def after_batch(self):
        if self.training and self.iter == 4: raise CancelEpochException()

class EvenValidation(Callback):
    "Validate on even epochs only; scale the loss by the batch's number (a callback acting on `learn.iter`)"
    def after_loss(self):
        if self.training: self.learn.loss_grad = self.learn.loss_grad * (1 + self.iter/10)
    def after_train(self):
        if self.epoch % 2: raise CancelEpochException()

class Flaky(Callback):
    "A transient error at the 14th batch, once in the folder (a flaky disk, a lost connection)"
    def after_batch(self):
        if self.training and self.train_iter == 14 and not Path('raised').exists() and not os.environ.get('NO_ERROR'):
            Path('raised').touch()
            raise RuntimeError('transient')

class Failing(Callback):
    "An error at the 14th batch of every fit call (a bug that no retry gets past)"
    def after_batch(self):
        if self.training and self.train_iter == 14: raise RuntimeError('failing')

class NoCallback(Callback): pass

cbs = {'gan': NoCallback, 'gan-adaptive': NoCallback, 'tensorboard': NoCallback, 'events': Everywhere, 'one-batch': Nested, 'get-preds': Nested, 'validate': Nested, 'fit-inside': Nested,
       'after-fit': DrawsAtEnd,
       'cancel-epoch': CancelAfter5, 'cancel-valid': EvenValidation, 'retry': Flaky, 'fallback': Flaky, 'exit': Flaky,
       'retry-fails': Failing}[a.shape]
if not a.no_resume: from resumable_train.autoresume import AutoResume
# `tensorboard`: the default AutoResume() too (a resume point at each epoch's end only, after `log_preds`'s batch)
ar = [] if a.no_resume else [AutoResume(every_iter=None if a.shape == 'tensorboard' else 3, verbose=False)]
if a.shape.startswith('gan'):
    from fastai.vision.gan import GANLearner, basic_generator, basic_critic, AdaptiveGANSwitcher
    noise,images = torch.randn(80, 16),torch.rand(80, 3, 16, 16)*2 - 1
    dls = DataLoaders.from_dsets(list(zip(noise[:64], images[:64])), list(zip(noise[64:], images[64:])), bs=8, device='cpu')
    switch = dict(switcher=AdaptiveGANSwitcher()) if a.shape == 'gan-adaptive' else {}
    learn = GANLearner.wgan(dls, basic_generator(16, 3, 16), basic_critic(16, 3), opt_func=partial(Adam, mom=0.), path='.',
                            cbs=[Report(), Windows(), *ar], **switch)
elif a.shape == 'tensorboard':
    import matplotlib; matplotlib.use('Agg')
    from PIL import Image
    from fastai.vision.all import ImageDataLoaders, Resize, CrossEntropyLossFlat
    from fastai.callback.tensorboard import TensorBoardCallback
    pixels = torch.randint(0, 256, (64, 16, 16, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    for i,p in enumerate(pixels):  # 32 images a class, made once in the run's folder
        f = Path('images')/'ab'[i % 2]/f'{i:02d}.png'
        if not f.exists(): f.parent.mkdir(parents=True, exist_ok=True); Image.fromarray(p.numpy()).save(f)
    dls = ImageDataLoaders.from_folder('images', valid_pct=0.25, seed=0, bs=8, item_tfms=Resize(16), num_workers=0, device='cpu')
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), path='.', cbs=[Report(), Windows(), TensorBoardCallback(), *ar])
else:
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    learn = Learner(dls, model, loss_func=lambda p,y: F.mse_loss(p.view(-1), y.view(-1)), cbs=[Report(), Windows(), cbs(), *ar],
                    path='.', lr=1e-2)
with learn.no_bar():
    if a.shape.startswith('gan'): learn.fit(3, 2e-4, wd=0.)
    elif a.shape == 'tensorboard': learn.fit_one_cycle(3, 1e-2)
    elif a.shape in ('retry', 'fallback', 'exit'):
        try: learn.fit_one_cycle(4)
        except RuntimeError as e:
            print('RAISED', e, flush=True)
            if a.shape == 'exit': sys.exit(1)  # a scheduler job: the requeued job is the rerun
            if a.shape == 'retry': learn.fit_one_cycle(4)
            else: learn.fit_one_cycle(2, 1e-3)
    elif a.shape == 'retry-fails':
        for attempt in range(3):
            try: learn.fit_one_cycle(4); break
            except RuntimeError as e: print('RAISED', attempt, e, flush=True)
    else:
        learn.fit_one_cycle(4 if a.shape != 'after-fit' else 2)
        if a.shape == 'after-fit': learn.fit(2, 1e-3)
save_result(learn, a.out)
print('DONE', flush=True)

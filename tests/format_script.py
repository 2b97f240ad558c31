"""A run that writes resume points with one version of the package, continued with another: `python format_script.py MODE DIR OUT`.

- `save`: train uninterrupted, writing `DIR/models/mid.pth` (inside epoch 2, after its batch 3) and `DIR/models/end1.pth` (at the end of
  epoch 1) with `learn.save`; this is how `tests/data/format3` was made, with resumable_train at the last commit that wrote format 3;
- `continue`: load each of the two and train the rest of the run, saving each result to `OUT.mid` and `OUT.end1`;
- `stock`: train uninterrupted without the package, saving the result to `OUT`.
"""
import sys
from pathlib import Path
from fastai.basics import *
from fastai.callback.all import *
from fastai.test_utils import synth_learner
from killrerun import Report, Draws, save_result

mode,d,out = sys.argv[1],Path(sys.argv[2]),sys.argv[3]
if mode != 'stock': import resumable_train.all  # noqa: F401 (patches Learner)

class Saves(Callback):
    "`learn.save` inside epoch 2 (after batch 3) and at the end of epoch 1"
    order = 95
    def after_batch(self):
        if self.training and self.epoch == 1 and self.iter == 2: self.learn.save('mid', with_iter=True)
    def after_epoch(self):
        if self.epoch == 0: self.learn.save('end1', with_iter=True)

def learner():
    set_seed(0, reproducible=True)
    return synth_learner(n_trn=6, path=d, cbs=[Report(), Draws()])

if mode == 'continue':
    for name in ('mid', 'end1'):
        learn = learner()
        learn.load(name)
        with learn.no_bar(): learn.fit_one_cycle(3, 1e-2)
        save_result(learn, f'{out}.{name}')
else:
    learn = learner()
    with learn.no_bar(): learn.fit_one_cycle(3, 1e-2, cbs=Saves() if mode == 'save' else None)
    save_result(learn, out)
print('DONE', flush=True)

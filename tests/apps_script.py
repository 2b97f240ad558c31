"""Train one of fastai's applications (or a plain Dataset or PyTorch DataLoader) with `AutoResume(every_iter=3)`, for `killrerun`.

`python apps_script.py OUT APP [--data DIR] [--then]`, run in the run's folder: APP is one of `LEARNERS`;
`--then` adds a fit call after the app's own (what a rerun that skips a completed fit call continues with).
`python apps_script.py OUTDIR --stock [--data DIR] [--apps APP...]` runs every app (or those given), one after the other in `OUTDIR/APP`, as stock fastai (the package
is never imported), without and with `--then`: `OUTDIR/APP.pth` and `OUTDIR/APP-then.pth` hold the results.
"""
import argparse, random, sys
from functools import partial
from pathlib import Path
import numpy as np, pandas as pd, torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *
from killrerun import Report, save_result

def digits_folder(path, n=12):
    "`n` images a class of scikit-learn's digits, as 16x16 PNGs in `path/{train,valid}/{class}` (made once)"
    from PIL import Image
    from sklearn.datasets import load_digits
    path = Path(path)
    if (path/'done').exists(): return path
    d = load_digits()
    for c in range(10):
        for j,i in enumerate(np.where(d.target == c)[0][:n]):
            f = path/('valid' if j % 4 == 0 else 'train')/str(c)/f'{i}.png'
            f.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray((d.images[i]*255/16).astype(np.uint8)).resize((16, 16)).convert('RGB').save(f)
    (path/'done').touch()
    return path

def vision(a):
    from fastai.vision.all import ImageDataLoaders, RandomResizedCrop, aug_transforms, vision_learner, xresnet18, accuracy
    dls = ImageDataLoaders.from_folder(digits_folder(a.data), bs=16, item_tfms=RandomResizedCrop(16, min_scale=0.5),
                                       batch_tfms=aug_transforms(size=16, min_scale=0.8), num_workers=2)
    arch = partial(xresnet18, widen=0.25)  # resnet18 is 13 times larger, and twice as slow on 16x16 images on a CPU
    learn = vision_learner(dls, arch, pretrained=False, metrics=accuracy, lr=1e-3)
    return learn, lambda: learn.fine_tune(1, freeze_epochs=1)

def tabular(a):
    from fastai.tabular.all import TabularDataLoaders, Categorify, FillMissing, Normalize, RegressionBlock, tabular_learner
    rng = np.random.default_rng(0)
    n = 96
    df = pd.DataFrame(dict(c=rng.choice(['a', 'b', 'c', 'd'], n), x1=rng.normal(size=n), x2=rng.normal(size=n)))
    df.loc[rng.choice(n, 10), 'x2'] = np.nan
    df['y'] = df.x1*2 + (df.c == 'a') + rng.normal(size=n)*0.1
    dls = TabularDataLoaders.from_df(df, procs=[Categorify, FillMissing, Normalize], cat_names=['c'], cont_names=['x1', 'x2'],
                                     y_names='y', y_block=RegressionBlock(), valid_idx=list(range(n-24, n)), bs=8)
    learn = tabular_learner(dls, layers=[16, 8], n_out=1, config=dict(ps=[0.2, 0.2], embed_p=0.1), metrics=mae)
    return learn, lambda: learn.fit_one_cycle(3, 1e-2)

def collab(a):
    from fastai.collab import CollabDataLoaders, collab_learner
    rng = np.random.default_rng(0)
    n = 96
    df = pd.DataFrame(dict(user=rng.integers(0, 12, n), item=rng.integers(0, 9, n), rating=rng.integers(1, 6, n).astype(np.float32)))
    dls = CollabDataLoaders.from_df(df, bs=8, valid_pct=0.25, seed=0)
    learn = collab_learner(dls, use_nn=True, layers=[8], y_range=(0, 5.5), emb_szs={'user': 4, 'item': 4})
    return learn, lambda: learn.fit_one_cycle(3, 1e-2)

class NoisyDataset(torch.utils.data.Dataset):
    "Points on a line, with noise drawn from python's, numpy's and torch's streams in `__getitem__`"
    def __init__(self, n, seed): self.x = torch.linspace(-1, 1, n)[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]
    def __len__(self): return len(self.x)
    def __getitem__(self, i):
        x = self.x[i] + 0.1*random.random() + 0.1*float(np.random.rand()) + 0.1*torch.rand(())
        return x[None], (2*self.x[i] + 0.1*torch.randn(()))[None]

def _mlp_learner(dls):
    model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    learn = Learner(dls, model, loss_func=MSELossFlat(), metrics=mae)
    return learn, lambda: learn.fit_one_cycle(3, 1e-2)

def dataset(a):
    return _mlp_learner(DataLoaders.from_dsets(NoisyDataset(40, 0), NoisyDataset(16, 1), bs=8, num_workers=2))

def torchdl(a):
    from torch.utils.data import DataLoader as TorchDL
    return _mlp_learner(DataLoaders(TorchDL(NoisyDataset(40, 0), batch_size=8, shuffle=True, num_workers=2,
                                            generator=torch.Generator().manual_seed(5)),
                                    TorchDL(NoisyDataset(16, 1), batch_size=8, num_workers=2)))

LEARNERS = dict(vision=vision, tabular=tabular, collab=collab, dataset=dataset, torchdl=torchdl)

def run(a, out, app, path, cbs=()):
    "Train `app` in `path`, with `Report` and `cbs`; save its result to `out`"
    set_seed(11, reproducible=True)
    learn,train = LEARNERS[app](a)
    learn.path = Path(path).absolute()
    learn.add_cbs([Report(), *cbs])
    with learn.no_bar():
        train()
        if a.then: learn.fit_one_cycle(1, 1e-3)
    save_result(learn, out)

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('out')
    p.add_argument('app', nargs='?', choices=list(LEARNERS))
    p.add_argument('--data', default='data', help='folder for the images of `vision`')
    p.add_argument('--stock', action='store_true', help='every app, as stock fastai (the package never imported)')
    p.add_argument('--then', action='store_true', help='another fit call after the first')
    p.add_argument('--apps', nargs='*', default=list(LEARNERS), help='with --stock: the apps to run')
    a = p.parse_args()
    if a.stock:
        for app in a.apps:
            for a.then in (False, True): run(a, Path(a.out)/f"{app}{'-then'*a.then}.pth", app, Path(a.out)/app)
        assert not any(m.startswith('resumable_train') for m in sys.modules), "the stock run imported the package"
    else:
        from resumable_train.autoresume import AutoResume
        run(a, a.out, a.app, '.', [AutoResume(every_iter=3, verbose=True)])
    print('DONE', flush=True)

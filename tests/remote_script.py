"""A training script with its resume points in a remote store, for the kill-and-rerun tests of `test_remote.py`.

`python remote_script.py OUT URL [--background] [--every N] [--keep K] [--stop-wait S] [--slow-upload S]`: trains a small model with
`AutoResume(dir=URL)` (credentials and endpoint from the environment, as a user's script gets them), prints `BATCH fit epoch iter` after
each training batch (see `killrerun.Report`) and saves its result to OUT. With `--slow-upload S`, every upload prints `UPLOADED name`
once the data object is in the store and waits S seconds before the manifest goes up: a kill then leaves a resume point without its
manifest. `python remote_script.py OUT --stock` trains the same run as stock fastai: the package never imported, no `AutoResume`, no
store.
"""
import argparse, time
import torch
from torch import nn
from fastai.basics import *
from fastai.callback.all import *  # noqa: F403 (`no_bar`, which `fastai.basics` lacks)
from fastai.test_utils import synth_dbunch
from killrerun import Report, save_result

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('url', nargs='?', help='where the resume points go (none with --stock)')
p.add_argument('--background', action='store_true')
p.add_argument('--every', type=int, default=2)
p.add_argument('--keep', type=int, default=2)
p.add_argument('--stop-wait', type=float, default=30)
p.add_argument('--slow-upload', type=float, default=0)
p.add_argument('--stock', action='store_true', help='stock fastai: the package never imported')
a = p.parse_args()
if (a.url is None) != a.stock: p.error('give the URL, or --stock')

if not a.stock:
    from resumable_train.autoresume import AutoResume
    from resumable_train.store import as_store, MANIFEST
    store = as_store(a.url, retries=2, backoff=0.1, config_kwargs=dict(connect_timeout=2, read_timeout=10, retries={'max_attempts': 1}))
if a.slow_upload:
    pipe = store.fs.pipe_file
    def slow_manifest(path, data, *args, **kwargs):
        if path.endswith(MANIFEST):
            print('UPLOADED', path.rpartition('/')[2].removesuffix(MANIFEST), flush=True)
            time.sleep(a.slow_upload)
        return pipe(path, data, *args, **kwargs)
    store.fs.pipe_file = slow_manifest

set_seed(5, reproducible=True)
dls = synth_dbunch(bs=8, n_train=6, n_valid=2)
model = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
ar = [] if a.stock else [AutoResume(every_iter=a.every, keep=a.keep, background=a.background, stop_wait=a.stop_wait, dir=store)]
learn = Learner(dls, model, loss_func=MSELossFlat(), metrics=mae, lr=1e-2, path='.', cbs=[Report(), *ar])
with learn.no_bar(): learn.fit_one_cycle(4)
save_result(learn, a.out)
print('DONE', flush=True)

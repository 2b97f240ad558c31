"Importing the package changes nothing in fastai for a run that does not use it (a fresh interpreter: the test process has imported fastai)."
import json
import pytest
from helpers import PY, run, check_rc

CHECK = '''
import json, sys
import fastai.basics
from fastai.callback.core import defaults
before = [c.__name__ for c in defaults.callbacks]
import resumable_train, resumable_train.all
after = [c.__name__ for c in defaults.callbacks]
imported = sorted(m for m in ('fastai.callback.progress', 'fastai.callback.schedule', 'fastai.callback.tracker',
                           'torchdata', 'datasets', 'tensorboard', 'torch.utils.tensorboard', 'wandb')
                  if m in sys.modules)
from fastai.learner import Learner
import fastai.callback.schedule  # the user's own import: fastai's default callbacks as without the package, and fit_one_cycle wrapped
stock = [c.__name__ for c in defaults.callbacks]
print(json.dumps(dict(before=before, after=after, imported=imported, stock=stock, wrapped=hasattr(Learner.fit_one_cycle, '_fastai'))))
'''

def test_import_changes_nothing():
    "No fastai callback module imported (nor torchdata or datasets: only a user's loader brings them), `defaults.callbacks` unchanged; fastai's schedules still get `start_epoch`/`start_iter` once imported"
    res = run([PY, '-c', CHECK], timeout=120)
    check_rc(res, 'import check')
    got = json.loads(res[1].strip().splitlines()[-1])
    assert got['after'] == got['before'], got
    assert got['imported'] == [], got
    assert 'ProgressCallback' in got['stock'] and got['wrapped'], got

ORDER = '''
import sys
first,second = sys.argv[1:]
exec(f"from {first} import *")
exec(f"from {second} import *")
import fastai.distributed, resumable_train.distributed as rd
print(DistributedTrainer is fastai.distributed.DistributedTrainer, DDPTrainer is rd.DDPTrainer)
'''

@pytest.mark.parametrize('first,second', [('fastai.distributed', 'resumable_train.all'), ('resumable_train.all', 'fastai.distributed')])
def test_import_order(first, second):
    "Star imports of fastai.distributed and the package, in either order: fastai's DistributedTrainer stays fastai's, ours is DDPTrainer"
    res = run([PY, '-c', ORDER, first, second], timeout=120)
    check_rc(res, 'import order')
    assert res[1].strip().splitlines()[-1] == 'True True', res[1][-2000:]

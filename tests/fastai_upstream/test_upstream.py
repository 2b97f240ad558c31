"""fastai's own tests for the Learner, the schedulers and the trackers pass with `resumable_train` imported.

The notebooks are fastai's (Apache-2.0) and are not copied here: set `FASTAI_NBS` to a folder holding `13a_learner`,
`14_callback.schedule` and `17_callback.tracker` (`.ipynb` from fastai/fastai `nbs/`, matching the installed fastai), else this is skipped.
Each notebook runs in its own process (`run_cells.py`), once with the package imported and once without: a cell may fail only if it also
fails with stock fastai (e.g. a notebook from a newer fastai than the one installed).
"""
import os, re, sys
from pathlib import Path
import pytest
sys.path.insert(0, str(Path(__file__).parent.parent))
from helpers import PY, run

HERE = Path(__file__).parent
NBS = ['13a_learner', '14_callback.schedule', '17_callback.tracker']
DIR = Path(os.environ['FASTAI_NBS']) if os.environ.get('FASTAI_NBS') else None

def _find(name):
    for ext in ('.ipynb', '.txt'):
        if DIR and (DIR/f'{name}{ext}').exists(): return DIR/f'{name}{ext}'

def _cells(out, kind): return {int(m) for m in re.findall(rf'^{kind} cell\s+(\d+)', out, flags=re.M)}

@pytest.mark.parametrize('name', NBS)
def test_fastai_notebook_with_package(name, tmp_path):
    nb = _find(name)
    if nb is None: pytest.skip(f"set FASTAI_NBS to a folder with fastai's {name}.ipynb to run fastai's own tests")
    got = run([PY, str(HERE/'run_cells.py'), str(nb)], timeout=300, env=dict(RUN_CELLS_CWD=str(tmp_path)), cwd=tmp_path)
    print(got[1][-6000:])
    if got[0] == 0: return
    stock = run([PY, str(HERE/'run_cells.py'), str(nb), '--stock'], timeout=300, env=dict(RUN_CELLS_CWD=str(tmp_path)), cwd=tmp_path)
    new = _cells(got[1], 'FAIL') - _cells(stock[1], 'FAIL')
    assert not new, f"cells failing only with resumable_train imported: {sorted(new)}\n{got[1][-6000:]}"

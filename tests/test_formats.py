"""Resume points written in an earlier format continue exactly. `tests/data/format3` holds the files `format_script.py save` wrote with the
package at a8807e9, the last commit that wrote format 3 (each DataLoader's stream and state in lists of their own, the training
DataLoader's state at the epoch's start, position and workers' streams apart; format 4 keeps one state per DataLoader)."""
import shutil
import torch
from helpers import TESTS, check_rc
from killrerun import batches, compare
from resumable_train.files import resume_record

def test_format3_continues(forker, stock, tmp_path):
    """A format-3 resume point inside an epoch and one at an epoch's end, each loaded and trained to the end of the run: bitwise the
    uninterrupted run of stock fastai, in a process that never imports the package (both runs forked: see forked.py)"""
    shutil.copytree(TESTS/'data'/'format3', tmp_path/'run'/'models')
    for name in ('mid', 'end1'):  # the files are format 3's, as written then
        rec = resume_record(torch.load(tmp_path/'run'/'models'/f'{name}.pth', weights_only=True))
        assert rec['version'] == 3 and 'dl_rngs' in rec and 'loaders' not in rec, sorted(rec)
    script = str(TESTS/'format_script.py')
    rc,out = forker.run(script, 'continue', tmp_path/'run', tmp_path/'out', timeout=120)
    check_rc((rc, out, ''), 'the continued runs')
    check_rc((*stock.run(script, 'stock', tmp_path/'stock', tmp_path/'stock.pth', timeout=120), ''), 'stock fastai')
    # 6 batches an epoch: the point inside epoch 2 continues with its batch 4, the one at the end of epoch 1 with epoch 2
    assert batches(out.splitlines(keepends=True)) == [(0, 1, i) for i in range(3, 6)] + [(0, 2, i) for i in range(6)] + \
        [(0, e, i) for e in (1, 2) for i in range(6)], out[-2000:]
    for name in ('mid', 'end1'):
        diffs = compare(tmp_path/'stock.pth', tmp_path/f'out.{name}')
        assert not diffs, f"continued from the format-3 point {name}: {diffs[:5]}"

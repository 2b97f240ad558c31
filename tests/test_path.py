"""The path of a resume point to the disk (issue 38): it is made in `point` and handed back, then written, and no module on the way
calls back into one it came from. The script traces the real calls; an architecture change that brings a callback back fails here."""
import json
from pathlib import Path

SCRIPT = Path(__file__).parent/'path_script.py'

def _twice(chain): return len(set(chain)) < len(chain)

def test_no_module_entered_twice(forker):
    "From `AutoResume._save` and from `Learner.save`: every chain of modules on the stack enters each module once; the writes' chains"
    rc,o = forker.run(SCRIPT, timeout=120)
    assert rc == 0, o
    got = json.loads(o.strip().splitlines()[-1])
    for who,t in got.items():
        assert t['chains'] and not [c for c in t['chains'] if _twice(c)], (who, [c for c in t['chains'] if _twice(c)])
    # the point is made (`point.make_point`) and returned; the write goes down the store alone
    assert got['autoresume']['write'] == [['autoresume', 'checkpoints', 'store', 'files']], got['autoresume']['write']
    assert got['learner']['write'] == [['learner', 'store', 'files']], got['learner']['write']
    assert ['autoresume', 'point'] in got['autoresume']['chains'] and ['learner', 'point'] in got['learner']['chains']

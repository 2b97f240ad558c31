"9. The command: `resumable-train inspect`, `ls` and `--help` against `python -c 'import torch; torch.load(...)'`, each a fresh process"
import random, subprocess, sys, tempfile
from pathlib import Path
from fastai.callback.core import Callback, CancelFitException
from common import *

CMD = str(Path(sys.executable).parent/'resumable-train')

class SaveAt(Callback):
    "Save a resume point after training batch `n`, then stop"
    def __init__(self, file, n): self.file,self.n = file,n
    def after_batch(self):
        if self.training and self.iter == self.n: self.learn.save(self.file, with_iter=True); raise CancelFitException

def run(quick=False, reps=None, device=None):
    reps = reps or (1 if quick else 7)
    with tempfile.TemporaryDirectory(prefix='bench-cli-') as d:
        d = Path(d)
        learn = make_learner(20, size='small', path=d)
        learn.fit(1, cbs=SaveAt(d/'resume', 10))
        f = str(d/'resume.pth')
        cmds = {"python -c 'import torch; torch.load(...)'": [sys.executable, '-c', f"import torch; torch.load({f!r}, weights_only=True)"],
                'resumable-train inspect': [CMD, 'inspect', f],
                'resumable-train inspect --json': [CMD, 'inspect', '--json', f],
                'resumable-train ls': [CMD, 'ls', str(d)],
                'resumable-train --help': [CMD, '--help'],
                "python -c 'import fastai.learner'": [sys.executable, '-c', 'import fastai.learner']}
        if quick: cmds = dict(list(cmds.items())[:2])  # a smoke run: the file loads, the command answers
        times = {k: [] for k in cmds}
        for _ in range(reps):
            ks = list(cmds); random.shuffle(ks)
            for k in ks: times[k].append(timed(subprocess.run, cmds[k], check=True, capture_output=True, timeout=120))
    base = med(times[next(iter(cmds))])
    t = Table('cli', "9. The command: seconds from start to exit, each a fresh process, against importing torch and loading the file",
              ['command', 'median s', 'max s', '× torch.load'],
              [f"{reps} repetitions in shuffled order; the file is a small model's resume point written by `learn.save` mid-epoch",
               "`inspect`, `ls` and `--help` import torch but not fastai; `import fastai.learner` is shown for scale"])
    for k,xs in times.items(): t.add(k, f"{med(xs):.2f}", f"{max(xs):.2f}", ratio(med(xs), base))
    t.raw = times
    return t

"""Run the notebooks' tests, one process per notebook, and check that the outputs the notebooks keep are current.

    python tests/notebooks.py [--update] [--jobs N] [NOTEBOOK ...]     (default: every notebook in nbs/)

Each notebook runs as `nbdev-test --flags slow` runs it: every cell but its `#| eval: false` ones, the cells flagged with a `tst_flags`
flag (`#| slow`) included, so that their outputs are checked too (`nbdev-test` alone leaves them out). Each runs in a process of its own: the notebooks
patch fastai's `Learner` as they run. The processes are forked from this one, which imports nbdev's runner, fastai with its applications and
the libraries under it (torch, pandas, matplotlib, ...) once, so no notebook pays for them (importing fastai draws from python's
random stream: here, before the seeding below, so not in a notebook). Its outputs are then normalised (see `normalise`: dates, temporary folders,
timings, memory addresses, the warnings that installed libraries print) and compared with the outputs kept in the notebook (the
numbers of fastai's epoch table give or take one in their last digit, which depends on the CPU's model: `_last_digit`); a notebook
whose outputs differ fails, with a diff. With `--update`, the new outputs are written into the notebooks instead (then run
`nbdev-clean`): `bash tests/run.sh --update-outputs` does both, and is how the outputs are regenerated after a change. The notebook in
`VARYING` (the distributed tutorial, which stops torchrun when a file appears, at a moment that varies from run to run) is
compared after `loosen` too: every number, the positions in a run and the runs of spaces masked, and each output's distinct lines in any
order (a process stopped a batch later can print an epoch's row before its restart, or once more); its words and its lines still have
to match, so that a message whose wording changed fails as in any other notebook. The other tutorials stop their processes right after
a chosen batch, so their outputs are compared as printed. Plots are compared by kind only: their pixels depend on matplotlib's version
and fonts.
Progress bars are off (`fastprogress.NO_BAR`): the epoch tables stay, without the bars' timings.
Each notebook starts with python's, numpy's and torch's random streams seeded (0), with PYTHONHASHSEED=0 and one thread per op, so that
the numbers it prints are the same in every run on one machine. Nothing is written to disk but the notebooks, and only with `--update`.
"""
import argparse, difflib, json, os, re, sys, tempfile, time, traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The tutorial that stops processes at moments that vary from run to run (torchrun stopped when a resume point appears): the batch
# numbers, the resume points' names and the positions vary, and a position may read `end of epoch 1/2` in one run and `epoch 2/2, batch 1/22`
# in another. Its outputs are compared after `loosen`; its own tests check the numbers that matter (the digests of interrupted and
# uninterrupted runs are equal). The other tutorials stop their scripts right after a chosen batch: their outputs are the same every run.
VARYING = {'11_tutorial.distributed.ipynb'}
# A warning as python prints it (`file:line: Category: message`, then the source line indented), and the files of installed libraries and of
# the standard library, but not this package's (installed or not)
_WARNING = re.compile(r'(?m)^(\S+\.py):\d+: \w*Warning: .*\n(?:  .*\n)?')
_LIBRARY = re.compile(r'/(?:site|dist)-packages/(?!resumable_train/)|/lib/python3\.\d+/(?!site-packages/)')

def _drop_library_warning(m): return '' if _LIBRARY.search(m[1]) else m[0]

_SUBS = [  # (pattern, replacement): what differs between two runs of the same notebook on the same machine
    (_WARNING, _drop_library_warning),  # which warnings libraries print depends on their versions; the package's own warnings stay
    ('█\r', ''),  # fastprogress's console bar probes the terminal with its fill character; a notebook shows an HTML bar instead
    (r'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d', 'YYYY-MM-DD hh:mm:ss'),
    (r'(/tmp|/var/folders/[^/\s]+/[^/\s]+/T)/tmp[\w.-]+', '/tmp/TMPDIR'),
    (r'\bat 0x[0-9a-f]+', 'at 0x...'),
    (r'\S*/site-packages/', '.../site-packages/'),
    (r'<td>\d\d:\d\d</td>', '<td>mm:ss</td>'),    # the time column of fastai's epoch table
    (r'(?m)(\s)\d\d:\d\d(\s*)$', r'\1mm:ss\2'),  # the same table as text
    (r'\b\d+\.\d+ ?s\b', 'N.NN s'),            # durations printed in seconds
    # a weights digest: a convolution's depends on the CPU, whatever ATEN_CPU_CAPABILITY says (torch hands convolutions to oneDNN, which
    # picks its kernels by the CPU's vector units: the demo's cell kept c212b93c5a71 and printed 5ec2ae6017a9 on an AVX2-only AMD EPYC);
    # the cells assert the digests that must be equal (interrupted and uninterrupted runs), and the README's MLP digest is checked by test_docs
    (r'\bweights [0-9a-f]{12}\b', 'weights DIGEST'),
    (r'\b[A-Z][a-z]{2}\d\d_\d\d-\d\d-\d\d_[\w.-]+', 'MonDD_hh-mm-ss_HOST'),  # TensorBoard's default log folder: the date and the host
    (r'\bresumable-train-check-\w+', 'resumable-train-check-XXXXXXXX'),  # `check`'s scratch folder
    (r'\b\d+ s([);])', r'N s\1'),  # `check`'s seconds since it started
]

def normalise(text:str)->str:
    "`text` with what changes from run to run replaced by placeholders"
    for pat,rep in _SUBS: text = re.sub(pat, rep, text)
    return text

_LOOSE = [  # (pattern, replacement), after _SUBS, for the notebooks in VARYING
    # files.position_text's two forms, and a fit call's end (`end of epoch 3/3`)
    (r'\b(?:end of |after )?epoch \d+/\d+(?:, (?:after )?batch \d+/\d+)?', 'POSITION'),
    (r'\d+(?:\.\d+)?', 'N'),
    (r'; N batch(?:es)? trained again \(N\.NN s lost\)', ''),  # the run log's line of a resume after a kill
    (r'\b(batch|interruption)(?:es|s)\b', r'\1'),  # a count that is 1 in one run and 2 in another
    (r'[ \t]+', ' '),  # the columns of a table, aligned to the widest cell
]

def loosen(text:str)->str:
    "`text` (normalised) with what varies between two runs of a tutorial in `VARYING` masked"
    for pat,rep in _LOOSE: text = re.sub(pat, rep, text)
    return text

def _loose_lines(text)->list:
    "`text` loosened, as its distinct lines in sorted order (a process killed just after an epoch's end prints that epoch's row again)"
    return sorted({l + '\n' for l in loosen(''.join(text) if isinstance(text, list) else str(text)).splitlines()})

def _image_kind(o):
    "A cell output with its images replaced by their kind: a plot's pixels depend on matplotlib's version and fonts"
    if 'data' not in o: return o
    return dict(o, data={k:('<image>' if k.startswith('image/') else v) for k,v in o['data'].items()})

def _loose_out(o):
    "A normalised cell output, loosened: its text as `_loose_lines`"
    o = dict(o)
    if 'text' in o: o['text'] = _loose_lines(o['text'])
    if 'data' in o: o['data'] = {k:(v if k.startswith('image/') else _loose_lines(v)) for k,v in o['data'].items()}
    return o

def _walk(o):
    "`o` (nested lists and dicts) with `normalise` applied to its strings"
    if isinstance(o, str): return normalise(o)
    if isinstance(o, list): return [_walk(v) for v in o]
    if isinstance(o, dict): return {k: v if k.startswith('image/') else _walk(v) for k,v in o.items()}  # no dates
    return o

def _norm_out(o):
    "A cell output, normalised, as nbdev-clean keeps it"
    if isinstance(o.get('text'), list): o = dict(o, text=''.join(o['text']))  # whole, for the warnings that span two lines
    data = o.get('data') or {}
    images = {k:v for k,v in data.items() if k.startswith('image/')}  # kept as they are (`\S*` on a long line of base64 is slow)
    if images: o = dict(o, data={k:v for k,v in data.items() if k not in images})
    o = _walk(o)
    if images: o['data'].update(images)
    o.pop('execution_count', None)
    if 'metadata' in o: o['metadata'] = {}
    for k in ('text',):
        if isinstance(o.get(k), str): o[k] = o[k].splitlines(keepends=True)
    for k,v in (o.get('data') or {}).items():
        if isinstance(v, str) and not k.startswith('image/'): o['data'][k] = v.splitlines(keepends=True)
    if o.get('output_type') == 'execute_result': o['execution_count'] = None
    return o

def _norm_outs(outs)->list:
    "Cell outputs, normalised, without the streams left empty (a library's warning, dropped)"
    return [o for o in map(_norm_out, outs) if o.get('output_type') != 'stream' or o['text']]

def _text(outs)->str:
    "Outputs as text, for a diff"
    parts = []
    for o in outs:
        if 'text' in o: parts.append(''.join(o['text']))
        for k,v in (o.get('data') or {}).items():
            parts.append(f"[{k}]\n" + (''.join(v) if isinstance(v, list) and not k.startswith('image/') else f"<{len(str(v))} chars>"))
    return '\n'.join(parts)

_SIX = re.compile(r'(-?\d+\.\d{6})\b')  # a float as fastai's epoch table prints it

def _last_digit(new, old)->bool:
    """Do outputs `new` and `old` differ only in the last digit of fastai's epoch table's numbers, by one? Which one it is depends on the
    CPU's model (8.732334 on one x86-64 machine, 8.732335 on an AMD EPYC), with the same vector kernels (ATEN_CPU_CAPABILITY=avx2); the
    cells assert the equalities that matter bit for bit"""
    a,b = _SIX.split(_text(new)),_SIX.split(_text(old))
    return len(a) == len(b) and all(x == y if i % 2 == 0 else abs(float(x) - float(y)) < 1.5e-6 for i,(x,y) in enumerate(zip(a, b)))

def run_one(fn:Path, update:bool)->int:
    "In a forked process: run notebook `fn`'s tests, then check or update its outputs; returns the exit status"
    import nbdev.test as T
    import fastprogress.fastprogress
    fastprogress.fastprogress.NO_BAR = True
    import random, numpy as np, torch
    random.seed(0); np.random.seed(0); torch.manual_seed(0)  # a notebook that draws without seeding still prints the same numbers
    ran = {}
    T.write_nb = lambda nb, _: ran.update({c['id']: c.get('outputs', []) for c in nb.cells if c.cell_type == 'code'})
    ok,_ = T.test_nb(fn, skip_flags=[], save=True)  # every cell, those flagged `#| slow` (tst_flags) included
    if not ok: return 1
    nb = json.loads(fn.read_text())
    diffs = []
    for c in nb['cells']:
        if c['cell_type'] != 'code' or c.get('id') not in ran: continue
        new = _norm_outs(json.loads(json.dumps(o, default=dict)) for o in ran[c['id']])
        old = _norm_outs(c.get('outputs', []))
        if update and new != old: c['outputs'] = new  # a cell whose outputs are current keeps them as printed (a real digest)
        if not update: new,old = [_image_kind(o) for o in new],[_image_kind(o) for o in old]
        if fn.name in VARYING and not update: new,old = [_loose_out(o) for o in new],[_loose_out(o) for o in old]
        if new != old and not (not update and _last_digit(new, old)):
            diffs.append(f"--- cell {c.get('id')}: {''.join(c['source']).splitlines()[0][:70] if c['source'] else ''}\n" +
                         ''.join(difflib.unified_diff(_text(old).splitlines(True), _text(new).splitlines(True), 'kept', 'now', n=1)))
    if update:
        with open(fn, 'w') as f: json.dump(nb, f, indent=1, ensure_ascii=False); f.write('\n')
        print(f"{fn}: outputs of {len(diffs)} cells changed")
        return 0
    if not diffs: return 0
    print(f"{fn}: the outputs kept in the notebook are not current ({len(diffs)} cells); regenerate them with "
          "`bash tests/run.sh --update-outputs`\n" + '\n'.join(diffs)[-6000:])
    return 1

def _start(nb:Path, update:bool):
    "Fork a child that runs `run_one(nb, update)`, its output going to a temporary file; returns `(pid, file)`"
    out = tempfile.TemporaryFile()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid: return pid, out
    code = 1
    try:
        os.dup2(out.fileno(), 1); os.dup2(out.fileno(), 2)
        code = run_one(nb, update)
    except BaseException: traceback.print_exc()
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('notebooks', nargs='*', type=Path)
    p.add_argument('--update', action='store_true', help="write the new outputs into the notebooks")
    p.add_argument('--jobs', type=int, default=2, help="notebooks run at the same time")
    a = p.parse_args()
    if (os.environ.get('PYTHONHASHSEED'), os.environ.get('OMP_NUM_THREADS')) != ('0', '1'):  # the forks inherit both from this process
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], dict(os.environ, PYTHONHASHSEED='0', OMP_NUM_THREADS='1'))
    nbs = [n.resolve() for n in a.notebooks] or (ROOT/'nbs').glob('*.ipynb')
    os.chdir(ROOT)
    from helpers import own_temporary_folder, quiet_library_warnings
    tmp = own_temporary_folder('resumable-train-nbs-')  # what the notebooks' examples leave there goes with it
    _SUBS.insert(0, (re.escape(tmp), '/tmp'))  # a path there reads as the system's own
    quiet_library_warnings()  # installed libraries' warnings that the package does not cause, as in pytest
    import nbdev.test, IPython, torch, pandas, matplotlib.pyplot, PIL.Image, fastcore.all, fastprogress.fastprogress  # once, for the forks
    import fastai.basics, fastai.callback.all, fastai.text.all, fastai.tabular.all, fastai.vision.all  # fastai too (see the docstring)
    import gc; gc.freeze()  # what is imported stays shared with the forks: their collections do not touch it (see forked.py)
    todo,running,failed = sorted(nbs, key=lambda n: -n.stat().st_size),{},0  # the longest first
    while todo or running:
        while todo and len(running) < a.jobs:
            nb = todo.pop(0)
            pid,out = _start(nb, a.update)
            running[pid] = nb,out,time.time()
        pid,st = os.wait()
        if pid not in running: continue
        nb,out,t = running.pop(pid)
        rc = os.waitstatus_to_exitcode(st)
        out.seek(0); text = out.read().decode(errors='replace'); out.close()
        print(f"{'ok  ' if rc == 0 else 'FAIL'} {nb} ({time.time()-t:.0f}s)", flush=True)
        if rc or a.update: print(text[-8000:], end='', flush=True)
        failed += rc != 0
    sys.exit(1 if failed else 0)

if __name__ == '__main__': main()

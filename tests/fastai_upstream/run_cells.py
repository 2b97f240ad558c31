"""Run the test cells of one of fastai's own notebooks against the installed fastai, with `resumable_train` imported.

`python run_cells.py NOTEBOOK [--stock]` takes a fastai notebook (`.ipynb`, or text with cells starting `%% code` / `%% md`) and runs its
code cells in one namespace, in order, printing one line per cell: PASS, FAIL (with the error) or SKIP (with the reason), then a summary;
the exit code is the number of failed cells. Cells that define fastai itself (`#|export`) are not run: the names come from the installed
fastai (patched by `resumable_train` unless `--stock`), which is what is being tested. No fastai code is kept in this repository: point
`FASTAI_NBS` at a folder holding the notebooks of the installed fastai version (fastai/fastai on GitHub, folder `nbs/`).
"""
import contextlib, io, json, re, sys, os, time, traceback, warnings
from pathlib import Path

SKIPS = [  # (pattern in the cell, why it is skipped)
    (r'^\s*[!%]', 'shell or IPython magic'),
    (r'#\s*\|?\s*skip\b|#\s*\|?\s*eval:\s*false', 'marked skip / eval: false in fastai'),
    (r'#\s*\|?\s*export', 'defines fastai itself: the installed fastai is tested instead'),
    (r'#\s*\|?\s*(default_exp|cuda)\b|notebook2script|nbdev_export|nbdev\.export', 'nbdev directive or export call'),
    (r'untar_data|URLs\.|download_url', 'needs the network'),
    (r'fastai\.vision|vision_learner|cnn_learner|ImageDataLoaders|PILImage', 'needs fastai.vision (torchvision is not installed)'),
    (r'\.cuda\(|torch\.cuda|default_device\(\s*\)\s*\.type|to_fp16|MixedPrecision\(', 'needs a GPU'),
    (r'show_doc\(|\bshow_plot=True|plot_lr_find|plot_sched|\.plot\(', 'documentation or plotting only'),
]

def cells(nb):
    "The code cells of `nb` (`.ipynb` or `%%` text)"
    if nb.suffix == '.ipynb':
        return [''.join(c['source']) for c in json.loads(nb.read_text())['cells'] if c['cell_type'] == 'code']
    parts = re.split(r'^%% (code|md)\s*$', nb.read_text(), flags=re.M)
    return [s.strip('\n') for k,s in zip(parts[1::2], parts[2::2]) if k == 'code']

def skip_reason(src):
    for pat,why in SKIPS:
        if re.search(pat, src, flags=re.M | re.I): return why

def main(nb, stock=False):
    import matplotlib; matplotlib.use('Agg')
    ns = {'__name__': '__main__'}
    exec('from fastai.basics import *\nfrom fastai.callback.all import *\nfrom fastai.test_utils import *\nfrom fastcore.test import *\n'
         'import shutil, pickle, functools, math', ns)
    if not stock: exec('import resumable_train\nfrom resumable_train.learner import *', ns)
    res = {'PASS': 0, 'FAIL': 0, 'SKIP': 0}
    os.chdir(os.environ.get('RUN_CELLS_CWD', os.getcwd()))
    for i,src in enumerate(cells(nb)):
        why = skip_reason(src)
        first = src.strip().splitlines()[0][:70] if src.strip() else ''
        if not src.strip(): continue
        if why:
            res['SKIP'] += 1; print(f"SKIP cell {i:3d} ({why}): {first}"); continue
        t,buf = time.time(),io.StringIO()  # the cell's own output (progress bars, tables) is shown only if it fails
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                warnings.simplefilter('ignore')
                exec(compile(src, f'{nb.name}[cell {i}]', 'exec'), ns)
            res['PASS'] += 1; print(f"PASS cell {i:3d} ({time.time()-t:.1f}s): {first}")
        except Exception as e:
            res['FAIL'] += 1
            print(f"FAIL cell {i:3d}: {first}\n    {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            print(buf.getvalue()[-2000:])
            traceback.print_exc(limit=-3, file=sys.stdout)
    print(f"SUMMARY {nb.name}: {res['PASS']} passed, {res['FAIL']} failed, {res['SKIP']} skipped")
    return res['FAIL']

if __name__ == '__main__':
    sys.exit(main(Path(sys.argv[1]), stock='--stock' in sys.argv))

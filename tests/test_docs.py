"""The docs say what the code and the notebooks have: the API table of 09_all (every signature the real one, the names a user calls), index's
sections word for word, links that go somewhere, and a Quick start that, killed and run again, ends with the digest it states."""
import ast, difflib, importlib, inspect, json, os, re, signal, struct, time
import pytest
from helpers import PY, ROOT, start, finish, run
import resumable_train.all  # noqa: F401 (patches Learner)
from fastai.learner import Learner
import fastai.callback.schedule  # noqa: F401 (fit_one_cycle & co.)


def _table()->list:
    "The rows of the API table (in nbs/09_all.ipynb), as (names column, module)"
    nb = json.loads((ROOT/'nbs'/'09_all.ipynb').read_text())
    part = next(''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'markdown' and '| name | module |' in ''.join(c['source']))
    rows = [l.split(' | ') for l in part.splitlines() if l.startswith('| `')]
    return [(r[0].lstrip('| '), r[1].strip('` ')) for r in rows]

def _split(params:str)->list:
    "`params` split at its top-level commas"
    out,depth,cur,quote = [],0,'',None
    for ch in params:
        if quote: quote = None if ch == quote else quote
        elif ch in '\'"': quote = ch
        elif ch in '([{': depth += 1
        elif ch in ')]}': depth -= 1
        if ch == ',' and depth == 0 and not quote: out.append(cur.strip()); cur = ''
        else: cur += ch
    return [p for p in out + [cur.strip()] if p]

def _entries():
    "Each name the table shows, with its module and the parameters it lists (`None`: shown without a signature)"
    for names,module in _table():
        if module == 'command': continue
        for span in re.findall(r'`([^`]+)`', names):
            m = re.fullmatch(r'([\w.]+)(?:\((.*)\))?', span)
            assert m, f"not a name or a signature: {span!r}"
            yield m.group(1), module, None if m.group(2) is None else _split(m.group(2))

def _resolve(name, module):
    if name.startswith('Learner.'): return getattr(Learner, name.split('.', 1)[1])
    return getattr(importlib.import_module(f'resumable_train.{module}'), name)

def _same_default(shown, real)->bool:
    try: return ast.literal_eval(shown) == real
    except (ValueError, SyntaxError): return shown == repr(real)

@pytest.mark.parametrize('name,module,params', list(_entries()), ids=[e[0] for e in _entries()])
def test_signature(name, module, params):
    "A name in the table is in its module, and the parameters it shows are the real ones, with the real defaults"
    o = _resolve(name, module)
    if params is None: return
    real = {k:p for k,p in inspect.signature(o).parameters.items() if k != 'self'}
    shown = set()
    for p in params:
        if p == '...': continue
        k,_,default = p.lstrip('*').partition('=')
        assert k in real, f"{name}: the API table shows a parameter {k!r} that the code does not have ({list(real)})"
        if p.startswith('*'): assert real[k].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD), (name, k)
        if default: assert _same_default(default, real[k].default), f"{name}: {k}={default} in the API table, {real[k].default!r} in the code"
        shown.add(k)
    if '...' not in params: assert shown == set(real), f"{name}: the API table does not show {sorted(set(real)-shown)}"

def test_every_user_name():
    "The table shows every name `resumable_train.all` exports, under the module that defines it, and no name it does not export"
    shown = {(n, m) for n,m,_ in _entries() if not n.startswith('Learner.')}
    user = {(n, getattr(resumable_train.all, n).__module__.split('.')[-1]) for n in resumable_train.all.__all__}
    assert shown == user, f"in the table but not exported: {sorted(shown - user)}; exported but not in the table: {sorted(user - shown)}"

# The README and nbs/index.ipynb (the docs' landing page) say the same: nbdev would write the README from index with Quarto, which this
# project does not install, so the README is kept by hand and this test compares them. Each section of index (its text, its visible code
# cells as ```python blocks, their outputs as ``` blocks, in order) is in the README, with the same text and in the same order; the
# README's own sections are these (for a clone of the repository: its two commands, the preemption benchmark, whose plot and
# files are the repository's, how to contribute).
README_ONLY = ('Fresh setup: two commands', 'What preemption costs', 'Contributing')

def _index_md()->str:
    "nbs/index.ipynb as markdown: its cells, without the hidden ones, and the outputs of its code cells"
    nb,parts = json.loads((ROOT/'nbs'/'index.ipynb').read_text()),[]
    for c in nb['cells']:
        src = ''.join(c['source']).strip()
        if c['cell_type'] == 'markdown': parts.append(re.sub(r'(?m)^(#+ .*?) -$', r'\1', src)); continue  # nbdev's `## Title -`
        if re.match(r'#\| *hide\b', src): continue
        parts.append(f"```python\n{src}\n```")
        for o in c.get('outputs', []):
            text = ''.join(o.get('text') or o.get('data', {}).get('text/plain', ''))
            if text.strip(): parts.append(f"```\n{text.rstrip()}\n```")
    return '\n\n'.join(parts)

def _sections(md:str)->list:
    "`md` cut at its `## ` headings: (heading, text) pairs, the part before the first heading under ''"
    out = [['', []]]
    for l in md.splitlines():
        if l.startswith('## '): out.append([l[3:].strip(), []])
        else: out[-1][1].append(l)
    return [(h, '\n'.join(ls).strip()) for h,ls in out]

def test_readme_is_index():
    "The README holds nbs/index.ipynb's sections word for word (links to the notebooks go to `nbs/` from the README)"
    readme = re.sub(r'<!--.*?-->\n*', '', (ROOT/'README.md').read_text(), flags=re.S).replace('](nbs/', '](')
    ours,theirs = dict(_sections(readme)),_sections(_index_md())
    test = [h for h,_ in _sections(readme) if h not in README_ONLY]
    assert test == [h for h,_ in theirs], f"the README's sections {test} are not index's {[h for h,_ in theirs]}"
    for h,text in theirs:
        if ours[h] != text:
            diff = difflib.unified_diff(ours[h].splitlines(), text.splitlines(), 'README.md', 'nbs/index.ipynb', lineterm='', n=1)
            raise AssertionError(f"section {h or '(before the first heading)'!r} differs:\n" + '\n'.join(diff))

def test_links():
    "The README's links to files go to files of this repository, index links every notebook, and no link names a site that does not exist"
    readme = (ROOT/'README.md').read_text()
    for target in re.findall(r'\]\(([^)#\s]+)[^)]*\)', readme):
        if not re.match(r'https?://', target): assert (ROOT/target).exists(), f"the README links to {target}, which does not exist"
    linked = set(re.findall(r'\]\(([\w.]+\.ipynb)\)', _index_md()))
    for nb in (ROOT/'nbs').glob('*.ipynb'):
        if nb.name != 'index.ipynb': assert nb.name in linked, f"index's notebook table does not list {nb.name}"
    for text in (readme, _index_md()):
        assert not re.search(r'github\.com/resumable-train|resumable-train\.github\.io', text), "a link to a repository or site that does not exist"

def _quick_start()->tuple:
    """The README's Quick start: its code (its blocks, one after the other), and the digests it prints for the script (uninterrupted, and
    killed and run again): placeholders, as the digest depends on the machine"""
    text = (ROOT/'README.md').read_text()
    part = text[text.index('\n## Quick start\n'):]
    part = part[:part.index('\n## ', 1)]
    return ''.join(re.findall(r'```python\n(.*?)```', part, re.S)),re.findall(r'\nweights (\w+)\n', part)

# The README's code without the package: its import, `AutoResume` and `weights_digest` (the same sha256, written out here)
_STOCK = [("from resumable_train.all import *\n", ""), (", cbs=AutoResume(every_iter=20)", ""),
          ("from sklearn.datasets import load_digits\n",
           "from sklearn.datasets import load_digits\nimport hashlib\ndef weights_digest(m):\n    h = hashlib.sha256()\n"
           "    for k,v in m.state_dict().items(): h.update(k.encode()); h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())\n"
           "    return h.hexdigest()[:12]\n")]

def test_quick_start(tmp_path):
    """The README's Quick start as written, in a fresh process SIGKILLed after its first resume point, then run again: the digest of the
    same script run uninterrupted by stock fastai (a process that never imports the package). The digest depends on the machine
    (MKL picks its kernels by the CPU, whatever `ATEN_CPU_CAPABILITY` says): the README shows a placeholder"""
    code,digests = _quick_start()
    assert digests == ['DIGEST', 'DIGEST'], f"the Quick start shows a digest that depends on the machine it ran on: {digests}"
    stock = code
    for a,b in _STOCK:
        assert a in stock, f"the Quick start no longer has {a!r}"
        stock = stock.replace(a, b)
    (tmp_path/'train.py').write_text(code)
    (tmp_path/'stock.py').write_text(stock + "import sys\nassert not any(m.startswith('resumable_train') for m in sys.modules)\n")
    env = dict(OMP_NUM_THREADS='1', ATEN_CPU_CAPABILITY='avx2')  # the settings the README states its numbers with
    s = start([PY, 'stock.py'], env=env, cwd=tmp_path)  # beside the killed run
    p = start([PY, 'train.py'], env=env, cwd=tmp_path)
    reach,trained,deadline = tmp_path/'runs'/'quickstart'/'models'/'autoresume.reach',0,time.monotonic() + 120
    try:
        while p.poll() is None and time.monotonic() < deadline:  # the reach mark: the batches trained so far
            b = reach.read_bytes()[:40] if reach.exists() else b''
            trained = struct.unpack('<qqqqd', b)[3] if len(b) == 40 else 0
            if trained > 20: break  # past its first resume point (every_iter=20)
            time.sleep(0.001)
        os.kill(p.pid, signal.SIGKILL)
    finally: rc,out,err = finish(p, 30)
    assert rc == -signal.SIGKILL and 'weights' not in out, (rc, trained, out[-2000:], err[-2000:])
    rc,out,err = run([PY, 'train.py'], timeout=120, env=env, cwd=tmp_path)
    assert rc == 0 and 'AutoResume: continuing from runs/quickstart/models/autoresume-' in out, (rc, out[-2000:], err[-2000:])
    src,sout,serr = finish(s, 120)
    assert src == 0, (sout[-2000:], serr[-2000:])
    want = re.findall(r'weights ([0-9a-f]{12})', sout)
    assert len(want) == 1 and re.findall(r'weights ([0-9a-f]{12})', out) == want, (want, out[-2000:])

# The docs build (nbdev-proc-nbs, and so nbdev-docs and nbdev-preview) runs, in a few worker processes that each take notebook after
# notebook, the cells nbdev's `_do_eval` picks: the exported ones, those that show docs, and every cell with an import in it. Exported cells
# patch fastai's `Learner` again from the notebook's own namespace, so an example run there after another notebook's exports runs against
# patches that are not the package's, and fails or not by which worker took which notebook. So a cell with an import holds imports and
# definitions only, as nbdev's FAQ asks: its examples are in a cell of their own, which the docs build does not run.
def test_docs_build_runs_no_examples():
    "Every cell the docs build runs, other than exported and show_doc cells, only imports or defines"
    from nbdev.process import NBProcessor
    from nbdev.processors import _do_eval
    runs = []
    for nb in sorted((ROOT/'nbs').glob('*.ipynb')):
        def check(cell, nb=nb):
            if not _do_eval(cell) or cell.directives_.keys() & {'export', 'exports', 'exporti', 'exec_doc'}: return
            if 'show_doc' in cell.source: return
            body = [t for t in cell.parsed_() if not isinstance(t, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))]
            if body: runs.append(f"{nb.name}, cell {cell.idx_}: {ast.unparse(body[0]).splitlines()[0]}")
        NBProcessor(nb, procs=[check]).process()
    assert not runs, "the docs build would run these examples (move the cell's imports into a cell of their own):\n" + '\n'.join(runs)

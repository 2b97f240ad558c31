"The README's API table says what the code has: every signature it shows is the real one, and no public name is missing from it."
import ast, importlib, inspect, re
import pytest
from helpers import ROOT
import resumable_train.all  # noqa: F401 (patches Learner)
from fastai.learner import Learner
import fastai.callback.schedule  # noqa: F401 (fit_one_cycle & co.)

MODULES = ('files', 'store', 'errors', 'runlog', 'state', 'loaders', 'learner', 'trackers', 'autoresume', 'distributed',
           'cli', 'plot')

def _table()->list:
    "The rows of the README's API table, as (names column, module)"
    text = (ROOT/'README.md').read_text()
    part = text[text.index('## Public API'):]
    part = part[:part.index('\n## ', 1)] if '\n## ' in part[1:] else part
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
        assert k in real, f"{name}: the README shows a parameter {k!r} that the code does not have ({list(real)})"
        if p.startswith('*'): assert real[k].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD), (name, k)
        if default: assert _same_default(default, real[k].default), f"{name}: {k}={default} in the README, {real[k].default!r} in the code"
        shown.add(k)
    if '...' not in params: assert shown == set(real), f"{name}: the README does not show {sorted(set(real)-shown)}"

def test_every_public_name():
    "Every name a module exports is in the table, under that module"
    shown = {(n, m) for n,m,_ in _entries()}
    missing = [(n, m) for m in MODULES for n in importlib.import_module(f'resumable_train.{m}').__all__ if (n, m) not in shown]
    assert not missing, f"public names missing from the README's API table: {missing}"

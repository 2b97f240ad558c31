"Shared pieces of the benchmarks: data whose items cost time to load, models, learners, timing, and the tables they print and keep"
import datetime, gc, json, os, platform, statistics, subprocess, time
from pathlib import Path
import torch, fastai
from torch import nn
from fastai.data.load import DataLoader
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.callback.progress import ProgressCallback
import resumable_train.learner  # noqa: F401 (patches Learner.save/load/fit)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent/'results'

class Items:
    "`n` pairs (x, y) of random floats; reading one item sleeps `delay` seconds, as if it came from disk or was decoded"
    def __init__(self, n, n_in=16, delay=0., seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x,self.y,self.delay = torch.randn(n, n_in, generator=g),torch.randn(n, 1, generator=g),delay
    def __len__(self): return len(self.x)
    def __getitem__(self, i):
        if self.delay: time.sleep(self.delay)
        return self.x[i],self.y[i]

def mlp(n_in, hidden):
    "A plain multi-layer perceptron from `n_in` through the `hidden` sizes to one output"
    sizes,layers = [n_in, *hidden],[]
    for a,b in zip(sizes, sizes[1:]): layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(sizes[-1], 1))

# model sizes used by the checkpoint, stall and memory benchmarks: (inputs, hidden layers)
SIZES = dict(small=(64, (256, 256)), medium=(128, (512, 512)), large=(2048, (2048,)*5))

def make_learner(n_batches, bs=8, size=None, n_in=16, hidden=(), delay=0., num_workers=0, device=None, path='.'):
    "A `Learner` on `n_batches` training batches of `Items`, with an MLP of `size` (a key of `SIZES`) or of `n_in`/`hidden`"
    if size is not None: n_in,hidden = SIZES[size]
    train = DataLoader(Items(n_batches*bs, n_in, delay), bs=bs, shuffle=True, drop_last=True, num_workers=num_workers)
    valid = DataLoader(Items(bs, n_in, seed=1), bs=bs)
    learn = Learner(DataLoaders(train, valid, device=device), mlp(n_in, hidden), loss_func=nn.MSELoss(), path=path)
    learn.logger = lambda *a, **k: None
    if hasattr(learn, 'progress'): learn.remove_cb(ProgressCallback)
    return learn

def n_params(model): return sum(p.numel() for p in model.parameters())

def tensor_bytes(o)->int:
    "Bytes held by the tensors in nested dicts/lists `o`"
    if isinstance(o, torch.Tensor): return o.numel()*o.element_size()
    if isinstance(o, dict): return sum(map(tensor_bytes, o.values()))
    if isinstance(o, (list, tuple)): return sum(map(tensor_bytes, o))
    return 0

def state_bytes(learn)->int:
    "Bytes of the model and optimizer state that a checkpoint holds"
    return tensor_bytes(learn.model.state_dict()) + tensor_bytes(learn.opt.state_dict())

def timed(f, *args, **kwargs)->float:
    "Seconds `f(*args, **kwargs)` takes, after a garbage collection"
    gc.collect()
    t = time.perf_counter()
    f(*args, **kwargs)
    return time.perf_counter() - t

def med(xs): return statistics.median(xs) if xs else float('nan')
def ms(s): return f"{s*1e3:.1f}" if s == s else '—'
def ratio(a, b): return f"{a/b:.2f}" if a == a and b == b and b else '—'
def mb(n): return f"{n/2**20:.1f}"

def machine_info(quick, device):
    "What the numbers depend on: date, machine, versions, settings"
    try: commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception: commit = ''
    cpu = next((l.split(':', 1)[1].strip() for l in Path('/proc/cpuinfo').read_text().splitlines() if l.startswith('model name')), platform.processor()) \
          if Path('/proc/cpuinfo').exists() else platform.processor()
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'), mode='quick' if quick else 'full',
                cpu=cpu, cores=os.cpu_count(), usable_cores=len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count(),
                torch_threads=torch.get_num_threads(), load_avg=[round(x, 2) for x in os.getloadavg()], device=str(device or 'cpu'),
                python=platform.python_version(), platform=platform.platform(), torch=torch.__version__, fastai=fastai.__version__,
                resumable_train=resumable_train.__version__, commit=commit)

class Table:
    "A benchmark's result: columns, rows of cells, notes; printed as markdown and kept as .md and .json"
    def __init__(self, name, title, columns, notes=()): self.name,self.title,self.columns,self.rows,self.notes,self.raw = name,title,columns,[],list(notes),{}
    def add(self, *cells): self.rows.append([str(c) for c in cells])

    def markdown(self, info):
        head = [f"## {self.title}", '', f"{info['date']} · {info['mode']} · {info['cpu']}, {info['usable_cores']}/{info['cores']} cores, "
                f"{info['torch_threads']} torch threads, load {info['load_avg']} · {info['device']} · torch {info['torch']}, "
                f"fastai {info['fastai']}, resumable_train {info['resumable_train']} ({info['commit']})", '']
        rows = ['| ' + ' | '.join(self.columns) + ' |', '|' + '---|'*len(self.columns)] + ['| ' + ' | '.join(r) + ' |' for r in self.rows]
        return '\n'.join(head + rows + [''] + [f"- {n}" for n in self.notes]) + '\n'

    def save(self, folder, info):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder/f'{self.name}.md').write_text(self.markdown(info))
        (folder/f'{self.name}.json').write_text(json.dumps(dict(info=info, title=self.title, columns=self.columns, rows=self.rows,
                                                                notes=self.notes, raw=self.raw), indent=1) + '\n')

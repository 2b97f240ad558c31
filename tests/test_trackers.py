"""A run killed twice at seeded batches and rerun reads as an uninterrupted run (issue 21): TensorBoard's scalars, W&B's
history, the run log, `resumable-train ls` and `plot`. The uninterrupted run, trackers and all, is bitwise stock fastai's (a process
that never imports the package)."""
import contextlib, io, json, random, struct
from pathlib import Path
import numpy as np, pytest, torch
from forked import Forker, stock_server
from helpers import TESTS, wandb_env
import killrerun as kr
from resumable_train.cli import main
from resumable_train.cli import plot_data, STOP_COLOR, RESUME_COLOR
from resumable_train.store import read_runlog, run_summary

SCRIPT = str(TESTS/'trackers_script.py')
EVERY = 5  # trackers_script.py's AutoResume(every_iter=5)

@pytest.fixture(scope='module')
def forker():
    return Forker(('fastai.basics', 'fastai.callback.schedule', 'fastai.callback.tensorboard',
                   'resumable_train.autoresume', 'resumable_train.cli', 'sklearn.datasets', 'killrerun'))

@pytest.fixture(scope='module')
def stock():
    "Stock fastai's runs: children of a process that never imports the package"
    yield from stock_server(('fastai.basics', 'fastai.callback.schedule', 'fastai.callback.tensorboard', 'sklearn.datasets',
                             'killrerun', 'helpers'))

def killed_twice(forker, stock, tmp_path, seed, *kinds, env=lambda run: None):
    """The batches of an uninterrupted run (bitwise stock fastai's, in `stock/`) and of one killed twice at seeded batches, then
    rerun: `(ref, trained)`"""
    (tmp_path/'ref').mkdir(); (tmp_path/'stock').mkdir()
    ref = kr.batches(kr.run_to_end(forker, SCRIPT, [tmp_path/'ref.pth', *kinds], cwd=tmp_path/'ref', env=env('ref')))
    rc,log = stock.run(SCRIPT, tmp_path/'stock.pth', *kinds, 'stock', timeout=120, env=env('stock'), cwd=tmp_path/'stock')
    assert rc == 0, f"stock fastai exited {rc}:\n{log[-3000:]}"
    kr.same_as_stock(tmp_path/'stock.pth', tmp_path/'ref.pth')
    rng = random.Random(seed)
    kills = [rng.randint(EVERY+1, len(ref)//3) for _ in range(2)]
    trained,snaps = kr.kill_and_rerun(forker, SCRIPT, list(kinds), tmp_path/'run', tmp_path/'out.pth', kills,
                                      env=env('run'))
    kr.check_kill_and_rerun(ref, trained, snaps, tmp_path/'ref.pth', tmp_path/'out.pth')
    return ref, trained

def scalars(folder)->dict:
    "Every scalar tag's `(step, value)` list, as TensorBoard reads the log folder `folder`"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(folder), size_guidance={'scalars': 0})
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()['scalars']}

def run_cli(*args)->str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out): assert main([str(a) for a in args]) == 0
    return out.getvalue()

def line_columns(img, color)->int:
    "How many vertical lines of `color` the RGB(A) image `img` holds (columns it covers a third of the height of)"
    rgb = np.array([int(color[i:i+2], 16) for i in (1, 3, 5)])/255
    hit = (np.abs(img[..., :3] - rgb).max(-1) < 0.15).sum(0) > img.shape[0]//3
    return int(np.sum(hit[1:] & ~hit[:-1]) + hit[0])

def trained_twice(ref, trained)->list:
    "For each kill: `(batches the killed run had trained, where the next run resumed)`, as `train_iter`s"
    return [(ref.index(prev[-1])+1, ref.index(nxt[0])) for prev,nxt in zip(trained[:-2], trained[1:-1])]

def test_tensorboard_runlog_plot(forker, stock, tmp_path):
    """TensorBoard reads one folder with the uninterrupted run's scalars (stock fastai's); the run log, `ls` and `plot` tell the two
    kills"""
    ref,trained = killed_twice(forker, stock, tmp_path, 21, 'tb')
    folders = [list((tmp_path/r/'runs').iterdir()) for r in ('ref', 'run', 'stock')]
    assert [len(f) for f in folders] == [1, 1, 1], folders
    a,b,c = [scalars(f[0]) for f in folders]
    assert {'train_loss', 'valid_loss', 'accuracy', 'lr_0'} <= set(a) and set(a) == set(b)
    for t in a: assert a[t] == b[t], f"{t}: {len(a[t])} events in the uninterrupted run, {len(b[t])} in the resumed one"
    assert a == c, f"the uninterrupted run's scalars differ from stock fastai's: {[t for t in set(a) | set(c) if a.get(t) != c.get(t)]}"

    kills = trained_twice(ref, trained)
    events = read_runlog(tmp_path/'run'/'models')
    assert [e['event'] for e in events] == ['started', 'killed', 'resumed', 'killed', 'resumed', 'finished']
    assert [e['train_iter'] for e in events if e['event'] == 'killed'] == [k for k,_ in kills]
    assert [(e['train_iter'], e['twice']) for e in events if e['event'] == 'resumed'] == [(r, k-r) for k,r in kills]
    s = run_summary(events)
    assert (s['interrupted'], s['killed'], s['twice']) == (2, 2, sum(k-r for k,r in kills))
    out = run_cli('ls', tmp_path/'run')
    assert out.count(': killed, after it trained') == 2 and '2 interruptions (2 killed, 0 stopped)' in out, out
    runs = json.loads(run_cli('ls', tmp_path/'run', '--json'))['runs']
    assert runs['autoresume']['summary'] == s
    assert runs['autoresume']['events'] == [{**e, 'fit': e['fit']+1, **({'epoch': e['epoch']+1} if 'epoch' in e else {})} for e in events]  # numbered from 1

    d,r = plot_data(tmp_path/'run'/'models'),torch.load(tmp_path/'ref.pth', weights_only=True)
    assert d['losses'] == [float(x) for x in r['losses']] and d['lrs'] == [float(x) for x in r['lrs']]
    assert d['values'] == [[float(x) for x in row[1:]] for row in r['values']]
    assert d['names'] == ['valid_loss', 'accuracy']
    assert (d['stops'], d['resumes']) == ([k for k,_ in kills], [r for _,r in kills])
    import matplotlib.image
    for run,n in (('ref', 0), ('run', len(set(d['stops'])))):
        run_cli('plot', tmp_path/run, '-o', tmp_path/f'{run}.png')
        img = matplotlib.image.imread(tmp_path/f'{run}.png')
        assert img.shape[:2] == (500, 1000) and img[..., :3].std() > 0.05, "a blank plot"
        assert line_columns(img, STOP_COLOR) == n
        assert line_columns(img, RESUME_COLOR) == (len(set(d['resumes'])) if n else 0)

def wandb_rows(folder)->list:
    "The history rows W&B wrote in the offline run folders under `folder`, each folder's in turn (as the runs started)"
    from wandb.proto import wandb_internal_pb2 as pb
    runs = []
    for f in Path(folder).glob('wandb/offline-run-*/run-*.wandb'):
        rows = []
        for data in leveldb_records(f.read_bytes()):
            r = pb.Record()
            r.ParseFromString(data)
            if r.WhichOneof('record_type') == 'history':
                rows.append({i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        runs.append((f.parent.name, rows))
    return sorted(runs, key=lambda r: r[0])  # offline-run-YYYYMMDD_HHMMSS-ID: the order they started in

def leveldb_records(data:bytes)->list:
    "The records of a `.wandb` file: a 7-byte header, then LevelDB's log format (32 kB blocks, records maybe in pieces)"
    pos,part,out = 7,b'',[]
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7: pos += left; continue
        _,n,kind = struct.unpack('<IHB', data[pos:pos+7])
        if n == 0 and kind == 0: pos += left; continue
        part += data[pos+7:pos+7+n]
        pos += 7+n
        if kind in (1, 4): out.append(part); part = b''  # FULL or LAST
    return out

TIMING = {'_timestamp', '_runtime', 'train_samples_per_sec'}  # what differs between any two runs

def synced(runs)->list:
    "The rows `wandb sync` leaves of the offline runs sent in turn: a step not above the last one kept is refused"
    out = []
    for _,rows in runs:
        for r in rows:
            if not out or r['_step'] > out[-1]['_step']: out.append(r)
    return [{k: v for k,v in r.items() if k not in TIMING} for r in out]

def test_wandb_offline(forker, stock, tmp_path):
    """W&B offline: one run id across the reruns; a rerun logs from the step it resumed at, each step with the
    uninterrupted run's values (stock fastai's); sent in turn (`wandb sync`), the steps strictly increase"""
    pytest.importorskip('wandb')
    envs = {run: wandb_env(tmp_path/f'wandb-{run}') for run in ('ref', 'run', 'stock')}
    ref,trained = killed_twice(forker, stock, tmp_path, 212, 'wandb', env=envs.get)
    rid = (tmp_path/'run'/'models'/'autoresume.wandb-id').read_text().strip()
    runs,(_,want) = wandb_rows(tmp_path/'wandb-run'),*wandb_rows(tmp_path/'wandb-ref')
    assert {n.rpartition('-')[2] for n,_ in runs} == {rid}, [n for n,_ in runs]
    assert len(runs) == 4, [n for n,_ in runs]  # 2 killed, the rest, the rerun after completion
    assert synced(wandb_rows(tmp_path/'wandb-stock')) == synced([(None, want)]), "the uninterrupted run's history differs from stock's"
    want = {r['_step']: r for r in synced([(None, want)])}
    assert sorted(want) == list(range(len(ref))), "the uninterrupted run logs one step per batch"
    (_,resumed),*_ = trained_twice(ref, trained)[1:]
    last = synced(runs[2:3])
    assert [r['_step'] for r in last] == list(range(resumed, len(ref))), "not logged from where it resumed"
    assert not runs[3][1], "the rerun after completion logged steps"
    for _,rows in runs:  # the killed runs' too: an orphaned step, logged again by a rerun, has the same values
        assert [r['_step'] for r in rows] == sorted({r['_step'] for r in rows}), "a run logged a step twice"
        for r in synced([(None, rows)]): assert r == want[r['_step']], f"step {r['_step']} differs"
    steps = [r['_step'] for r in synced(runs)]
    assert steps == sorted(set(steps)) and steps[-1] == len(ref)-1

"""Soak: issue 28's randomized scripts for a time budget. Each case is a generated script (tests/random_scripts.py) run uninterrupted
with AutoResume and as stock fastai, killed at one or two points drawn in the kill windows (turn by turn, so that every window is
hit; a family with windows of its own has its first kill in one of them), rerun to the end and once more. It reports "scripts ×
kills passed / refused / failed" and each failure's seed, script and symptom, on stdout and in benchmarks/results/soak.md (a
failed case's folder is kept, its path printed).

`python benchmarks/soak.py --minutes 10 [--seed 0] [--cases N] [--text 0.25] [--shapes one,cached] [--families retry,stream]
[--no-mixup] [--out DIR] [--keep DIR]`
Run it under `nice`: each case forks a few short processes, one at a time, from this one (which imports fastai once).
"""
import argparse, collections, datetime, json, os, platform, random, re, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT/'tests'), str(ROOT)]
os.environ.setdefault('OMP_NUM_THREADS', '1')

def signature(symptom:str)->str:
    "A failure's symptom with its numbers, paths and seeds blanked: cases with one signature share a defect, most likely"
    s = re.sub(r'\(to be killed at [^)]*\)|\(\w+: [a-z]+ [^)]*\)', '', symptom)
    s = re.sub(r"\(raised while handling ([\w.]+).*", r"(raised while handling \1)", s)
    s = re.sub(r'different run \(.*', 'different run (...)', s)
    s = re.sub(r'^the rerun after (kill \d+|\d+ kill\(s\)) ?:', 'a rerun after a kill:', s)
    s = re.sub(r'/\S+', 'PATH', s)
    s = re.sub(r'\d+(\.\d+)?(e-?\d+)?', 'N', s)
    s = re.sub(r'first: \S+', 'first: X', s)
    return re.sub(r'\s+', ' ', s).strip()[:220]

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--minutes', type=float, default=10.)
    p.add_argument('--seed', type=int, default=0, help='the first seed; then seed+1, ...')
    p.add_argument('--cases', type=int, default=None, help='stop after this many cases')
    p.add_argument('--text', type=float, default=None, help='share of text-classifier scripts (default: the generator draws)')
    p.add_argument('--shapes', default=None, help='comma-separated shapes to draw from (default: all; see random_scripts.SHAPES)')
    p.add_argument('--families', default=None,
                   help="comma-separated families to draw from, '' for none (default: the generator draws; see random_scripts.FAMILIES)")
    p.add_argument('--no-mixup', action='store_true', help='no MixUp (its crash on a skipped call hides the rest)')
    p.add_argument('--edits', type=float, default=0., help='share of cases whose script is edited between the kills and the rerun '
                                                           '(issue 60: random_scripts.EDITS, turn by turn)')
    p.add_argument('--out', default=str(ROOT/'benchmarks'/'results'))
    p.add_argument('--keep', default=None, help='where the folders of failed cases are kept (default: a temporary folder)')
    p.add_argument('--timeout', type=float, default=180, help='seconds one run of a script may take')
    p.add_argument('--report', nargs='+', default=None, metavar='JSON', help="only write the report of these runs' soak.json, merged")
    a = p.parse_args()
    if a.report:
        runs = [json.loads(Path(f).read_text()) for f in a.report]
        return report([c for r in runs for c in r['cases']], a, sum(r.get('wall', 0) for r in runs), Path(a.keep or '?'),
                      heads=[h for r in runs for h in r['head'].splitlines()])
    import torch, warnings
    torch.set_num_threads(1)
    warnings.simplefilter('ignore')
    from forked import Forker, StockForker
    # stock fastai's runs: a process of their own, which never imports the package
    stock = StockForker(modules=('fastai.basics', 'fastai.callback.all', 'fastai.text.all', 'sklearn.datasets', 'random_scripts'))
    forker = Forker(modules=('fastai.basics', 'fastai.callback.all', 'fastai.text.all', 'resumable_train.all', 'sklearn.datasets'))
    import random_scripts as rs
    keep = Path(a.keep or tempfile.mkdtemp(prefix='soak-failed-'))
    work = Path(tempfile.mkdtemp(prefix='soak-'))
    t0,cases,seed = time.monotonic(),[],a.seed
    budget = a.minutes*60
    try:
        while time.monotonic() - t0 < budget and (a.cases is None or len(cases) < a.cases):
            i = len(cases)
            rng = random.Random(seed)
            first = rs.WINDOWS[seed % len(rs.WINDOWS)]  # turn by turn: every window is hit
            windows = [first] + ([rng.choice(rs.WINDOWS)] if rng.random() < 0.5 else [])
            force = {} if a.text is None else dict(app='text' if rng.random() < a.text else 'digits')
            if a.shapes: force['shape'] = rng.choice(a.shapes.split(','))
            if a.no_mixup: force['mixup'] = False
            if a.families is not None: force['family'] = rng.choice(a.families.split(','))
            if a.families and force['family'] == 'stream':  # the digits alone, not exported (see random_scripts._family)
                force.update(app='digits', shape=force.get('shape') or rng.choice([s for s in rs.SHAPES if s != 'export']))
            if a.families and force['family'] == 'retry': force['mixup'] = False
            # a family's first kill in its own windows, turn by turn
            if (fw := rs.family_windows(rs.make_script(seed, **force)[1])): windows[0] = fw[seed % len(fw)]
            folder = work/f'{seed}'
            job = rs.make_script(seed, **force)[1]['family'].split()[1:2] in (['raise'], ['exit'])  # its rerun fails by design
            edit = rs.EDITS[seed % len(rs.EDITS)] if rng.random() < a.edits and not job else None
            r = rs.run_case(forker, seed, folder, windows=windows, timeout=a.timeout, stock=stock, edit=edit, **force)
            r['elapsed'] = time.monotonic() - t0
            if r['outcome'] == 'failed':
                dest = keep/f'{seed}'
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(folder, dest, ignore=shutil.ignore_patterns('*.pth'))
                r['kept'] = str(dest)
            shutil.rmtree(folder, ignore_errors=True)
            cases.append(r)
            kills = ', '.join(f'{w}: {s}' for w,s in r['kills']) or '-'
            print(f"{r['outcome']:7} seed {seed:5} {r['cpu']:5.1f}s cpu | {r['desc'][:150]} | kills {kills}"
                  + (f" | edit {edit}" if edit else '')
                  + (f"\n        {r['symptom']}" if r['symptom'] else ''), flush=True)
            seed += 1
    finally:
        shutil.rmtree(work, ignore_errors=True); stock.close()
        if not a.keep and not any(keep.iterdir()): keep.rmdir()  # no failure: no folder left in the temporary folder
    report(cases, a, time.monotonic() - t0, keep)

def report(cases, a, wall, keep, heads=None):
    n_k = sum(len(c['kills']) for c in cases)
    count = collections.Counter(c['outcome'] for c in cases)
    kills = collections.Counter(c['outcome'] for c in cases for _ in c['kills'])
    try: commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError: commit = '?'
    dirty = subprocess.run(['git', 'status', '--porcelain', '--', 'resumable_train'], cwd=ROOT, capture_output=True, text=True).stdout
    head = (f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} · commit {commit}{' (modified)' if dirty else ''}"
            f" · {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {[round(x, 2) for x in os.getloadavg()]}"
            f" · {wall/60:.1f} min, seeds {a.seed}-{a.seed+len(cases)-1}"
            + (f", shapes {a.shapes}" if a.shapes else '') + (f", families {a.families!r}" if a.families is not None else '')
            + (', no MixUp' if a.no_mixup else '') + (f", text share {a.text}" if a.text is not None else ''))
    lines = ["## Soak: randomized scripts killed and rerun (issue 28)", "", *('- ' + h for h in heads or [head]), "",
             f"**{len(cases)} scripts × {n_k} kills: {count['passed']} passed / {count['refused']} refused / {count['failed']} failed** "
             f"(kills in those cases: {kills['passed']} / {kills['refused']} / {kills['failed']}); "
             f"CPU {sum(c['cpu'] for c in cases):.0f} s in the scripts' processes", ""]
    def table(title, key, rows):
        lines.extend([f"| {title} | cases | passed | refused | failed |", "|---|---|---|---|---|"])
        for k in rows:
            cs = [c for c in cases if k in key(c)]
            cc = collections.Counter(c['outcome'] for c in cs)
            lines.append(f"| {k} | {len(cs)} | {cc['passed']} | {cc['refused']} | {cc['failed']} |")
        lines.append('')
    from random_scripts import SHAPES, WINDOWS, FAMILIES, FAMILY_WINDOWS, EDITS
    table('shape', lambda c: [c['info']['shape']] + ['MixUp'] * c['info']['mixup'], list(SHAPES) + ['MixUp'])
    fam = lambda c: (c['info'].get('family') or 'none').split()  # 'nested get_preds': in 'nested' and 'get_preds'
    table('family (issue 48: calls inside `after_epoch`, cancels, retries, streams)', lambda c: fam(c)[:1], ['none', *FAMILIES])
    hows = (('nested', ('get_preds', 'validate', 'one_batch')), ('cancel', ('epoch', 'valid', 'step')),
            ('retry', ('loop', 'fallback-ValueError', 'fallback-RuntimeError', 'raise', 'exit')),
            ('stream', ('kept-long', 'kept-short', 'replay-long', 'replay-short')))
    table('family, by what it does', lambda c: [' '.join(fam(c)[:2]).rstrip(':')], [f'{f} {h}' for f,hs in hows for h in hs])
    # issue 60: an error is a kill, deterministic (it comes back) or transient (gone), by the script's reaction
    table('error: reaction and kind', lambda c: [' '.join(fam(c)[1:3])] if fam(c)[0] == 'retry' else [],
          [f'{h} {m}' for h in dict(hows)['retry'] for m in ('deterministic', 'transient')])
    # issue 60: one rule for every edit between a kill and the rerun: refused naming it, or (a hyperparameter) named; passed when so
    table('edit between the kill and the rerun (passed: refused or named as the rule says)', lambda c: [c.get('edit') or 'none'],
          ['none', *EDITS])
    edited = [c for c in cases if c.get('edit') and c['outcome'] == 'passed']
    answers = collections.Counter((c['edit'], c['symptom'].split(': ')[1] if ': ' in c['symptom'] else '?') for c in edited)
    lines.extend(["| edit | how it was answered | cases |", "|---|---|---|"])
    lines.extend(f"| {e} | {how} | {n} |" for (e,how),n in sorted(answers.items()))
    lines.append('')
    table('app', lambda c: [c['info']['app']], ['digits', 'text'])
    table('kill window (a case counts in each of its windows)', lambda c: [w for w,_ in c['kills']],
          list(WINDOWS) + [w for ws in FAMILY_WINDOWS.values() for w in ws])
    # the families' own windows, each family's cases by the window of their first kill
    lines.extend(["| family: first kill's window | cases | passed | refused | failed |", "|---|---|---|---|---|"])
    for f,ws in FAMILY_WINDOWS.items():
        for w in ws:
            for h in dict(hows)[f]:
                cs = [c for c in cases if ' '.join(fam(c)[:2]).rstrip(':') == f'{f} {h}' and c['kills'][:1] and c['kills'][0][0] == w]
                cc = collections.Counter(c['outcome'] for c in cs)
                lines.append(f"| {f} {h}: {w} | {len(cs)} | {cc['passed']} | {cc['refused']} | {cc['failed']} |")
    lines.append('')
    # the uninterrupted run with AutoResume against the same script as stock fastai (a process that never imports the package)
    # (`AutoResume(replay=True)`'s streams draw apart from the training's: only their batches and steps are compared)
    lines.extend(["| shape: uninterrupted, AutoResume vs stock fastai | compared | bitwise equal | differs | same batches (replay) |",
                  "|---|---|---|---|---|"])
    for k in list(SHAPES) + ['MixUp', 'all']:
        cs = [c for c in cases if c.get('stock') and (k == 'all' or k == c['info']['shape'] or k == 'MixUp' and c['info']['mixup'])]
        lines.append(f"| {k} | {len(cs)} | {sum(c['stock'] == 'equal' for c in cs)} | {sum(c['stock'] == 'differs' for c in cs)} "
                     f"| {sum(c['stock'] == 'apart' for c in cs)} |")
    lines.append('')
    failed = [c for c in cases if c['outcome'] == 'failed']
    groups = collections.OrderedDict()
    for c in failed: groups.setdefault(signature(c['symptom']), []).append(c)
    if groups:
        lines += ["### Distinct failures (grouped by symptom, numbers blanked)", "",
                  "| symptom | cases | seeds (first 8) | shapes | windows |", "|---|---|---|---|---|"]
        for sig,cs in groups.items():
            shapes = sorted({c['info']['shape'] + ('+MixUp' if c['info']['mixup'] else '') for c in cs})
            wins = sorted({w for c in cs for w,_ in c['kills']})
            lines.append(f"| {sig.replace('|', '/')} | {len(cs)} | {', '.join(str(c['seed']) for c in cs[:8])} | {', '.join(shapes)} "
                         f"| {', '.join(wins) or 'none (uninterrupted)'} |")
        lines += ["", "### Each failure", "", "| seed | script | kills | symptom |", "|---|---|---|---|"]
        for c in failed:
            lines.append(f"| {c['seed']} | {c['desc'].replace('|', '/')} | {'; '.join(f'{w}: {s}' for w,s in c['kills']) or '-'} "
                         f"| {c['symptom'].replace('|', '/')} |")
        lines += ["", f"Folders of the failed cases (script, each run's log): {keep}"]
    refused = [c for c in cases if c['outcome'] == 'refused']
    if refused:
        lines += ["", "### Refusals", "", "| seed | script | message |", "|---|---|---|"]
        lines += [f"| {c['seed']} | {c['desc'].replace('|', '/')} | {c['symptom'].replace('|', '/')} |" for c in refused]
    lines += ["", "- reproduce one case: `python benchmarks/soak.py --seed SEED --cases 1 --out /tmp/x` (with the same `--text`, "
              "`--shapes`, `--families`, `--no-mixup`); a case's first kill window is `WINDOWS[seed % 6]` (first, epoch_end, between, "
              "valid, end_write, mid), or for a family with windows of its own `FAMILY_WINDOWS[family][seed % n]` (retry: "
              "before_raise, retry_start, retry; stream: past_len); a second one is drawn from the seed half the time", ""]
    text = '\n'.join(lines)
    print('\n' + text)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out)/'soak.md').write_text(text)
    (Path(a.out)/'soak.json').write_text(json.dumps(dict(head='\n'.join(heads or [head]), wall=wall, cases=cases), indent=1, default=str))

if __name__ == '__main__': main()

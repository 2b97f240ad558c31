"""Resume points on a real S3-compatible server (moto's, on 127.0.0.1, started and stopped here), through s3fs.

The store alone: a round trip, an interrupted upload, damaged objects, wrong credentials, an unreachable server. Then training scripts
with `AutoResume(dir='s3://...')` in forked processes: killed, damaged, cut off from the server, refused; and the command on a URL. Their
uninterrupted run is bitwise stock fastai's (the same training, without the package or a store, in a process that never imports it)."""
import json, os, random, signal, socket, subprocess, time
import pytest, torch
import s3fs  # noqa: F401 (imported once here, not in each forked run; `forker` is conftest's)
from resumable_train.files import CheckpointError
from resumable_train.store import FsspecStore, StoreError, MANIFEST, as_store
from killrerun import batches, compare, kill_and_rerun, check_kill_and_rerun, run_to_end, run_until, same_as_stock
from s3server import S3Server, TESTS

@pytest.fixture(scope='module')
def s3():
    server = S3Server()
    yield server
    server.close()

CK = {'model': {'w': torch.arange(6.)}, 'opt': {'state': [], 'hypers': []}}

def test_store_round_trip(s3):
    "Save writes the data, then the manifest; damaged or incomplete objects do not load, and say why, naming the URL"
    url = f's3://{s3.bucket}/store/run1'
    st = FsspecStore(url, **s3.options())
    assert st.ls() == []
    st.save(CK, 'a-0001.pth')
    assert s3.keys('store/run1/') == ['store/run1/a-0001.pth', 'store/run1/a-0001.pth' + MANIFEST]
    assert torch.equal(st.load('a-0001.pth')['model']['w'], CK['model']['w'])
    c = s3.client()
    data = c.get_object(Bucket=s3.bucket, Key='store/run1/a-0001.pth')['Body'].read()
    c.put_object(Bucket=s3.bucket, Key='store/run1/a-0002.pth', Body=data)
    assert [(e.name, e.complete) for e in st.ls()] == [('a-0001.pth', True), ('a-0002.pth', False)]
    with pytest.raises(CheckpointError, match=f'{url}/a-0002.pth has no manifest'): st.load('a-0002.pth')
    c.put_object(Bucket=s3.bucket, Key='store/run1/a-0001.pth', Body=data[:-100])
    with pytest.raises(CheckpointError, match=f'{url}/a-0001.pth is {len(data)-100:,} bytes but its manifest says {len(data):,}'): st.load('a-0001.pth')
    st.remove('a-0001.pth'); st.remove('a-0002.pth')
    assert s3.keys('store/run1/') == []

def test_wrong_credentials(s3):
    "A key the server does not know: listing and writing raise at once, naming the URL and the cause"
    url = f's3://{s3.bucket}/store/creds'
    st = FsspecStore(url, **dict(s3.options(), key='AKIAWRONGWRONGWRONG0', secret='wrong'))
    with pytest.raises(StoreError, match=f'Could not list {url}: access refused .*check the credentials'): st.ls()
    with pytest.raises(StoreError, match=f'Could not write {url}/a-0001.pth: access refused'): st.save(CK, 'a-0001.pth')
    assert s3.keys('store/creds/') == []

def test_missing_bucket(s3):
    st = FsspecStore('s3://no-such-bucket/run1', **s3.options())
    with pytest.raises(StoreError, match='Could not write s3://no-such-bucket/run1/a-0001.pth: not found'): st.save(CK, 'a-0001.pth')

def test_unreachable(s3):
    "The server stops: a write retries, then raises naming the URL; the earlier checkpoint is intact when it is back"
    url = f's3://{s3.bucket}/store/down'
    st = as_store(url, retries=2, backoff=0.05, **s3.options())
    st.save(CK, 'a-0001.pth')
    s3.stop()
    try:
        with pytest.raises(StoreError, match=f'Could not write {url}/a-0002.pth: EndpointConnectionError.*gave up after 3 attempts'):
            st.save(CK, 'a-0002.pth')
        with pytest.raises(StoreError, match=f'Could not list {url}'): st.ls()
    finally: s3.start()
    assert [(e.name, e.complete) for e in st.ls()] == [('a-0001.pth', True)]
    assert torch.equal(st.load('a-0001.pth')['model']['w'], CK['model']['w'])

# Process level: a training script with `AutoResume(dir='s3://...')`, killed, damaged, cut off, rerun.
SCRIPT = TESTS/'remote_script.py'

@pytest.fixture(scope='module')
def ref(forker, stock, s3, tmp_path_factory):
    "The uninterrupted run, bitwise stock fastai's: its result file and the batches it trained"
    d = tmp_path_factory.mktemp('ref')
    lines = run_to_end(forker, SCRIPT, [d/'ref.pth', f's3://{s3.bucket}/ref'], env=s3.env, cwd=d)
    (d/'stock').mkdir()
    rc,log = stock.run(SCRIPT, d/'stock.pth', '--stock', timeout=90, cwd=d/'stock')
    assert rc == 0, f"stock fastai exited {rc}:\n{log[-3000:]}"
    same_as_stock(d/'stock.pth', d/'ref.pth')
    return dict(out=d/'ref.pth', batches=batches(lines))

def run(forker, args, env, until=None, sig=signal.SIGKILL, then=None, cwd=None, timeout=90):
    "Run the script; once a line satisfies `until`, send `sig` (or call `then()`); return `(returncode, output)`"
    rc,lines = run_until(forker, SCRIPT, args, sig=sig if until else None, until=until, then=then, env=env, cwd=cwd, timeout=timeout)
    return rc, ''.join(lines)

def nth_batch(n):
    "A predicate true at the `n`-th `BATCH` line it sees"
    seen = []
    def f(line):
        if line.startswith('BATCH '): seen.append(line)
        return len(seen) == n and line.startswith('BATCH ')
    return f

def objects(s3, prefix)->dict:
    "Every object under `prefix` with its ETag and time, the run lock aside: equal results mean no resume point was written"
    return {o['Key']: (o['ETag'], o['LastModified']) for o in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get('Contents', [])
            if not o['Key'].endswith('.lock')}

def same_as_ref(ref, out):
    d = compare(ref['out'], out)
    assert not d, f"{len(d)} differences from the uninterrupted run, first:\n" + '\n'.join(d[:10])

def test_kill_and_rerun(forker, s3, ref, tmp_path):
    "SIGKILL at random batches, rerun to the end: bitwise the uninterrupted run; a rerun after the end uploads nothing"
    url,out = f's3://{s3.bucket}/kills',tmp_path/'out.pth'
    kills = [random.Random(11).randrange(1, 9) for _ in range(3)]
    trained,snaps = kill_and_rerun(forker, SCRIPT, [url], tmp_path/'run', out, kills, env=s3.env)
    check_kill_and_rerun(ref['batches'], trained, snaps, ref['out'], out)
    before = objects(s3, 'kills/')
    points = [k for k in before if not k.endswith('.runlog')]
    assert len(points) == 4 and len(before) == 5, f"2 resume points, 2 manifests, the run log: {sorted(before)}"
    assert not batches(run_to_end(forker, SCRIPT, [out, url], env=s3.env, cwd=tmp_path/'run'))
    assert objects(s3, 'kills/') == before

def test_kill_during_upload(forker, s3, ref, tmp_path):
    "Uploads in the background; SIGKILL at random batches, and once between a data object and its manifest: skipped with a warning"
    url,out,env = f's3://{s3.bucket}/upload',tmp_path/'out.pth',dict(s3.env, KILLRERUN_SLEEP='0.05')
    rng,done = random.Random(5),[]
    for k in (rng.randrange(1, 9), rng.randrange(1, 9)):
        rc,text = run(forker, [out, url, '--background'], env, until=nth_batch(k))
        assert rc == -signal.SIGKILL, text[-2000:]
        done += [l for l in text.splitlines() if l.startswith('BATCH ')]
    rc,text = run(forker, [out, url, '--background', '--slow-upload', '5'], env, until=lambda l: l.startswith('UPLOADED'))
    assert rc == -signal.SIGKILL, text[-2000:]
    cut = [l.split()[1] for l in text.splitlines() if l.startswith('UPLOADED')][0]
    assert f'upload/{cut}' in objects(s3, 'upload/') and f'upload/{cut}{MANIFEST}' not in objects(s3, 'upload/')
    rc,text = run(forker, [out, url, '--background'], s3.env)
    assert rc == 0, text[-3000:]
    assert f'{url}/{cut} has no manifest' in text and 'skipping it' in text, text[:3000]
    same_as_ref(ref, out)
    assert all(k.endswith(('.pth', MANIFEST, '.runlog')) for k in objects(s3, 'upload/'))  # the run log: issue 21
    assert f'upload/{cut}' not in objects(s3, 'upload/'), "the unfinished upload is pruned once newer resume points are complete"

def test_damaged_objects(forker, s3, ref, tmp_path):
    "A truncated data object, a missing manifest, a manifest that does not match: each skipped with a warning naming it"
    url,out = f's3://{s3.bucket}/damaged',tmp_path/'out.pth'
    rc,text = run(forker, [out, url, '--keep', '10'], dict(s3.env, KILLRERUN_SLEEP='0.05'), until=nth_batch(13))
    assert rc == -signal.SIGKILL
    names = sorted((k for k in objects(s3, 'damaged/') if k.endswith('.pth')), reverse=True)
    assert len(names) >= 5, names
    c = s3.client()
    body = lambda k: c.get_object(Bucket=s3.bucket, Key=k)['Body'].read()
    c.put_object(Bucket=s3.bucket, Key=names[0], Body=body(names[0])[:-1000])
    c.delete_object(Bucket=s3.bucket, Key=names[1] + MANIFEST)
    c.put_object(Bucket=s3.bucket, Key=names[2] + MANIFEST, Body=body(names[3] + MANIFEST))
    rc,text = run(forker, [out, url, '--keep', '10'], s3.env)
    assert rc == 0, text[-3000:]
    u = lambda k: f's3://{s3.bucket}/{k}'
    assert f'{u(names[0])} is ' in text and 'but its manifest says' in text, text[:3000]
    assert f'{u(names[1])} has no manifest' in text
    assert f'{u(names[2])} is ' in text or f'{u(names[2])} does not match the sha256' in text
    assert f'AutoResume: continuing from {u(names[3])}' in text
    same_as_ref(ref, out)

@pytest.mark.parametrize('background', [False, True])
def test_server_stopped(forker, s3, ref, tmp_path, background):
    "The server goes away mid-run: retried, then a clear error naming the URL; nothing lost; the rerun with the server back is exact"
    url,out = f's3://{s3.bucket}/outage{int(background)}',tmp_path/'out.pth'
    bg = ['--background'] if background else []
    try: rc,text = run(forker, [out, url, *bg], dict(s3.env, KILLRERUN_SLEEP='0.05'), until=nth_batch(7), then=s3.stop)
    finally: s3.start()
    assert rc == 1, text[-3000:]
    assert 'Traceback' not in text and f'Could not write {url}/autoresume-' in text and 'gave up after 3 attempts' in text, text[-3000:]
    trained = [l for l in text.splitlines() if l.startswith('BATCH ')]
    assert len(trained) < len(ref['batches']), "the error stopped training"
    rc,text = run(forker, [out, url, *bg], s3.env)
    assert rc == 0, text[-3000:]
    assert 'AutoResume: continuing from' in text
    same_as_ref(ref, out)

def test_wrong_credentials_run(forker, s3, tmp_path):
    "A key the server refuses: the script stops before training, with an error naming the URL and the cause"
    url = f's3://{s3.bucket}/creds'
    rc,text = run(forker, [tmp_path/'out.pth', url], dict(s3.env, AWS_SECRET_ACCESS_KEY='wrong'))
    assert rc == 1 and 'BATCH' not in text, text[-3000:]
    # its first read: whose files the run's name holds (issue 49), before its lock
    assert 'Traceback' not in text and f'Could not read {url}/autoresume.runlog: access refused (PermissionError' in text, text[-3000:]
    assert 'check the credentials' in text and 'attempts' not in text, text[-3000:]   # refused at once, not retried

def test_missing_bucket_run(forker, s3, tmp_path):
    "A bucket that does not exist: refused before training (when the run takes its lock), at once, naming the URL"
    url = 's3://no-such-bucket/run1'
    rc,text = run(forker, [tmp_path/'out.pth', url], s3.env)
    assert rc == 1 and 'BATCH' not in text, text[-3000:]
    assert f'Could not lock {url}/.autoresume.lock: not found' in text and 'attempts' not in text, text[-3000:]

def lock_doc(s3, key)->dict: return json.loads(s3.client().get_object(Bucket=s3.bucket, Key=key)['Body'].read())

def test_second_run_refused(forker, s3, tmp_path):
    "Two processes on one URL: the second is refused before training, naming the first's host, pid and start; the first ends exactly"
    url = f's3://{s3.bucket}/twice'
    p = forker.start(SCRIPT, tmp_path/'a.pth', url, env=dict(s3.env, KILLRERUN_SLEEP='0.3'), cwd=tmp_path)
    try:
        for line in p.stdout:
            if line.startswith('BATCH '): break
        doc = lock_doc(s3, 'twice/.autoresume.lock')
        assert doc['pid'] == p.pid and doc['host'] == socket.gethostname(), doc
        rc,text = run(forker, [tmp_path/'b.pth', url], s3.env)
        assert rc == 1 and 'BATCH' not in text, text[-3000:]
        assert f"{url} is in use: process {p.pid} on {socket.gethostname()} has been training run 'autoresume' there since" in text, text[-3000:]
    finally: p.kill_group()

def test_lease_passes(s3):
    "A lock whose lease ran out (its machine died) is taken over; one within its lease, on another machine, is not; renewals keep it"
    from resumable_train.store import _held
    url,key = f's3://{s3.bucket}/lease','lease/.exp.lock'
    old = dict(host='elsewhere', boot='', pid=1, since=time.time()-100, expires=time.time()-1)
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=json.dumps(old).encode())
    st = as_store(url, **s3.options())
    st.lock('exp', lease=1.5)
    try:
        doc = lock_doc(s3, key)
        assert (doc['host'], doc['pid']) == (socket.gethostname(), os.getpid()), doc
        time.sleep(2.5)  # past the lease: renewed meanwhile
        assert lock_doc(s3, key)['expires'] > time.time(), "the lease was not renewed"
        mine = _held.pop(st._key('.exp.lock'))   # forgotten, as another process would see the run
        s3.client().put_object(Bucket=s3.bucket, Key=key, Body=json.dumps(dict(old, expires=time.time()+60)).encode())
        with pytest.warns(UserWarning, match=f"Lost the lock on {url}"):   # the first holder's renewal meets another's object
            with pytest.raises(RuntimeError, match=f"{url} is in use: process 1 on elsewhere"): st.lock('exp')
            mine.stop.wait(1.5)  # renewals come every 0.5 s; the first one after the change warns and stops renewing
        mine.release()
    finally: s3.client().delete_object(Bucket=s3.bucket, Key=key)

def test_old_s3fs_refused(s3, monkeypatch):
    "An s3fs without conditional writes is refused with the version to install (the `s3` extra asks for it)"
    import resumable_train.store as locks
    monkeypatch.setattr(locks, '_exclusive_writes', lambda fs: False)
    with pytest.raises(StoreError, match=r"has no conditional writes.*pip install 's3fs>=2024.12.0'"):
        as_store(f's3://{s3.bucket}/old', **s3.options()).lock('exp')

def test_sigterm_waits_bounded(forker, s3, ref, tmp_path):
    "SIGTERM while an upload is in flight: the stop waits for it; when it takes longer than stop_wait, the run stops without it"
    url,out,env = f's3://{s3.bucket}/sigterm',tmp_path/'out.pth',dict(s3.env, KILLRERUN_SLEEP='0.05')
    rc,text = run(forker, [out, url, '--background', '--slow-upload', '0.5'], env, until=lambda l: l.startswith('UPLOADED'), sig=signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, text[-3000:]
    stop = [l for l in text.splitlines() if l.startswith('AutoResume: stopped by SIGTERM')]
    assert stop and 'did not finish' not in text, text[-3000:]
    last = [l for l in text.splitlines() if l.startswith('BATCH ')][-1].split()
    ep,it = int(last[2]),int(last[3])+1  # the stop comes after the batch that was training when the signal came
    st = as_store(url, **s3.options())
    newest = max((e for e in st.ls() if e.complete), key=lambda e: e.name)
    rec = st.load(newest.name)['opt']['resume']
    assert (rec['epoch'], rec['iter']) == (ep, it), "the stop waited for the upload in flight, then uploaded a resume point at the stop"
    rc,text = run(forker, [out, url, '--background', '--slow-upload', '20', '--stop-wait', '1'], env,
                  until=lambda l: l.startswith('UPLOADED'), sig=signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, text[-3000:]
    assert f'AutoResume: the resume point being written to {url} did not finish within 1' in text, text[-3000:]
    rc,text = run(forker, [out, url], s3.env)
    assert rc == 0, text[-3000:]
    same_as_ref(ref, out)

def test_cli_ls_inspect(s3, monkeypatch, capsys):
    "`resumable-train ls URL` and `inspect URL` with the credentials from the environment; a wrong key is an error naming the URL"
    import s3fs
    from resumable_train.cli import main
    from fastai.test_utils import synth_learner
    import resumable_train.learner  # noqa: F401 (patches Learner.save)
    url = f's3://{s3.bucket}/cli'
    for k,v in s3.env.items(): monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    learn = synth_learner()
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    learn.save(f'{url}/a-0001', with_iter=True)  # the record of a finished run
    s3.client().put_object(Bucket=s3.bucket, Key='cli/a-0002.pth', Body=b'PK')
    assert main(['ls', url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f'{url}:' and len(out) == 4, out
    assert any('valid' in l and 'finished run' in l and l.endswith('a-0001.pth') for l in out), out
    assert any('incomplete' in l and 'has no manifest' in l and l.endswith('a-0002.pth') for l in out), out
    assert main(['inspect', f'{url}/a-0001.pth']) == 0
    assert f'{url}/a-0001.pth' in capsys.readouterr().out
    monkeypatch.setenv('AWS_SECRET_ACCESS_KEY', 'wrong')
    s3fs.S3FileSystem.clear_instance_cache()
    assert main(['ls', url]) == 2
    assert f'Could not list {url}: access refused' in capsys.readouterr().err
    s3fs.S3FileSystem.clear_instance_cache()

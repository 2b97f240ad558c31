"""6. Uploads: how long the training loop stalls per resume point when resume points go to S3 (moto's server on this machine),
with `AutoResume(background=True)` against synchronous, next to the same with a local folder

    python benchmarks/upload.py [--quick]     # or through run.py: python benchmarks/run.py --only upload
"""
import os, random, socket, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from common import *
from stall import TimedAutoResume, Compute

class _Moto:
    "moto's S3 server in its own process on 127.0.0.1 (so that it does not compete with the training thread for the GIL)"
    def __init__(self):
        with socket.socket() as s: s.bind(('127.0.0.1', 0)); self.port = s.getsockname()[1]
        self.p = subprocess.Popen([str(Path(sys.executable).parent/'moto_server'), '-H', '127.0.0.1', '-p', str(self.port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for _ in range(600):
            try: urllib.request.urlopen(f'http://127.0.0.1:{self.port}/moto-api/', timeout=1); break
            except OSError: time.sleep(0.05)
        self.options = dict(key='bench', secret='bench', client_kwargs=dict(endpoint_url=f'http://127.0.0.1:{self.port}', region_name='us-east-1'))
        import boto3
        boto3.client('s3', endpoint_url=f'http://127.0.0.1:{self.port}', region_name='us-east-1', aws_access_key_id='bench',
                     aws_secret_access_key='bench').create_bucket(Bucket='bench')
    def close(self): self.p.kill(); self.p.wait(10)

def _one(learn, dir, background, secs, every=2):
    "Stall of the second resume point of a fit (host buffers reused), and the time of its write"
    ar = TimedAutoResume(every_iter=every, background=background, verbose=False, dir=dir)
    learn.fit(1, cbs=[ar, Compute(secs, ar)])
    return ar.stalls[1],ar.writes[1]

def run(quick=False, device=None, reps=None):
    reps = reps or (1 if quick else 5)
    size,secs = ('small', 0.05) if quick else ('medium', 1.0)
    learn,moto = make_learner(5, bs=8, size=size, device=device),_Moto()
    from resumable_train.store import as_store
    stalls,writes = {},{}
    try:
        with tempfile.TemporaryDirectory(prefix='bench-upload-') as d:
            variants = [('local', False), ('local', True), ('s3', False), ('s3', True)]
            for r in range(reps):
                for i,(where,bg) in enumerate(random.Random(r).sample(variants, len(variants))):
                    dir = f'{d}/{r}-{i}' if where == 'local' else as_store(f's3://bench/{r}-{i}', **moto.options)
                    s,w = _one(learn, dir, bg, secs)
                    stalls.setdefault((where, bg), []).append(s); writes.setdefault((where, bg), []).append(w)
    finally: moto.close()
    m = {k: med(v) for k,v in stalls.items()}
    t = Table('upload', '6. Uploads: training-thread stall per resume point in S3 (local moto server), background vs synchronous, next to a local folder',
              ['model', 'state MB', 'local sync ms', 'local background ms', 'S3 sync ms', 'S3 background ms', 'S3 background / S3 sync',
               'S3 sync / local sync', 'S3 upload ms (other thread)'],
              [f"stall: time in AutoResume.after_batch at a batch that writes a resume point; the second of a fit is taken (host buffers reused); "
               f"{secs} s of stand-in compute per batch, so no write is in flight at the next one; median of {reps} fits, variants shuffled",
               "S3: moto's standalone server on 127.0.0.1 in its own process, through s3fs; a write = torch.save to a temporary file, sha256, "
               "upload of the data, upload of the manifest; local: temporary file, fsync, rename, fsync of the folder"])
    t.add(size, mb(state_bytes(learn)), ms(m['local', False]), ms(m['local', True]), ms(m['s3', False]), ms(m['s3', True]),
          ratio(m['s3', True], m['s3', False]), ratio(m['s3', False], m['local', False]), ms(med(writes['s3', True])))
    t.raw = dict(stalls={f'{k[0]}-{"background" if k[1] else "sync"}': v for k,v in stalls.items()},
                 writes={f'{k[0]}-{"background" if k[1] else "sync"}': v for k,v in writes.items()})
    return t

if __name__ == '__main__':
    quick = '--quick' in sys.argv
    t = run(quick=quick)
    out = RESULTS/'quick' if quick else RESULTS
    info = machine_info(quick, None)
    t.save(out, info)
    print(t.markdown(info))

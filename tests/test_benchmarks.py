"The benchmarks run: `python benchmarks/run.py --quick` prints and writes every table (numbers are not checked: performance is measured, not asserted)"
import json
import pytest, torch
from helpers import PY, ROOT, run, check_rc

NAMES = ('fastforward', 'checkpoint', 'overhead', 'overhead_secs', 'stall', 'memory', 'upload', 'peers', 'sigterm', 'cli', 'streams', 'streams_hf')

def test_quick_benchmarks(tmp_path):
    res = run([PY, str(ROOT/'benchmarks'/'run.py'), '--quick', '--out', str(tmp_path)], timeout=300)
    check_rc(res, 'benchmarks/run.py --quick')
    out = res[1]
    for n in NAMES:
        md,js = tmp_path/f'{n}.md',tmp_path/f'{n}.json'
        assert md.exists() and js.exists(), f"{n}: no table written\n{out[-3000:]}"
        t = json.loads(js.read_text())
        assert t['rows'] and all(len(r) == len(t['columns']) for r in t['rows']), t
        assert {'date', 'cores', 'torch', 'fastai'} <= set(t['info'])
        assert t['title'] in out and '| ' + ' | '.join(t['columns']) + ' |' in out, f"{n}: table not printed\n{out[-3000:]}"
    peers = json.loads((tmp_path/'peers.json').read_text())['rows']
    for name in ('accelerate save_state', 'dcp.save', 'dcp.async_save: stall', 'resumable_train background: stall'):  # the peers ran (the dev extra installs them)
        assert any(r[0] == name for r in peers), (name, peers)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="benchmarks/gpu_check.py runs the CUDA paths: no GPU here")
def test_gpu_check(tmp_path):
    "On a machine with a GPU: fp16 killed and resumed, 2-process nccl (with 2 GPUs), CUDA streams, costs with CUDA tensors"
    res = run([PY, str(ROOT/'benchmarks'/'gpu_check.py'), '--quick', '--out', str(tmp_path)], timeout=600)
    check_rc(res, 'benchmarks/gpu_check.py')
    assert 'FAILED' not in (tmp_path/'gpu_check.md').read_text()

def test_gpu_check_issue32_on_cpu(tmp_path):
    "Issue 32's tables run on a CPU (the device snapshot on `StandInCopies`): every variant measured, none failed"
    res = run([PY, str(ROOT/'benchmarks'/'gpu_check.py'), '--device', 'cpu', '--quick', '--checks', '5', '6', '--out', str(tmp_path)],
              timeout=400)
    check_rc(res, 'benchmarks/gpu_check.py --device cpu --checks 5 6')
    report = (tmp_path/'gpu_check.md').read_text()
    assert 'FAILED' not in report and 'failed:' not in report, report
    saves = json.loads((tmp_path/'check5'/'device_saves.json').read_text())['rows']
    for what in ('bare torch.save', 'learn.save', 'dcp async_save (default stager)', 'AutoResume background, host copy',
                 'AutoResume background, device snapshot (device path taken)', 'limit: clone on the device'):
        assert any(r[2] == what for r in saves), (what, saves)
    resumes = json.loads((tmp_path/'check6'/'resume_time.json').read_text())['rows']
    assert len(resumes) == 2 and all(float(r[5]) > 0 for r in resumes), resumes

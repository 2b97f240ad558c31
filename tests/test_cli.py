"The installed `resumable-train` command, in real processes: demo interrupted by SIGINT and rerun, inspect and ls, bad input"
import json, os, re, signal, sys, time
from pathlib import Path
import pytest
from helpers import run, start, finish, check_rc

CMD = str(Path(sys.executable).parent/'resumable-train')
DIGEST = re.compile(r'weights ([0-9a-f]{12})')

def demo(d, *args): return [CMD, 'demo', '--dir', str(d), '--epochs', '2', *args]

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "An uninterrupted demo run, and one stopped by SIGINT in epoch 1 (then rerun), side by side"
    tmp = tmp_path_factory.mktemp('cli')
    assert Path(CMD).exists(), f"{CMD} is not installed: pip install -e ."
    ref = start(demo(tmp/'ref', '--pause', '0'))
    p = start(demo(tmp/'cut'))
    first = tmp/'cut'/'models'/'autoresume-0001.pth'
    deadline = time.monotonic() + 90
    while not first.exists() and p.poll() is None and time.monotonic() < deadline: time.sleep(0.1)
    time.sleep(0.5)
    os.kill(p.pid, signal.SIGINT)
    return tmp, finish(ref, 90), finish(p, 60)

def test_demo_resumes_after_sigint(runs):
    tmp,ref,cut = runs
    check_rc(ref, 'uninterrupted demo')
    rc,out,err = cut
    assert rc == 130, f"rc={rc}\n{out[-2000:]}\n{err[-2000:]}"
    stop = re.search(r'stopped by SIGINT at epoch (\d+)/\d+, batch (\d+)/\d+', out)
    assert stop and stop.group(1) == '2', out[-2000:]
    res = run(demo(tmp/'cut'), timeout=90)
    check_rc(res, 'resumed demo')
    assert re.search(rf"\(epoch 2/\d+, batch {stop.group(2)}/\d+\)", res[1]), res[1][-2000:]
    assert DIGEST.search(res[1]).group(1) == DIGEST.search(ref[1]).group(1)

def test_inspect_and_ls(runs):
    tmp = runs[0]
    models = tmp/'ref'/'models'
    rc,out,err = run([CMD, 'inspect', '--json', str(models/'autoresume-0003.pth')], timeout=60)
    check_rc((rc, out, err), 'inspect')
    info = json.loads(out)
    assert info['valid'] and info['position'] is None and info['fit_index'] == 0 and info['metrics']['epoch'] == 1
    data = (models/'autoresume-0002.pth').read_bytes()
    (models/'autoresume-0004.pth').write_bytes(data[:len(data)//3])
    rc,out,err = run([CMD, 'ls', str(tmp/'ref')], timeout=60)
    check_rc((rc, out, err), 'ls')
    names = [l.split()[-1] for l in out.splitlines()[2:]]
    assert names[0] == 'autoresume-0004.pth' and 'damaged' in out.splitlines()[2], out
    rc,out,err = run([CMD, 'inspect', str(models/'autoresume-0004.pth')], timeout=60)
    assert rc == 2 and out == '' and 'autoresume-0004.pth is truncated' in err, (rc, out, err)
    rc,out,err = run([CMD, 'inspect', str(tmp/'nothing.pth')], timeout=60)
    assert rc == 2 and f"{tmp/'nothing.pth'} does not exist" in err, (rc, out, err)

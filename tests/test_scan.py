"""The scan under torch.distributed (issue 20): a store error on one node's reader reaches every rank, which all stop with that message,
instead of the other ranks waiting for a broadcast that never comes. Two ranks forked from the test process, gloo on CPU."""
import pytest
from helpers import TESTS
from test_distributed import wait_ranks, why
from test_elastic import free_port

SCRIPT = TESTS/'scan_script.py'

@pytest.mark.parametrize('failing', [0, 1])
def test_store_error_reaches_every_rank(forker, tmp_path, failing):
    port = free_port()
    env = lambda r: dict(RANK=str(r), LOCAL_RANK='0', WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    res = wait_ranks([forker.start(SCRIPT, tmp_path, failing, env=env(r)) for r in (0, 1)], timeout=60)
    msg = f'RAISED StoreError Could not list {tmp_path}/node{failing}: the store cannot be reached'
    assert all(rc == 0 and msg in out for rc,out in res), why(res)

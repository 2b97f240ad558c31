"""Two ranks scan a run while one node's store fails, for test_scan.py: `python scan_script.py FOLDER FAILING_RANK` under torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK 0 on both, as on two nodes). Prints what the scan of the run
(`checkpoints.scan_run`, which `FitStart.decide` makes) raised."""
import datetime, os, sys
import torch.distributed as dist
from resumable_train.autoresume import AutoResume
from resumable_train.store import LocalStore, StoreError
from resumable_train.checkpoints import scan_run

folder,failing = sys.argv[1],int(sys.argv[2])
rank = int(os.environ['RANK'])

class FailingStore(LocalStore):
    "A folder whose listing fails, as a store that cannot be reached does"
    def ls(self): raise StoreError(f"Could not list {self.url}: the store cannot be reached")

dist.init_process_group('gloo', rank=rank, world_size=int(os.environ['WORLD_SIZE']), timeout=datetime.timedelta(seconds=15))
ar = AutoResume(dir=(FailingStore if rank == failing else LocalStore)(f'{folder}/node{rank}'))
try: scan_run(ar.store, ar.fname, ar.wait); print('SCANNED', flush=True)
except Exception as e: print('RAISED', type(e).__name__, e, flush=True)
dist.destroy_process_group()

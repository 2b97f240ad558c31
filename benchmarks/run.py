#!/usr/bin/env python
"""Benchmarks of resumable_train: fast-forward, checkpoint cost, AutoResume overhead, background-write stalls, memory, uploads to S3,
peers (Accelerate, torch.distributed.checkpoint) in the same run, time from SIGTERM to a durable resume point,
the command's start-up time, resuming a stream (and a Hugging Face stream with a shuffle buffer).

    python benchmarks/run.py            # all, full size (a few minutes); tables printed and kept in benchmarks/results/
    python benchmarks/run.py --quick    # smoke run, seconds
    python benchmarks/run.py --only checkpoint memory --device cuda
"""
import argparse, json, sys, time
from pathlib import Path
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # these modules, then this checkout's package

NAMES = ('fastforward', 'checkpoint', 'overhead', 'overhead_secs', 'stall', 'memory', 'upload', 'peers', 'sigterm', 'cli', 'streams', 'streams_hf')

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--quick', action='store_true', help='tiny sizes and one repetition: checks the benchmarks run, numbers mean little')
    p.add_argument('--only', nargs='+', choices=NAMES, default=NAMES, help='run only these benchmarks')
    p.add_argument('--out', default=None, help='folder for the .md/.json tables (default benchmarks/results, or benchmarks/results/quick with --quick)')
    p.add_argument('--device', default=None, help="device of the model for checkpoint, overhead, stall and memory (e.g. cuda); cpu by default")
    p.add_argument('--reps', type=int, default=None, help='repetitions per variant (default: each benchmark its own)')
    p.add_argument('--threads', type=int, default=None, help='torch threads (default: torch default)')
    p.add_argument('--memory-child', nargs=2, metavar=('VARIANT', 'SIZE'), help=argparse.SUPPRESS)
    p.add_argument('--sigterm-server', nargs=2, metavar=('SIZE', 'REPS'), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    import torch
    if a.threads: torch.set_num_threads(a.threads)
    import memory
    if a.memory_child: return print(json.dumps(memory.measure(*a.memory_child, device=a.device)))
    if a.sigterm_server:
        import sigterm
        return print(json.dumps(sigterm.serve(a.sigterm_server[0], int(a.sigterm_server[1]), device=a.device)))
    from common import RESULTS, machine_info
    import fastforward, checkpoint, overhead, stall, upload, peers, sigterm, cli, streams
    out = Path(a.out) if a.out else RESULTS/'quick' if a.quick else RESULTS
    info = machine_info(a.quick, a.device)
    mods = dict(fastforward=fastforward, checkpoint=checkpoint, overhead=overhead, overhead_secs=overhead.run_secs, stall=stall, memory=memory, upload=upload, peers=peers, sigterm=sigterm, cli=cli, streams=streams, streams_hf=streams.run_hf)
    for n in a.only:
        t0 = time.perf_counter()
        kw = dict(device=a.device) if n not in ('fastforward', 'streams', 'streams_hf') else {}
        t = getattr(mods[n], 'run', mods[n])(quick=a.quick, reps=a.reps, **kw)
        t.save(out, info)
        print(t.markdown(info) + f"({n}: {time.perf_counter()-t0:.0f} s; written to {out/n}.md and .json)\n", flush=True)

if __name__ == '__main__': main()

"""The ``frame`` kind's cost: a rank's CPU per frame it handles, from a 1-byte star.

``ENTRENAR_SPIN_US=0 ENTRENAR_CALLER_SPIN_US=0 python -m torch.distributed.run
--standalone --nproc_per_node N -m benchmarks.model.frame_cost [--calls K]``

Every rank runs K 1-byte MAX allreduces with ``algorithm="star"`` on an
entrenar group (one host; the transport as ``ENTRENAR_TRANSPORT`` says): the
barrier's plan until it became the dissemination barrier, and reports its
process CPU time (every thread, ``getrusage``) over them. The star (collectives/star.py):
rank 0 handles 2(N-1) frames per call, a rank that is neither rank 0 nor its
neighbour 4 (its token, the answer, the neighbours' headers). Rank 0 prints
(rank 0's CPU - the median such rank's) / K / (2(N-1) - 4): CPU seconds per
frame, beside everything per call both pay alike (the Python of a call, the
wake-ups). With the spins at 0 a rank burns no CPU waiting. Needs N >= 4.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from entrenar_pg import Options


def cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model.frame_cost")
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < 4:
        raise SystemExit("frame_cost needs at least 4 ranks")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    pg = dist.new_group(
        list(range(world)), backend="entrenar", pg_options=Options(algorithm="star")
    )
    token = torch.zeros(1, dtype=torch.uint8)
    for _ in range(20):  # warm-up: connections, buffers
        dist.all_reduce(token, dist.ReduceOp.MAX, group=pg)
    dist.barrier()
    start = cpu_s()
    for _ in range(a.calls):
        dist.all_reduce(token, dist.ReduceOp.MAX, group=pg)
    spent = torch.tensor([cpu_s() - start], dtype=torch.float64)
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, spent)
    if rank == 0:
        per_call = [float(t) / a.calls for t in every]
        leaf = statistics.median(per_call[2 : world - 1])
        frames = 2 * (world - 1) - 4
        print(
            f"N={world} transport={os.environ.get('ENTRENAR_TRANSPORT', 'auto')}: CPU per call "
            f"rank 0 {per_call[0] * 1e6:.0f} µs, a middle leaf {leaf * 1e6:.0f} µs; "
            f"per frame {(per_call[0] - leaf) / frames * 1e6:.1f} µs ({frames} frames more)"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

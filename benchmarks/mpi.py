"""MPI allreduce timings for ``python -m benchmarks.bench`` (the MPI column).

Run by the benchmark as ``mpiexec -n N python .../benchmarks/mpi.py --plan
SIZE:ROUNDS:PER_BLOCK:WARMUP,...`` (by path, so that neither entrenar_pg nor
torch is imported and the ranks start quickly); rank 0 prints one JSON line on stdout:
``{"library": ..., "world_size": N, "times": {"SIZE": [seconds, ...]}}``, one
time per timed iteration, each the maximum over ranks of that iteration's
duration (the same statistic as the torch variants of the benchmark).

Needs only numpy and mpi4py (``pip install mpich mpi4py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import numpy as np


def parse_plan(text: str) -> list[tuple[int, int, int, int]]:
    """Parse ``SIZE:ROUNDS:PER_BLOCK:WARMUP`` items separated by commas."""
    plan = []
    for item in text.split(","):
        size, rounds, per_block, warmup = (int(x) for x in item.split(":"))
        plan.append((size, rounds, per_block, warmup))
    return plan


def time_size(comm: object, size: int, rounds: int, per_block: int, warmup: int) -> list[float]:
    """Time ``rounds * per_block`` in-place float32 Allreduces of ``size`` bytes on this rank."""
    from mpi4py import MPI

    buf = np.zeros(size // 4, dtype=np.float32)
    times: list[float] = []
    for _ in range(rounds):
        comm.Barrier()  # type: ignore[attr-defined]
        for _ in range(warmup):
            comm.Allreduce(MPI.IN_PLACE, buf)  # type: ignore[attr-defined]
        for _ in range(per_block):
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buf)  # type: ignore[attr-defined]
            times.append(time.perf_counter() - t0)
    return times


def run(plan: Sequence[tuple[int, int, int, int]]) -> dict[str, object] | None:
    """Time every planned size; rank 0 returns the combined result, other ranks None."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    result: dict[str, list[float]] = {}
    for size, rounds, per_block, warmup in plan:
        mine = time_size(comm, size, rounds, per_block, warmup)
        gathered: list[list[float]] | None = comm.gather(mine, root=0)
        if gathered is not None:
            result[str(size)] = [max(col) for col in zip(*gathered, strict=True)]
    if comm.rank != 0:
        return None
    return {
        "library": MPI.Get_library_version().splitlines()[0].strip(),
        "world_size": comm.size,
        "times": result,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (under mpiexec)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="SIZE:ROUNDS:PER_BLOCK:WARMUP,...")
    args = parser.parse_args(argv)
    out = run(parse_plan(args.plan))
    if out is not None:
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

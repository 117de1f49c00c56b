"""The flight recorder's cost: a tight loop of 4 KiB blocking allreduces at N = 2.

    TORCH_FR_BUFFER_SIZE=2000 torchrun --standalone --nproc_per_node=2 \\
        -m benchmarks.flight_recorder_cost ROUNDS CALLS

(or ``python -m benchmarks.flight_recorder_cost ROUNDS CALLS`` on each rank,
env://). With ``TORCH_FR_BUFFER_SIZE`` > 0 the group records; each round then runs
one block of CALLS calls with the recorder detached (off) and one with it
attached (on), in alternating order, both ranks in step, and prints the
per-call median of every block. Without it (or on a tree without the
recorder), every block is "off" and is timed the same way, so two trees'
runs can be compared (the cost of the recorder's hooks when off).
Rank 0 prints one JSON line: {"off": [us...], "on": [us...]}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def main(rounds: int, calls: int) -> None:
    dist.init_process_group("entrenar", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    pg: Any = dist.distributed_c10d._get_default_group()  # the EntrenarProcessGroup itself
    runtime = pg._runtime
    recorder = getattr(runtime, "recorder", None)
    t = torch.ones(1024)
    for _ in range(500):
        dist.all_reduce(t)
    medians: dict[str, list[float]] = {"off": [], "on": []}
    clock = time.perf_counter
    for r in range(rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for mode in order:
            if recorder is None and mode == "on":
                continue
            if recorder is not None:
                runtime.recorder = recorder if mode == "on" else None
            dist.barrier()
            times = []
            for _ in range(calls):
                start = clock()
                dist.all_reduce(t)
                times.append(clock() - start)
            medians[mode].append(statistics.median(times) * 1e6)
    if rank == 0:
        print(json.dumps(medians), flush=True)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

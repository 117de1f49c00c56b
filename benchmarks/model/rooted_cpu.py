"""CPU per call of the barrier and small broadcasts, entrenar beside gloo, on one host.

``python -m torch.distributed.run --standalone --nproc_per_node N -m
benchmarks.model.rooted_cpu [--calls K] [--sizes 4K,64K] [--blocks B]``

On a loaded machine wall times of sub-millisecond calls are mostly the
scheduler's; the process CPU time a call costs each rank (every thread,
``getrusage``) is what this code controls, and what other ranks on the same
cores wait for. Each rank runs, in B blocks alternating the backends, K
calls of each op (the barrier; a broadcast from rank 0 per size) and takes
its CPU time and wall time per call; rank 0 prints per op and backend the
median over ranks of the median over blocks, and entrenar / gloo.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks.config import FLOAT32_BYTES
from benchmarks.model.rooted_rank import op_names
from benchmarks.sizes import format_bytes, parse_sizes, rotated


def cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def one_op(name: str, pg: dist.ProcessGroup, bufs: dict[int, torch.Tensor]) -> None:
    if name == "barrier":
        dist.barrier(group=pg)
    else:
        dist.broadcast(bufs[int(name.split()[1])], 0, group=pg)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model.rooted_cpu")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--sizes", default="4K,64K")
    a = p.parse_args(argv)
    sizes = list(parse_sizes(a.sizes))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    groups = {b: dist.new_group(list(range(world)), backend=b) for b in ("entrenar", "gloo")}
    bufs = {s: torch.zeros(s // FLOAT32_BYTES) for s in sizes}
    names = op_names(sizes)
    per: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for block in range(a.blocks):
        for backend in rotated(list(groups), block):
            pg = groups[backend]
            for name in names:
                for _ in range(10):  # warm-up: connections, cached plans
                    one_op(name, pg, bufs)
                dist.barrier()
                c0, t0 = cpu_s(), time.monotonic()
                for _ in range(a.calls):
                    one_op(name, pg, bufs)
                c1, t1 = cpu_s(), time.monotonic()
                per.setdefault((backend, name), []).append(
                    ((c1 - c0) / a.calls, (t1 - t0) / a.calls)
                )
    mine = torch.tensor(
        [statistics.median(x[i] for x in per[k]) for k in sorted(per) for i in (0, 1)],
        dtype=torch.float64,
    )
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        keys = sorted(per)
        table = torch.stack(every).median(dim=0).values.tolist()
        at = {k: (table[2 * i], table[2 * i + 1]) for i, k in enumerate(keys)}
        print(f"N={world}, {a.blocks} blocks of {a.calls} calls; medians over ranks")
        print("| op | entrenar CPU | gloo CPU | ratio | entrenar wall | gloo wall | ratio |")
        print("|---|---|---|---|---|---|---|")
        for name in names:
            (ec, ew), (gc, gw) = at[("entrenar", name)], at[("gloo", name)]
            label = name if name == "barrier" else f"broadcast {format_bytes(int(name.split()[1]))}"
            print(
                f"| {label} | {ec * 1e6:.0f} µs | {gc * 1e6:.0f} µs | {ec / gc:.2f} "
                f"| {ew * 1e6:.0f} µs | {gw * 1e6:.0f} µs | {ew / gw:.2f} |"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

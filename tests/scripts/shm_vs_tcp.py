"""Time dist.all_reduce over entrenar's TCP and shared-memory transports, interleaved.

torchrun --standalone --nproc_per_node=N tests/scripts/shm_vs_tcp.py [rounds]
Prints, on rank 0, the median time per call at each size for each transport
and their ratio (shm / tcp): the machine is shared, so ratios, not absolutes.
Also the process CPU time per call (user + system, every thread of rank 0):
with ENTRENAR_SPIN_US=0 ENTRENAR_CALLER_SPIN_US=0 (no busy-polling) that is
the work a call costs, which other load on the machine does not inflate.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import entrenar_pg  # noqa: F401  (registers the backend)
from entrenar_pg import Options

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


def time_one(group: dist.ProcessGroup, t: torch.Tensor, iters: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per call."""
    dist.barrier(group=group)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    return (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    groups = {
        tr: dist.new_group(backend="entrenar", pg_options=Options(transport=tr))
        for tr in ("tcp", "shm")
    }
    for tr, g in groups.items():
        mesh = g._get_backend(torch.device("cpu"))._runtime.mesh
        assert bool(mesh.shm) == (tr == "shm"), (tr, mesh.shm)
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    for size in SIZES:
        t = torch.ones(size // 4)
        iters = max(3, min(300, (64 << 20) // size // 2))
        for g in groups.values():  # warm-up: plans, pages
            time_one(g, t, 2)
        for _ in range(rounds):
            for tr, g in groups.items():
                wall, used = time_one(g, t, iters)
                times.setdefault((tr, size), []).append(wall)
                cpu.setdefault((tr, size), []).append(used)
    if dist.get_rank() == 0:
        print(f"N={world}  median per call; busbw = bytes*2(N-1)/N / time")
        for size in SIZES:
            tcp = statistics.median(times[("tcp", size)])
            shm = statistics.median(times[("shm", size)])
            ctcp = statistics.median(cpu[("tcp", size)])
            cshm = statistics.median(cpu[("shm", size)])
            bw = size * 2 * (world - 1) / world
            print(
                f"{size >> 10:>6} KiB  tcp {tcp * 1e6:9.1f} us ({bw / tcp / 1e9:5.2f} GB/s)  "
                f"shm {shm * 1e6:9.1f} us ({bw / shm / 1e9:5.2f} GB/s)  shm/tcp {shm / tcp:5.2f}"
                f"  | cpu/call tcp {ctcp * 1e6:9.1f} us shm {cshm * 1e6:9.1f} us"
                f" ratio {cshm / ctcp:5.2f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Time dist.all_reduce over entrenar's TCP transport, its shared-memory byte
rings and its shm-native allreduce (the slot areas), interleaved.

torchrun --standalone --nproc_per_node=N -m benchmarks.shm_vs_tcp [rounds] [sizes...]
Prints, on rank 0, the median time per call at each size for each path and
the ratios slots / rings and slots / tcp: the machine is shared, so ratios,
not absolutes. The paths:

- ``tcp``: ``Options(transport="tcp")``;
- ``rings``: ``transport="shm"`` with the policy told the ranks are not all
  local (``mesh.all_local = False``): every plan over the byte rings, as
  before the slot areas (DIRECT / RING at N=2, STAR / RING above);
- ``slots``: ``transport="shm"``: the policy's ``SHM`` row;
- ``floor``: a backend that moves nothing (benchmarks/floor.py): torch's
  dispatch of ``dist.all_reduce`` into a Python process group, the least
  any Python backend pays per call;
- ``algo``: the slots path's job alone (``jobs.allreduce_flat`` called
  directly: no torch dispatch, no submit, no Work), so that
  ``slots - algo`` is what dispatch and our submit path cost.

Also the process CPU time per call (user + system, every thread of rank 0).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

import entrenar_pg  # noqa: F401  (registers the backend)
from benchmarks import floor
from entrenar_pg import Options
from entrenar_pg.collectives import choose
from entrenar_pg.reduce_ops import Kind, Reduction
from entrenar_pg.runtime import jobs
from entrenar_pg.runtime.context import JobContext
from entrenar_pg.wire import Algo, OpCode

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
_SUM = Reduction(Kind.SUM)


def runtime_of(group: dist.ProcessGroup) -> Any:
    """An entrenar group's runtime (its backend's private ``_runtime``)."""
    backend: Any = group._get_backend(torch.device("cpu"))
    return backend._runtime


class AlgoOnly:
    """The slots group's allreduce job without dispatch: sequence numbers of
    its own (far above the group's, the same on every rank)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.rt = runtime_of(group)
        self.seq = 1 << 40

    def __call__(self, t: torch.Tensor) -> None:
        self.seq += 1
        rt = self.rt
        mesh = rt.mesh
        spin_s, timeout_s = rt.options.caller_spin_us / 1e6, rt.timeout.seconds
        ctx = JobContext(
            mesh,
            rt.rank,
            mesh.world,
            self.seq,
            rt.scratch,
            spin_s,
            timeout_s,
            rt.choices,
            rt.options,
        )
        jobs.allreduce_flat(ctx, t, _SUM, t.numel() * t.element_size())


def time_one(
    call: Callable[[torch.Tensor], object], sync: Callable[[], object], t: torch.Tensor, iters: int
) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per call."""
    sync()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        call(t)
    return (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    sizes = tuple(int(s) for s in sys.argv[2:]) or SIZES
    dist.init_process_group("gloo")
    floor.register()
    world = dist.get_world_size()
    groups = {
        "tcp": dist.new_group(backend="entrenar", pg_options=Options(transport="tcp")),
        "rings": dist.new_group(backend="entrenar", pg_options=Options(transport="shm")),
        "slots": dist.new_group(backend="entrenar", pg_options=Options(transport="shm")),
        "floor": dist.new_group(backend=floor.BACKEND),
    }
    rings = runtime_of(groups["rings"])
    rings.mesh.all_local = False  # the policy's rows for the byte rings
    slots = runtime_of(groups["slots"])
    assert slots.mesh.all_local and slots.mesh.slots is not None
    algo = AlgoOnly(groups["slots"])
    calls: dict[str, Callable[[torch.Tensor], object]] = {
        name: partial(dist.all_reduce, group=g) for name, g in groups.items()
    }
    calls["algo"] = algo
    syncs: dict[str, Callable[[], object]] = {
        name: partial(dist.barrier, group=g) for name, g in groups.items()
    }
    syncs["algo"] = syncs["slots"]
    syncs["floor"] = dist.barrier  # the floor's barrier waits for no one
    names = list(calls)
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    for size in sizes:
        t = torch.ones(size // 4)
        choice = choose(OpCode.ALLREDUCE, size, world, slots.options, slots.mesh.all_local)
        assert choice.algo is Algo.SHM
        iters = max(3, min(300, (64 << 20) // size // 2))
        for name in names:  # warm-up: plans, pages
            time_one(calls[name], syncs[name], t, 2)
        for _ in range(rounds):
            for name in names:
                wall, used = time_one(calls[name], syncs[name], t, iters)
                times.setdefault((name, size), []).append(wall)
                cpu.setdefault((name, size), []).append(used)
    if dist.get_rank() == 0:
        print(f"N={world}  median per call (us); busbw = bytes*2(N-1)/N / time (GB/s)")
        print(f"{'size':>9} " + " ".join(f"{n:>15}" for n in names) + "  slots/rings slots/tcp")
        for size in sizes:
            med = {n: statistics.median(times[(n, size)]) for n in names}
            bw = size * 2 * (world - 1) / world
            cols = " ".join(f"{med[n] * 1e6:8.1f} ({bw / med[n] / 1e9:4.2f})" for n in names)
            print(
                f"{size >> 10:>5} KiB {cols}  {med['slots'] / med['rings']:11.2f} "
                f"{med['slots'] / med['tcp']:9.2f}"
            )
        print("cpu per call (us): " + ", ".join(names))
        for size in sizes:
            c = [statistics.median(cpu[(n, size)]) * 1e6 for n in names]
            print(f"{size >> 10:>5} KiB " + " ".join(f"{x:10.1f}" for x in c))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

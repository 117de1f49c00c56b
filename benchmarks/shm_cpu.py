"""CPU time of one N=2 shm sum's own Python, against a baseline tree, in one process.

``python -m benchmarks.shm_cpu --baseline-tree DIR [--size 4K,64K] [--rounds 7] [--calls 50000]``

On a shared machine the wall time of two ranks moves with the load (the
DeepSpeed comparison, ``benchmarks.shm_dist``, is judged per job for that
reason); the CPU time one thread spends in its own code does much less.
Two parts of a blocking ``dist.all_reduce`` of a float32 SUM over shared
memory between two ranks, each timed with ``time.thread_time`` (best and
median of ``--rounds`` rounds, the trees alternating):

- ``core``: ``shm_allreduce.allreduce_shm_pair`` on a slot area over two
  anonymous mappings of this process, whose peer is always there (its
  ``ARRIVED`` word far ahead, its headers equal to ours): the copy in, the
  meeting, the header compare, the add; no wait.
- ``thin``: ``EntrenarProcessGroup.allreduce`` of two thread ranks' groups
  (rank 0 calling), with that sum replaced by nothing: torch's options and
  the tensor read, the route, the claim, the seq, the counters, the Work.

The baseline tree is copied as the package ``entrenar_baseline`` (the
package imports itself relatively), as ``benchmarks.shm_dist`` does.
"""

from __future__ import annotations

import argparse
import importlib
import mmap
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.sizes import format_bytes, parse_sizes

BASELINE_PACKAGE = "entrenar_baseline"


@dataclass
class _Link:
    """What a slot area keeps of a peer's link: its rank and its wake-up socket."""

    peer: int
    sock: socket.socket


@dataclass
class _Shape:
    """A pair shape's two fields ``allreduce_shm_pair`` reads."""

    pair: Any
    packed: bytearray


@dataclass
class _Call:
    """A Call's fields the pair path reads when the peer is there."""

    mesh: Any
    seq: int = 5
    spin_s: float = 0.0
    timeout_s: float = 1.0


@dataclass
class _Mesh:
    slots: Any


def _pair_area_bytes(slots: Any) -> int:
    """One rank's slot area of a two-rank group in that tree (one size for
    every group in trees before ``slots.area_bytes``)."""
    sized = getattr(slots, "area_bytes", None)
    return int(sized(2)) if sized is not None else int(slots.AREA_BYTES)


def core(package: str, nbytes: int) -> Callable[[], None]:
    """One call of ``package``'s pair sum whose peer is always there."""
    slots = importlib.import_module(f"{package}.transport.shm.slots")
    shm = importlib.import_module(f"{package}.collectives.shm_allreduce")
    wire = importlib.import_module(f"{package}.wire")
    mine, _theirs = socket.socketpair()
    areas = {q: memoryview(mmap.mmap(-1, _pair_area_bytes(slots))) for q in (0, 1)}
    area = slots.SlotArea(0, areas, {1: _Link(1, mine)}, placement=False)
    pair = shm._new_pair(area, torch.float32, nbytes, shm.Kind.SUM)
    shape = _Shape(pair, bytearray(wire.HEADER_BYTES))
    call = _Call(_Mesh(area))
    wire.stamp_seq(shape.packed, call.seq)
    area._ctl[1][slots._ARRIVED] = 1 << 60  # the peer: always a phase ahead
    for parity in (0, 1):
        area.peer_headers[parity][0][:] = shape.packed
    buf = torch.ones(nbytes // 4)
    fn, op = shm.allreduce_shm_pair, wire.OpCode.ALLREDUCE

    def run() -> None:
        fn(call, buf, shape, op, 0.0)

    return run


@dataclass(frozen=True)
class _Patched:
    """A module attribute replaced for the timing, and what to put back."""

    module: Any
    name: str
    original: Any

    def undo(self) -> None:
        setattr(self.module, self.name, self.original)


def thin(package: str, nbytes: int) -> tuple[Callable[[], None], list[Any], _Patched]:
    """One thin-path call of ``package``'s group (rank 0), the sum itself a no-op
    until the returned patch is undone (the module is the process's: every
    pair sum of ``package`` does nothing meanwhile)."""
    pg_module = importlib.import_module(f"{package}.api.process_group")
    options = importlib.import_module(package).Options(transport="shm")
    store = dist.HashStore()
    groups: list[Any] = [None, None]

    def make(rank: int) -> None:
        groups[rank] = pg_module.EntrenarProcessGroup(
            dist.PrefixStore("cpu", store), rank, 2, timeout=timedelta(seconds=30), options=options
        )

    _on_both(make)
    tensors = [torch.ones(nbytes // 4) for _ in groups]
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    _on_both(lambda r: groups[r].allreduce([tensors[r]], opts).wait())  # the route, learnt
    _on_both(lambda r: groups[r].allreduce([tensors[r]], opts).wait())
    shm = importlib.import_module(f"{package}.runtime.thin").shm
    patch = _Patched(shm, "allreduce_shm_pair", shm.allreduce_shm_pair)
    shm.allreduce_shm_pair = _nothing
    group, t = groups[0], tensors[0]

    def run() -> None:
        group.allreduce([t], opts)

    return run, groups, patch


def _nothing(*args: Any) -> None:
    return None


def _on_both(fn: Callable[[int], Any]) -> None:
    threads = [threading.Thread(target=fn, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shm_cpu", description=__doc__)
    p.add_argument("--baseline-tree", required=True, help="a directory holding entrenar_pg/")
    p.add_argument("--size", default="4K,64K", help="float32 message sizes (<= 128 KiB)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=50_000, help="calls per round")
    a = p.parse_args(argv)
    copy = tempfile.mkdtemp(prefix="shm_cpu_")
    shutil.copytree(Path(a.baseline_tree) / "entrenar_pg", Path(copy) / BASELINE_PACKAGE)
    sys.path.insert(0, copy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trees = {"new": "entrenar_pg", "baseline": BASELINE_PACKAGE}
    print("thread CPU time per call, us (best / median of rounds); the trees alternate")
    print(f"{'part':>5} {'size':>7} {'new':>13} {'baseline':>13} {'new/base':>9}")
    groups: list[Any] = []
    patches: list[_Patched] = []
    try:
        for nbytes in parse_sizes(a.size):
            runs = {name: core(pkg, nbytes) for name, pkg in trees.items()}
            _report("core", nbytes, runs, a.rounds, a.calls)
        runs = {}
        for name, pkg in trees.items():
            runs[name], made, patch = thin(pkg, 4096)
            groups += made
            patches.append(patch)
        _report("thin", 4096, runs, a.rounds, a.calls)
    finally:
        # The process may go on (a test calls main): no-op sums, groups, the
        # copy's path and one thread must not outlive the timing.
        for patch in patches:
            patch.undo()
        for g in groups:
            g.shutdown()
        sys.path.remove(copy)
        torch.set_num_threads(threads)
        shutil.rmtree(copy, ignore_errors=True)


def _report(
    part: str, nbytes: int, runs: dict[str, Callable[[], None]], rounds: int, calls: int
) -> None:
    got: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            got[name].append(timeit.timeit(run, number=calls, timer=time.thread_time) / calls)
    cells = {
        name: f"{min(v) * 1e6:.2f} / {statistics.median(v) * 1e6:.2f}" for name, v in got.items()
    }
    ratio = statistics.median(got["new"]) / statistics.median(got["baseline"])
    print(
        f"{part:>5} {format_bytes(nbytes):>7} {cells['new']:>13} {cells['baseline']:>13} "
        f"{ratio:9.2f}"
    )


if __name__ == "__main__":
    main()

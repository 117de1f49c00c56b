"""Per-call times of our shm allreduce and DeepSpeed's at one size, with where each rank ran.

``python -m benchmarks.shm_dist [--size 64K] [--blocks 6] [--per 100] [--pin] [--tree DIR]``

The bench reports medians; this shows what makes them. Two processes get
torchrun's environment, a gloo default group, an entrenar ``shm`` group and
DeepSpeed's SHM op (``benchmarks/deepspeed_peer.py``, installed by
``benchmarks/install_peers.sh``), all in the same processes. They time
alternating blocks of each, every call on both ranks, and read
``sched_getcpu()`` after every call. Reported per contestant:
- quantiles of the per-iteration maximum over ranks (as the bench);
- the share of calls above 2x the p10;
- the share of calls after which both ranks were on one CPU, with the
  median there and apart (docs/benchmarks.md, "the slow mode is a shared
  core");
- each rank's placement moves (``transport/shm/placement.py``; -1 where the
  tree has none).

``--pin`` puts rank r on CPU r (a core each, whatever the scheduler would do).
``--tree DIR``: the ranks import ``DIR/entrenar_pg`` (a copy, as the bench's
``--baseline-tree``) instead of this checkout's, to see another tree's calls.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.deepspeed_peer import DeepSpeedShm, deepspeed_available, remove_segments
from benchmarks.sizes import parse_bytes
from benchmarks.workers import torchrun_env

CONTESTANTS = ("entrenar-shm", "deepspeed-shm")


def _rank(rank: int, port: int, args: dict[str, Any], queue: Any) -> None:
    torch.set_num_threads(1)
    if args["pin"]:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torchrun_env(rank, 2, port)
    import entrenar_pg
    from entrenar_pg import Options

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    env = dict(os.environ, ENTRENAR_TRANSPORT="shm")
    ours = dist.new_group([0, 1], backend="entrenar", pg_options=Options.from_env(env))
    ds = DeepSpeedShm(rank)
    t = torch.ones(args["size"] // 4)
    calls: dict[str, Callable[[], Any]] = {
        "entrenar-shm": partial(dist.all_reduce, t, group=ours),
        "deepspeed-shm": partial(ds.all_reduce, t),
    }
    getcpu = ctypes.CDLL(None).sched_getcpu
    times: dict[str, list[float]] = {k: [] for k in CONTESTANTS}
    cpus: dict[str, list[int]] = {k: [] for k in CONTESTANTS}
    clock = time.perf_counter
    for block in range(args["blocks"]):
        for name in CONTESTANTS if block % 2 == 0 else CONTESTANTS[::-1]:
            fn = calls[name]
            dist.barrier()
            for _ in range(5):  # the block's warm-up
                fn()
            for _ in range(args["per"]):
                began = clock()
                fn()
                times[name].append(clock() - began)
                cpus[name].append(getcpu())
    dist.barrier()
    backend: Any = ours._get_backend(torch.device("cpu"))
    placement = getattr(backend._runtime.mesh.slots, "placement", None)
    moves = getattr(placement, "moves", -1)
    queue.put((rank, times, cpus, moves, entrenar_pg.__file__))
    dist.destroy_process_group()


def _q(xs: list[float], f: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * f))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shm_dist", description=__doc__)
    p.add_argument("--size", default="64K", help="float32 message size")
    p.add_argument("--blocks", type=int, default=6, help="alternating blocks")
    p.add_argument("--per", type=int, default=100, help="timed calls per block")
    p.add_argument("--pin", action="store_true", help="rank r on CPU r")
    p.add_argument("--tree", default="", help="a directory holding entrenar_pg/ to measure")
    a = p.parse_args(argv)
    ok, why = deepspeed_available()
    if not ok:
        raise SystemExit(why)
    args = {"size": parse_bytes(a.size), "blocks": a.blocks, "per": a.per, "pin": a.pin}
    copy = tempfile.mkdtemp(prefix="shm_dist_") if a.tree else ""
    if copy:  # spawned ranks start with this process's sys.path: the copy first
        shutil.copytree(Path(a.tree) / "entrenar_pg", Path(copy) / "entrenar_pg")
        sys.path.insert(0, copy)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = random.randint(20000, 60000)
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(2)]
    load = os.getloadavg()[0]
    for proc in procs:
        proc.start()
    got = {}
    try:
        for _ in procs:
            rank, times, cpus, moves, where = queue.get(timeout=600)
            got[rank] = (times, cpus, moves, where)
    finally:
        for proc in procs:
            proc.join(60)
        remove_segments(port, 2)
        if copy:
            shutil.rmtree(copy, ignore_errors=True)
    print(
        f"{a.size}, N=2, load {load:.1f} -> {os.getloadavg()[0]:.1f}, "
        f"{a.blocks} blocks x {a.per}{', pinned' if a.pin else ''}; "
        f"placement moves per rank: {got[0][2]}, {got[1][2]}; entrenar_pg: {got[0][3]}"
    )
    print(
        f"{'contestant':>14} {'p10':>7} {'p25':>7} {'median':>7} {'p75':>7} {'p90':>8}  "
        f"{'>2xp10':>6}  {'one CPU':>7} {'med there':>10} {'med apart':>10}  (us)"
    )
    for name in CONTESTANTS:
        per = [max(x, y) * 1e6 for x, y in zip(got[0][0][name], got[1][0][name], strict=True)]
        same = [x == y for x, y in zip(got[0][1][name], got[1][1][name], strict=True)]
        there = [u for u, s in zip(per, same, strict=True) if s]
        apart = [u for u, s in zip(per, same, strict=True) if not s]
        p10 = _q(per, 0.1)
        slow = sum(u > 2 * p10 for u in per) / len(per)
        med_there = f"{statistics.median(there):10.2f}" if there else f"{'-':>10}"
        med_apart = f"{statistics.median(apart):10.2f}" if apart else f"{'-':>10}"
        print(
            f"{name:>14} {p10:7.2f} {_q(per, 0.25):7.2f} {_q(per, 0.5):7.2f} "
            f"{_q(per, 0.75):7.2f} {_q(per, 0.9):8.2f}  {slow:6.0%}  "
            f"{sum(same) / len(same):7.0%} {med_there} {med_apart}"
        )


if __name__ == "__main__":
    main()

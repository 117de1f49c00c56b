"""Per-call times of our shm allreduce and DeepSpeed's, with where each rank ran.

``python -m benchmarks.shm_dist [--size 64K[,1M...]] [--blocks 6] [--per 100] [--pin]
[--tree DIR] [--transport shm|tcp] [--baseline-tree DIR]``

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
``--transport tcp``: our groups over TCP (``entrenar-tcp``), DeepSpeed's still
its SHM. ``--baseline-tree DIR``: a third contestant in the same processes,
``entrenar-<transport>@baseline``: ``DIR/entrenar_pg`` copied as the package
``entrenar_baseline`` (the package imports itself relatively) and registered
as backend ``entrenar_baseline``, its own group beside ours. DeepSpeed's time
sits at one of two levels for a whole job (8 or 19-20 us at 64 KiB here,
docs/benchmarks.md), so a change is judged against the baseline and
DeepSpeed in one job, never across jobs.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
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
from benchmarks.sizes import format_bytes, parse_sizes
from benchmarks.workers import torchrun_env

DEEPSPEED = "deepspeed-shm"
BASELINE_PACKAGE = "entrenar_baseline"  # the baseline tree's copy, imported under this name


def contestants(transport: str, baseline: bool) -> tuple[str, ...]:
    """The contestants' names, ours first: ``entrenar-<transport>``, DeepSpeed,
    and with a baseline tree ``entrenar-<transport>@baseline``."""
    ours = f"entrenar-{transport}"
    return (ours, DEEPSPEED, f"{ours}@baseline") if baseline else (ours, DEEPSPEED)


def _baseline_group(env: dict[str, str]) -> Any:
    """A group of the baseline tree's backend (``--baseline-tree``)."""
    base = importlib.import_module(BASELINE_PACKAGE)
    create = importlib.import_module(f"{BASELINE_PACKAGE}.api.process_group")
    if BASELINE_PACKAGE.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BASELINE_PACKAGE, create.create_process_group, extended_api=True, devices=["cpu"]
        )
    return dist.new_group([0, 1], backend=BASELINE_PACKAGE, pg_options=base.Options.from_env(env))


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
    env = dict(os.environ, ENTRENAR_TRANSPORT=args["transport"])
    names = contestants(args["transport"], args["baseline"])
    groups = {
        names[0]: dist.new_group([0, 1], backend="entrenar", pg_options=Options.from_env(env))
    }
    if args["baseline"]:
        groups[names[2]] = _baseline_group(env)
    ds = DeepSpeedShm(rank)
    getcpu = ctypes.CDLL(None).sched_getcpu
    clock = time.perf_counter
    out: dict[int, tuple[dict[str, list[float]], dict[str, list[int]]]] = {}
    for size in args["sizes"]:
        t = torch.ones(size // 4)
        calls: dict[str, Callable[[], Any]] = {
            name: partial(dist.all_reduce, t, group=group) for name, group in groups.items()
        }
        calls[DEEPSPEED] = partial(ds.all_reduce, t)
        times: dict[str, list[float]] = {k: [] for k in names}
        cpus: dict[str, list[int]] = {k: [] for k in names}
        for block in range(args["blocks"]):
            # every order in turn: no contestant always follows the same one
            order = names[block % len(names) :] + names[: block % len(names)]
            for name in order if block % 2 == 0 else order[::-1]:
                fn = calls[name]
                t.fill_(1.0)  # finite sums whatever came before
                dist.barrier()
                for _ in range(5):  # the block's warm-up
                    fn()
                for _ in range(args["per"]):
                    began = clock()
                    fn()
                    times[name].append(clock() - began)
                    cpus[name].append(getcpu())
        out[size] = (times, cpus)
    dist.barrier()
    moves = {}
    for name, group in groups.items():
        backend: Any = group._get_backend(torch.device("cpu"))
        placement = getattr(backend._runtime.mesh.slots, "placement", None)
        moves[name] = getattr(placement, "moves", -1)
    queue.put((rank, out, moves, entrenar_pg.__file__))
    dist.destroy_process_group()


def _q(xs: list[float], f: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * f))]


def _report(size: int, names: tuple[str, ...], got: dict[int, Any]) -> None:
    """One size's table: per contestant, its quantiles and placement; then ours / theirs."""
    label = f"{format_bytes(size)}:"
    pad = " " * len(label)
    print(
        f"{label} {'contestant':>22} {'p10':>7} {'p25':>7} {'median':>7} {'p75':>7} "
        f"{'p90':>8}  {'>2xp10':>6}  {'one CPU':>7} {'med there':>10} {'med apart':>10}  (us)"
    )
    medians = {}
    for name in names:
        t0, t1 = (got[r][0][size][0][name] for r in (0, 1))
        c0, c1 = (got[r][0][size][1][name] for r in (0, 1))
        per = [max(x, y) * 1e6 for x, y in zip(t0, t1, strict=True)]
        same = [x == y for x, y in zip(c0, c1, strict=True)]
        there = [u for u, s in zip(per, same, strict=True) if s]
        apart = [u for u, s in zip(per, same, strict=True) if not s]
        p10 = _q(per, 0.1)
        slow = sum(u > 2 * p10 for u in per) / len(per)
        medians[name] = statistics.median(per)
        med_there = f"{statistics.median(there):10.2f}" if there else f"{'-':>10}"
        med_apart = f"{statistics.median(apart):10.2f}" if apart else f"{'-':>10}"
        print(
            f"{pad} {name:>22} {p10:7.2f} {_q(per, 0.25):7.2f} "
            f"{medians[name]:7.2f} {_q(per, 0.75):7.2f} {_q(per, 0.9):8.2f}  {slow:6.0%}  "
            f"{sum(same) / len(same):7.0%} {med_there} {med_apart}"
        )
    ours, ds = medians[names[0]], medians[DEEPSPEED]
    ratios = [f"ours/DeepSpeed {ours / ds:.2f}x"]
    if len(names) > 2:
        base = medians[names[2]]
        ratios.append(f"ours/baseline {ours / base:.2f}x")
        ratios.append(f"baseline/DeepSpeed {base / ds:.2f}x")
    print(f"{pad} median ratios: {', '.join(ratios)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shm_dist", description=__doc__)
    p.add_argument("--size", default="64K", help="float32 message sizes (comma list)")
    p.add_argument("--blocks", type=int, default=6, help="alternating blocks per size")
    p.add_argument("--per", type=int, default=100, help="timed calls per block")
    p.add_argument("--pin", action="store_true", help="rank r on CPU r")
    p.add_argument("--transport", default="shm", choices=("shm", "tcp"), help="our groups'")
    p.add_argument("--tree", default="", help="a directory holding entrenar_pg/ to measure")
    p.add_argument(
        "--baseline-tree", default="", help="a directory holding entrenar_pg/: a third contestant"
    )
    a = p.parse_args(argv)
    ok, why = deepspeed_available()
    if not ok:
        raise SystemExit(why)
    args = {
        "sizes": parse_sizes(a.size),
        "blocks": a.blocks,
        "per": a.per,
        "pin": a.pin,
        "baseline": bool(a.baseline_tree),
        "transport": a.transport,
    }
    copy = tempfile.mkdtemp(prefix="shm_dist_")
    # spawned ranks start with this process's sys.path: the copies first
    if a.tree:
        shutil.copytree(Path(a.tree) / "entrenar_pg", Path(copy) / "entrenar_pg")
    if a.baseline_tree:
        shutil.copytree(Path(a.baseline_tree) / "entrenar_pg", Path(copy) / BASELINE_PACKAGE)
    sys.path.insert(0, copy)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = random.randint(20000, 60000)
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(2)]
    load = os.getloadavg()
    for proc in procs:
        proc.start()
    got = {}
    try:
        for _ in procs:
            rank, out, moves, where = queue.get(timeout=600)
            got[rank] = (out, moves, where)
    finally:
        for proc in procs:
            proc.join(60)
        remove_segments(port, 2)
        shutil.rmtree(copy, ignore_errors=True)
    names = contestants(a.transport, args["baseline"])
    end = os.getloadavg()
    print(
        f"N=2, load (1/5 min) {load[0]:.1f}/{load[1]:.1f} -> {end[0]:.1f}/{end[1]:.1f} on "
        f"{os.cpu_count()} CPUs, {a.blocks} blocks x {a.per} per size"
        f"{', pinned' if a.pin else ''}; entrenar_pg: {got[0][2]}"
    )
    print(f"placement moves per rank: {got[0][1]}, {got[1][1]}; per iteration, max over ranks")
    for size in args["sizes"]:
        _report(size, names, got)


if __name__ == "__main__":
    main()

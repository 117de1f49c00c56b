"""Per-call time by its place after a barrier, N = 2 over shared memory (issue 25, item 7).

    python -m benchmarks.after_barrier [--size 4K] [--blocks 30] [--calls 30] [--json PATH]

The bench (``benchmarks.bench``) times a few calls per block, each block
opened by a barrier on the job's gloo group, with 2 untimed calls first for
small messages. What such a block's median reads depends on how fast a
caller settles after the barrier, not only on a call's own cost. This runs
two ranks (processes, one torch thread each) and, for each contestant in
turn, ``--blocks`` blocks of a barrier and ``--calls`` blocking float32 SUM
allreduces, each timed alone; it prints the median time of the k-th call
after the barrier, for every k, and of the calls from the 10th on:

- ``dist``: ``dist.all_reduce(t, group=g)`` on an entrenar group
  (``ENTRENAR_TRANSPORT=shm``), what a program calls;
- ``method``: ``g.allreduce([t], opts).wait()`` with one options object made
  once: the same group through torch's dispatcher, without
  ``dist.all_reduce``'s Python wrapper and its fresh options per call;
- ``deepspeed``: DeepSpeed's ``inference_all_reduce`` (where installed,
  ``bash benchmarks/install_peers.sh``; its segments unlinked at the end).

The blocks of the contestants alternate (the first block of each is not
counted). Rank 0 prints; nothing is asserted about the times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.config import SWEEP_VARIANTS
from benchmarks.deepspeed_peer import DeepSpeedShm, deepspeed_available, remove_segments
from benchmarks.sizes import FLOAT32_BYTES, format_bytes, parse_bytes
from benchmarks.spawn import free_port
from benchmarks.workers import (
    Contestant,
    _GroupAllreduce,
    _GroupMethod,
    _new_group,
    _time_allreduce,
    torchrun_env,
)

WORLD = 2
STEADY_FROM = 10  # calls after the barrier from which a call counts as settled


def _contestants(rank: int) -> dict[str, Contestant]:
    """Every contestant, on groups made here (collective: both ranks): the bench's own
    (``workers``), one entrenar shm group called both ways."""
    group = _new_group(dataclasses.replace(SWEEP_VARIANTS["auto"], transport="shm"), WORLD)
    out: dict[str, Contestant] = {"dist": _GroupAllreduce(group), "method": _GroupMethod(group)}
    if deepspeed_available()[0]:
        out["deepspeed"] = DeepSpeedShm(rank)
    return out


def by_place(rows: Sequence[Sequence[float]]) -> list[float]:
    """The median over ``rows`` (one per block) of each place's time."""
    return [statistics.median(col) for col in zip(*rows, strict=True)]


def _rank(rank: int, port: int, nbytes: int, blocks: int, calls: int, out: str) -> None:
    torchrun_env(rank, WORLD, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    t = torch.ones(nbytes // FLOAT32_BYTES)
    who = _contestants(rank)
    rows: dict[str, list[list[float]]] = {name: [] for name in who}
    for b in range(blocks + 1):
        for name, contestant in who.items():
            dist.barrier()
            row = _time_allreduce(t, contestant, 0, calls)  # no untimed call: place 1 is timed
            if b:  # the first block of each: start-up, not counted
                rows[name].append(row)
    if rank == 0:
        report: dict[str, dict[str, Any]] = {
            name: {
                "by_place_us": [x * 1e6 for x in by_place(r)],
                "settled_us": statistics.median(x for row in r for x in row[STEADY_FROM:]) * 1e6,
            }
            for name, r in rows.items()
        }
        print(
            f"N={WORLD}, {format_bytes(nbytes)}, {blocks} blocks of {calls} calls after a barrier"
        )
        for name, got in report.items():
            places = " ".join(f"{x:.0f}" for x in got["by_place_us"])
            print(f"{name:>10}: settled {got['settled_us']:.1f} us; by place (us): {places}")
        if out:
            with open(out, "w") as f:
                json.dump({"bytes": nbytes, "blocks": blocks, "calls": calls, **report}, f)
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.after_barrier", description=__doc__)
    p.add_argument("--size", default="4K", help="message size (default 4K)")
    p.add_argument("--blocks", type=int, default=30, help="blocks per contestant (default 30)")
    p.add_argument("--calls", type=int, default=30, help="timed calls per block (default 30)")
    p.add_argument("--json", default="", help="also write the figures here")
    a = p.parse_args(argv)
    if a.calls <= STEADY_FROM:
        p.error(f"--calls must be above {STEADY_FROM}")
    port = free_port()
    try:
        mp.spawn(_rank, args=(port, parse_bytes(a.size), a.blocks, a.calls, a.json), nprocs=WORLD)
    finally:
        remove_segments(port, WORLD)


if __name__ == "__main__":
    main()

"""One rank of a measurement: ``python -m benchmarks.model.rank --config SPEC.json --out DIR``.

Started by ``measure.py`` under torchrun in an emulated host's namespace
(``benchmarks/netns_job.py``). The default group is gloo's and only
synchronises; each variant of the spec is a group of its own, made, checked
and timed by ``benchmarks/workers.py``'s pieces, as the cluster's ranks do:
interleaved rounds per size, the order rotated each round, so the machine's
load falls on every variant alike. Writes ``DIR/rank<R>.json``:
``{"variant|bytes": [seconds per call, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import netns_job
from benchmarks.config import FLOAT32_BYTES, Variant
from benchmarks.sizes import rotated
from benchmarks.workers import Contestant, _GroupAllreduce, _new_group, _time_allreduce, _verify


def repeats(nbytes: int, spec: dict[str, Any]) -> int:
    """Timed calls per variant, size and round: ``budget / size`` within [min, max]."""
    return int(min(spec["max_repeats"], max(spec["min_repeats"], spec["budget"] // nbytes)))


def sweep(spec: dict[str, Any], rank: int, world: int) -> dict[str, list[float]]:
    variants = [Variant(**v) for v in spec["variants"]]
    groups: dict[str, Contestant] = {
        v.name: _GroupAllreduce(_new_group(v, world)) for v in variants
    }
    out: dict[str, list[float]] = {}
    for nbytes in spec["sizes"]:
        t = torch.zeros(nbytes // FLOAT32_BYTES, dtype=torch.float32)
        n = repeats(nbytes, spec)
        for r in range(spec["rounds"]):
            for name in rotated(list(groups), r):
                if r == 0:
                    _verify(t, groups[name], rank, world, name)
                dist.barrier()
                # one warm-up after the barrier, then the timed calls
                samples = _time_allreduce(t, groups[name], 1, n)
                out.setdefault(f"{name}|{nbytes}", []).extend(samples)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model.rank")
    p.add_argument("--config", required=True, help="the sweep's spec (measure.Sweep.spec())")
    p.add_argument("--out", required=True, help="directory for rank<R>.json")
    a = p.parse_args(argv)
    spec = json.loads(Path(a.config).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # One intra-op thread, as torchrun gives each of several ranks: the ranks
    # share the cores, and torch's parallel sums would wait on each other.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        netns_job.write_record(Path(a.out), rank, sweep(spec, rank, world))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""One rank of a measurement: ``python -m benchmarks.model.rank SPEC.json OUT.json``.

Started by ``measure.py`` with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) set. The default group is gloo's and only
synchronises; each variant of the spec is a group of its own (gloo, or
entrenar with the variant's transport and algorithm), timed in interleaved
rounds per size so the machine's load falls on every variant alike. Writes
``{"variant|bytes": [seconds per call, ...]}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FLOAT32 = 4


def _group(variant: dict[str, Any], world: int) -> dist.ProcessGroup:
    ranks = list(range(world))
    if variant["backend"] == "gloo":
        return dist.new_group(ranks, backend="gloo")
    from entrenar_pg import Options

    env = dict(os.environ, ENTRENAR_TRANSPORT=variant["transport"])
    opts = Options.from_env(env, algorithm=variant["algorithm"])
    return dist.new_group(ranks, backend="entrenar", pg_options=opts)


def _check(t: torch.Tensor, group: dist.ProcessGroup, rank: int, world: int, name: str) -> None:
    """One verified call (also the first warm-up): every element is 1 + ... + world."""
    t.fill_(rank + 1)
    dist.all_reduce(t, group=group)
    want = world * (world + 1) / 2
    if not bool(torch.all(t == want)):
        raise AssertionError(f"rank {rank}: {name}: allreduce of {t.numel()} floats is wrong")


def repeats(nbytes: int, spec: dict[str, Any]) -> int:
    """Timed calls per variant, size and round: ``budget / size`` within [min, max]."""
    return int(min(spec["max_repeats"], max(spec["min_repeats"], spec["budget"] // nbytes)))


def sweep(spec: dict[str, Any], rank: int, world: int) -> dict[str, list[float]]:
    groups = {v["name"]: _group(v, world) for v in spec["variants"]}
    out: dict[str, list[float]] = {}
    for nbytes in spec["sizes"]:
        t = torch.zeros(nbytes // FLOAT32, dtype=torch.float32)
        n = repeats(nbytes, spec)
        names = list(groups)
        for r in range(spec["rounds"]):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                group = groups[name]
                if r == 0:
                    _check(t, group, rank, world, name)
                dist.barrier()
                dist.all_reduce(t, group=group)  # warm-up after the barrier
                samples = out.setdefault(f"{name}|{nbytes}", [])
                for _ in range(n):
                    t0 = time.perf_counter()
                    dist.all_reduce(t, group=group)
                    samples.append(time.perf_counter() - t0)
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # One intra-op thread, as torchrun gives each of several ranks: the ranks
    # share the cores, and torch's parallel sums would wait on each other.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        result = sweep(spec, rank, world)
        Path(argv[1]).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

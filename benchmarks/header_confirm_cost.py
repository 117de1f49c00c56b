"""What the header rule costs: this tree's entrenar against an older copy, in one run.

    git archive <old-commit> entrenar_pg | tar -x -C /tmp/old
    mv /tmp/old/entrenar_pg /tmp/old/entrenar_old
    PYTHONPATH=$PWD:/tmp/old python -m benchmarks.header_confirm_cost

The old copy is imported as ``entrenar_old`` (its imports are relative), so
every rank process holds both an old and a new group over one store and the
two are timed in alternating blocks: the same processes, cores and moment for
both. A block is K blocking calls back to back (``asyncOp=False``, as
``dist.broadcast`` issues them); its time per call is the slowest rank's.
Reported: the median over rounds, per (collective, size, N), and new/old.
Back-to-back blocking broadcasts let an old root run ahead of its leaves
(it returned once the kernel took its bytes); ``allreduce+broadcast``
(a DDP step's pattern: gradient buckets, then the buffer broadcast) shows
the cost where ranks are already in step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# (collective, bytes, calls per block, rounds)
CASES = [
    ("broadcast", 4 << 10, 200, 15),
    ("reduce", 4 << 10, 200, 15),
    ("allreduce", 4 << 10, 200, 15),
    ("alltoall", 4 << 10, 200, 15),
    ("allreduce+broadcast", 4 << 10, 200, 15),  # a DDP step's pattern: buckets, then buffers
    ("broadcast", 64 << 20, 2, 7),
    ("reduce", 64 << 20, 2, 7),
]


def _issue(pg: Any, name: str, t: torch.Tensor, out: torch.Tensor) -> None:
    if name == "allreduce+broadcast":
        _issue(pg, "allreduce", t, out)
        _issue(pg, "broadcast", t, out)
    elif name == "broadcast":
        opts: Any = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.asyncOp = False
        pg.broadcast([t], opts).wait()
    elif name == "reduce":
        opts = dist.ReduceOptions()
        opts.rootRank = 0
        opts.asyncOp = False
        pg.reduce([t], opts).wait()
    elif name == "allreduce":
        opts = dist.AllreduceOptions()
        opts.asyncOp = False
        pg.allreduce([t], opts).wait()
    else:
        opts = dist.AllToAllOptions()
        opts.asyncOp = False
        pg.all_to_all_single(out, t, [], [], opts).wait()


def _worker(rank: int, world: int, port: int, cases: list[Any], result_path: str) -> None:
    torch.set_num_threads(1)
    import entrenar_old  # type: ignore[import-not-found]

    import entrenar_pg

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    timeout = timedelta(seconds=120)
    groups = {
        "old": entrenar_old.EntrenarProcessGroup(
            dist.PrefixStore("old", store), rank, world, timeout=timeout
        ),
        "new": entrenar_pg.EntrenarProcessGroup(
            dist.PrefixStore("new", store), rank, world, timeout=timeout
        ),
    }
    mine: dict[str, dict[str, list[float]]] = {}
    for name, nbytes, calls, rounds in cases:
        numel = nbytes // 4
        numel -= numel % world  # alltoall: equal pieces
        t = torch.ones(numel)
        out = torch.empty(numel)
        key = f"{name}/{nbytes}"
        mine[key] = {"old": [], "new": []}
        for version in ("old", "new"):  # warm-up (plans, scratch, views)
            for _ in range(min(calls, 5)):
                _issue(groups[version], name, t, out)
        for rnd in range(rounds):
            order = ("old", "new") if rnd % 2 == 0 else ("new", "old")
            for version in order:
                pg = groups[version]
                pg.barrier().wait()
                start = time.perf_counter()
                for _ in range(calls):
                    _issue(pg, name, t, out)
                mine[key][version].append((time.perf_counter() - start) / calls)
    store.set(f"result/{rank}", json.dumps(mine))
    if rank == 0:
        per_rank = [json.loads(store.get(f"result/{r}")) for r in range(world)]
        with open(result_path, "w") as f:
            json.dump(per_rank, f)
    groups["new"].barrier().wait()
    for g in groups.values():
        g.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--small-only", action="store_true")
    args = ap.parse_args()
    cases = [c for c in CASES if not (args.small_only and c[1] > 1 << 20)]
    print("| collective | size | N | old (us) | new (us) | new/old |")
    print("|---|---|---|---|---|---|")
    for world in [int(w) for w in args.worlds.split(",")]:
        path = f"/tmp/header_confirm_cost_{os.getpid()}_{world}.json"
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(world, port, cases, path), nprocs=world, join=True)
        with open(path) as f:
            per_rank = json.load(f)
        os.remove(path)
        for name, nbytes, _, rounds in cases:
            key = f"{name}/{nbytes}"
            med = {}
            for version in ("old", "new"):
                # per round: the slowest rank's time per call; then the median
                slowest = [max(r[key][version][i] for r in per_rank) for i in range(rounds)]
                med[version] = statistics.median(slowest) * 1e6
            size = f"{nbytes >> 10} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
            print(
                f"| {name} | {size} | {world} | {med['old']:.0f} | {med['new']:.0f} "
                f"| {med['new'] / med['old']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Measurements for the cost model: run ranks, gather their samples, summarise.

``links_run`` takes what the fit needs, all with two ranks and one link kind
each, gloo beside entrenar every time: shared memory and loopback TCP with
both ranks on one emulated host, then one rank on each of two emulated hosts
joined by shaped links; and the in-process cost of a combine
(``reduce_sweep``). The hosts and the ranks' start are the cluster
harness's (``benchmarks/netns_job.py`` over ``benchmarks/netns.py``), so
the shaped link is the one ``python -m benchmarks.cluster --rate`` runs on.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks import netns_job
from benchmarks.cluster_config import ClusterConfig
from benchmarks.config import MiB, Variant
from benchmarks.results import combine_ranks, shape_row

# Samples per variant, size and round: budget / size within [MIN, MAX] (as the
# committed fit took them); the cluster's plan (sizes.plan_for) counts them over
# all rounds.
ROUND_BUDGET = 256 * MiB
NET_ROUND_BUDGET = 64 * MiB  # the shaped link: 64 MiB is half a second at 1 Gbit/s
MIN_PER_ROUND, MAX_PER_ROUND = 3, 20


@dataclass(frozen=True)
class Sweep:
    """What every rank runs: the variants, on the cluster's knobs (shape, sizes,
    link rate, sampling, time-outs)."""

    variants: tuple[Variant, ...]
    cluster: ClusterConfig

    @classmethod
    def of(
        cls,
        variants: Sequence[Variant],
        shape: tuple[int, int],
        sizes: Sequence[int],
        rate: str | None,
        rounds: int,
        round_budget: int = ROUND_BUDGET,
    ) -> Sweep:
        """``variants`` on ``shape`` (hosts, local) ranks, each host's link at ``rate``."""
        cfg = ClusterConfig(
            hosts=shape[0],
            local=shape[1],
            sizes=tuple(sizes),
            rate=rate,
            variants=tuple(v.name for v in variants),
            repeats=MAX_PER_ROUND * rounds,
            min_repeats=MIN_PER_ROUND * rounds,
            rounds=rounds,
            budget_bytes=round_budget * rounds,
            timeout_s=600.0,
        )
        return cls(tuple(variants), cfg)

    def spec(self) -> dict[str, Any]:
        """What every rank reads (``rank.py``)."""
        return {
            "cluster": self.cluster.to_json(),
            "variants": [dataclasses.asdict(v) for v in self.variants],
        }


def row(
    variant: str, hosts: int, local: int, nbytes: int, times: Sequence[float]
) -> dict[str, Any]:
    """One measurement row: a variant's per-call seconds at one shape and size, summarised."""
    return {**shape_row(variant, hosts, local, nbytes, times), "samples": len(times)}


def rows_of(sweep: Sweep, per_rank: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every variant and size from the ranks' records; per call, the slowest rank's
    time (the collective is done when every rank is)."""
    cfg = sweep.cluster
    return [
        row(
            v.name,
            cfg.hosts,
            cfg.local,
            nbytes,
            combine_ranks([r["times"][f"{v.name}|{nbytes}"] for r in per_rank]),
        )
        for v in sweep.variants
        for nbytes in cfg.sizes
    ]


def run(sweep: Sweep) -> list[dict[str, Any]]:
    """Measure ``sweep`` on its emulated hosts (the cluster harness's)."""
    prefix = f"enrm{os.getpid() % 100000}"
    per_rank = netns_job.run_ranks(sweep.cluster, "benchmarks.model.rank", sweep.spec(), prefix)
    return rows_of(sweep, per_rank)


def reduce_sweep(sizes: Sequence[int], repeats: int = 7) -> list[dict[str, Any]]:
    """In process: seconds of one float32 ``a += b`` per size (the ``reduce`` kind),
    on one intra-op thread as in every rank (``rank.py``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reduce_rows(sizes, repeats)
    finally:
        torch.set_num_threads(threads)


def _reduce_rows(sizes: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for nbytes in sizes:
        a = torch.ones(nbytes // 4)
        b = torch.ones(nbytes // 4)
        a.add_(b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a.add_(b)
            times.append(time.perf_counter() - t0)
        rows.append(row("reduce", 1, 1, nbytes, times))
    return rows


# The 2-rank runs the fit reads, named for the kind each one measures (fit.py's table).
LOCAL_VARIANTS = [
    Variant("entrenar-shm-direct", "entrenar", {"algorithm": "direct"}, transport="shm"),
    Variant("entrenar-slots", "entrenar", {"algorithm": "auto"}, transport="shm"),
    Variant("entrenar-tcp-direct", "entrenar", {"algorithm": "direct"}, transport="tcp"),
    Variant("gloo", "gloo"),
]
NET_VARIANTS = [
    Variant("entrenar-net-direct", "entrenar", {"algorithm": "direct"}, transport="tcp"),
    Variant("gloo", "gloo"),
]


def links_run(
    local_sizes: list[int], net_sizes: list[int], rate: str, rounds: int
) -> dict[str, Any]:
    """Every measurement the fit reads: {"meta": ..., "rows": [...]}; local runs are 1 x 2,
    shaped ones 2 x 1 (gloo's rows there are renamed ``gloo-net``)."""
    rows = reduce_sweep(local_sizes)
    rows += run(Sweep.of(LOCAL_VARIANTS, (1, 2), local_sizes, None, rounds))
    net = run(Sweep.of(NET_VARIANTS, (2, 1), net_sizes, rate, rounds, NET_ROUND_BUDGET))
    for r in net:
        if r["variant"] == "gloo":
            r["variant"] = "gloo-net"
    rows += net
    meta = {
        "rate": rate,
        "cores": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    return {"meta": meta, "rows": rows}

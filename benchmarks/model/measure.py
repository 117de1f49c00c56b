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
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import netns, netns_job
from benchmarks.config import Variant
from benchmarks.results import combine_ranks, summarize


@dataclass
class Sweep:
    """What each rank times: the variants, the sizes, and how many samples."""

    variants: list[Variant]
    sizes: list[int]
    rounds: int = 3
    budget: int = 256 << 20  # bytes per variant, size and round
    min_repeats: int = 3
    max_repeats: int = 20
    timeout_s: float = 600.0

    def spec(self) -> dict[str, Any]:
        """What every rank reads (``rank.py``)."""
        return {
            "variants": [dataclasses.asdict(v) for v in self.variants],
            "sizes": self.sizes,
            "rounds": self.rounds,
            "budget": self.budget,
            "min_repeats": self.min_repeats,
            "max_repeats": self.max_repeats,
        }


def row(
    variant: str, hosts: int, local: int, nbytes: int, times: Sequence[float]
) -> dict[str, Any]:
    """One measurement row: a variant's per-call seconds at one shape and size, summarised."""
    stats = summarize(times)
    return {
        "variant": variant,
        "hosts": hosts,
        "local": local,
        "bytes": nbytes,
        "median_s": stats["median_s"],
        "min_s": stats["min_s"],
        "max_s": stats["max_s"],
        "samples": stats["n"],
    }


def rows_of(
    sweep: Sweep, per_rank: Sequence[dict[str, list[float]]], hosts: int, local: int
) -> list[dict[str, Any]]:
    """Every variant and size; per call, the slowest rank's time (the collective is done
    when every rank is)."""
    return [
        row(
            v.name, hosts, local, nbytes, combine_ranks([r[f"{v.name}|{nbytes}"] for r in per_rank])
        )
        for v in sweep.variants
        for nbytes in sweep.sizes
    ]


def run(sweep: Sweep, hosts: int, local: int, rate: str | None) -> list[dict[str, Any]]:
    """Measure ``sweep`` on ``hosts`` x ``local`` ranks, each host's link shaped to ``rate``."""
    with tempfile.TemporaryDirectory(prefix="entrenar_model_") as d:
        per_rank = netns_job.run_ranks(
            hosts,
            local,
            "benchmarks.model.rank",
            sweep.spec(),
            Path(d),
            prefix=f"enrm{os.getpid() % 100000}",
            timeout_s=sweep.timeout_s,
            shaping=netns.Shaping(rate=rate or ""),
        )
    return rows_of(sweep, per_rank, hosts, local)


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
    rows += run(Sweep(LOCAL_VARIANTS, local_sizes, rounds=rounds), 1, 2, None)
    net = run(Sweep(NET_VARIANTS, net_sizes, rounds=rounds, budget=64 << 20), 2, 1, rate)
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

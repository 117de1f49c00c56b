"""Emulated clusters: H hosts (network namespaces) x L ranks, gloo against entrenar.

Run ``python -m benchmarks.cluster`` as root from the repository root (``--help``
for the flags). launch/netns_cluster.sh builds the hosts: one namespace per
host, its ``eth0`` on a veth link to a bridge in a namespace of its own,
addresses 10.77.0.<i+1>, nothing outside those namespaces touched; with
``--rate`` every host link is tbf-shaped both ways. One torchrun per host
starts L ranks there (``benchmarks/cluster_rank.py``; the job runs through
``benchmarks/netns_job.py``, as the cost model's measurements do); all
H x L ranks are one job, which creates a group per variant (gloo, entrenar,
entrenar-flat: ``benchmarks/cluster_config.py``) and runs them interleaved,
the order rotated each round.

Reported per variant and size (definitions as ``benchmarks.bench``): a
sample is one blocking ``all_reduce`` timed on every rank, the maximum over
ranks of each iteration; median, min, max over samples; busbw = bytes /
median x 2(n-1)/n with n = H x L ranks. Cross-host bytes per host: what the
busiest host link carried per allreduce call in its busier direction, from
the veth counters (frames: headers, ACKs and retransmissions included; the
fences' barriers measured and subtracted), against the lower bound
2(H-1)/H x S that any allreduce must move through some host's link.
Sockets per rank: TCP sockets a rank opened for the variant's group, the mean
over ranks. Every variant's first call of each size is checked on every rank
(every element must be 1 + 2 + ... + N).

Outputs (``--out``, default ``runs/cluster-<H>x<L>[-<rate>]``): ``cluster.json``,
``results.md``, ``cluster.png``; the table on stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import netns, netns_job
from benchmarks.cluster_config import (
    CLUSTER_VARIANTS,
    DEFAULT_SIZES,
    DEFAULT_VARIANTS,
    ClusterConfig,
)
from benchmarks.cluster_load import background_cores, job_cores
from benchmarks.cluster_report import report_lines, write_outputs
from benchmarks.config import GLOO
from benchmarks.machine import git_revision, machine_info
from benchmarks.netns_job import shaping_of
from benchmarks.results import busbw_factor, combine_ranks, shape_row
from benchmarks.sizes import parse_bytes, parse_sizes
from benchmarks.spawn import BenchError

log = logging.getLogger("benchmarks.cluster")


def bound_bytes(hosts: int, size: int) -> float:
    """The least an allreduce of ``size`` bytes moves through a host's link, each way."""
    return 2.0 * (hosts - 1) / hosts * size


def check_shaping(shaping: netns.Shaping) -> None:
    """Refuse, before anything is built, shaping this kernel cannot do."""
    if not netns.namespaces_allowed():
        raise BenchError("cannot create network namespaces (needs root and `ip netns`)")
    if shaping.netem:
        ok, why = netns.qdisc_available("netem", *shaping.netem.split())
        if not ok:
            raise BenchError(
                f"--delay: this kernel cannot add a netem qdisc ({shaping.netem}; "
                f"tc: {why or '?'}): sch_netem is missing here, so no delay can be emulated"
            )
    if shaping.rate:
        ok, why = netns.qdisc_available(*shaping.tbf())
        if not ok:
            raise BenchError(f"--rate {shaping.rate}: tc cannot add a tbf qdisc (tc: {why or '?'})")


def _link_per_call(
    leader: dict[str, Any], variant: str, size: int, fence: dict[str, float]
) -> dict[str, float]:
    """A host's bytes sent and received per call of ``variant`` at ``size``, fences removed."""
    blocks = [b for b in leader["links"] if b["variant"] == variant and b["bytes"] == size]
    calls = sum(b["calls"] for b in blocks)
    return {d: (sum(b[d] for b in blocks) - len(blocks) * fence[d]) / calls for d in ("tx", "rx")}


def _blocks(
    ranks: Sequence[dict[str, Any]], variant: str | None = None, size: int | None = None
) -> list[list[dict[str, Any]]]:
    """Every rank's load records of the blocks of ``variant`` at ``size`` (every block if None)."""
    return [
        [
            b
            for b in r.get("load", [])
            if (variant is None or b["variant"] == variant) and (size is None or b["bytes"] == size)
        ]
        for r in ranks
    ]


def _background(
    ranks: Sequence[dict[str, Any]], variant: str | None = None, size: int | None = None
) -> float | None:
    """Cores the rest of the machine took during the blocks of ``variant`` at ``size``
    (every block if None): ``cluster_load.background_cores``; None for records without it."""
    return background_cores(_blocks(ranks, variant, size))


def combine(cfg: ClusterConfig, ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's record -> rows (the schema of cluster.json) and per-host link details."""
    names = list(cfg.variants)
    for r in ranks:
        missing = [f"{v}|{s}" for s in cfg.sizes for v in names if f"{v}|{s}" not in r["verified"]]
        if missing:
            raise BenchError(f"rank {r['rank']}: results never checked for {missing}")
    leaders = sorted((r for r in ranks if r["local_rank"] == 0), key=lambda r: r["host"])
    if [r["host"] for r in leaders] != list(range(cfg.hosts)):
        raise BenchError(f"expected one leader per host, got hosts {[r['host'] for r in leaders]}")
    fences = [
        {d: statistics.median(c[d] for c in r["calibration"]) for d in ("tx", "rx")}
        for r in leaders
    ]
    rows: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    for size in cfg.sizes:
        for name in names:
            samples = combine_ranks([r["times"][f"{name}|{size}"] for r in ranks])
            row = shape_row(name, cfg.hosts, cfg.local, size, samples)
            per_host = [
                _link_per_call(r, name, size, f) for r, f in zip(leaders, fences, strict=True)
            ]
            for host, h in enumerate(per_host):
                links.append(
                    {
                        "variant": name,
                        "bytes": size,
                        "host": host,
                        "tx_per_call": h["tx"],
                        "rx_per_call": h["rx"],
                    }
                )
            row.update(
                busbw_GBps=size / row["median_s"] / 1e9 * busbw_factor(cfg.world),
                xhost_bytes_per_host=max(max(h["tx"], h["rx"]) for h in per_host),
                bound_bytes_per_host=bound_bytes(cfg.hosts, size),
                sockets_per_rank=statistics.fmean(r["sockets"][name] for r in ranks),
                # Cores other processes took meanwhile (the cost model's load term).
                background_cores=_background(ranks, name, size),
                # Cores the job's own ranks took meanwhile (``cluster_load.job_cores``).
                job_cores=job_cores(_blocks(ranks, name, size)),
                # every call (the slowest rank's), in order: a median that moved between
                # two runs shows here whether the calls are bimodal (the cost model's check)
                samples_s=samples,
            )
            rows.append(row)
    return {
        "rows": rows,
        "links": links,
        "fence_bytes": fences,
        "background_cores": _background(ranks),
    }


def run_cluster(cfg: ClusterConfig) -> dict[str, Any]:
    """The whole run: checks, the job, the rows; the JSON-able result."""
    started = time.time()
    check_shaping(shaping_of(cfg))
    load_start = list(os.getloadavg())
    prefix = f"enrc{os.getpid() % 100000}"
    ranks = netns_job.run_ranks(cfg, "benchmarks.cluster_rank", cfg.to_json(), prefix)
    part = combine(cfg, ranks)
    notes = list(ranks[0]["notes"])
    gloo = {r["bytes"]: r["median_s"] for r in part["rows"] if r["variant"] == GLOO}
    return {
        "meta": {
            "hosts": cfg.hosts,
            "local": cfg.local,
            "rate": cfg.rate,
            "delay": cfg.delay,
            "git": git_revision(),
            "machine": machine_info(),
            # Beyond the schema: how the run was made, and what to read it with.
            "config": cfg.to_json(),
            "variant_options": ranks[0]["variant_options"],
            "policy_defaults": ranks[0].get("policy_defaults", {}),
            "entrenar_pg_file": ranks[0]["entrenar_pg_file"],
            "loadavg_start": load_start,
            "loadavg_end": list(os.getloadavg()),
            # Over every timed block: cores other processes took (benchmarks/cluster_load.py).
            "background_cores": part["background_cores"],
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)) + " UTC",
            "elapsed_s": time.time() - started,
            "fence_bytes_per_block": part["fence_bytes"],
            # Every "variant|size" whose first call was checked on every rank.
            "verified": sorted(set.intersection(*(set(r["verified"]) for r in ranks))),
            "netns_prefix": prefix,
            # Per rank: seconds from its start to the end of imports, init, groups, sweep.
            "rank_phases_s": [r["phases"] for r in ranks],
            "time_vs_gloo": {
                f"{r['variant']}|{r['bytes']}": r["median_s"] / gloo[r["bytes"]]
                for r in part["rows"]
                if r["bytes"] in gloo
            },
            "notes": notes,
        },
        "rows": part["rows"],
        "links": part["links"],
    }


def parse_args(argv: Sequence[str] | None = None) -> tuple[ClusterConfig, Path]:
    """Flags -> the configuration and the output directory."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster",
        description="gloo vs entrenar allreduce on an emulated cluster of network namespaces",
    )
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts (namespaces), default 2")
    p.add_argument("--local", type=int, default=2, help="ranks per host, default 2")
    p.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})"
    )
    p.add_argument("--rate", default=None, help="every host link's rate, both ways (e.g. 1gbit)")
    p.add_argument("--delay", default=None, help="netem delay on every host link (e.g. 1ms)")
    names = [v.name for v in CLUSTER_VARIANTS]
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"from {names} (default {','.join(DEFAULT_VARIANTS)})",
    )
    p.add_argument("--repeats", type=int, default=20, help="most timed samples per variant, size")
    p.add_argument("--min-repeats", type=int, default=4, help="fewest timed samples")
    p.add_argument("--rounds", type=int, default=4, help="interleaving rounds (default 4)")
    p.add_argument("--budget", default="512M", help="bytes per variant and size (default 512M)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole job")
    p.add_argument("--out", default=None, help="output directory")
    a = p.parse_args(argv)
    variants = tuple(x.strip() for x in a.variants.split(",") if x.strip())
    bad = [x for x in variants if x not in names]
    if bad or not variants:
        p.error(f"bad --variants {a.variants!r}; choose from {names}")
    if a.hosts < 2 or a.local < 1:
        p.error("--hosts must be >= 2 and --local >= 1")
    cfg = ClusterConfig(
        hosts=a.hosts,
        local=a.local,
        sizes=parse_sizes(a.sizes),
        rate=a.rate,
        delay=a.delay,
        variants=variants,
        repeats=a.repeats,
        min_repeats=a.min_repeats,
        rounds=a.rounds,
        budget_bytes=parse_bytes(a.budget),
        timeout_s=a.timeout,
    )
    out = Path(a.out or f"runs/cluster-{a.hosts}x{a.local}" + (f"-{a.rate}" if a.rate else ""))
    return cfg, out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: run, print the table, write the outputs. Exit 1 on a failed run."""
    logging.basicConfig(level=logging.INFO, format="[cluster] %(message)s", stream=sys.stderr)
    cfg, out = parse_args(argv)
    log.info(
        "%d hosts x %d ranks, links %s, %d sizes x %d variants ...",
        cfg.hosts,
        cfg.local,
        cfg.rate or "unshaped",
        len(cfg.sizes),
        len(cfg.variants),
    )
    try:
        result = run_cluster(cfg)
    except BenchError as e:
        print(f"cluster bench failed: {e}", file=sys.stderr)
        return 1
    paths = write_outputs(result, out)
    print("\n".join(report_lines(result)))
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {result['meta']['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

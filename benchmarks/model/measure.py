"""Measurements for the cost model: run ranks, gather their samples, summarise.

``links_run`` takes what the fit needs, all with two ranks and one link kind
each: shared memory and loopback on this host, then one rank on each of two
emulated hosts joined by shaped links (``netns.py``), gloo beside entrenar
every time; and the in-process cost of a combine (``reduce_sweep``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.model import netns
from benchmarks.spawn import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Variant:
    """One contestant: a backend, and for entrenar its transport and algorithm."""

    name: str
    backend: str  # "gloo" or "entrenar"
    transport: str = "auto"
    algorithm: str = "auto"


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
        return {
            "variants": [v.__dict__ for v in self.variants],
            "sizes": self.sizes,
            "rounds": self.rounds,
            "budget": self.budget,
            "min_repeats": self.min_repeats,
            "max_repeats": self.max_repeats,
        }


def _launch(
    sweep: Sweep, hosts: netns.Hosts | None, local: int, tmp: Path
) -> list[dict[str, list[float]]]:
    """Start every rank (in its host's namespace when ``hosts``), wait, read their samples."""
    nhosts = hosts.count if hosts else 1
    world = nhosts * local
    spec = tmp / "spec.json"
    spec.write_text(json.dumps(sweep.spec()))
    master = hosts.addr(0) if hosts else "127.0.0.1"
    port = 29517 if hosts else free_port()  # a namespace's ports are all free
    procs: list[subprocess.Popen[bytes]] = []
    outs = [tmp / f"rank{r}.json" for r in range(world)]
    try:
        for r in range(world):
            h, lr = divmod(r, local)
            env = dict(os.environ, PYTHONPATH=str(REPO))
            env.update(
                RANK=str(r),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(lr),
                LOCAL_WORLD_SIZE=str(local),
                MASTER_ADDR=master,
                MASTER_PORT=str(port),
            )
            if hosts:
                env.update(ENTRENAR_IFNAME="eth0", GLOO_SOCKET_IFNAME="eth0")
            prefix = hosts.exec_prefix(h) if hosts else []
            cmd = [*prefix, sys.executable, "-m", "benchmarks.model.rank", str(spec), str(outs[r])]
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO))
        deadline = time.monotonic() + sweep.timeout_s
        while any(p.poll() is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if bad:
                raise RuntimeError(
                    f"measurement: rank {bad[0]} exited with {procs[bad[0]].returncode}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"measurement: timed out after {sweep.timeout_s:.0f} s")
            time.sleep(0.1)
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RuntimeError(f"measurement: rank {bad[0]} exited with {procs[bad[0]].returncode}")
        return [json.loads(o.read_text()) for o in outs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def call_times(per_rank: Sequence[dict[str, list[float]]], key: str) -> list[float]:
    """Per call, the slowest rank's time: the collective is done when every rank is."""
    return [max(xs) for xs in zip(*(r[key] for r in per_rank), strict=True)]


def rows_of(
    sweep: Sweep, per_rank: Sequence[dict[str, list[float]]], hosts: int, local: int
) -> list[dict[str, Any]]:
    rows = []
    for v in sweep.variants:
        for nbytes in sweep.sizes:
            times = call_times(per_rank, f"{v.name}|{nbytes}")
            rows.append(
                {
                    "variant": v.name,
                    "hosts": hosts,
                    "local": local,
                    "bytes": nbytes,
                    "median_s": statistics.median(times),
                    "min_s": min(times),
                    "max_s": max(times),
                    "samples": len(times),
                }
            )
    return rows


def run(sweep: Sweep, hosts: int, local: int, rate: str | None) -> list[dict[str, Any]]:
    """Measure ``sweep`` on ``hosts`` x ``local`` ranks (hosts > 1 or a rate: namespaces)."""
    with tempfile.TemporaryDirectory(prefix="entrenar_model_") as d:
        if hosts == 1 and rate is None:
            per_rank = _launch(sweep, None, local, Path(d))
        else:
            with netns.hosts(hosts, rate) as made:
                per_rank = _launch(sweep, made, local, Path(d))
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
        rows.append(
            {
                "variant": "reduce",
                "hosts": 1,
                "local": 1,
                "bytes": nbytes,
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "samples": repeats,
            }
        )
    return rows


# The 2-rank runs the fit reads, named for the kind each one measures (fit.py's table).
LOCAL_VARIANTS = [
    Variant("entrenar-shm-direct", "entrenar", "shm", "direct"),
    Variant("entrenar-slots", "entrenar", "shm", "auto"),
    Variant("entrenar-tcp-direct", "entrenar", "tcp", "direct"),
    Variant("gloo", "gloo"),
]
NET_VARIANTS = [
    Variant("entrenar-net-direct", "entrenar", "tcp", "direct"),
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
    for row in net:
        if row["variant"] == "gloo":
            row["variant"] = "gloo-net"
    rows += net
    meta = {
        "rate": rate,
        "cores": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    return {"meta": meta, "rows": rows}

"""Measure the flat barrier and broadcast on emulated hosts and set them beside the model.

``python -m benchmarks.model measure-rooted [--hosts 2 --local 2 --rate 1gbit]``:
H namespaces x L ranks (``netns_job.run_ranks``, links shaped as the
cluster bench shapes them), ranks ``rooted_rank.py``; per op and backend the
median over rounds of (last rank's end - last rank's start), the median
CPU a rank's process spent per call (``call_stats``), and entrenar's
prediction (``rooted.barrier_dissemination`` / ``rooted.broadcast_flat`` under the
run's ``Conditions``: ranks per core and tbf's burst, as ``check`` does) at
the assumed frame cost and at none. Prints a Markdown table; ``--out`` keeps
the rows as JSON.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any

from benchmarks import netns_job
from benchmarks.cluster_config import ClusterConfig
from benchmarks.cluster_load import background_cores
from benchmarks.model import check, costs, rooted
from benchmarks.model.links import LinkTable
from benchmarks.model.rooted_rank import op_names
from benchmarks.sizes import format_bytes
from entrenar_pg.config import Options
from entrenar_pg.wire import Algo


def measure(
    hosts: int, local: int, rate: str, sizes: list[int], rounds: int
) -> list[dict[str, Any]]:
    """One job; a row per (backend, op): the median call and the samples."""
    cfg = ClusterConfig(
        hosts=hosts, local=local, sizes=tuple(sizes), rate=rate or None, timeout_s=300.0
    )
    backends = ["entrenar", "gloo"]
    spec = {"sizes": sizes, "rounds": rounds, "backends": backends}
    prefix = f"enrr{os.getpid() % 100000}"
    per_rank = netns_job.run_ranks(cfg, "benchmarks.model.rooted_rank", spec, prefix)
    # The cores other processes took over the timed rounds (the model's load term).
    others = background_cores([[rec["load"]] for rec in per_rank])
    rows = []
    for backend in backends:
        for name in op_names(sizes):
            row: dict[str, Any] = {
                "backend": backend,
                "op": name.split()[0],
                "bytes": int(name.split()[1]) if " " in name else 0,
                "hosts": hosts,
                "local": local,
                "background_cores": others,
            }
            row.update(call_stats([rec["times"][backend][name] for rec in per_rank]))
            if backend == "entrenar" and row["op"] == "broadcast":
                # the algorithm this tree's policy ran (the model predicts that one)
                shape = costs.Shape(hosts, local, int(row["bytes"]))
                row["algo"] = rooted.broadcast_algo(shape, check.topology_of(shape)).name
            rows.append(row)
    return rows


def call_stats(per_rank: list[list[list[float]]]) -> dict[str, Any]:
    """One op's figures from every rank's (start, end, cpu) per round: every call
    (last rank's end - last rank's start, in round order: ``calls_s``), the median
    and the fastest, and ``cpu_s``, the
    median over rounds of the CPU a rank's process spent in the call (the mean
    over ranks). On ranks sharing cores the CPU is what the other ranks wait
    for, where wall times of sub-millisecond calls are mostly the scheduler's."""
    rounds = len(per_rank[0])
    calls = [max(r[i][1] for r in per_rank) - max(r[i][0] for r in per_rank) for i in range(rounds)]
    cpu = [statistics.fmean(r[i][2] for r in per_rank) for i in range(rounds)]
    return {
        "median_s": statistics.median(calls),
        "min_s": min(calls),
        "cpu_s": statistics.median(cpu),
        "calls_s": calls,
    }


def _run_conditions(row: dict[str, Any], rate: str, cores: int) -> costs.Conditions:
    """The emulated run's conditions for ``row``: its ranks on ``cores``, tbf's burst,
    each call timed alone (``rooted_rank``: a control barrier before each, so tbf's
    bucket is full), and the load the run recorded (``background_cores``: ``LOAD``'s
    term, where the table has it; none for runs that did not record it)."""
    shape = costs.Shape(int(row["hosts"]), int(row["local"]), int(row["bytes"]))
    meta = {"rate": rate, "machine": {"nproc": cores}}
    where = check.conditions_of(meta, shape, row.get("background_cores"))
    return dataclasses.replace(where, back_to_back=False)


def _shape(row: dict[str, Any]) -> costs.Shape:
    return costs.Shape(int(row["hosts"]), int(row["local"]), int(row["bytes"]))


def _broadcast_algo_unrecorded(shape: costs.Shape) -> Algo:
    """The algorithm a run that recorded none ran (those runs came before
    3127f08): one rank per host took the one-host rule (before 9dcc254),
    which ``topology="flat"`` still gives, and the dissemination rounds
    stopped at 256 KiB (the chain above; 1 MiB since the eighteenth session),
    and the chain ran in rank order (the hosts' chain came in the twenty-fifth)."""
    opts = Options(topology="flat") if shape.local == 1 else Options()
    algo = rooted.broadcast_algo(shape, check.topology_of(shape), opts)
    if (algo is Algo.DISSEMINATION and shape.nbytes > 256 << 10) or algo is Algo.HOST_CHAIN:
        return Algo.CHAIN
    return algo


def predicted(row: dict[str, Any], links: LinkTable, rate: str, cores: int) -> float:
    """entrenar's flat algorithm for ``row`` under the emulated run's conditions
    (``_run_conditions``): the broadcast the policy picks with the run's topology."""
    shape = _shape(row)
    if row["op"] == "broadcast":
        algo = Algo[row["algo"]] if "algo" in row else _broadcast_algo_unrecorded(shape)
        phases = rooted.broadcast_flat(
            shape, costs.ENTRENAR, True, check.topology_of(shape), algo=algo
        )
    else:
        phases = rooted.FLAT[str(row["op"])](shape, costs.ENTRENAR, True)
    return costs.total_time(phases, links, _run_conditions(row, rate, cores))


def predicted_host_aware_barrier(
    row: dict[str, Any], links: LinkTable, rate: str, cores: int
) -> float:
    """The host-aware barrier candidate (``rooted.barrier_leaders_dissemination``: not
    code) on the barrier row's shape and conditions: with one rank per host (H x 1)
    it is the flat dissemination barrier, so an H x 1 run measures it."""
    phases = rooted.barrier_leaders_dissemination(_shape(row), costs.ENTRENAR)
    return costs.total_time(phases, links, _run_conditions(row, rate, cores))


def report(rows: list[dict[str, Any]], links: LinkTable, rate: str, cores: int) -> str:
    frames = rooted.FRAME_CASES
    head = " | ".join(f"predicted (frame {f * 1e6:.0f} µs)" for f in frames)
    lines = [
        f"| H x L | op | size | gloo | entrenar | entrenar / gloo | CPU per rank: entrenar / gloo "
        f"| {head} |",
        "|---" * (7 + len(frames)) + "|",
    ]
    gloo_rows = {(r["op"], r["bytes"]): r for r in rows if r["backend"] == "gloo"}
    for r in rows:
        if r["backend"] != "entrenar":
            continue
        g = gloo_rows[(r["op"], r["bytes"])]["median_s"]
        g_cpu = gloo_rows[(r["op"], r["bytes"])].get("cpu_s")
        cpu = f"{r['cpu_s'] * 1e6:.0f} / {g_cpu * 1e6:.0f} µs" if "cpu_s" in r and g_cpu else "-"
        preds = []
        for f in frames:
            p = predicted(r, rooted.with_frame(links, f), rate, cores)
            preds.append(f"{check.duration(p)} ({p / r['median_s'] - 1:+.0%})")
        lines.append(
            f"| {r['hosts']} x {r['local']} | {r['op']} | {format_bytes(r['bytes'])} "
            f"| {check.duration(g)} | {check.duration(r['median_s'])} "
            f"| {r['median_s'] / g:.2f} | {cpu} | " + " | ".join(preds) + " |"
        )
    return "\n".join(lines)

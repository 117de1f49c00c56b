"""Benchmark: entrenar vs gloo (vs raw TCP, vs MPI) allreduce, and a DDP training step.

Run ``python -m benchmarks.bench`` from the repository root (``--help`` for the
flags; ``--quick`` is the sub-minute smoke run CI uses). One multi-process run
per world size creates one process group per variant (gloo, entrenar
ring/star/auto/deterministic) plus a raw-socket pair and interleaves them,
rotating the order each round (A B C, B C A, C A B, ...), so slow drift of a
shared machine hits every variant alike.

Definitions (nccl-tests): a sample is one blocking ``all_reduce`` call timed with
``perf_counter`` on every rank; the reported sample is the *maximum over ranks*
of that iteration's duration (when the slowest rank had its result; per-rank
durations need no clock sync). median, min and max are over samples; warm-up
iterations are excluded. algbw = bytes / median time; allreduce busbw =
algbw * 2(n-1)/n. Raw TCP: two processes each send *and* receive ``bytes`` at
once on one TCP_NODELAY socket with default buffers; GB/s is bytes / time, each
way (comparable with the busbw of an allreduce at n = 2, which moves the same
bytes each way). 1 GB = 1e9 bytes.

Before/after (``--baseline-tree DIR``): every world size runs
``--baseline-rounds`` rounds; a round is two fresh jobs alive at once, one
whose workers import this checkout's ``entrenar_pg`` and one whose workers
import a copy of ``DIR/entrenar_pg``, taking turns block by block (A B A B
..., ``turns``). The second's entrenar variants are named
``<variant>@baseline``; gloo, raw TCP and the floor pool the samples of both.
The report's ``new / baseline`` is the median, over every round and block
k, of block k's median time on one side over block k's on the other
(``baseline.job_ratios``: the two blocks ran one right after the other),
beside how many such pairs, each round's own median (its spread) and the
ratio of the pooled medians. ``--pin`` puts rank r on the r-th CPU in both
jobs. Everything else in a worker (the bench's modules,
``trainer.model``, torch) is the same in both. An A/A run (``DIR`` this
checkout) shows how far identical code reads from 1.

Outputs (``--out DIR``): ``bench.json``, ``results.md`` (markdown tables),
``allreduce_busbw.png``, ``allreduce_latency.png``; a text table on stdout.

This module is the CLI (flags, the run over world sizes, ``main``). The rest of
``benchmarks/``: ``config`` (variants, :class:`BenchConfig`), ``sizes`` (size
parsing, per-size plans), ``workers`` (what each spawned rank runs), ``model``
(the DDP step's model), ``spawn`` (starting ranks and ``mpiexec``),
``results`` (samples to rows), ``baseline`` (``--baseline-tree``), ``machine``
(what this machine offers), ``report`` (tables, plots, files), ``mpi`` (the MPI
ranks, run by path), ``floor`` (the backend that moves nothing),
``deepspeed_peer`` (DeepSpeed's SHM allreduce, the ``deepspeed`` variant),
``goals`` (issue 17's PASS/FAIL table), ``turns`` (two jobs taking turns,
block by block), ``calls`` (the Python calls one
4 KiB allreduce makes, counted once per run after the timed runs: a separate
program too) and ``split4k`` (a separate program:
where a 4 KiB call's time goes).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.baseline import (
    add_baseline_ratios,
    copy_baseline_package,
    ddp_key,
    run_world_vs_baseline,
    sweep_key,
)
from benchmarks.calls import count_in_subprocess, summary_row
from benchmarks.config import (
    BASELINE,
    DDP_VARIANTS,
    DEEPSPEED,
    DEFAULT_SIZES,
    MPI_SHM,
    MPI_TCP,
    QUICK_SIZES,
    SWEEP_VARIANTS,
    TRANSPORTS,
    BenchConfig,
    GiB,
    MiB,
    Variant,
    base_name,
    with_transports,
)
from benchmarks.cross_core import round_trip_ns
from benchmarks.deepspeed_peer import deepspeed_available
from benchmarks.goals import same_host_goals
from benchmarks.machine import (
    entrenar_available,
    entrenar_transports,
    git_revision,
    machine_info,
    mpi_available,
)
from benchmarks.report import report_lines, write_outputs
from benchmarks.results import add_ratios, allreduce_row, combine_world, ratio_to
from benchmarks.sizes import parse_bytes, parse_sizes, plan_for
from benchmarks.spawn import BenchError, run_mpi, run_world

log = logging.getLogger("benchmarks.bench")


def _measure_worlds(
    cfg: BenchConfig, result: dict[str, Any], mpiexec: str | None, baseline_root: str | None
) -> None:
    """Every world size's runs (and MPI runs), their rows appended to ``result``."""
    notes = result["meta"]["notes"]
    order = [v.name for v in sweep_variants(cfg)]
    if baseline_root is not None:
        order = [x for name in order for x in (name, name + BASELINE)]
    for world in cfg.world_sizes:
        log.info("world size %d: %d sizes x %d variants ...", world, len(cfg.sizes), len(order))
        if baseline_root is None:
            ranks = run_world(world, cfg)
        else:
            ranks, files, per_round = run_world_vs_baseline(world, cfg, baseline_root)
            result["meta"]["baseline"].setdefault("entrenar_pg_file", {})[world] = files
            result["meta"]["baseline"].setdefault("round_ratios", {})[world] = per_round
        part = combine_world(world, ranks, order)
        for row in part["allreduce"]:  # its samples' blocks, for the goals' round-by-round ratios
            row["rounds"] = plan_for(row["size_bytes"], cfg).rounds
        for r in ranks:
            for name, why in r.get("unavailable", {}).items():
                result["meta"]["unavailable"].setdefault(name, f"N={world}: {why}")
        for k in ("allreduce", "raw_tcp", "ddp"):
            result[k].extend(part[k])
        if mpiexec is not None:
            for name, tcp in ((MPI_SHM, False), (MPI_TCP, True)):
                log.info("world size %d: %s ...", world, name)
                try:
                    mres = run_mpi(world, cfg, mpiexec, tcp)
                except (BenchError, subprocess.TimeoutExpired) as e:
                    notes.append(f"{name} N={world} failed: {e}")
                    continue
                result["meta"].setdefault("mpi_library", mres["library"])
                for size_s, samples in mres["times"].items():
                    result["mpi"].append(allreduce_row(world, name, int(size_s), samples))


def count_python_calls(result: dict[str, Any], baseline_root: str | None) -> None:
    """``result["python_calls"]``: one blocking 4 KiB allreduce's Python calls per
    transport (``benchmarks/calls.py``), this checkout's and the baseline's.

    Counted in a separate short process after the timed runs, so no profiler
    is ever on while anything is timed; a failed count is a note, not a failed
    bench."""
    roots = {"": str(Path(__file__).resolve().parents[1])}
    if baseline_root is not None:
        roots[BASELINE] = baseline_root
    rows: dict[str, Any] = {}
    for suffix, root in roots.items():
        try:
            counted = count_in_subprocess(root)
        except RuntimeError as e:
            result["meta"]["notes"].append(f"Python call count{suffix} skipped: {e}")
            continue
        imported = Path(counted["conditions"]["entrenar_pg"]).resolve()
        if not imported.is_relative_to(Path(root).resolve()):
            result["meta"]["notes"].append(
                f"Python call count{suffix} skipped: it imported {imported}, not {root}'s"
            )
            continue
        for transport, r in counted["transports"].items():
            rows[f"entrenar[{transport}]{suffix}"] = dict(summary_row(r), entrenar_pg=str(imported))
    result["python_calls"] = rows


def sweep_variants(cfg: BenchConfig) -> list[Variant]:
    """The allreduce sweep's variants for ``cfg``, entrenar ones once per transport."""
    return with_transports([SWEEP_VARIANTS[a] for a in cfg.algos], cfg.transports)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the whole benchmark described by ``cfg``; returns the JSON-able result."""
    started = time.time()
    notes: list[str] = []
    # Which of the machine's two states the run starts in (benchmarks/cross_core.py).
    round_trip_start = round_trip_ns()
    algos = list(cfg.algos)
    ok, why = entrenar_available()
    if not ok and any(SWEEP_VARIANTS[a].backend == "entrenar" for a in algos):
        notes.append(f"entrenar variants skipped: {why}")
        algos = [a for a in algos if SWEEP_VARIANTS[a].backend != "entrenar"]
    unavailable: dict[str, str] = {}
    if "deepspeed" in algos:
        ds_ok, ds_why = deepspeed_available()
        if not ds_ok:
            unavailable[DEEPSPEED] = ds_why
            algos.remove("deepspeed")
    transports = cfg.transports
    if ok and transports:
        honoured = entrenar_transports()
        for t in transports:
            if t not in honoured:
                unavailable[f"entrenar[{t}]"] = (
                    "this entrenar_pg has no Options.transport (ENTRENAR_TRANSPORT is ignored, "
                    "every group is TCP)"
                )
        transports = tuple(t for t in transports if t in honoured)
    cfg = dataclasses.replace(cfg, algos=tuple(algos), transports=transports, entrenar=ok)
    mpiexec, mpi_why = mpi_available() if cfg.mpi else (None, "disabled (--no-mpi)")
    if mpiexec is None:
        notes.append(f"MPI column skipped: {mpi_why}")
    result: dict[str, Any] = {
        "meta": {
            "machine": machine_info(),
            "git": git_revision(),
            "loadavg_start": list(os.getloadavg()),
            "config": cfg.to_json(),
            "variants": [v.name for v in sweep_variants(cfg)],
            "variant_options": {v.name: v.options for v in sweep_variants(cfg)},
            "variant_transport": {v.name: v.transport for v in sweep_variants(cfg)},
            # Columns asked for but not measured, and why (never silently missing).
            "unavailable": unavailable,
            "timing": "per iteration, max over ranks of each rank's blocking all_reduce time; "
            "median/min/max over samples; warm-up excluded; variants interleaved",
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "notes": notes,
        },
        "allreduce": [],
        "raw_tcp": [],
        "mpi": [],
        "ddp": [],
    }
    if cfg.baseline_tree:
        if not ok:
            raise BenchError(f"--baseline-tree needs the entrenar backend here: {why}")
        result["meta"]["baseline"] = {
            "tree": str(Path(cfg.baseline_tree).resolve()),
            "git": git_revision(Path(cfg.baseline_tree)),
        }
        with tempfile.TemporaryDirectory(prefix="entrenar_baseline_") as tmp:
            baseline_root = copy_baseline_package(cfg.baseline_tree, tmp)
            _measure_worlds(cfg, result, mpiexec, baseline_root)
            count_python_calls(result, baseline_root)
        rounds = result["meta"]["baseline"].get("round_ratios", {})
        for rows, key, job_key in (
            (result["allreduce"], ("world_size", "size_bytes"), sweep_key),
            (result["ddp"], ("world_size",), ddp_key),
        ):
            for world in cfg.world_sizes:
                mine = [r for r in rows if r["world_size"] == world]
                add_baseline_ratios(mine, key, rounds.get(world), job_key)
    else:
        _measure_worlds(cfg, result, mpiexec, None)
        if ok:
            count_python_calls(result, None)
    for r in result["ddp"]:
        active = r.get("check_active", {}).get(r["variant"], True)
        if base_name(r["variant"]).endswith("-check") and not active:
            notes.append(
                f"DDP N={r['world_size']} {r['variant']}: Options(check=True) was set but the "
                f"group has no active contract checker (check_active={active}); the row "
                "measures the plain backend"
            )
    raw = {(r["world_size"], r["size_bytes"]): r["GBps_each_way"] for r in result["raw_tcp"]}
    add_ratios(result["allreduce"], raw)
    add_ratios(result["mpi"], raw)
    for r in result["mpi"]:
        r["time_vs_gloo"] = ratio_to(result["allreduce"], r)
    result["goals"] = same_host_goals(result["allreduce"])
    result["meta"]["elapsed_s"] = time.time() - started
    result["meta"]["loadavg_end"] = list(os.getloadavg())
    trips = [round_trip_start, round_trip_ns()]
    result["meta"]["cross_core_round_trip_ns"] = trips
    if None not in trips:
        notes.append(
            "cross-core round trip CPU 0 <-> 1 (python -m benchmarks.cross_core): "
            + " at start, ".join(f"{ns:.0f} ns" for ns in trips)
            + " at end (this VM's near state ~175 ns, its far state ~560: docs/benchmarks.md)"
        )
    return result


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    """Turn command-line flags into a :class:`BenchConfig`."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description="Allreduce sweep and DDP step: entrenar vs gloo vs raw TCP (vs MPI).",
    )
    p.add_argument("--world-sizes", default=None, help="comma list (default 2,4; --quick: 2)")
    p.add_argument(
        "--sizes",
        default=None,
        help=f"sizes and START:END:xF ranges (default {DEFAULT_SIZES}; --quick: {QUICK_SIZES})",
    )
    p.add_argument(
        "--algos",
        default=None,
        help=f"variants from {','.join(SWEEP_VARIANTS)} (default all; --quick: all but deepspeed)",
    )
    p.add_argument(
        "--transports",
        default="",
        help=f"ENTRENAR_TRANSPORT values from {','.join(TRANSPORTS)}: every entrenar variant runs"
        " once per transport, named <variant>[<transport>] (default: the environment's, one run)",
    )
    p.add_argument(
        "--ddp-variants",
        default="",
        help=f"DDP step variants from {','.join(v.name for v in DDP_VARIANTS)} (default all)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="max timed samples per variant and size (default 50; --quick 8)",
    )
    p.add_argument("--rounds", type=int, default=None, help="interleaving rounds (default 5)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed calls before each timed block (default by size: 2 up to 64 KiB,"
        " 1 up to 16 MiB, then 0)",
    )
    p.add_argument(
        "--budget",
        default=None,
        help="bytes per variant and size, bounds the samples (default 2G; --quick 64M)",
    )
    p.add_argument("--ddp-steps", type=int, default=None, help="timed DDP steps per variant")
    p.add_argument("--no-ddp", action="store_true", help="skip the DDP step benchmark")
    p.add_argument("--no-raw", action="store_true", help="skip the raw TCP reference")
    p.add_argument("--no-mpi", action="store_true", help="skip the MPI column")
    p.add_argument("--quick", action="store_true", help="smoke run, under a minute")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds allowed per world size (default 900; --quick 100)",
    )
    p.add_argument(
        "--baseline-tree",
        default="",
        metavar="DIR",
        help="also run every entrenar variant on DIR/entrenar_pg (a copy), as <variant>@baseline,"
        " and report new/baseline ratios",
    )
    p.add_argument(
        "--baseline-rounds",
        type=int,
        default=2,
        help="with --baseline-tree: rounds per world size, each two jobs at once taking turns"
        " block by block, A B A B ... (default 2)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin rank r's process to the r-th allowed CPU (modulo their number): the"
        " scheduler then neither puts two ranks on one core nor moves them, so a"
        " --baseline-tree comparison measures the code under one fixed placement",
    )
    p.add_argument("--out", default="bench_out", help="output directory")
    a = p.parse_args(argv)
    # --quick leaves DeepSpeed out: its spinning collapses on a loaded machine
    # (tens of ms a call), which would put the smoke run past its time limit.
    quick_algos = ",".join(k for k in SWEEP_VARIANTS if k != "deepspeed")
    algos_text = a.algos or (quick_algos if a.quick else ",".join(SWEEP_VARIANTS))
    algos = tuple(x.strip() for x in algos_text.split(",") if x.strip())
    unknown = [x for x in algos if x not in SWEEP_VARIANTS]
    if unknown:
        p.error(f"unknown --algos {unknown}; choose from {list(SWEEP_VARIANTS)}")
    transports = tuple(x.strip() for x in a.transports.split(",") if x.strip())
    bad = [x for x in transports if x not in TRANSPORTS]
    if bad or len(set(transports)) != len(transports):
        p.error(f"bad --transports {a.transports!r}; choose distinct values from {TRANSPORTS}")
    ddp_names = tuple(x.strip() for x in a.ddp_variants.split(",") if x.strip())
    bad = [x for x in ddp_names if x not in {v.name for v in DDP_VARIANTS}]
    if bad:
        p.error(f"unknown --ddp-variants {bad}; choose from {[v.name for v in DDP_VARIANTS]}")
    q = a.quick
    worlds = a.world_sizes or ("2" if q else "2,4")
    cfg = BenchConfig(
        world_sizes=tuple(int(x) for x in worlds.split(",")),
        sizes=parse_sizes(a.sizes or (QUICK_SIZES if q else DEFAULT_SIZES)),
        algos=algos,
        transports=transports,
        ddp_variants=ddp_names,
        repeats=a.repeats or (8 if q else 50),
        min_repeats=3 if q else 5,
        rounds=a.rounds or (2 if q else 5),
        warmup=-1 if a.warmup is None else a.warmup,
        budget_bytes=parse_bytes(a.budget) if a.budget else (64 * MiB if q else 2 * GiB),
        raw=not a.no_raw,
        mpi=not a.no_mpi,
        ddp=not a.no_ddp,
        ddp_steps=a.ddp_steps or (4 if q else 120),
        ddp_rounds=2 if q else 12,
        timeout_s=a.timeout or (100.0 if q else 900.0),
        op_timeout_s=60.0 if q else 120.0,
        quick=q,
        baseline_tree=a.baseline_tree,
        baseline_rounds=a.baseline_rounds,
        pin=a.pin,
        out=a.out,
    )
    if a.warmup is not None and a.warmup < 0:
        p.error("--warmup must be 0 or more")
    if any(w < 2 for w in cfg.world_sizes):
        p.error("--world-sizes must all be >= 2")
    if (
        cfg.baseline_tree
        and not (Path(cfg.baseline_tree) / "entrenar_pg" / "__init__.py").is_file()
    ):
        p.error(f"--baseline-tree {cfg.baseline_tree}: no entrenar_pg package there")
    if cfg.baseline_rounds < 1:
        p.error("--baseline-rounds must be >= 1")
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: run, print the table, write outputs. Exit 1 on a failed run."""
    logging.basicConfig(level=logging.INFO, format="[bench] %(message)s", stream=sys.stderr)
    cfg = parse_args(argv)
    try:
        result = run_bench(cfg)
    except BenchError as e:
        print(f"bench failed: {e}", file=sys.stderr)
        return 1
    paths = write_outputs(result, Path(cfg.out))
    print("\n".join(report_lines(result)))
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {result['meta']['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Before/after (``--baseline-tree``): this checkout's ``entrenar_pg`` against another tree's."""

from __future__ import annotations

import copy
import logging
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.config import BASELINE, DDP_VARIANTS, SWEEP_VARIANTS, BenchConfig, base_name
from benchmarks.results import block_medians, combine_ranks
from benchmarks.sizes import ddp_per_block, plan_for
from benchmarks.spawn import BenchError, run_jobs

log = logging.getLogger(__name__)

# Every variant whose samples depend on which entrenar_pg the workers import.
ENTRENAR_VARIANT_NAMES = frozenset(
    v.name for v in (*SWEEP_VARIANTS.values(), *DDP_VARIANTS) if v.backend == "entrenar"
)


def copy_baseline_package(tree: str, dest: str) -> str:
    """Copy ``tree/entrenar_pg`` (no bytecode) under ``dest``; returns the import root.

    A copy, not the tree itself on ``sys.path``: only the package under test
    comes from the baseline (the bench's modules and ``trainer.model`` stay the
    checkout's), and the baseline tree is only read, never written (bytecode).
    """
    src = Path(tree) / "entrenar_pg"
    if not (src / "__init__.py").is_file():
        raise BenchError(f"--baseline-tree {tree}: no entrenar_pg package there")
    shutil.copytree(src, Path(dest) / "entrenar_pg", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def mark_baseline(rank_result: dict[str, Any]) -> dict[str, Any]:
    """A worker's result with its entrenar variants renamed ``<name>@baseline``."""

    def rename(name: str) -> str:
        return name + BASELINE if base_name(name) in ENTRENAR_VARIANT_NAMES else name

    def rename_keys(d: dict[str, Any]) -> dict[str, Any]:
        return {rename(k): v for k, v in d.items()}

    out = dict(rank_result)
    out["allreduce"] = {
        f"{rename(name)}|{size}": v
        for key, v in rank_result["allreduce"].items()
        for name, size in [key.split("|")]
    }
    out["ddp"] = rename_keys(rank_result["ddp"])
    info = dict(rank_result["ddp_info"])
    for k in ("check_active", "checker_stats"):
        if k in info:
            info[k] = rename_keys(info[k])
    out["ddp_info"] = info
    return out


def merge_runs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One rank's results of two runs as one: the samples of each key concatenated."""
    out = copy.deepcopy(a)
    for section in ("allreduce", "raw", "ddp"):
        for key, samples in b[section].items():
            out[section].setdefault(key, []).extend(samples)
    for k in ("check_active", "checker_stats"):
        if k in b["ddp_info"]:
            out["ddp_info"].setdefault(k, {}).update(b["ddp_info"][k])
    return out


def run_world_vs_baseline(
    world: int, cfg: BenchConfig, baseline_root: str
) -> tuple[list[dict[str, Any]], dict[str, str], list[dict[str, list[float]]]]:
    """``cfg.baseline_rounds`` rounds, each two fresh jobs alive at once and
    taking turns block by block (this checkout's, the baseline's:
    ``turns.py``), merged.

    Returns each rank's merged result, the ``entrenar_pg`` file each side's
    rank 0 imported, checked (the baseline's must be the copy under
    ``baseline_root``, the other's must not), and per round the new/baseline
    block ratios of every entrenar key (``job_ratios``).
    """
    root = Path(baseline_root).resolve()
    merged: list[dict[str, Any]] = []
    files: dict[str, str] = {}
    per_round: list[dict[str, list[float]]] = []
    for r in range(cfg.baseline_rounds):
        log.info(
            "world size %d: round %d, new and baseline entrenar_pg taking turns ...", world, r + 1
        )
        new, base = run_jobs(world, cfg, [None, baseline_root])
        for side, ranks, is_base in (("new", new, False), ("baseline", base, True)):
            for rank, res in enumerate(ranks):
                got = Path(res["entrenar_pg_file"]).resolve()
                if got.is_relative_to(root) != is_base:
                    raise BenchError(
                        f"world size {world}: rank {rank} of a {side} run imported "
                        f"entrenar_pg from {got} (baseline copy: {root})"
                    )
            files[side] = ranks[0]["entrenar_pg_file"]
        base = [mark_baseline(x) for x in base]
        per_round.append(job_ratios(new, base, cfg))
        for ranks in (new, base):
            merged = (
                [merge_runs(a, b) for a, b in zip(merged, ranks, strict=True)] if merged else ranks
            )
    return merged, files, per_round


def job_ratios(
    new: list[dict[str, Any]], base: list[dict[str, Any]], cfg: BenchConfig
) -> dict[str, list[float]]:
    """One round's new/baseline ratios per entrenar key (``"<variant>|<size>"``
    of the sweep, ``"ddp|<variant>"`` of the DDP step): for each block k, the
    ratio of block k's median time on each side (max over ranks per
    iteration, as the rows). Block k of the two sides ran one right after
    the other (``turns.py``), so whatever else the machine did then hit
    both; a whole-job median would compare moments seconds apart."""
    out: dict[str, list[float]] = {}
    for section, prefix in (("allreduce", ""), ("ddp", "ddp|")):
        for key in new[0][section]:
            name, _, size = key.partition("|")
            twin = f"{name}{BASELINE}|{size}" if size else name + BASELINE
            if twin not in base[0][section]:
                continue
            per_block = plan_for(int(size), cfg).per_block if size else ddp_per_block(cfg)
            mine = block_medians(combine_ranks([x[section][key] for x in new]), per_block)
            theirs = block_medians(combine_ranks([x[section][twin] for x in base]), per_block)
            out[prefix + key] = [a / b for a, b in zip(mine, theirs, strict=True)]
    return out


def add_baseline_ratios(
    rows: list[dict[str, Any]],
    key: tuple[str, ...],
    per_round: list[dict[str, list[float]]] | None = None,
    job_key: Callable[[dict[str, Any]], str] | None = None,
) -> None:
    """On X's rows, against X@baseline's (same ``key`` fields):
    ``time_vs_baseline_pooled``, the ratio of the median times of all
    rounds' samples pooled. With ``per_round`` (``job_ratios`` of each
    round) and ``job_key`` (a row's key there): ``time_vs_baseline_blocks``,
    how many block pairs, and ``time_vs_baseline_rounds``, each round's
    median block ratio. ``time_vs_baseline`` is the median of every round's
    block ratios where there are rounds, else the pooled ratio.

    The block ratios are the ones to read: each pairs two blocks that ran
    one right after the other; pooling compares moments seconds apart, on a
    machine whose other work comes and goes."""
    by_key = {(r["variant"], *(r[k] for k in key)): r for r in rows}
    for r in rows:
        base = by_key.get((r["variant"] + BASELINE, *(r[k] for k in key)))
        if base is None:
            continue
        pooled = r["median_s"] / base["median_s"]
        r["time_vs_baseline_pooled"] = pooled
        r["time_vs_baseline"] = pooled
        if per_round and job_key is not None:
            name = job_key(r)
            rounds = [x[name] for x in per_round if x.get(name)]
            if rounds:
                every = [ratio for one in rounds for ratio in one]
                r["time_vs_baseline"] = statistics.median(every)
                r["time_vs_baseline_blocks"] = len(every)
                r["time_vs_baseline_rounds"] = [statistics.median(one) for one in rounds]


def sweep_key(row: dict[str, Any]) -> str:
    """A sweep row's key in ``job_ratios``."""
    return f"{row['variant']}|{row['size_bytes']}"


def ddp_key(row: dict[str, Any]) -> str:
    """A DDP row's key in ``job_ratios``."""
    return f"ddp|{row['variant']}"

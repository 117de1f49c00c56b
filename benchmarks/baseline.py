"""Before/after (``--baseline-tree``): this checkout's ``entrenar_pg`` against another tree's."""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path
from typing import Any

from benchmarks.config import BASELINE, DDP_VARIANTS, SWEEP_VARIANTS, BenchConfig, base_name
from benchmarks.spawn import BenchError, run_world

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
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """``cfg.baseline_rounds`` pairs of runs (this checkout, baseline; A B B A ...), merged.

    Returns each rank's merged result and the ``entrenar_pg`` file each side's
    rank 0 imported, checked: the baseline runs must have imported the copy
    under ``baseline_root``, the others must not have.
    """
    root = Path(baseline_root).resolve()
    merged: list[dict[str, Any]] = []
    files: dict[str, str] = {}
    for r in range(cfg.baseline_rounds):
        for is_base in (False, True) if r % 2 == 0 else (True, False):
            side = "baseline" if is_base else "new"
            log.info("world size %d: round %d, %s entrenar_pg ...", world, r + 1, side)
            ranks = run_world(world, cfg, baseline_root if is_base else None)
            for rank, res in enumerate(ranks):
                got = Path(res["entrenar_pg_file"]).resolve()
                if got.is_relative_to(root) != is_base:
                    raise BenchError(
                        f"world size {world}: rank {rank} of a {side} run imported "
                        f"entrenar_pg from {got} (baseline copy: {root})"
                    )
            files[side] = ranks[0]["entrenar_pg_file"]
            if is_base:
                ranks = [mark_baseline(x) for x in ranks]
            merged = (
                [merge_runs(a, b) for a, b in zip(merged, ranks, strict=True)] if merged else ranks
            )
    return merged, files


def add_baseline_ratios(rows: list[dict[str, Any]], key: tuple[str, ...]) -> None:
    """``time_vs_baseline`` (median time of X over X@baseline, same ``key`` fields) on X's rows."""
    by_key = {(r["variant"], *(r[k] for k in key)): r for r in rows}
    for r in rows:
        base = by_key.get((r["variant"] + BASELINE, *(r[k] for k in key)))
        if base is not None:
            r["time_vs_baseline"] = r["median_s"] / base["median_s"]

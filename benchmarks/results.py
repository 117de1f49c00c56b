"""Samples to result rows: per-iteration max over ranks, median/min/max, bandwidths, ratios."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.config import FLOOR, GLOO


def busbw_factor(world_size: int) -> float:
    """nccl-tests allreduce bus-bandwidth factor 2(n-1)/n."""
    return 2.0 * (world_size - 1) / world_size


def summarize(samples: Sequence[float]) -> dict[str, float | int]:
    """median/min/max/mean of a list of durations in seconds."""
    return {
        "n": len(samples),
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "mean_s": statistics.fmean(samples),
    }


def combine_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per-iteration maximum over ranks (all ranks time the same iterations)."""
    lengths = {len(x) for x in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks report different sample counts: {sorted(lengths)}")
    return [max(col) for col in zip(*per_rank, strict=True)]


def shape_row(
    variant: str, hosts: int, local: int, size: int, samples: Sequence[float]
) -> dict[str, Any]:
    """The head of a row of an H x L run, as cluster.json and the cost model's
    measurements.json both hold it (``benchmarks.model`` reads either)."""
    stats = summarize(samples)
    return {
        "variant": variant,
        "hosts": hosts,
        "local": local,
        "bytes": size,
        "median_s": stats["median_s"],
        "min_s": stats["min_s"],
        "max_s": stats["max_s"],
    }


def block_medians(samples: Sequence[float], per_block: int) -> list[float]:
    """The median of each block of ``per_block`` consecutive samples (a job's
    samples of one key are its blocks', in order)."""
    return [
        statistics.median(samples[i : i + per_block]) for i in range(0, len(samples), per_block)
    ]


def allreduce_row(world: int, variant: str, size: int, samples: Sequence[float]) -> dict[str, Any]:
    """One allreduce result row with nccl-tests bandwidths."""
    row: dict[str, Any] = {"world_size": world, "variant": variant, "size_bytes": size}
    row.update(summarize(samples))
    algbw = size / row["median_s"] / 1e9
    row["algbw_GBps"] = algbw
    row["busbw_GBps"] = algbw * busbw_factor(world)
    row["samples_s"] = list(samples)
    return row


def add_ratios(rows: list[dict[str, Any]], raw: dict[tuple[int, int], float]) -> None:
    """Add time and busbw ratios to gloo (same world size and size) and busbw / raw TCP."""
    gloo = {(r["world_size"], r["size_bytes"]): r for r in rows if r["variant"] == GLOO}
    for r in rows:
        key = (r["world_size"], r["size_bytes"])
        g = gloo.get(key)
        r["time_vs_gloo"] = r["median_s"] / g["median_s"] if g else None
        r["busbw_vs_gloo"] = r["busbw_GBps"] / g["busbw_GBps"] if g else None
        raw_gbps = raw.get(key)
        r["busbw_vs_raw"] = r["busbw_GBps"] / raw_gbps if raw_gbps else None


def combine_world(
    world: int, ranks: Sequence[dict[str, Any]], order: Sequence[str]
) -> dict[str, Any]:
    """Merge the per-rank samples of one world size into rows (by size, then ``order``)."""
    rows: list[dict[str, Any]] = []

    def sort_key(key: str) -> tuple[int, int]:
        name, size = key.split("|")
        return int(size), order.index(name) if name in order else len(order)

    keys = sorted(ranks[0]["allreduce"], key=sort_key)
    for key in keys:
        name, size = key.split("|")
        samples = combine_ranks([r["allreduce"][key] for r in ranks])
        rows.append(allreduce_row(world, name, int(size), samples))
    raw_rows = []
    for size_s in sorted(ranks[0]["raw"], key=int):
        samples = combine_ranks([r["raw"][size_s] for r in ranks if size_s in r["raw"]])
        row: dict[str, Any] = {"world_size": world, "size_bytes": int(size_s)}
        row.update(summarize(samples))
        row["GBps_each_way"] = int(size_s) / row["median_s"] / 1e9
        raw_rows.append(row)
    ddp_rows = []
    info = ranks[0]["ddp_info"]
    for name in ranks[0]["ddp"]:
        samples = combine_ranks([r["ddp"][name] for r in ranks])
        row = {"world_size": world, "variant": name, **info, **summarize(samples)}
        row["tokens_per_s"] = info["tokens_per_step"] / row["median_s"]
        ddp_rows.append(row)
    g = next((r for r in ddp_rows if r["variant"] == GLOO), None)
    floor = next((r for r in ddp_rows if r["variant"] == FLOOR), None)
    for row in ddp_rows:
        row["step_vs_gloo"] = row["median_s"] / g["median_s"] if g else None
        # What communication adds to a step (the floor moves nothing).
        row["above_floor_s"] = row["median_s"] - floor["median_s"] if floor else None
    return {"allreduce": rows, "raw_tcp": raw_rows, "ddp": ddp_rows}


def ratio_to(rows: Sequence[dict[str, Any]], r: dict[str, Any]) -> float | None:
    """``r``'s median time over gloo's at the same world size and message size."""
    for g in rows:
        if (
            g["variant"] == GLOO
            and g["world_size"] == r["world_size"]
            and g["size_bytes"] == r["size_bytes"]
        ):
            return float(r["median_s"] / g["median_s"])
    return None

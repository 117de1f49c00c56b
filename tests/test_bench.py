"""Tests of the benchmark CLI: its pure helpers and a ``--quick`` smoke run (no timing asserts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.baseline import add_baseline_ratios, mark_baseline, merge_runs
from benchmarks.config import DDP_VARIANTS, GLOO, SWEEP_VARIANTS, BenchConfig
from benchmarks.machine import entrenar_available
from benchmarks.results import busbw_factor, combine_ranks
from benchmarks.sizes import parse_sizes, plan_for, rotated

REPO = Path(__file__).resolve().parents[1]


def test_parse_sizes_ranges_and_lists() -> None:
    assert parse_sizes("4K:256K:x4") == (4096, 16384, 65536, 262144)
    assert parse_sizes("1M,4KiB,4K") == (4096, 1 << 20)
    assert parse_sizes("10") == (12,)  # rounded up to whole float32 elements
    with pytest.raises(ValueError):
        parse_sizes("4Q")


def test_plan_is_bounded_and_interleaved() -> None:
    cfg = BenchConfig(repeats=40, min_repeats=3, rounds=5, budget_bytes=1 << 30)
    small = plan_for(4096, cfg)
    assert small.samples >= 40 and small.rounds == 5
    big = plan_for(256 << 20, cfg)
    assert 3 <= big.samples <= 5 and big.warmup == 0


def test_combine_ranks_takes_per_iteration_max() -> None:
    assert combine_ranks([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]
    with pytest.raises(ValueError):
        combine_ranks([[1.0], [1.0, 2.0]])


def test_rotation_and_busbw_factor() -> None:
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert busbw_factor(2) == 1.0
    assert busbw_factor(4) == 1.5


def test_baseline_runs_are_renamed_merged_and_compared() -> None:
    def run(t: float) -> dict:
        return {
            "allreduce": {"gloo|4096": [t], "entrenar-auto|4096": [t]},
            "raw": {"4096": [t]},
            "ddp": {"gloo": [t], "entrenar-check": [t]},
            "ddp_info": {"check_active": {"entrenar-check": True}},
        }

    base = mark_baseline(run(2.0))
    assert set(base["allreduce"]) == {"gloo|4096", "entrenar-auto@baseline|4096"}
    assert set(base["ddp"]) == {"gloo", "entrenar-check@baseline"}
    assert base["ddp_info"]["check_active"] == {"entrenar-check@baseline": True}
    merged = merge_runs(run(1.0), base)
    assert merged["allreduce"]["gloo|4096"] == [1.0, 2.0]  # gloo pools both runs
    assert merged["allreduce"]["entrenar-auto|4096"] == [1.0]
    assert merged["allreduce"]["entrenar-auto@baseline|4096"] == [2.0]
    assert merged["raw"]["4096"] == [1.0, 2.0]
    rows = [
        {"variant": "entrenar-auto", "world_size": 2, "size_bytes": 4096, "median_s": 1.0},
        {"variant": "entrenar-auto@baseline", "world_size": 2, "size_bytes": 4096, "median_s": 4.0},
        {"variant": "entrenar-auto", "world_size": 2, "size_bytes": 8192, "median_s": 1.0},
    ]
    add_baseline_ratios(rows, ("world_size", "size_bytes"))
    assert rows[0]["time_vs_baseline"] == 0.25
    assert "time_vs_baseline" not in rows[1] and "time_vs_baseline" not in rows[2]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((out / "bench.json").read_text())
    meta = result["meta"]
    sizes = meta["config"]["sizes"]
    variants = meta["variants"]
    assert GLOO in variants and sizes
    if entrenar_available()[0]:  # the backend imports here, so the bench must have used it
        assert {v.name for v in SWEEP_VARIANTS.values()} <= set(variants), meta["notes"]
        assert {v.name for v in DDP_VARIANTS} <= {r["variant"] for r in result["ddp"]}
    got = {(r["variant"], r["size_bytes"]) for r in result["allreduce"] if r["world_size"] == 2}
    assert got == {(v, s) for v in variants for s in sizes}
    rows = result["allreduce"] + result["mpi"] + result["raw_tcp"] + result["ddp"]
    for r in rows:
        for key in ("median_s", "min_s", "max_s"):
            assert math.isfinite(r[key]) and r[key] > 0, r
    assert result["raw_tcp"], "the raw TCP reference is missing"
    assert {r["variant"] for r in result["ddp"]} >= {GLOO}
    for png in ("allreduce_busbw.png", "allreduce_latency.png"):
        assert (out / png).stat().st_size > 1000
    assert "allreduce float32, N=2" in proc.stdout

"""Tests of the benchmark CLI: its pure helpers and a ``--quick`` smoke run (no timing asserts)."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks, run_session

from benchmarks import bench, deepspeed_peer, report
from benchmarks.baseline import (
    add_baseline_ratios,
    copy_baseline_package,
    job_ratios,
    mark_baseline,
    merge_runs,
    sweep_key,
)
from benchmarks.config import (
    DDP_VARIANTS,
    DEEPSPEED,
    GLOO,
    SWEEP_VARIANTS,
    BenchConfig,
    with_transports,
)
from benchmarks.goals import CONTENDER, METHOD, SHM, TCP, same_host_goals
from benchmarks.machine import entrenar_available
from benchmarks.report import baseline_table, report_lines
from benchmarks.results import allreduce_row, busbw_factor, combine_ranks
from benchmarks.sizes import parse_sizes, plan_for, rotated
from benchmarks.spawn import run_jobs
from benchmarks.turns import Turns, TurnTimeout, new_turns
from entrenar_pg import Options


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
    assert small.warmup == 2  # by size, unless --warmup names it
    named = dataclasses.replace(cfg, warmup=10)
    assert plan_for(4096, named).warmup == plan_for(256 << 20, named).warmup == 10
    assert plan_for(4096, named).samples == small.samples  # the timed calls unchanged


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
    assert rows[0]["time_vs_baseline"] == rows[0]["time_vs_baseline_pooled"] == 0.25
    assert "time_vs_baseline" not in rows[1] and "time_vs_baseline" not in rows[2]
    # With rounds: the median of the rounds' ratios; the pooled ratio is kept beside it.
    # With rounds: the median of every round's block ratios, each round's median beside it.
    blocks = ([0.9, 0.8, 1.0], [1.5, 1.6], [1.0])
    rounds = [{"entrenar-auto|4096": x} for x in blocks] + [{}]
    add_baseline_ratios(rows, ("world_size", "size_bytes"), rounds, sweep_key)
    assert rows[0]["time_vs_baseline"] == 1.0 and rows[0]["time_vs_baseline_blocks"] == 6
    assert rows[0]["time_vs_baseline_rounds"] == [0.9, 1.55, 1.0]
    assert rows[0]["time_vs_baseline_pooled"] == 0.25
    result = {
        "meta": {
            "git": "x",
            "config": {"baseline_rounds": 3},
            "baseline": {"tree": "t", "git": "y"},
        },
        "allreduce": rows,
        "ddp": [],
    }
    table = "\n".join(baseline_table(result))
    assert "0.90-1.55 (3)" in table and "1.000" in table and "0.250" in table, table


def test_a_rounds_ratio_pairs_each_block_with_the_other_sides_block_beside_it() -> None:
    """Blocks of 2 samples: the new side was slow in its third block, the
    baseline in its second and third (the machine was busy then, or the
    baseline job's ranks shared a core): pooled medians would read 1/5, the
    blocks beside each other 1, 1/5, 1."""
    cfg = BenchConfig(sizes=(4096,), repeats=6, min_repeats=6, rounds=3, ddp=False)
    assert plan_for(4096, cfg).per_block == 2

    def ranks(name: str, blocks: list[float]) -> list[dict[str, Any]]:
        samples = [x for b in blocks for x in (b, b)]
        return [{"allreduce": {f"{name}|4096": samples}, "ddp": {}} for _ in range(2)]

    new = ranks("entrenar-auto", [1.0, 1.0, 5.0])
    base = ranks("entrenar-auto@baseline", [1.0, 5.0, 5.0])
    assert job_ratios(new, base, cfg) == {"entrenar-auto|4096": [1.0, 0.2, 1.0]}
    # The DDP step's blocks (ddp_steps over ddp_rounds), keyed ddp|<variant>.
    cfg = BenchConfig(ddp_steps=4, ddp_rounds=2)
    new = [{"allreduce": {}, "ddp": {"entrenar": [2.0, 2.0, 9.0, 9.0]}}]
    base = [{"allreduce": {}, "ddp": {"entrenar@baseline": [1.0, 1.0, 9.0, 9.0]}}]
    assert job_ratios(new, base, cfg) == {"ddp|entrenar": [2.0, 1.0]}


@pytest.mark.timeout(30)
def test_turns_alternate_a_b_a_b_and_a_finished_side_holds_nobody() -> None:
    """Two threads as the two jobs' rank 0 on the real shared turn: blocks
    run one at a time, in the order A B, A B, A B; once A has finished, B
    runs its extra blocks alone; a turn never given back times out."""
    ctx = mp.get_context("spawn")
    a, b = new_turns(ctx, timeout_s=10)
    order: list[str] = []

    def side(turns: Turns, name: str, blocks: int) -> None:
        for _ in range(blocks):
            turns.wait()
            order.append(name)
            time.sleep(0.002)  # a block
            turns.done()
        turns.finish()

    threads = [
        threading.Thread(target=side, args=(b, "B", 5)),  # started first: still waits for A
        threading.Thread(target=side, args=(a, "A", 3)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert order == ["A", "B", "A", "B", "A", "B", "B", "B"]
    lone, _ = new_turns(ctx, timeout_s=0.2)
    lone.wait()
    lone.done()  # A's block 0; its block 1 waits for B's block 0
    with pytest.raises(TurnTimeout):
        lone.wait()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_new_and_baseline_jobs_take_turns(tmp_path: Path) -> None:
    """This tree against a copy of itself (an A/A run), ``--pin``ned: both
    jobs alive at once, each importing its own entrenar_pg, their ranks on
    the same CPUs, their timed blocks never overlapping and alternating
    A B A B; a round's block ratios for every entrenar key, the DDP step's
    included."""
    root = copy_baseline_package(str(Path(__file__).resolve().parents[1]), str(tmp_path))
    cfg = BenchConfig(
        world_sizes=(2,),
        sizes=(4096,),
        algos=("gloo", "auto"),
        transports=("tcp",),
        repeats=4,
        min_repeats=4,
        rounds=2,
        raw=False,
        mpi=False,
        ddp_variants=("entrenar",),
        ddp_steps=1,
        ddp_rounds=1,
        timeout_s=150.0,
        op_timeout_s=60.0,
        pin=True,
    )
    new, base = run_jobs(2, cfg, [None, root])
    cpus = sorted(os.sched_getaffinity(0))
    for job in (new, base):  # --pin: rank r on the r-th CPU, in both jobs
        assert [x["affinity"] for x in job] == [[cpus[r % len(cpus)]] for r in range(2)]
    assert not Path(new[0]["entrenar_pg_file"]).resolve().is_relative_to(tmp_path)
    assert Path(base[0]["entrenar_pg_file"]).resolve().is_relative_to(tmp_path)
    spans = sorted(
        [(s, e, "A") for s, e in new[0]["block_spans"]]
        + [(s, e, "B") for s, e in base[0]["block_spans"]]
    )
    blocks = 2 * 2 + 1  # sizes x rounds x 2 variants, then one DDP block
    assert len(spans) == 2 * blocks
    for (_, end, _), (start, _, _) in zip(spans, spans[1:], strict=False):
        assert end <= start, spans  # one job's block at a time
    assert "".join(x for _, _, x in spans) == "AB" * blocks
    ratios = job_ratios(new, [mark_baseline(x) for x in base], cfg)
    assert set(ratios) == {"entrenar-auto[tcp]|4096", "ddp|entrenar[tcp]"}, ratios
    assert [len(x) for x in ratios.values()] == [2, 1]  # a ratio per block
    assert all(math.isfinite(x) and x > 0 for one in ratios.values() for x in one)


def test_transports_and_ddp_variants_parse() -> None:
    cfg = bench.parse_args(["--transports", "tcp, shm", "--ddp-variants", "gloo,entrenar"])
    assert cfg.transports == ("tcp", "shm")
    assert cfg.ddp_variants == ("gloo", "entrenar")
    assert BenchConfig.from_json(cfg.to_json()) == cfg  # what the workers receive
    assert bench.parse_args([]).transports == ()  # default: the environment's transport
    assert bench.parse_args(["--pin"]).pin and not bench.parse_args([]).pin
    assert bench.parse_args(["--warmup", "10"]).warmup == 10 and bench.parse_args([]).warmup == -1
    bad_args = (["--transports", "udp"], ["--transports", "tcp,tcp"], ["--ddp-variants", "x"])
    for bad in (*bad_args, ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_with_transports_names_entrenar_variants_only() -> None:
    base = [SWEEP_VARIANTS["gloo"], SWEEP_VARIANTS["auto"], SWEEP_VARIANTS["deepspeed"]]
    got = with_transports(base, ("tcp", "shm"))
    assert [(v.name, v.transport) for v in got] == [
        (GLOO, ""),
        ("entrenar-auto[tcp]", "tcp"),
        ("entrenar-auto[shm]", "shm"),
        (DEEPSPEED, ""),
    ]
    assert got[1].options == SWEEP_VARIANTS["auto"].options
    assert with_transports(base, ()) == base
    # --baseline-tree renames a transport variant like its plain twin.
    marked = mark_baseline(
        {"allreduce": {"entrenar-auto[shm]|4096": [1.0]}, "ddp": {}, "ddp_info": {}}
    )
    assert set(marked["allreduce"]) == {"entrenar-auto[shm]@baseline|4096"}


def _row(world: int, variant: str, size: int, seconds: float) -> dict:
    return allreduce_row(world, variant, size, [seconds])


def test_same_host_goals_pass_fail_and_missing_rows() -> None:
    k4, k64, m1 = 4096, 1 << 16, 1 << 20
    rows = [
        # N=2, 4 KiB: shm 2.9x DeepSpeed (limit 3) and faster than TCP; the method row beside.
        _row(2, DEEPSPEED, k4, 10e-6),
        _row(2, SHM, k4, 29e-6),
        _row(2, TCP, k4, 100e-6),
        _row(2, METHOD, k4, 8e-6),
        # N=2, 64 KiB: 1.02x DeepSpeed, over the limit of 1 from 64 KiB on.
        _row(2, DEEPSPEED, k64, 50e-6),
        _row(2, SHM, k64, 51e-6),
        # N=2, 1 MiB: shm slower than DeepSpeed (busbw below), and slower than TCP.
        _row(2, DEEPSPEED, m1, 200e-6),
        _row(2, SHM, m1, 250e-6),
        _row(2, TCP, m1, 240e-6),
        # N=4, 4 KiB: 0.6x DeepSpeed (limit 1) and faster than TCP.
        _row(4, DEEPSPEED, k4, 5e-3),
        _row(4, SHM, k4, 3e-3),
        _row(4, TCP, k4, 4e-3),
        # N=4, 1 MiB: no shm row (transport not available): n/a, with TCP's ratio still shown.
        _row(4, DEEPSPEED, m1, 1e-3),
        _row(4, TCP, m1, 2e-3),
        _row(4, GLOO, m1, 9e-3),
    ]
    goals = {(g["world_size"], g["size_bytes"]): g for g in same_host_goals(rows)}
    assert set(goals) == {(2, k4), (2, k64), (2, m1), (4, k4), (4, m1)}
    g = goals[(2, k4)]
    assert (g["vs_deepspeed"], g["vs_tcp"], g["ds_limit"]) == ("PASS", "PASS", 3.0)
    assert g["shm_vs_ds_time"] == pytest.approx(2.9)
    assert g["method_vs_ds_time"] == pytest.approx(0.8)
    g = goals[(2, k64)]
    assert (g["vs_deepspeed"], g["ds_limit"], g["method_vs_ds_time"]) == ("FAIL", 1.0, None)
    g = goals[(2, m1)]
    assert (g["vs_deepspeed"], g["vs_tcp"], g["ds_limit"]) == ("FAIL", "FAIL", 1.0)
    assert g["shm_vs_ds_busbw"] == pytest.approx(0.8)
    g = goals[(4, k4)]
    assert (g["vs_deepspeed"], g["vs_tcp"], g["ds_limit"]) == ("PASS", "PASS", 1.0)
    g = goals[(4, m1)]
    assert (g["vs_deepspeed"], g["vs_tcp"]) == ("n/a", "n/a")
    assert g["tcp_vs_ds_time"] == pytest.approx(2.0) and g["shm_s"] is None


def test_same_host_goals_read_a_default_transport_run() -> None:
    """A run without --transports (the README's command) names its rows
    ``entrenar-auto`` and ``entrenar-auto-method``: on one host that is the
    shared memory, and they are judged as the [shm] rows; a [shm] row, where
    there is one, wins. (Before: every goal of such a run read n/a.)"""
    k64 = 1 << 16
    rows = [
        _row(2, DEEPSPEED, k64, 20e-6),
        _row(2, CONTENDER, k64, 18e-6),
        _row(2, f"{CONTENDER}-method", k64, 15e-6),
        _row(4, DEEPSPEED, k64, 1e-3),
        _row(4, CONTENDER, k64, 5e-3),
        _row(4, SHM, k64, 0.5e-3),
    ]
    goals = {g["world_size"]: g for g in same_host_goals(rows)}
    assert goals[2]["vs_deepspeed"] == "PASS"
    assert goals[2]["shm_vs_ds_time"] == pytest.approx(0.9)
    assert goals[2]["method_vs_ds_time"] == pytest.approx(0.75)
    assert goals[4]["shm_vs_ds_time"] == pytest.approx(0.5)


def test_same_host_goals_ratio_round_by_round() -> None:
    """Each round's block of entrenar-shm over the same round's block of
    DeepSpeed's (their medians), so a round that stands apart shows; none
    where a row has no rounds recorded."""
    k64 = 1 << 16
    ours = allreduce_row(2, SHM, k64, [1.0, 1.0, 2.0, 2.2, 3.0, 2.8, 4.0, 4.0])
    theirs = allreduce_row(2, DEEPSPEED, k64, [2.0, 2.0, 2.0, 2.2, 1.0, 1.0, 8.0, 8.0])
    for row in (ours, theirs):
        row["rounds"] = 4
    (g,) = same_host_goals([ours, theirs])
    assert g["shm_vs_ds_rounds"] == pytest.approx([0.5, 1.0, 2.9, 0.5])
    assert report._fmt_rounds(g["shm_vs_ds_rounds"]) == "0.75 (0.50-2.90)"
    del ours["rounds"]
    (g,) = same_host_goals([ours, theirs])
    assert g["shm_vs_ds_rounds"] is None and report._fmt_rounds(None) == "-"


def test_missing_deepspeed_and_transport_are_reported_not_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench, "deepspeed_available", lambda: (False, "deepspeed not installed"))
    monkeypatch.setattr(bench, "entrenar_available", lambda: (True, ""))
    monkeypatch.setattr(bench, "entrenar_transports", lambda: ("tcp",))
    seen: list[BenchConfig] = []
    monkeypatch.setattr(bench, "_measure_worlds", lambda cfg, *a: seen.append(cfg))

    def no_count(root: str) -> dict[str, Any]:
        raise RuntimeError("the call counter failed (1): boom")

    monkeypatch.setattr(bench, "count_in_subprocess", no_count)
    cfg = BenchConfig(algos=("gloo", "auto", "deepspeed"), transports=("tcp", "shm"), mpi=False)
    result = bench.run_bench(cfg)
    (ran,) = seen
    assert ran.algos == ("gloo", "auto") and ran.transports == ("tcp",)
    meta = result["meta"]
    assert meta["variants"] == [GLOO, "entrenar-auto[tcp]"]
    assert meta["unavailable"] == {
        DEEPSPEED: "deepspeed not installed",
        "entrenar[shm]": "this entrenar_pg has no Options.transport (ENTRENAR_TRANSPORT is "
        "ignored, every group is TCP)",
    }
    text = "\n".join(report_lines(result))
    assert f"unavailable: {DEEPSPEED}: deepspeed not installed" in text
    assert "unavailable: entrenar[shm]:" in text
    assert "note: Python call count skipped: the call counter failed (1): boom" in text


def test_deepspeed_availability_and_segment_cleanup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(deepspeed_peer.importlib.util, "find_spec", lambda name: None)
    ok, why = deepspeed_peer.deepspeed_available()
    assert not ok and "install_peers.sh" in why
    prefix = f"{deepspeed_peer.SEGMENT_PREFIX}_{__import__('os').getuid()}_127.0.0.1_5000_"
    for name in (prefix + "0", prefix + "1", "other_segment"):
        (tmp_path / name).write_bytes(b"x")
    assert deepspeed_peer.remove_segments(5000, 4, str(tmp_path)) == [prefix + "0", prefix + "1"]
    assert [p.name for p in tmp_path.iterdir()] == ["other_segment"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    # --ddp-steps 1: one round per DDP variant, a warm-up step and a timed one,
    # instead of --quick's two rounds of three (the GPT steps of five variants
    # were half this run's CPU); every DDP row is still checked below.
    cmd = [sys.executable, "-m", "benchmarks.bench", "--quick", "--ddp-steps", "1"]
    proc = run_session([*cmd, "--out", str(out)], timeout=150, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((out / "bench.json").read_text())
    meta = result["meta"]
    sizes = meta["config"]["sizes"]
    variants = meta["variants"]
    assert GLOO in variants and sizes
    if entrenar_available()[0]:  # the backend imports here, so the bench must have used it
        entrenar = {v.name for v in SWEEP_VARIANTS.values() if v.backend == "entrenar"}
        assert entrenar <= set(variants), meta["notes"]
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
    if entrenar_available()[0]:
        calls = result["python_calls"]
        assert set(calls) == {"entrenar[shm]", "entrenar[tcp]"}, meta["notes"]
        assert all(r["ours"] > 0 and r["torch"] > 0 for r in calls.values()), calls
        assert "Python calls per 4 KiB allreduce (ours / torch)" in proc.stdout


def _ds_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"{deepspeed_peer.SEGMENT_PREFIX}_*")}


def _mapped_ds_segments() -> set[str]:
    """DeepSpeed's segments that a live process still maps: another job's
    (test_quick_bench_smoke's on another worker, or any DeepSpeed job),
    not ones this bench left behind, whose ranks have exited."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in text.splitlines():
            name = line.rsplit("/dev/shm/", 1)[-1] if "/dev/shm/" in line else ""
            if name.startswith(deepspeed_peer.SEGMENT_PREFIX):
                mapped.add(name)
    return mapped


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_deepspeed_column_smoke(tmp_path: Path) -> None:
    """DeepSpeed's SHM allreduce measured beside gloo, or reported unavailable, never absent."""
    out = tmp_path / "bench"
    before = _ds_segments()
    cmd = [sys.executable, "-m", "benchmarks.bench", "--world-sizes", "2", "--sizes", "4K"]
    cmd += ["--algos", "gloo,deepspeed", "--rounds", "2", "--repeats", "4", "--no-ddp"]
    cmd += ["--no-raw", "--no-mpi", "--timeout", "180", "--out", str(out)]
    proc = run_session(cmd, timeout=220, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((out / "bench.json").read_text())
    measured = {r["variant"] for r in result["allreduce"]}
    unavailable = result["meta"]["unavailable"]
    assert (DEEPSPEED in measured) != (DEEPSPEED in unavailable), result["meta"]
    if deepspeed_peer.deepspeed_available()[0]:
        # Installed: the column must have run (a failure to start is a finding, not a skip).
        assert DEEPSPEED in measured, unavailable
        # Less what a live process maps: a concurrent DeepSpeed job's, seen once
        # when the quick bench ran beside this test (segments of another port).
        left = _ds_segments() - before - _mapped_ds_segments()
        assert not left, f"the bench left DeepSpeed's segments in /dev/shm: {sorted(left)}"
    else:
        assert f"unavailable: {DEEPSPEED}:" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_shm_pairs_times_both_in_pairs_and_cleans_up(tmp_path: Path) -> None:
    """``torchrun -m benchmarks.shm_pairs``: entrenar and DeepSpeed's SHM in
    pairs of blocks, each pair's medians and the cross-core probe, checked
    sums, DeepSpeed's segments unlinked; without DeepSpeed it says so."""
    out = tmp_path / "pairs.json"
    before = _ds_segments()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "benchmarks.shm_pairs", "--size", "4K", "--pairs", "2", "--calls", "20"]
    proc = run_session([*cmd, "--out", str(out)], timeout=150, check=False)
    if not deepspeed_peer.deepspeed_available()[0]:
        assert proc.returncode != 0 and "deepspeed" in proc.stderr, proc.stderr[-3000:]
        return
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["nbytes"] == 4096 and result["calls"] == 20
    assert len(result["pairs"]) == 2
    for pair in result["pairs"]:
        assert 0 < pair["entrenar_s"] < 1 and 0 < pair["deepspeed_s"] < 1, pair
        assert pair["round_trip_ns"] is None or pair["round_trip_ns"] > 0, pair
    assert "pairs; ratio median" in proc.stdout, proc.stdout
    left = _ds_segments() - before - _mapped_ds_segments()
    assert not left, f"shm_pairs left DeepSpeed's segments in /dev/shm: {sorted(left)}"


def test_transport_variant_refuses_an_entrenar_without_the_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An entrenar_pg that ignores ENTRENAR_TRANSPORT must not be measured under a [shm] name."""
    import dataclasses

    import entrenar_pg
    from benchmarks import workers

    @dataclasses.dataclass(frozen=True)
    class OldOptions:  # an entrenar_pg from before the transports (e.g. a --baseline-tree)
        algorithm: str = "auto"

    monkeypatch.setattr(entrenar_pg, "Options", OldOptions)
    (shm,) = with_transports([SWEEP_VARIANTS["auto"]], ("shm",))
    with pytest.raises(RuntimeError, match=r"entrenar-auto\[shm\]: .*no Options.transport"):
        workers._new_group(shm, 2)


@pytest.mark.timeout(60)
def test_shm_cpu_times_both_trees_parts(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks.shm_cpu`` against this tree as its own baseline: a row per
    part and size, each with both trees' times and a ratio near 1."""
    from benchmarks import shm_cpu

    root = str(Path(__file__).resolve().parents[1])
    shm_cpu.main(["--baseline-tree", root, "--size", "4K", "--rounds", "2", "--calls", "200"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:3] for r in rows] == [["core", "4", "KiB"], ["thin", "4", "KiB"]], rows
    for r in rows:
        new, base, ratio = float(r[3]), float(r[6]), float(r[-1])
        assert 0 < new < 1000 and 0 < base < 1000, r  # microseconds per call
        assert 0.2 < ratio < 5, r  # the same code on both sides
    # The timing's no-op sum is undone: two ranks' shm sum in this process sums
    # again (it stayed a no-op once, and later tests of the worker got wrong sums).
    groups = make_groups(2, Options(transport="shm"))
    try:
        sums = run_ranks(2, _sum_of_ones, groups=groups, timeout_s=30)
    finally:
        for g in groups:
            g.shutdown()
    assert sums == [2.0, 2.0]


def _sum_of_ones(rank: int, pg: Any) -> float:
    t = torch.ones(1024)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    pg.allreduce([t], opts).wait()
    return float(t[0])

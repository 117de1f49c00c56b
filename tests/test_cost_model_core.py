"""A core per rank in the cost model, without processes: gloo's cost per call split off
its alphas per message, entrenar's queued frames (a star's root takes its peers' frames
one after another), their fit (dedicated.py) and the held-out check on the committed
16-core runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_cost_model import LINKS

from benchmarks.model import check, cli, costs, dedicated, held_out
from benchmarks.model.links import (
    GLOO_CALL,
    GLOO_LOOPBACK,
    GLOO_NET,
    NET,
    QUEUED_FRAME,
    WAKE,
    LinkTable,
)

CORE16 = Path(__file__).resolve().parents[1] / "benchmarks/model/data/core16"
OWN_CORES = {"rate": "1gbit", "machine": {"nproc": 16}}  # 2 x 2 and 4 x 2: a core per rank
SHARED_CORES = {"rate": "1gbit", "machine": {"nproc": 2}}
CALL_S, FRAME_S = 60e-6, 20e-6  # the call at most 2 x gloo-loopback's 50 us


def _truth() -> LinkTable:
    return dedicated.with_queued_frame(dedicated.with_gloo_call(LINKS, CALL_S), FRAME_S)


def _run(
    h: int, local: int, meta: dict[str, Any], truth: LinkTable, noise: float = 0.0
) -> dict[str, Any]:
    """Cluster rows the model makes with ``truth`` (and relative ``noise``)."""
    rng, rows = np.random.default_rng(31), []
    for variant in ("gloo", "entrenar-flat", "entrenar"):
        for s in (4 << 10, 16 << 10, 64 << 10, 16 << 20):
            row = {"variant": variant, "hosts": h, "local": local, "bytes": s, "median_s": 1}
            model = check.predict_row(row, meta, truth).predicted_s
            rows.append({**row, "median_s": model * (1 + noise * rng.standard_normal())})
    return {"meta": meta, "rows": rows}


def test_the_gloo_call_keeps_the_two_rank_sweeps_time_and_is_paid_once_per_call() -> None:
    """with_gloo_call: each gloo kind's alpha gives up the call / its sweep's 2 messages,
    so the 2-rank ring the sweep measured takes what it took; a 14-step ring (4 x 2)
    pays the call once instead of 7 times."""
    assert dedicated.sweep_messages(GLOO_NET) == dedicated.sweep_messages(GLOO_LOOPBACK) == 2
    split = dedicated.with_gloo_call(LINKS, CALL_S)
    assert split[GLOO_NET].alpha == pytest.approx(LINKS[GLOO_NET].alpha - CALL_S / 2)
    assert dedicated.max_gloo_call(LINKS) == pytest.approx(2 * LINKS[GLOO_LOOPBACK].alpha)
    with pytest.raises(ValueError, match="below zero"):
        dedicated.with_gloo_call(LINKS, 1.01 * dedicated.max_gloo_call(LINKS))
    for h, local, steps in ((2, 1, 2), (4, 2, 14)):
        phases = costs.ring(costs.Shape(h, local, 4), costs.GLOO)
        before = costs.total_time(phases, LINKS, fabric=costs.GLOO)
        after = costs.total_time(phases, split, fabric=costs.GLOO)
        assert before - after == pytest.approx(CALL_S * (steps / 2 - 1))


def test_queued_frames_are_a_roots_beyond_one_per_hop_and_none_in_a_ring() -> None:
    """Phase.queued: the star's root 2(N-2), a leader L-2 in, 2(H-2) in the exchange,
    L-2 out; a 2-rank hop (what the sweeps measured) and the symmetric algorithms none."""

    def queued(algo: costs.Algorithm, h: int, local: int) -> float:
        return sum(p.queued for p in algo(costs.Shape(h, local, 4 << 10), costs.ENTRENAR))

    assert queued(costs.star, 2, 2) == 4 and queued(costs.star, 4, 2) == 12
    assert queued(costs.direct, 4, 2) == 12 and queued(costs.direct, 2, 1) == 0
    assert queued(costs.host_leaders, 2, 2) == 0 and queued(costs.host_leaders, 4, 4) == 8
    assert queued(costs.ring, 4, 2) == queued(costs.doubling, 4, 2) == 0


def test_queued_frames_take_the_longer_of_their_time_and_the_bytes() -> None:
    """The root handles one frame while the link carries the next: a phase's queued
    frames and its bytes overlap (the longer counts), its alphas come on top; not
    fitted (no QUEUED_FRAME), nothing."""
    few = costs.Phase("star", {NET: 2}, {NET: 1000}, queued=4)
    many = costs.Phase("star", {NET: 2}, {NET: 1000}, queued=400)
    lat, bw = 2 * LINKS[NET].alpha, 1000 * LINKS[NET].beta
    assert few.time(LINKS, frame_s=1e-6) == pytest.approx(lat + bw)
    assert many.time(LINKS, frame_s=1e-6) == pytest.approx(lat + 400e-6)
    star = costs.star(costs.Shape(4, 2, 4), costs.ENTRENAR)
    unqueued = [dataclasses.replace(p, queued=0.0) for p in star]
    assert costs.total_time(star, LINKS) == costs.total_time(unqueued, LINKS)
    framed = dedicated.with_queued_frame(LINKS, FRAME_S)
    assert costs.total_time(star, framed) > costs.total_time(unqueued, framed)


def test_fit_dedicated_recovers_the_call_and_the_frame_from_one_layouts_rows() -> None:
    """dedicated.fit_dedicated: rows below 1 MiB made by the model with a known gloo call
    and queued frame (3 % noise) on one layout give both back, each from its own
    implementation's rows (entrenar's only where frames queue); rows from 1 MiB are
    not used."""
    run = _run(4, 2, OWN_CORES, _truth(), noise=0.03)
    for row in run["rows"]:
        if row["bytes"] >= check.LARGE_BYTES:
            row["median_s"] *= 10  # a fit that used them would miss
    fitted = dedicated.fit_dedicated([run], LINKS)
    assert fitted[GLOO_CALL].alpha == pytest.approx(CALL_S, rel=0.05)
    assert fitted[QUEUED_FRAME].alpha == pytest.approx(FRAME_S, rel=0.1)
    assert fitted[GLOO_NET].alpha == pytest.approx(
        LINKS[GLOO_NET].alpha - fitted[GLOO_CALL].alpha / 2
    )
    assert fitted.meta["dedicated_rows"][GLOO_CALL] == 3
    with pytest.raises(ValueError, match="already have"):
        dedicated.fit_dedicated([run], fitted)


def test_the_call_and_the_frame_are_fitted_only_where_each_rank_has_a_core() -> None:
    """Rows whose ranks share cores fit the wake-ups (wake.py), not these: no row to fit
    on, and held_out.fit_layout then leaves the call and the frame out."""
    shared = _run(2, 2, SHARED_CORES, _truth())
    assert not dedicated.has_own_cores([shared])
    with pytest.raises(ValueError, match="a core per rank"):
        dedicated.fit_dedicated([shared], LINKS)
    table = held_out.fit_layout([shared], LINKS)
    assert WAKE in table.params and GLOO_CALL not in table.params
    own = held_out.fit_layout([_run(2, 2, OWN_CORES, _truth())], LINKS)
    assert GLOO_CALL in own.params and WAKE not in own.params
    with pytest.raises(ValueError, match="no row below 1 MiB"):
        held_out.fit_layout([{"meta": OWN_CORES, "rows": []}], LINKS)


def test_held_out_on_synthetic_layouts_predicts_each_from_the_other() -> None:
    """Rows of 2 x 2 and 4 x 2 made with the same call and frame: each direction's fit
    predicts the other layout's rows and a third layout's (``also``) within 1 %."""
    truth = _truth()
    runs = [_run(2, 2, OWN_CORES, truth), _run(4, 2, OWN_CORES, truth)]
    third = _run(8, 2, OWN_CORES, truth)
    for d in held_out.held_out(runs, LINKS, also=[third]):
        layouts = {(c.hosts, c.local) for c in d.checked}
        assert d.fitted_on not in layouts and (8, 2) in layouts
        assert max(abs(c.error) for c in d.checked) < 0.01
    with pytest.raises(ValueError, match="fitted on"):
        held_out.held_out(runs, LINKS, also=[runs[0]])


def test_held_out_command_on_the_committed_16_core_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``held-out`` on the 16-core machine's 2 x 2 and 4 x 2 runs, 8 x 2 beside: each
    layout's rows below 1 MiB predicted from the other's fit (docs/benchmarks.md, the
    thirty-first session): 14 of 15 at 2 x 2 and 15 of 15 at 4 x 2 (8 of 15 each
    before), every row from 1 MiB still within 25 %; gloo's call fits 217 us both ways."""
    argv = ["held-out", f"{CORE16}/cluster-2x2-1gbit.json", f"{CORE16}/cluster-4x2-1gbit.json"]
    argv += ["--also", f"{CORE16}/cluster-8x2-1gbit.json", "--links", f"{CORE16}/links.json"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    first, second = out.split("## fitted on 4 x 2")
    assert "## fitted on 2 x 2: gloo call 217 us" in first and "queued frame 26.0 us" in first
    assert "gloo call 217 us" in second and "queued frame 23.5 us" in second
    assert "- 4 x 2: below 1 MiB 15 of 15, from 1 MiB 9 of 9" in first
    assert "- 2 x 2: below 1 MiB 14 of 15, from 1 MiB 9 of 9" in second
    assert first.count("| 8 x 2 |") == second.count("| 8 x 2 |") == 18

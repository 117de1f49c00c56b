"""Turns on shared cores in the cost model, without processes: the last hop's bytes
after a spinning rank's turns (costs.Phase.time), the rooted ops' own turn
(wake.fit_rooted_wake, predicted from other layouts only) and the host-aware barrier
candidate's rounds."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from test_cost_model import LINKS

from benchmarks.model import check, cli, costs, held_out, rooted, rooted_measure, wake
from benchmarks.model.links import GLOO_WAKE, NET, WAKE, LinkParams, LinkTable

# test_cost_model's link table (every kind distinct), with net alpha 30 us.
BASE = LinkTable(
    {k: LinkParams(30e-6, p.beta) if k == NET else p for k, p in LINKS.params.items()},
    dict(LINKS.meta),
)
META = {"rate": "1gbit", "machine": {"nproc": 2}}
CLUSTER_WAKE_S = 320e-6  # the allreduce rows' turn (the 15:20 pair fitted 289-320 us)
ROOTED_WAKE_S = 245e-6  # the rooted rows' turn in the same window (234-272 us)


def _with_wake(alpha: float) -> LinkTable:
    return LinkTable(
        {**BASE.params, WAKE: LinkParams(alpha, 0), GLOO_WAKE: LinkParams(8e-4, 0)}, {}
    )


def _cluster_run(h: int, local: int) -> dict[str, Any]:
    """Cluster rows the model makes at ``CLUSTER_WAKE_S``."""
    truth, rows = _with_wake(CLUSTER_WAKE_S), []
    for variant in ("gloo", "entrenar-flat", "entrenar"):
        for s in (4 << 10, 64 << 10, 256 << 10, 16 << 20):
            row = {"variant": variant, "hosts": h, "local": local, "bytes": s, "median_s": 1}
            rows.append({**row, "median_s": check.predict_row(row, META, truth).predicted_s})
    return {"meta": META, "rows": rows}


def _rooted_run(h: int, local: int) -> dict[str, Any]:
    """measure-rooted rows the model makes at ``ROOTED_WAKE_S`` (and gloo's, ignored)."""
    truth, rows = rooted.with_frame(_with_wake(ROOTED_WAKE_S), 0.0), []
    for op, s in (("barrier", 0), ("broadcast", 4 << 10), ("broadcast", 64 << 10)):
        row: dict[str, Any] = {"backend": "entrenar", "op": op, "bytes": s}
        row.update(hosts=h, local=local)
        rows.append({**row, "median_s": rooted_measure.predicted(row, truth, "1gbit", 2)})
        rows.append({**row, "backend": "gloo", "median_s": 1.0})
    return {"rate": "1gbit", "machine": {"nproc": 2}, "rows": rows}


def test_a_spinning_ranks_turns_overlap_every_hops_bytes_but_the_last() -> None:
    """costs.Phase.time on shared cores: the turns that finish a phase come after its
    last hop's message has arrived, so a one-hop phase (the leaders' exchange) pays its
    bytes and its turns, a 14-step ring all but one step's bytes; where the bytes
    outlast the turns, the bytes; on dedicated cores (no waits) alpha + bytes."""
    one = costs.Phase("exchange", {NET: 1}, {NET: 64 << 10})
    bw = (64 << 10) * BASE[NET].beta  # 550.5 us
    assert one.time(BASE, waits=600e-6) == pytest.approx(30e-6 + 600e-6 + bw, rel=1e-12)
    ring = costs.Phase("ring", {NET: 14}, {NET: 64 << 10}, symmetric=True)
    assert ring.time(BASE, waits=600e-6) == pytest.approx(14 * 30e-6 + 600e-6 + bw / 14)
    assert ring.time(BASE, waits=100e-6) == pytest.approx(14 * 30e-6 + bw)  # bytes bind
    assert one.time(BASE) == pytest.approx(30e-6 + bw)


def test_rooted_rows_take_the_turn_of_other_layouts_rooted_runs() -> None:
    """The allreduce rows (made at 320 us a turn) and the rooted rows (245 us) of the same
    window: each rooted run is predicted with the turn fitted on the rooted runs of the
    *other* layouts (2 x 2 from 4 x 2 and 8 x 1, ...), within 1 %, where the cluster
    rows' turn over-predicts by more than 20 % (the 4 x 2 barrier +27 % and broadcast
    4 KiB +31 % of the 15:20 pair); ``fitted_on`` never holds the run's own layout."""
    directions = held_out.held_out([_cluster_run(2, 2), _cluster_run(4, 2)], BASE)
    rooted_runs = [_rooted_run(2, 2), _rooted_run(4, 2), _rooted_run(8, 1)]
    for run in rooted_runs:
        here = held_out.layout(run)
        predicted = held_out.rooted_rows(run, directions, rooted_runs)
        assert len(predicted) == 3
        for rr in predicted:
            assert here not in rr.fitted_on and len(rr.fitted_on) == 2
            assert rr.error == pytest.approx(0.0, abs=0.01), (here, rr.row["op"])
            assert rr.from_cluster_s / float(rr.row["median_s"]) - 1 > 0.2, (here, rr.row)
    fitted = wake.fit_rooted_wake(rooted_runs[:2], directions[0].table)
    assert fitted[WAKE].alpha == pytest.approx(ROOTED_WAKE_S, rel=0.01)
    assert fitted[NET] == directions[0].table[NET]  # only the turn is refitted
    # without rooted runs of another layout: the cluster rows' turn, as before
    ((alone, *_),) = [held_out.rooted_rows(rooted_runs[0], directions, rooted_runs[:1])]
    assert alone.fitted_on == () and alone.predicted_s == alone.from_cluster_s
    with pytest.raises(ValueError, match="no entrenar row"):
        wake.fit_rooted_wake([{"rows": []}], BASE)


def test_the_host_aware_barrier_rounds_are_symmetric_as_the_flat_ones() -> None:
    """The host-aware barrier candidate's leaders' rounds: every leader sends and receives
    in each, so on shared cores a round waits k/2 turns, as the flat dissemination's;
    with one rank per host (8 x 1) the candidate *is* the flat barrier and predicts
    its time (it charged k-1 turns a round: 3 x (30 + 3 x 245) us against 3 x (30 +
    2 x 245) us measured-like)."""
    links = rooted.with_frame(_with_wake(ROOTED_WAKE_S), 0.0)
    four = costs.Conditions(ranks_per_core=4.0)
    shape = costs.Shape(8, 1, 0)
    flat = costs.total_time(rooted.barrier_dissemination(shape, costs.ENTRENAR), links, four)
    aware = rooted.barrier_leaders_dissemination(shape, costs.ENTRENAR)
    assert costs.total_time(aware, links, four) == pytest.approx(flat, rel=1e-9)
    tokens = 3 * rooted.TOKEN_BYTES * BASE[NET].beta / 3  # the last round's token, after
    assert flat == pytest.approx(3 * (30e-6 + 2 * ROOTED_WAKE_S) + tokens, rel=1e-9)
    row = {"backend": "entrenar", "op": "barrier", "bytes": 0, "hosts": 8, "local": 1}
    assert rooted_measure.predicted_host_aware_barrier(row, links, "1gbit", 2) == pytest.approx(
        rooted_measure.predicted(row, links, "1gbit", 2), rel=1e-9
    )


DATA = Path(__file__).resolve().parents[1] / "benchmarks/model/data"


def test_held_out_rooted_rows_of_the_15_19_window(capsys: pytest.CaptureFixture[str]) -> None:
    """``held-out`` on the committed runs of the 15:19 window (the previous session's
    quiet pair and rooted runs) and the 8 x 1 rooted run of 16:01: every rooted row of
    2 x 2, 4 x 2 and 8 x 1 is predicted from the other layouts' rooted runs within
    25 % (with the cluster rows' turn, 4 x 2 barrier +27 % and broadcast 4 KiB +31 %,
    docs/benchmarks.md, "The cost model: the last hop after the turns")."""
    w = DATA / "windows/1519"
    argv = ["held-out", f"{w}/cluster-2x2-1gbit.json", f"{w}/cluster-4x2-1gbit.json"]
    argv += ["--rooted", f"{w}/rooted-2x2-1gbit.json", f"{w}/rooted-4x2-1gbit.json"]
    argv += [f"{w}/rooted-8x1-1gbit-1601.json"]
    assert cli.main([*argv, "--links", str(DATA / "quiet/links.json")]) == 0
    out = capsys.readouterr().out
    rooted_part = out[out.index("## measure-rooted") :]
    assert rooted_part.count("(turn fitted on the rooted runs of") == 3
    rows = [line for line in rooted_part.splitlines() if line.startswith(("| barrier", "| bro"))]
    errors = [_percent(r.split("|")[5]) for r in rows]
    old = [_percent(r.split("|")[6]) for r in rows]
    assert len(rows) == 12 and max(abs(e) for e in errors) <= 25, errors
    # the cluster rows' turn, beside it: the 4 x 2 barrier and small broadcasts over
    assert max(old) > 25 and sum(o > 25 for o in old) >= 2, old


def _percent(cell: str) -> int:
    """The signed percentage in a report cell ("+27%" or "2.01 ms (+27%)")."""
    found = re.search(r"([+-]\d+)%", cell)
    assert found, cell
    return int(found.group(1))


def test_median_over_runs_keeps_every_row_at_its_median_over_the_runs() -> None:
    """``held_out.median_over_runs``: three 4 x 2 runs, one whose flat star at 64 KiB
    fell into its slow mode (16 ms against 4.5): the merged run keeps every row once,
    at the median over the runs (4.6 ms), its fastest sample the fastest of any run,
    the load the median (none where a run did not record it); layouts stay apart."""

    def run(start: str, star_s: float, load: float | None) -> dict[str, Any]:
        rows = [
            {"variant": "entrenar-flat", "hosts": 4, "local": 2, "bytes": 64 << 10},
            {"variant": "gloo", "hosts": 4, "local": 2, "bytes": 64 << 10},
        ]
        rows[0].update(median_s=star_s, min_s=star_s * 0.9, background_cores=load)
        rows[1].update(median_s=0.017, min_s=0.01, background_cores=load)
        meta = {**META, "started": start, "background_cores": load}
        return {"meta": meta, "rows": [{**r, "samples_s": [r["median_s"]]} for r in rows]}

    runs = [run("05:38", 4.5e-3, 0.0), run("15:20", 16.1e-3, 0.2), run("12:55", 4.6e-3, 0.1)]
    other = _cluster_run(2, 2)
    merged = held_out.median_over_runs([*runs, other])
    assert [held_out.layout(m) for m in merged] == [(4, 2), (2, 2)]
    star = {r["variant"]: r for r in merged[0]["rows"]}["entrenar-flat"]
    assert len(merged[0]["rows"]) == 2 and star["median_s"] == 4.6e-3
    assert star["min_s"] == pytest.approx(4.5e-3 * 0.9) and star["background_cores"] == 0.1
    assert "samples_s" not in star
    assert merged[0]["meta"]["started"] == "median of 3 runs (05:38, 15:20, 12:55)"
    assert merged[0]["meta"]["background_cores"] == 0.1
    # a run of one: its rows as they were (the fastest sample: the median where none)
    alone = [{**r, "min_s": r["median_s"], "background_cores": None} for r in other["rows"]]
    assert merged[1]["rows"] == alone
    unrecorded = held_out.median_over_runs([runs[0], run("x", 5e-3, None)])[0]
    assert unrecorded["meta"]["background_cores"] is None

"""The cost model (benchmarks/model/): formulas, fitting and the check, without processes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import cluster_load, cluster_report
from benchmarks.model import check, cli, costs, fit, held_out, plan, rooted, rooted_measure, wake
from benchmarks.model.links import (
    GLOO_LOOPBACK,
    GLOO_NET,
    GLOO_WAKE,
    KINDS,
    LOAD,
    NET,
    REDUCE,
    SHM,
    WAKE,
    LinkParams,
    LinkTable,
)
from entrenar_pg.collectives import hierarchical
from entrenar_pg.collectives.common import chunk_bounds
from entrenar_pg.collectives.policy import choose
from entrenar_pg.config import Options
from entrenar_pg.transport.topology import Topology
from entrenar_pg.wire import OpCode

# Made-up but plausible parameters: every kind distinct, so a formula that
# picks the wrong kind changes the answer.
LINKS = LinkTable(
    {
        kind: LinkParams(alpha, beta)
        for kind, alpha, beta in zip(
            KINDS,
            (30e-6, 20e-6, 60e-6, 200e-6, 0.0, 50e-6, 150e-6),
            (0.4e-9, 0.3e-9, 0.8e-9, 8.4e-9, 0.2e-9, 0.6e-9, 8.0e-9),
            strict=True,
        )
    },
    {"rate": "1gbit"},
)
SHAPES = [(1, 2), (1, 8), (2, 1), (2, 2), (4, 2), (16, 8), (1024, 8)]
SIZES = [4 << (2 * i) for i in range(14)]  # 4 B .. 256 MiB


@pytest.mark.parametrize("name", list(costs.ALGORITHMS))
def test_every_algorithm_is_monotone_in_size(name: str) -> None:
    for h, local in SHAPES:
        if h == 1 and local == 1:
            continue
        t = [costs.predict(name, costs.Shape(h, local, s), LINKS) for s in SIZES]
        assert all(b >= a for a, b in zip(t, t[1:], strict=False)), (name, h, local, t)
        assert t[0] > 0


@pytest.mark.parametrize(("h", "local"), [(2, 1), (2, 8), (4, 2), (64, 8), (1024, 8)])
def test_host_link_bytes(h: int, local: int) -> None:
    """Bytes per host link per direction: the host slices 2(H-1)/H x S whatever L and the
    pieces are (the bound); the leaders (H-1) x S, or log2 H x S where the code
    exchanges by recursive doubling (hierarchical.leaders_doubling: here 64 and 1,024
    hosts, from 4 KiB); recursive doubling at every H ceil(log2 H) x S;
    the flat ring 2(N-1)/N x S (one ring edge per host); direct (H-1) x L^2 x S;
    star (H-1) x L x S."""
    for s in (4 << 10, 3 << 20, 64 << 20):  # one piece, one piece, MAX_PIECES pieces
        shape = costs.Shape(h, local, s)
        n = h * local
        for slices in (costs.host_slices, costs.host_slices_one_piece):
            got = costs.host_link_bytes(slices(shape, costs.ENTRENAR), NET)
            assert got == pytest.approx(2 * (h - 1) / h * s), (slices, s)
        leaders = costs.host_link_bytes(costs.host_leaders(shape, costs.ENTRENAR), NET)
        doubles = hierarchical.leaders_doubling(h, s)
        assert doubles == (h >= 64), (h, s)
        assert leaders == pytest.approx((math.log2(h) if doubles else h - 1) * s)
        doubling = costs.host_link_bytes(costs.leaders_doubling(shape, costs.ENTRENAR), NET)
        assert doubling == pytest.approx(math.ceil(math.log2(h)) * s)
        ring = costs.host_link_bytes(costs.ring(shape, costs.ENTRENAR), NET)
        assert ring == pytest.approx(2 * (n - 1) / n * s)
        direct = costs.host_link_bytes(costs.direct(shape, costs.ENTRENAR), NET)
        assert direct == pytest.approx((h - 1) * local**2 * s)
        star = costs.host_link_bytes(costs.star(shape, costs.ENTRENAR), NET)
        assert star == pytest.approx((h - 1) * local * s)  # rank 0's host link; fill moves none


@pytest.mark.parametrize(
    ("s", "count", "pieces"),
    [(1 << 20, 1, 1), (8 << 20, 2, 2), (20 << 20, 5, 9), (1 << 30, hierarchical.MAX_PIECES, 20)],
)
def test_host_slices_run_in_the_codes_pieces(s: int, count: int, pieces: int) -> None:
    """The slices' stages: PIECE_BYTES pieces (at most MAX_PIECES), the first and last cut
    again from 4 pieces (``piece_bounds``), pieces + 2 stages pipelined; every piece's
    cross-host rings pay their 2(H-1) steps again, one piece's rings only once; the local
    passes: L-1 steps of (L-1)/L x piece each, reduce-scatter then all-gather."""
    h, local = 4, 8
    shape = costs.Shape(h, local, s)
    assert hierarchical.piece_count(s, h) == count
    phases = costs.host_slices(shape, costs.ENTRENAR)
    assert len(phases) == pieces + 2
    assert sum(p.messages.get(NET, 0) for p in phases) == pieces * 2 * (h - 1)
    one = costs.host_slices_one_piece(shape, costs.ENTRENAR)
    assert [p.messages.get(NET, 0) for p in one] == [0, 2 * (h - 1), 0]
    local_bytes = sum(p.nbytes.get(SHM, 0) for p in phases)
    assert local_bytes == pytest.approx(2 * (local - 1) / local * s)  # over the byte rings
    assert sum(p.nbytes.get(NET, 0) for p in phases) == pytest.approx(2 * (h - 1) / h * s)
    assert {p.messages[SHM] for p in phases if SHM in p.messages} == {local - 1}
    # the stages overlap local and cross-host work: less than the pieces one after the other
    alone = costs.Shape(h, local, s // count)
    one_by_one = count * costs.total_time(
        costs.host_slices_one_piece(alone, costs.ENTRENAR), LINKS
    )
    if count > 1:
        assert costs.total_time(phases, LINKS) < one_by_one


@pytest.mark.parametrize("numel", [0, 3, 4, 1000, 4096 * 16 + 7, (64 << 20) // 4])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 16])
def test_piece_bounds_cover_the_buffer_with_small_ends(numel: int, count: int) -> None:
    """The host slices' pieces tile [0, numel) in order; below 4 pieces they are
    ``chunk_bounds``'s; from 4 the first and last piece are cut into a quarter, a
    quarter and a half (what the link waits for before the first byte crosses and
    after the last), the pieces between whole."""
    bounds = hierarchical.piece_bounds(numel, count)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
    if count < 4:
        assert bounds == chunk_bounds(numel, count)
        return
    assert len(bounds) == count + 4
    sizes = [b - a for a, b in bounds]
    piece = numel / count
    for got, want in zip(sizes, [0.25, 0.25, 0.5] + [1.0] * (count - 2) + [0.5, 0.25, 0.25]):
        assert abs(got - want * piece) <= 1
def test_host_leaders_phases() -> None:
    """Leaders: (L-1) x S into the leader over the local links, one cross-host message,
    (H-1) x S combined at the leader, (L-1) x S back out; from 8 hosts where the direct
    exchange's bytes cost more than the hops saved, log2 H rounds of recursive doubling."""
    h, local, s = 8, 4, 8 << 10  # 8 KiB at 8 hosts: below the doubling's 10 KiB
    phases = costs.host_leaders(costs.Shape(h, local, s), costs.ENTRENAR)
    assert [p.name for p in phases] == [
        "to leader",
        "leaders' exchange",
        "leaders' combine",
        "from leader",
    ]
    assert phases[0].nbytes[SHM] == phases[3].nbytes[SHM] == (local - 1) * s
    assert phases[1].messages == {NET: 1}
    assert phases[2].nbytes[REDUCE] == (h - 1) * s
    # one rank per host: only the exchange and its combine
    assert len(costs.host_leaders(costs.Shape(h, 1, s), costs.ENTRENAR)) == 2
    doubling = costs.host_leaders(costs.Shape(h, local, 64 << 10), costs.ENTRENAR)
    assert [p.name for p in doubling][1:3] == ["doubling", "doubling combine"]
    assert doubling[1].messages == {NET: 3} and doubling[1].nbytes[NET] == 3 * (64 << 10)


# What a loop of small calls sees through a token bucket: no byte is charged.
BUCKET = LinkTable(
    {**LINKS.params, **{k: LinkParams(LINKS[k].alpha, 0.0) for k in (NET, GLOO_NET)}}, {}
)


def _synthetic_rows(rng: np.random.Generator, noise: float) -> list[dict[str, float | str | int]]:
    """Measurements made from LINKS through the fit's own formulas, with relative noise;
    on the shaped link small sizes pass in the bucket (fit.py)."""
    rows: list[dict[str, float | str | int]] = []
    for variant, m in fit.MEASURES.items():
        for s in [4096 * 4**i for i in range(8)]:
            shape = costs.Shape(m.hosts, m.local, s)
            links = BUCKET if m.shaped and s < fit.ALPHA_BELOW else LINKS
            t = costs.total_time(m.algorithm(shape, m.fabric), links)
            rows.append(
                {
                    "variant": variant,
                    "bytes": s,
                    "median_s": t * (1 + noise * rng.standard_normal()),
                }
            )
    return rows


def test_fit_recovers_alpha_and_beta_from_noisy_synthetic_data() -> None:
    rng = np.random.default_rng(26)
    table = fit.fit(_synthetic_rows(rng, noise=0.02))
    for kind in KINDS:
        want, got = LINKS[kind], table[kind]
        assert got.beta == pytest.approx(want.beta, rel=0.1), kind
        if want.alpha > 0:
            assert got.alpha == pytest.approx(want.alpha, rel=0.1), kind
        else:
            assert got.alpha < 2e-6, kind  # the combine has no per-call cost worth the name
    # noise-free data is recovered exactly
    exact = fit.fit(_synthetic_rows(rng, noise=0.0))
    for kind in KINDS:
        assert exact[kind].beta == pytest.approx(LINKS[kind].beta, rel=1e-6)


def test_check_asks_the_policy_a_run_recorded() -> None:
    """A cluster run's rows are modelled with the policy's defaults of the run that
    made them (meta ``policy_defaults``), and a run without that record with the
    thresholds of before it (``check.POLICY_BEFORE_RECORDED``): 2 x 2 and 4 x 2 at
    64 KiB ran the star and the leaders then, the leaders and the slices today.
    (Before: every committed run was modelled with today's policy.)"""
    today = {f: getattr(Options(), f) for f in ("host_star_max_bytes", "host_leaders_link_bytes")}

    def ran(hosts: int, meta: dict[str, Any]) -> str:
        row = {"variant": "entrenar", "hosts": hosts, "local": 2, "bytes": 64 << 10}
        return check.model_row(row, meta).algorithm

    assert (ran(2, {}), ran(4, {})) == ("star", "host_leaders")
    assert (ran(2, {"policy_defaults": today}), ran(4, {"policy_defaults": today})) == (
        "host_leaders",
        "host_slices",
    )
    old = {"policy_defaults": check.POLICY_BEFORE_RECORDED}
    assert (ran(2, old), ran(4, old)) == ("star", "host_leaders")


def test_check_asks_the_policy_with_the_topology() -> None:
    """What each cluster variant runs for (H, L, size) is the policy's choice given H hosts
    of L ranks: host-aware across hosts (leaders up to host_leaders_max_bytes and the
    direct exchange's host_leaders_link_bytes, slices above), flat with one rank per
    host or topology="flat", shm on one host; the pinned variants keep their algorithm
    at every size. (Before: flat star for 2 x 2 x 64 KiB.)"""
    t = Options().host_leaders_max_bytes

    def algo(variant: str, h: int, local: int, s: int) -> str:
        shape = costs.Shape(h, local, s)
        return check.entrenar_algorithm(shape, "auto", check.options_of(variant))[0]

    assert algo("entrenar", 2, 2, 64 << 10) == "host_leaders"  # the star's extra 64 KiB
    assert algo("entrenar", 2, 2, 16 << 10) == "star"  # two hosts: one hop fewer
    assert algo("entrenar", 2, 2, t) == "host_leaders"
    assert algo("entrenar", 2, 2, t + 1) == "host_slices"
    assert algo("entrenar", 4, 2, 32 << 10) == "host_leaders"  # 3 x 32 KiB on the link
    assert algo("entrenar", 4, 2, t) == "host_slices"  # 3 x 64 KiB: host_leaders_link_bytes
    assert algo("entrenar", 8, 2, t) == "host_leaders"  # the leaders double
    assert algo("entrenar", 1024, 8, 64 << 20) == "host_slices"
    assert algo("entrenar", 4, 1, 64 << 10) == "star"  # one rank per host: flat
    assert algo("entrenar", 2, 1, 64 << 10) == "direct"
    assert algo("entrenar", 1, 4, 64 << 10) == "shm"
    assert algo("entrenar-flat", 2, 2, 64 << 10) == "star"
    assert algo("entrenar-flat", 4, 2, 16 << 20) == "ring"
    assert algo("entrenar-leaders", 4, 2, 64 << 20) == "host_leaders"
    assert algo("entrenar-slices", 4, 2, 4 << 10) == "host_slices"
    # the model's choice equals the policy's asked independently, over a grid
    for h, local in [(2, 2), (2, 8), (4, 2), (64, 8), (1024, 8), (3, 1)]:
        keys = [f"node-{r // local}" for r in range(h * local)]
        topo = Topology.from_keys(keys)
        for s in (4 << 10, t, t + 1, 16 << 20):
            want = choose(OpCode.ALLREDUCE, s, h * local, Options(), False, topo).algo
            assert algo("entrenar", h, local, s) == want.name.lower(), (h, local, s)
    row = {"variant": "entrenar", "hosts": 4, "local": 2, "bytes": 1 << 20, "median_s": 1.0}
    slices = costs.host_slices(costs.Shape(4, 2, 1 << 20), costs.ENTRENAR)
    assert check.predict_row(row, {}, LINKS).predicted_s == costs.total_time(slices, LINKS)
    with pytest.raises(ValueError, match="no model"):
        check.options_of("entrenar-mpi")


def test_check_predicts_the_policy_and_flags_rows_off_by_more_than_25_percent() -> None:
    meta = {"rate": "1gbit"}  # shaped: tbf's burst is not charged (no machine: a core per rank)

    def predicted(variant: str, h: int, local: int, s: int) -> float:
        row = {"variant": variant, "hosts": h, "local": local, "bytes": s, "median_s": 1.0}
        return check.predict_row(row, meta, LINKS).predicted_s

    small, large = 64 << 10, 16 << 20
    burst = costs.Conditions(free_net_bytes=check.TBF_BURST_BYTES)
    star = costs.star(costs.Shape(2, 2, small), costs.ENTRENAR)
    assert predicted("entrenar-flat", 2, 2, small) == costs.total_time(star, LINKS, burst)
    t_gloo = costs.total_time(costs.ring(costs.Shape(4, 2, large), costs.GLOO), LINKS, burst)
    assert predicted("gloo", 4, 2, large) == t_gloo

    rows = [
        ("entrenar-flat", 2, 2, small, 1.10),  # measured 10 % above the prediction: fine
        ("gloo", 4, 2, large, 0.70),  # predicted 43 % above: flagged
        ("entrenar", 4, 2, large, 1.40),  # predicted 29 % below: flagged
        ("gloo", 2, 2, small, 0.82),  # predicted 22 % above: fine
    ]
    measured_rows: list[dict[str, Any]] = [
        {
            "variant": v,
            "hosts": h,
            "local": local,
            "bytes": s,
            "median_s": f * predicted(v, h, local, s),
        }
        for v, h, local, s, f in rows
    ]
    measured_rows[0]["xhost_bytes_per_host"] = 2 * small  # what a 2 x 2 star moves through host 0
    run = {"meta": meta, "rows": measured_rows}
    checked = check.check([run], LINKS)
    assert [c.flagged for c in checked] == [False, True, True, False]
    assert checked[0].link_bytes == checked[0].measured_link_bytes == 2 * small
    assert checked[1].measured_link_bytes is None
    assert checked[1].link_bytes == pytest.approx(2 * 7 / 8 * large)  # gloo's ring, N = 8
    assert checked[1].error == pytest.approx(1 / 0.7 - 1)
    assert "2 flagged" in check.report(checked)
    with pytest.raises(ValueError, match="no model"):
        check.predict_row(
            {"variant": "mpi", "hosts": 2, "local": 1, "bytes": 4, "median_s": 1}, {}, LINKS
        )


def test_plan_crossovers_are_where_the_fastest_changes() -> None:
    """Each crossover found by bisection separates two sizes 1 % apart whose fastest differ."""
    names = ["direct", "star", "ring", "host slices", "host leaders", "leaders doubling"]
    found = 0
    for h, local in [(2, 2), (4, 8), (64, 1), (1024, 8)]:
        for c in plan.crossovers(h, local, LINKS, names):
            found += 1
            assert plan.best(h, local, int(c.nbytes * 0.99), LINKS, names) == c.before
            assert plan.best(h, local, int(c.nbytes * 1.01), LINKS, names) == c.after != c.before
    assert found >= 4


def test_leaders_to_slices_crossover_falls_then_rises_with_the_doubling() -> None:
    """Up to 4 hosts the leaders exchange directly, (H-1) x S per host link, so the
    crossover to the slices falls from 2 to 4 hosts; from 8 hosts they double
    (log2 H x S, log2 H hops) while the slices' steps grow as 2(H-1): it rises with H,
    past 1 MiB at 256 hosts."""
    for local in (2, 8):
        xs = [plan.leaders_to_slices(h, local, LINKS) for h in plan.HOSTS]
        assert all(x is not None for x in xs), xs
        got = dict(zip(plan.HOSTS, [x or 0 for x in xs], strict=True))
        assert got[4] < got[2] and got[4] < got[8], (local, got)
        rising = [got[h] for h in plan.HOSTS if h >= 8]
        assert all(b > a for a, b in zip(rising, rising[1:], strict=False)), (local, got)
        assert got[256] > 1 << 20, (local, got)
    lines = plan.threshold_lines(LINKS)
    assert "host_leaders_max_bytes = 64 KiB" in lines[0]


def test_scale_table_is_the_policy_against_the_flat_ring() -> None:
    table = plan.scale_table(LINKS).splitlines()
    assert len(table) == 2 + len(plan.SCALE_HOSTS) * len(plan.SCALE_SIZES)
    first = table[2].split(" | ")
    assert first[0] == "| 8 x 8" and first[2] == "host_leaders"
    last = table[-1].split(" | ")
    assert last[0] == "| 1024 x 8" and last[2] == "host_slices"
    assert float(last[-1].rstrip(" |")) == pytest.approx(1.0)  # the slices: at the bound


def test_predict_command_names_the_policys_pick(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["predict", "--hosts", "4", "--local", "2", "--sizes", "4K,1M"]) == 0
    out = capsys.readouterr().out
    assert "4096 B: the policy picks star" in out  # 4 x 2: the star row (policy.star_beats_leaders)
    assert "1048576 B: the policy picks host_slices" in out
    assert "leaders doubling (proposal)" in out


def test_the_slices_pieces_fall_with_the_hosts() -> None:
    """Up to 4 hosts MAX_PIECES pieces of PIECE_BYTES; then 4 x MAX_PIECES / H, one
    from 64 hosts: each piece pays the cross-host rings' 2(H-1) steps again."""
    big = 1 << 30
    counts = [hierarchical.piece_count(big, h) for h in (2, 4, 8, 16, 32, 64, 1024)]
    assert counts == [16, 16, 8, 4, 2, 1, 1]
    assert hierarchical.piece_count(hierarchical.PIECE_BYTES - 1, 2) == 1
    assert hierarchical.piece_count(3 * hierarchical.PIECE_BYTES, 8) == 3
    # With them the model's slices are never slower than the flat ring at scale
    # (with 16 pieces at every H: 1.12x at 64 x 8 and 1.71x at 1,024 x 8, 64 MiB).
    for h in (64, 1024):
        shape = costs.Shape(h, 8, 64 << 20)
        slices = costs.total_time(costs.host_slices(shape, costs.ENTRENAR), LINKS)
        ring = costs.total_time(costs.ring(shape, costs.ENTRENAR), LINKS)
        assert slices <= ring, (h, slices, ring)


def test_conditions_charge_wake_ups_per_hop_and_leave_the_burst_free() -> None:
    """costs.Conditions: each rank past the first on a core makes every hop in sequence
    wait WAKE's alpha (none on dedicated cores), overlapped with the phase's bytes; tbf's
    burst is taken off the host-link bytes of the first phases, once per call, but a
    loop of calls never beats the link's rate; the check reads both from a run's meta."""
    wake = LinkTable({**LINKS.params, WAKE: LinkParams(400e-6, 0.0)}, {})
    shape = costs.Shape(4, 2, 4 << 10)
    ring = costs.ring(shape, costs.ENTRENAR)
    assert costs.hops(ring) == 2 * (8 - 1)
    base = costs.total_time(ring, wake)
    assert costs.total_time(ring, LINKS) == base  # dedicated cores: no wake-up term
    four = costs.Conditions(ranks_per_core=4.0)
    alphas = 14 * LINKS[NET].alpha  # the ring's 14 hops pay the slowest kind's alpha
    # a ring step is a symmetric round: k/2 = 2 turns of WAKE per hop at 4 ranks per core,
    # and the last step's bytes (7,168 B x 8.4 ns over 14 steps) after the turns
    last_step = 7168 * LINKS[NET].beta / 14
    want = alphas + 14 * 2 * 400e-6 + last_step
    assert costs.total_time(ring, wake, four) == pytest.approx(want, rel=1e-9)
    assert costs.total_time(ring, LINKS, four) == base  # no WAKE fitted: nothing added
    slices = costs.host_slices(costs.Shape(2, 2, 4 << 20), costs.ENTRENAR)
    per_plan = [max(p.messages.values()) for p in slices]
    assert costs.hops(slices) == sum(per_plan) and len(per_plan) == len(slices)
    # The burst: a star's 2 x 64 KiB through host 0's link is free, but the bucket
    # refills at the rate: the call takes the bytes' time at the rate.
    small = costs.star(costs.Shape(2, 2, 64 << 10), costs.ENTRENAR)
    free = costs.Conditions(free_net_bytes=128 << 10)
    uncharged = [costs.Phase(p.name, p.messages, {**p.nbytes, NET: 0.0}, p.fill) for p in small]
    at_rate = 2 * (64 << 10) * LINKS[NET].beta
    assert costs.total_time(uncharged, LINKS) < at_rate
    assert costs.total_time(small, LINKS, free) == at_rate
    big = costs.star(costs.Shape(2, 2, 1 << 20), costs.ENTRENAR)  # 2 MiB: the burst pays
    saved = costs.total_time(big, LINKS) - costs.total_time(big, LINKS, free)
    assert saved == pytest.approx((128 << 10) * LINKS[NET].beta * (1 + big[0].fill))
    meta = {"rate": "1gbit", "machine": {"nproc": 2}}
    assert check.conditions_of(meta, shape) == costs.Conditions(4.0, check.TBF_BURST_BYTES)
    assert check.conditions_of({}, shape) == costs.DEDICATED


# Hand-sized parameters for the small-message formulas: round numbers to compute by hand.
HAND = LinkTable(
    {
        SHM: LinkParams(20e-6, 0.1e-9),
        NET: LinkParams(30e-6, 8e-9),
        REDUCE: LinkParams(0.0, 0.02e-9),
        GLOO_LOOPBACK: LinkParams(50e-6, 0.6e-9),
        GLOO_NET: LinkParams(150e-6, 8e-9),
        WAKE: LinkParams(250e-6, 0.0),
        GLOO_WAKE: LinkParams(700e-6, 0.0),
    },
    {},
)


def test_small_star_on_a_shaped_link_is_its_bytes_at_the_rate_or_its_waits() -> None:
    """The star at 2 x 2 (2 ranks per core, tbf's 128 KiB burst), by hand.

    64 KiB: host 0's link carries 2 x 64 KiB = 128 KiB each way, all in the burst;
    alphas 2 x 30 us, waits 2 hops x 1 extra rank x 250 us = 500 us, overlapping the
    local bytes (64 KiB x 0.1 ns x 2: the fill); the loop's rate, 131,072 B x 8 ns =
    1.048576 ms, binds. (The old formula: 60 + 13.1 + 500 = 573.1 us.)
    4 KiB: the rate's 65.5 us does not bind: 60 us + max(0.82 us, 500 us + the last
    of the 2 hops' bytes, 0.41 us) = 560.41 us (an older formula added all the
    bytes: 560.82 us; the one before this, none: 560 us)."""
    two = costs.Conditions(ranks_per_core=2.0, free_net_bytes=128 << 10)
    star64 = costs.star(costs.Shape(2, 2, 64 << 10), costs.ENTRENAR)
    assert costs.total_time(star64, HAND, two) == pytest.approx(1.048576e-3, rel=1e-9)
    star4 = costs.star(costs.Shape(2, 2, 4 << 10), costs.ENTRENAR)
    assert costs.total_time(star4, HAND, two) == pytest.approx(560.41e-6, rel=1e-4)
    # dedicated cores, no burst: unchanged alpha + beta (60 us + 2 x 131,072 B x 8 ns)
    assert costs.total_time(star64, HAND) == pytest.approx(60e-6 + 2 * 1.048576e-3, rel=1e-9)


def test_gloo_waits_one_wake_up_per_hop_entrenar_one_per_rank_on_the_core() -> None:
    """gloo blocks (GLOO_WAKE per hop, whatever the ranks per core, after its own
    message arrived: the wait overlaps only the other segment in flight), entrenar
    spins (WAKE per turn of the others on the core: k/2 turns in a ring step). The
    ring at 4 KiB, no burst, by hand:
    gloo 4 x 2: 14 hops x 150 us + max(7,168 B x 8 ns, 14 x 700 us + 57.3 us / 2)
    = 11.92867 ms; gloo 2 x 2: 6 x 150 us + max(6,144 B x 8 ns, 6 x 700 us +
    49.2 us / 2) = 5.124576 ms; entrenar 4 x 2: 14 x 30 us + max(57.3 us, 14 x 2 x
    250 us + the last step's 57.3 us / 14) = 7.424096 ms (the old formula: 11.9, 5.1
    and 10.92 ms)."""
    shape42, shape22 = costs.Shape(4, 2, 4 << 10), costs.Shape(2, 2, 4 << 10)
    four, two = costs.Conditions(ranks_per_core=4.0), costs.Conditions(ranks_per_core=2.0)
    gloo42 = costs.total_time(costs.ring(shape42, costs.GLOO), HAND, four, costs.GLOO)
    gloo22 = costs.total_time(costs.ring(shape22, costs.GLOO), HAND, two, costs.GLOO)
    ours42 = costs.total_time(costs.ring(shape42, costs.ENTRENAR), HAND, four)
    assert gloo42 == pytest.approx(2.1e-3 + 9.8e-3 + 7168 * 8e-9 / 2, rel=1e-9)
    assert gloo22 == pytest.approx(0.9e-3 + 4.2e-3 + 6144 * 8e-9 / 2, rel=1e-9)
    assert ours42 == pytest.approx(7.42e-3 + 7168 * 8e-9 / 14, rel=1e-9)
    assert costs.hop_wait(HAND, costs.DEDICATED, costs.GLOO) == 0.0  # a core per rank
    # the check waits as the row's implementation does
    row = {"variant": "gloo", "hosts": 4, "local": 2, "bytes": 4 << 10, "median_s": 1.0}
    meta = {"machine": {"nproc": 2}}
    assert check.predict_row(row, meta, HAND).predicted_s == pytest.approx(gloo42)


def test_a_rooted_hop_waits_k_minus_1_turns_a_symmetric_round_k_over_2() -> None:
    """costs.hop_wait: a spinning rank's hop waits WAKE per turn of the others on its
    core. The star's root (one rank acts for all, having just yielded) queues behind
    k-1; in a ring step or dissemination round every rank on the core receives, and
    its place in the line is uniform: k/2 (the old formula charged k-1 for both). At
    2 per core both are 1; gloo (blocking) pays one wake-up per hop either way. By
    hand with HAND (WAKE 250 us, net alpha 30 us), 4 KiB, no burst:
    the dissemination barrier at 4 x 2: 3 rounds x (30 us + 2 x 250 us) = 1.59 ms (the
    quiet run measured 1.59 ms; the old formula 3 x 780 us = 2.34 ms); at 2 x 2:
    2 x (30 + 250) us = 0.56 ms; the star at 4 x 2 stays 2 x (30 + 3 x 250) us (each
    plus the last hop's bytes, which its turns cannot overlap: ``costs.Phase.time``)."""
    four, two = costs.Conditions(ranks_per_core=4.0), costs.Conditions(ranks_per_core=2.0)
    assert costs.hop_wait(HAND, four, costs.ENTRENAR, symmetric=True) == pytest.approx(500e-6)
    assert costs.hop_wait(HAND, four, costs.ENTRENAR) == pytest.approx(750e-6)
    assert costs.hop_wait(HAND, two, costs.ENTRENAR, symmetric=True) == pytest.approx(250e-6)
    assert costs.hop_wait(HAND, two, costs.ENTRENAR) == pytest.approx(250e-6)
    assert costs.hop_wait(HAND, four, costs.GLOO, symmetric=True) == pytest.approx(700e-6)
    links = rooted.with_frame(HAND, 0.0)
    shape42, shape22 = costs.Shape(4, 2, 0), costs.Shape(2, 2, 0)
    barrier42 = rooted.barrier_dissemination(shape42, costs.ENTRENAR)
    barrier22 = rooted.barrier_dissemination(shape22, costs.ENTRENAR)
    # (+ the last round's token bytes: 5 tokens of 33 B over 3 rounds at 8 ns)
    tokens = 5 * rooted.TOKEN_BYTES * 8e-9 / 3
    assert costs.total_time(barrier42, links, four) == pytest.approx(3 * 530e-6 + tokens)
    tokens22 = 3 * rooted.TOKEN_BYTES * 8e-9 / 2  # 3 tokens over 2 rounds
    assert costs.total_time(barrier22, links, two) == pytest.approx(2 * 280e-6 + tokens22)
    star = costs.star(costs.Shape(4, 2, 4 << 10), costs.ENTRENAR)
    # + the last hop's bytes after the turns: host 0's 6 x 4 KiB at 8 ns, x 2 (the fill)
    # over the star's 2 hops
    last_hop = 6 * 4096 * 8e-9 * 2 / 2
    assert costs.total_time(star, HAND, four) == pytest.approx(2 * 780e-6 + last_hop, rel=1e-3)
    for name in ("ring", "doubling", "direct", "host slices"):
        phases = costs.ALGORITHMS[name][0](costs.Shape(4, 2, 4 << 10), costs.ENTRENAR)
        assert all(p.symmetric for p in phases if p.messages), name
    for name in ("star", "host leaders"):
        phases = costs.ALGORITHMS[name][0](costs.Shape(4, 2, 4 << 10), costs.ENTRENAR)
        assert not any(p.symmetric for p in phases), name


def test_a_blocking_wait_starts_when_its_own_segment_has_arrived() -> None:
    """gloo sleeps until its segment is in and only then waits to be woken; its ring
    keeps two segments in flight (gloo/allreduce.cc), so a wait overlaps the other
    one's bytes, not its own. gloo's ring at 4 x 2, 1 MiB, 4 per core, by hand
    (HAND: gloo-net 150 us, 8 ns/B; GLOO_WAKE 700 us): bytes 1.75 MiB x 8 ns =
    14.68 ms; waits 14 x 700 us = 9.8 ms; 14 x 150 us + max(14.68, 9.8 + 14.68 / 2)
    = 19.24 ms (the old formula overlapped the wait with all the bytes: 16.78 ms;
    measured quiet: 27.6 ms median, 16.3 ms fastest). entrenar spins and takes its
    turns while the bytes fly: the same phases under ENTRENAR's waits overlap all."""
    shape = costs.Shape(4, 2, 1 << 20)
    four = costs.Conditions(ranks_per_core=4.0)
    bw = 2 * 7 / 8 * (1 << 20) * 8e-9
    gloo = costs.total_time(costs.ring(shape, costs.GLOO), HAND, four, costs.GLOO)
    assert gloo == pytest.approx(14 * 150e-6 + 9.8e-3 + bw / 2, rel=1e-9)
    assert gloo > 14 * 150e-6 + max(bw, 9.8e-3) * 1.1
    phase = costs.ring(shape, costs.GLOO)[0]
    assert phase.in_flight == costs.RING_IN_FLIGHT == 2
    assert phase.time(HAND, 9.8e-3) == pytest.approx(14 * 150e-6 + bw)  # spinning: overlaps
    assert phase.time(HAND, 0.0, blocking=True) == phase.time(HAND)  # no wait: alpha-beta


def test_fit_wake_follows_the_rows_that_agree_not_one_in_the_other_mode() -> None:
    """Small medians here are bimodal (a fast mode where the woken thread's core is
    idle): the quiet 2 x 2 run read gloo's 256 KiB at 3.72 ms and its 4 and 64 KiB at
    7.6-7.9 ms. wake.fit_wake fits the absolute log ratio, so one row of three in the
    fast mode (here 2.5x faster) leaves GLOO_WAKE where the other two put it; the
    squared relative error (the old fit) followed the fast row to ~360 us."""
    truth = LinkTable({**LINKS.params, GLOO_WAKE: LinkParams(900e-6, 0.0)}, {})
    meta = {"rate": "1gbit", "machine": {"nproc": 2}}
    rows = []
    for s, mode in ((4 << 10, 1.0), (64 << 10, 1.0), (256 << 10, 1 / 2.5)):
        row = {"variant": "gloo", "hosts": 2, "local": 2, "bytes": s, "median_s": 1.0}
        rows.append({**row, "median_s": check.predict_row(row, meta, truth).predicted_s * mode})
    fitted = wake.fit_wake([{"meta": meta, "rows": rows}], LINKS)
    assert fitted[GLOO_WAKE].alpha == pytest.approx(900e-6, rel=0.02)


def test_fit_wake_recovers_both_wake_up_alphas_from_cluster_rows() -> None:
    """wake.fit_wake: rows below 1 MiB made by the model with known WAKE and GLOO_WAKE (and
    3 % noise) give them back, each from its own rows; rows from 1 MiB and rows with a
    core per rank are not used."""
    rng = np.random.default_rng(26)
    truth = {WAKE: LinkParams(240e-6, 0.0), GLOO_WAKE: LinkParams(800e-6, 0.0)}
    want = LinkTable({**LINKS.params, **truth}, {})
    meta = {"rate": "1gbit", "machine": {"nproc": 2}}
    rows = []
    for variant in ("gloo", "entrenar-flat", "entrenar-leaders", "entrenar-slices"):
        for h, local in ((2, 2), (4, 2)):
            for s in (4 << 10, 64 << 10, 256 << 10, 16 << 20):
                row = {"variant": variant, "hosts": h, "local": local, "bytes": s}
                model = check.predict_row({**row, "median_s": 1.0}, meta, want).predicted_s
                noisy = model * (1 + 0.03 * rng.standard_normal())
                # rows from 1 MiB are off by 10x: a fit that used them would miss
                rows.append({**row, "median_s": noisy * (10 if s >= 1 << 20 else 1)})
    fitted = wake.fit_wake([{"meta": meta, "rows": rows}], LINKS)
    assert fitted[WAKE].alpha == pytest.approx(240e-6, rel=0.05)
    assert fitted[GLOO_WAKE].alpha == pytest.approx(800e-6, rel=0.05)
    assert fitted.meta["wake_rows"] == {WAKE: 3 * 2 * 3, GLOO_WAKE: 2 * 3, LOAD: 0}
    assert LOAD not in fitted.params  # no loaded row: the load term stays off
    with pytest.raises(ValueError, match="no row below 1 MiB"):
        wake.fit_wake([{"meta": {}, "rows": rows}], LINKS)  # a core per rank: nothing to fit


ROOTED_SHAPES = [(2, 2), (4, 2), (8, 8), (64, 8), (1024, 8)]


@pytest.mark.parametrize(("h", "local"), ROOTED_SHAPES)
def test_broadcast_cross_host_bytes(h: int, local: int) -> None:
    """Per host link per direction, the data alone: the flat direct (N-L) x S (the root
    to every rank elsewhere), the chain and the leaders' chain S (one crossing per host
    boundary), the root to the leaders (H-1) x S, the leaders' tree ceil(log2 H) x S;
    the header confirmation adds L x (N-L) 32-byte frames to each."""
    n = h * local
    for s in (4 << 10, 1 << 20, 64 << 20):
        shape = costs.Shape(h, local, s)
        assert _link(rooted.broadcast_direct, shape) == (n - local) * s
        assert _link(rooted.broadcast_hosts_direct, shape) == (h - 1) * s
        assert _link(rooted.broadcast_chain, shape) == s
        assert _link(rooted.broadcast_hosts_chain, shape) == s
        assert _link(rooted.broadcast_hosts_tree, shape) == math.ceil(math.log2(h)) * s
        confirm = local * (n - local) * rooted.HEADER_BYTES
        assert _link(rooted.broadcast_direct, shape, True) == (n - local) * s + confirm
        # the chain confirms through the rounds: min(d, L) tokens per round of step d
        rounds = [1 << k for k in range(math.ceil(math.log2(n)))]
        tokens = sum(min(d, local) for d in rounds) * rooted.TOKEN_BYTES
        assert _link(rooted.broadcast_chain, shape, True) == s + tokens


def _link(algo: rooted.Rooted, shape: costs.Shape, confirm: bool = False) -> float:
    return rooted.cross_host_bytes(algo(shape, costs.ENTRENAR, confirm), NET)


@pytest.mark.parametrize(("h", "local"), ROOTED_SHAPES)
def test_barrier_and_broadcast_hops_and_frames(h: int, local: int) -> None:
    """Hops in sequence and the busiest rank's frames: the flat barrier 2 hops and
    2(N-1) frames at rank 0; the leaders' star 4 hops, at most 2(H-1) frames in one
    phase; the dissemination 2 + ceil(log2 H) hops; the flat chain N-1 hops, the
    leaders' chain H (H-1 across, 1 inside)."""
    n, e = h * local, costs.ENTRENAR
    rounds = math.ceil(math.log2(h))
    star = rooted.barrier_star(costs.Shape(h, local, 0), e)
    assert costs.hops(star) == 2 and star[0].nbytes[rooted.FRAME] == 2 * (n - 1)
    leaders = rooted.barrier_leaders_star(costs.Shape(h, local, 0), e)
    assert costs.hops(leaders) == 4
    assert max(p.nbytes[rooted.FRAME] for p in leaders) == max(2 * (h - 1), local - 1)
    dissemination = rooted.barrier_leaders_dissemination(costs.Shape(h, local, 0), e)
    assert costs.hops(dissemination) == 2 + rounds
    shape = costs.Shape(h, local, 64 << 20)
    chain = rooted.broadcast_chain(shape, e)
    assert costs.hops(chain) == n - 1
    assert [p.messages for p in chain[:2]] == [{NET: h - 1}, {SHM: n - h}]
    assert costs.hops(rooted.broadcast_hosts_chain(shape, e)) == h
    assert costs.hops(rooted.broadcast_hosts_tree(shape, e)) == rounds + 1
    # one rank per host: the candidates have no in-host phase
    alone = costs.Shape(h, 1, 4 << 10)
    assert costs.hops(rooted.barrier_leaders_star(alone, e)) == 2
    assert costs.hops(rooted.broadcast_hosts_direct(alone, e)) == 1


@pytest.mark.parametrize("s", [0, 4 << 10, 1 << 20, (1 << 20) + 1, 64 << 20])
def test_flat_broadcast_is_what_the_policy_picks(s: int) -> None:
    for h, local in ROOTED_SHAPES:
        shape = costs.Shape(h, local, s)
        algo = choose(OpCode.BROADCAST, s, shape.world, Options()).algo
        want = {
            "DISSEMINATION": rooted.broadcast_dissemination,
            "DIRECT": rooted.broadcast_direct,
            "CHAIN": rooted.broadcast_chain,
        }[algo.name]
        assert rooted.broadcast_flat(shape, costs.ENTRENAR) == want(shape, costs.ENTRENAR)


def test_rooted_times_grow_with_size_and_frames() -> None:
    """Every algorithm alone (not the policy's pick: at 8 x 8 its direct 1 MiB is
    predicted slower than its chain of 4 MiB, see docs/benchmarks.md)."""
    algos = [*rooted.RETUNED["broadcast"], *rooted.CANDIDATES["broadcast"].values()]
    for frame in (0.0, 30e-6):
        links = rooted.with_frame(LINKS, frame)
        for h, local in ROOTED_SHAPES:
            for algo in algos:
                t = [
                    costs.total_time(algo(costs.Shape(h, local, s), costs.ENTRENAR), links)
                    for s in SIZES
                ]
                assert all(b >= a for a, b in zip(t, t[1:], strict=False)), (algo, h, local)
    shape = costs.Shape(64, 8, 0)
    slow = rooted.compare("barrier", shape, costs.ENTRENAR, rooted.with_frame(LINKS, 30e-6))
    fast = rooted.compare("barrier", shape, costs.ENTRENAR, rooted.with_frame(LINKS, 0.0))
    # The dissemination barrier: 9 rounds at the slower alpha, then a rank's 2 x 9
    # frames; the star it replaced: 2 hops, then rank 0's 2(N-1) frames.
    rounds = 9
    assert slow.flat_s == pytest.approx(rounds * LINKS[NET].alpha + 2 * rounds * 30e-6)
    assert rounds * LINKS[NET].alpha <= fast.flat_s < slow.flat_s
    star = rooted.barrier_star(shape, costs.ENTRENAR)
    star_s = costs.total_time(star, rooted.with_frame(LINKS, 30e-6))
    assert star_s == pytest.approx(2 * LINKS[NET].alpha + 2 * (64 * 8 - 1) * 30e-6)
    assert slow.flat_s < star_s


def test_compare_finds_where_host_aware_pays() -> None:
    """Few hosts, no frame cost: the barrier's local hops pay only where they are cheaper
    than a cross-host one (the leaders' 1 cross-host round at 2 hosts against the star's
    2); where every hop costs the same (the fitted table, where each is a wake-up) its 2
    extra hops lose. The flat direct broadcast of 1 MiB through the root's link loses to
    the root sending one copy per host; 64 MiB on 2 x 2: the chain crosses each host
    boundary once already (1.0)."""
    links = rooted.with_frame(LINKS, 0.0)
    e = costs.ENTRENAR
    barrier = rooted.compare("barrier", costs.Shape(2, 2, 0), e, links)
    assert barrier.ratio < 1 and barrier.candidate == "leaders dissemination"
    even = LinkTable({**links.params, SHM: LinkParams(LINKS[NET].alpha, LINKS[SHM].beta)}, {})
    assert rooted.compare("barrier", costs.Shape(2, 2, 0), e, even).ratio > 1
    mib = rooted.compare("broadcast", costs.Shape(4, 2, 1 << 20), e, links)
    assert mib.ratio < 0.5 and mib.retuned_ratio < 1
    big = rooted.compare("broadcast", costs.Shape(2, 2, 64 << 20), e, links)
    assert big.ratio == pytest.approx(1.0, abs=0.02)
    lines = rooted.crossover_lines("broadcast", links, e)
    assert len(lines) == len(rooted.PLAN_HOSTS) * len(rooted.PLAN_LOCALS)
    assert lines[0].startswith("- 2 x 2: host-aware at ") and "1 MiB" in lines[0]


def test_rooted_command_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["rooted"]) == 0
    out = capsys.readouterr().out
    for shape in ("| 2 x 2 |", "| 1024 x 8 |"):
        assert out.count(shape) == 3  # barrier, broadcast, broadcast confirming on its links
    assert "barrier, where host-aware pays (frame 5 µs)" in out
    assert "| H x L (frame 0 µs / 5 µs / 20 µs) |" in out


def test_measure_rooted_takes_the_last_arrival_and_the_cpu_per_rank() -> None:
    """A call's time is the last rank's end minus the last rank's start, and its CPU
    the mean over ranks; each is the median over rounds. The report puts the CPU
    per rank beside gloo's, and rows measured before the CPU was recorded say so."""
    per_rank = [
        [[0.0, 3.0, 0.2], [10.0, 11.0, 0.4], [20.0, 25.0, 0.6]],  # rank 0
        [[1.0, 2.0, 0.4], [10.5, 12.0, 0.2], [21.0, 22.0, 0.2]],  # rank 1
    ]
    got = rooted_measure.call_stats(per_rank)
    # the rounds' calls: 3 - 1, 12 - 10.5, 25 - 21; CPU per rank: 0.3, 0.3, 0.4
    assert got == pytest.approx(
        {"median_s": 2.0, "min_s": 1.5, "cpu_s": 0.3, "calls_s": [2.0, 1.5, 4.0]}
    )
    rows = [
        {"backend": b, "op": "barrier", "bytes": 0, "hosts": 2, "local": 2, **stats}
        for b, stats in (
            ("entrenar", {"median_s": 1e-3, "min_s": 1e-3, "cpu_s": 300e-6}),
            ("gloo", {"median_s": 2e-3, "min_s": 2e-3, "cpu_s": 150e-6}),
        )
    ]
    line = next(
        x for x in rooted_measure.report(rows, LINKS, "1gbit", 2).splitlines() if "2 x 2" in x
    )
    assert "| 0.50 | 300 / 150 µs |" in line
    del rows[1]["cpu_s"]
    line = next(
        x for x in rooted_measure.report(rows, LINKS, "1gbit", 2).splitlines() if "2 x 2" in x
    )
    assert "| 0.50 | - |" in line


def test_measure_rooted_report_sets_each_row_beside_gloo_and_the_model() -> None:
    """The report of measured rows (no processes): entrenar / gloo per op, and the
    prediction of the flat algorithm under the emulated run's conditions (ranks per
    core, tbf's burst), as ``check`` would set them."""
    rows = [
        {
            "backend": b,
            "op": op,
            "bytes": s,
            "hosts": 2,
            "local": 2,
            "median_s": t * scale,
            "min_s": t * scale,
        }
        for b, scale in (("entrenar", 1.0), ("gloo", 2.0))
        for op, s, t in (("barrier", 0, 1e-3), ("broadcast", 1 << 20, 20e-3))
    ]
    out = rooted_measure.report(rows, LINKS, "1gbit", cores=2)
    lines = [x for x in out.splitlines() if x.startswith("| 2 x 2 |")]
    assert len(lines) == 2 and all("| 0.50 |" in x for x in lines)  # entrenar half gloo's
    shape = costs.Shape(2, 2, 1 << 20)
    where = check.conditions_of({"rate": "1gbit", "machine": {"nproc": 2}}, shape)
    assert where.ranks_per_core == 2 and where.free_net_bytes > 0 and where.back_to_back
    links = rooted.with_frame(LINKS, rooted.ASSUMED_FRAME_S)
    # what the run ran: a row that recorded no algorithm is from before 3127f08, when
    # the policy with the hosts' topology sent 1 MiB down the chain on slow hosts (today:
    # the dissemination rounds; the one-host rule would send it direct), each call timed
    # alone after a control barrier: tbf's bucket full, no loop-rate bound
    ran = rooted.broadcast_chain(shape, costs.ENTRENAR, True)
    today = rooted.broadcast_flat(shape, costs.ENTRENAR, True, check.topology_of(shape))
    assert today == rooted.broadcast_dissemination(shape, costs.ENTRENAR)
    assert ran != rooted.broadcast_flat(shape, costs.ENTRENAR, True)
    alone = costs.Conditions(where.ranks_per_core, where.free_net_bytes, back_to_back=False)
    want = costs.total_time(ran, links, alone)
    got = rooted_measure.predicted(rows[1], links, "1gbit", 2)
    dedicated = costs.total_time(ran, links)
    assert got == pytest.approx(want)
    # LINKS has no wake kind: the conditions take only tbf's burst off the chain's link
    assert want == pytest.approx(dedicated - check.TBF_BURST_BYTES * LINKS[NET].beta)
    # in a loop the rate binds where the burst would save: the direct broadcast's 2 MiB
    direct = rooted.broadcast_direct(shape, costs.ENTRENAR)
    assert costs.total_time(direct, links, alone) < costs.total_time(direct, links, where)
    # 256 KiB on 2 x 2 slow hosts: the dissemination rounds, as the policy runs them
    rounds = costs.Shape(2, 2, 256 << 10)
    topo = check.topology_of(rounds)
    assert rooted.broadcast_flat(rounds, costs.ENTRENAR, True, topo) == (
        rooted.broadcast_dissemination(rounds, costs.ENTRENAR)
    )
    assert check.duration(want) in lines[1]


def test_held_out_fits_each_layout_and_checks_only_the_other() -> None:
    """held_out: rows made by the model at 2 x 2 with WAKE 200 us and at 4 x 2 with WAKE
    300 us (GLOO_WAKE 800 / 600 us): each direction's table carries the alphas of the
    run it was fitted on, and its check holds only the other layout's rows (so the
    4 x 2 rows, checked with the 2 x 2 fit, come out low). A rooted run is predicted
    with the other layout's table; a run of two layouts is refused."""
    meta = {"rate": "1gbit", "machine": {"nproc": 2}}
    runs = []
    for (h, local), w, g in (((2, 2), 200e-6, 800e-6), ((4, 2), 300e-6, 600e-6)):
        truth = LinkTable({**LINKS.params, WAKE: LinkParams(w, 0), GLOO_WAKE: LinkParams(g, 0)}, {})
        rows = []
        for variant in ("gloo", "entrenar-flat", "entrenar"):
            for s in (4 << 10, 64 << 10, 256 << 10, 16 << 20):
                row = {"variant": variant, "hosts": h, "local": local, "bytes": s, "median_s": 1}
                rows.append({**row, "median_s": check.predict_row(row, meta, truth).predicted_s})
        runs.append({"meta": meta, "rows": rows})
    first, second = held_out.held_out(runs, LINKS)
    assert first.fitted_on == (2, 2) and second.fitted_on == (4, 2)
    assert first.table[WAKE].alpha == pytest.approx(200e-6, rel=0.02)
    assert second.table[GLOO_WAKE].alpha == pytest.approx(600e-6, rel=0.02)
    assert {(c.hosts, c.local) for c in first.checked} == {(4, 2)}
    assert {(c.hosts, c.local) for c in second.checked} == {(2, 2)}
    small = [c for c in first.checked if c.nbytes < 1 << 20 and c.variant != "gloo"]
    # 4 x 2 made at 300 us, predicted with 200 us: low where the waits show, never high
    assert all(c.error <= 1e-9 for c in small) and any(c.error < -0.1 for c in small)
    rooted_run = {
        "rate": "1gbit",
        "rows": [
            {
                "backend": "entrenar",
                "op": "barrier",
                "bytes": 0,
                "hosts": 4,
                "local": 2,
                "median_s": 1e-3,
            }
        ],
    }
    ((predicted,),) = [held_out.rooted_rows(rooted_run, [first, second])]
    links = rooted.with_frame(first.table, 0.0)
    want = rooted_measure.predicted(predicted.row, links, "1gbit", 2)
    assert predicted.predicted_s == predicted.from_cluster_s == want
    with pytest.raises(ValueError, match="one layout"):
        held_out.layout({"rows": runs[0]["rows"] + runs[1]["rows"]})
    assert first.checked_when == "start not recorded"
    timed = {"meta": {"started": "05:37", "loadavg_start": [1.66, 2, 5], "loadavg_end": [2.7]}}
    assert held_out.when(timed) == "05:37, load 1.7 -> 2.7"


def test_held_out_command_on_the_committed_quiet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``held-out`` on the committed quiet runs: both directions and both rooted runs
    are reported, each cluster table holding only the other layout's 18 rows."""
    quiet = Path(__file__).resolve().parents[1] / "benchmarks/model/data/quiet"
    argv = ["held-out", f"{quiet}/cluster-2x2-1gbit.json", f"{quiet}/cluster-4x2-1gbit.json"]
    argv += ["--rooted", f"{quiet}/rooted-2x2-1gbit.json", f"{quiet}/rooted-4x2-1gbit.json"]
    assert cli.main([*argv, "--links", f"{quiet}/links.json"]) == 0
    out = capsys.readouterr().out
    first, second = out.split("## fitted on 4 x 2")
    assert "## fitted on 2 x 2" in first and "| 2 x 2 |" not in first
    assert first.count("| 4 x 2 |") == 18 and second.count("| 2 x 2 |") == 18
    assert "## measure-rooted 2 x 2" in second and "## measure-rooted 4 x 2" in second
    assert second.count("| barrier | 0 B |") == 2


def test_machine_busy_is_user_nice_system_and_steal_in_clock_ticks() -> None:
    """cluster_load.machine_busy_s: /proc/stat's cpu line, user + nice + system + steal
    (a hypervisor's other guests take cores too); idle, iowait and the interrupt
    columns are not another process's."""
    tick = 1 / cluster_load.os.sysconf("SC_CLK_TCK")
    stat = "cpu  100 20 30 5000 40 7 9 11 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    assert cluster_load.machine_busy_s(stat) == pytest.approx((100 + 20 + 30 + 11) * tick)
    assert cluster_load.machine_busy_s() > 0  # this machine's
    with pytest.raises(ValueError, match="'cpu' line"):
        cluster_load.machine_busy_s("intr 1 2 3\n")


def test_background_cores_are_the_machines_busy_less_the_jobs_own_cpu() -> None:
    """cluster_load.background_cores: (the machine's busy CPU - every rank's CPU) / wall,
    summed over the blocks first (ticks are coarse beside a short block), never below
    0, None where no rank read the machine; BlockClock reads the machine on one rank."""
    reader = [
        {"wall_s": 0.5, "cpu_s": 0.4, "busy_s": 1.5},
        {"wall_s": 1.5, "cpu_s": 0.6, "busy_s": 2.5},
    ]
    other = [{"wall_s": 0.5, "cpu_s": 0.5}, {"wall_s": 1.5, "cpu_s": 0.5}]
    # busy 4.0 s; the job 1.0 + 1.0 s; over 2 s of wall: 1 core to the others
    assert cluster_load.background_cores([reader, other]) == pytest.approx(1.0)
    idle = [{**b, "busy_s": 0.5} for b in reader]
    assert cluster_load.background_cores([idle, other]) == 0.0
    assert cluster_load.background_cores([other, other]) is None
    clock = cluster_load.BlockClock(reads_machine=True)
    start = clock.read()
    sum(i * i for i in range(20000))  # some CPU of this process
    block = cluster_load.BlockClock.block(start, clock.read())
    assert block["wall_s"] > 0 and block["cpu_s"] > 0 and block["busy_s"] >= 0
    assert "busy_s" not in cluster_load.BlockClock.block(*[(1.0, 1.0, None)] * 2)


def test_load_makes_a_spinning_hop_wait_and_a_blocking_one_not() -> None:
    """costs.Conditions.load_wait: each turn of a spinning rank's hop also waits LOAD's
    alpha x the share of the cores other processes took (its yields hand the core to
    their threads), and a rank alone on its core waits one such turn; gloo sleeps and
    its wake-up is placed ahead of them: nothing. With no LOAD fitted, or no load,
    nothing; the share is capped at 1. By hand (HAND: WAKE 250 us; LOAD 2 ms), half
    the cores busy: a turn 250 + 1,000 us; 2 per core, a hop 1 turn; 4 per core, a
    rooted hop 3 turns, a symmetric one 2; a core per rank, 1 turn of 1,000 us."""
    loaded = LinkTable({**HAND.params, LOAD: LinkParams(2e-3, 0.0)}, {})
    half = costs.Conditions(ranks_per_core=2.0, busy_share=0.5)
    assert costs.hop_wait(loaded, half, costs.ENTRENAR) == pytest.approx(1.25e-3)
    four = costs.Conditions(ranks_per_core=4.0, busy_share=0.5)
    assert costs.hop_wait(loaded, four, costs.ENTRENAR) == pytest.approx(3 * 1.25e-3)
    assert costs.hop_wait(loaded, four, costs.ENTRENAR, symmetric=True) == pytest.approx(2.5e-3)
    assert costs.hop_wait(loaded, half, costs.GLOO) == pytest.approx(700e-6)  # gloo: unmoved
    assert costs.hop_wait(HAND, half, costs.ENTRENAR) == pytest.approx(250e-6)  # not fitted
    alone = costs.Conditions(busy_share=0.5)
    assert costs.hop_wait(loaded, alone, costs.ENTRENAR) == pytest.approx(1e-3)
    assert costs.hop_wait(loaded, alone, costs.GLOO) == 0.0
    assert costs.hop_wait(loaded, costs.Conditions(busy_share=3.0), costs.ENTRENAR) == 2e-3
    assert costs.hop_wait(loaded, costs.DEDICATED, costs.ENTRENAR) == 0.0
    # The check reads the row's load (cores) over the run's cores; older runs: none.
    meta = {"rate": "1gbit", "machine": {"nproc": 2}}
    row = {"variant": "entrenar", "hosts": 2, "local": 2, "bytes": 4 << 10, "median_s": 1.0}
    assert check.model_row({**row, "background_cores": 1.5}, meta).where.busy_share == 0.75
    assert check.model_row(row, meta).where.busy_share == 0.0
    star = costs.star(costs.Shape(2, 2, 4 << 10), costs.ENTRENAR)  # 2 rooted hops
    busy = check.predict_row({**row, "background_cores": 1.0}, meta, loaded).predicted_s
    quiet = check.predict_row(row, meta, loaded).predicted_s
    assert busy - quiet == pytest.approx(2 * 1e-3, rel=1e-6) and len(star) == 1


def test_measure_rooted_rows_carry_the_run_s_load_into_the_prediction() -> None:
    """A measure-rooted row's ``background_cores`` (the cores other processes took over
    the run's timed rounds) reaches its prediction as a cluster row's does: the
    dissemination barrier at 2 x 2 (2 ranks per core, 2 rounds of symmetric hops, 1
    turn each) waits LOAD's alpha x the share more per round; a run that did not record
    it predicts as before."""
    loaded = LinkTable({**HAND.params, LOAD: LinkParams(2e-3, 0.0)}, {})
    links = rooted.with_frame(loaded, 0.0)
    row = {"backend": "entrenar", "op": "barrier", "bytes": 0, "hosts": 2, "local": 2}
    quiet = rooted_measure.predicted(row, links, "1gbit", 2)
    assert rooted_measure.predicted({**row, "background_cores": None}, links, "1gbit", 2) == quiet
    busy = rooted_measure.predicted({**row, "background_cores": 1.0}, links, "1gbit", 2)
    assert busy - quiet == pytest.approx(2 * 0.5 * 2e-3, rel=1e-6)


def test_fit_wake_takes_the_load_from_loaded_rows_and_the_wake_from_quiet_ones() -> None:
    """wake.fit_wake on a quiet run and a loaded one of the same layout (made by the
    model with WAKE 240 us, LOAD 900 us, 3 % noise): WAKE from the run whose others
    took under a quarter of the cores, then LOAD from the loaded run's rows given
    it; GLOO_WAKE from
    gloo's quiet rows (it has no load term: its loaded rows here run 1.5x slower, and
    a fit that took them would move)."""
    rng = np.random.default_rng(6)
    truth = {WAKE: (240e-6, 0.0), GLOO_WAKE: (800e-6, 0.0), LOAD: (900e-6, 0.0)}
    want = LinkTable({**LINKS.params, **{k: LinkParams(*v) for k, v in truth.items()}}, {})
    meta = {"rate": "1gbit", "machine": {"nproc": 2}}
    runs = []
    for background in (None, 1.2):
        rows = []
        for variant in ("gloo", "entrenar-flat", "entrenar-leaders"):
            for s in (4 << 10, 64 << 10, 256 << 10):
                row = {"variant": variant, "hosts": 2, "local": 2, "bytes": s}
                row |= {"median_s": 1.0, "background_cores": background}
                model = check.predict_row(row, meta, want).predicted_s
                if variant == "gloo" and background:
                    model *= 1.5
                rows.append({**row, "median_s": model * (1 + 0.03 * rng.standard_normal())})
        recorded = {} if background is None else {"background_cores": background}
        runs.append({"meta": {**meta, **recorded}, "rows": rows})
    fitted = wake.fit_wake(runs, LINKS)
    assert fitted[WAKE].alpha == pytest.approx(240e-6, rel=0.1)
    assert fitted[LOAD].alpha == pytest.approx(900e-6, rel=0.1)
    assert fitted[GLOO_WAKE].alpha == pytest.approx(800e-6, rel=0.1)
    assert fitted.meta["wake_rows"] == {GLOO_WAKE: 3, WAKE: 6, LOAD: 6}
    # the quiet run alone: no load to fit, the term stays off
    assert LOAD not in wake.fit_wake(runs[:1], LINKS).params
    # quiet or loaded is the run's figure: a loaded run's rows that read low are its
    low = {**runs[1], "rows": [{**r, "background_cores": 0.1} for r in runs[1]["rows"]]}
    assert not wake.is_quiet(low) and wake.is_quiet(runs[0])
    assert wake.fit_wake([runs[0], low], LINKS).meta["wake_rows"][WAKE] == 6


def test_gloo_has_two_modes_where_its_ranks_share_cores_and_the_row_names_its_own() -> None:
    """check: where gloo's ranks share cores its row gets a second prediction, the fast
    mode (every wake-up finds its core free: the links alone), and is judged against
    the mode its median fell into (the nearer by ratio), named in the row; the
    one (slow-mode) error is kept beside it. Where the wake-ups hide behind the bytes
    (16 MiB) or a core per rank, one mode; entrenar, one mode."""
    meta = {"rate": "1gbit", "machine": {"nproc": 2}}
    row = {"variant": "gloo", "hosts": 2, "local": 2, "bytes": 256 << 10, "median_s": 1.0}
    probe = check.predict_row(row, meta, HAND)
    assert probe.fast_s is not None and probe.fast_s < probe.predicted_s / (1 + check.TOLERANCE)
    fast = check.predict_row({**row, "median_s": probe.fast_s * 1.1}, meta, HAND)
    assert fast.mode == "fast" and not fast.flagged and fast.error > check.TOLERANCE
    assert fast.mode_error == pytest.approx(1 / 1.1 - 1)
    slow = check.predict_row({**row, "median_s": probe.predicted_s * 0.9}, meta, HAND)
    assert slow.mode == "slow" and not slow.flagged
    between = (probe.fast_s * probe.predicted_s) ** 0.5  # the geometric middle of the band
    if between / probe.fast_s > 1 + check.TOLERANCE:
        assert check.predict_row({**row, "median_s": between}, meta, HAND).flagged
    big = check.predict_row({**row, "bytes": 16 << 20}, meta, HAND)
    assert big.fast_s is None and big.mode == ""
    assert check.predict_row(row, {}, HAND).fast_s is None  # a core per rank
    ours = check.predict_row({**row, "variant": "entrenar"}, meta, HAND)
    assert ours.fast_s is None and ours.mode == "" and ours.flagged  # 1 s measured
    ours = check.predict_row(
        {**row, "variant": "entrenar", "median_s": ours.predicted_s}, meta, HAND
    )
    text = check.report([fast, slow, ours])
    assert "row: fast" in text and "row: slow" in text
    assert "3 of 3 rows within 25% of the mode" in text and "one (slow-mode) prediction: 2" in text


def test_held_out_takes_several_runs_per_layout_and_reports_each_with_its_load() -> None:
    """held_out: runs grouped by layout; each direction fits on all of one layout's runs
    and reports every run of the other on its own, with the cores others took; a
    third layout is refused. The cluster report prints the run's load."""
    meta = {"rate": "1gbit", "machine": {"nproc": 2}}
    truth = LinkTable(
        {**LINKS.params, WAKE: LinkParams(2e-4, 0), GLOO_WAKE: LinkParams(8e-4, 0)}, {}
    )
    runs = []
    for h, background in ((2, None), (2, 1.0), (4, None)):
        rows = []
        for variant in ("gloo", "entrenar"):
            row = {"variant": variant, "hosts": h, "local": 2, "bytes": 4 << 10, "median_s": 1}
            row["median_s"] = check.predict_row(row, meta, truth).predicted_s
            rows.append({**row, "background_cores": background})
        others = {} if background is None else {"background_cores": background}
        runs.append({"meta": {**meta, **others}, "rows": rows})
    first, second = held_out.held_out(runs, LINKS)
    assert first.fitted_on == (2, 2) and len(first.per_run) == 1
    assert second.fitted_on == (4, 2) and len(second.per_run) == 2
    assert second.per_run[1][0].endswith("other processes 1.00 cores")
    assert len(second.checked) == 4
    text = held_out.report([first, second], [])
    assert text.count("### checked: the run of") == 3
    plain = held_out.held_out(runs, LINKS, use_load=False)[1]
    assert all(c.background_cores is None for c in plain.checked)
    assert plain.per_run[1][0].endswith("other processes 1.00 cores")  # the run's, still said
    with pytest.raises(ValueError, match="two layouts"):
        held_out.held_out(
            [*runs, {"meta": meta, "rows": [{**runs[2]["rows"][0], "hosts": 8}]}], LINKS
        )
    machine = {"nproc": 2, "cpu": "x"}
    result = {
        "meta": {
            "hosts": 2, "local": 2, "rate": "1gbit", "delay": None, "git": "g", "started": "s",
            "machine": machine, "loadavg_start": [1.0], "loadavg_end": [2.0], "elapsed_s": 1.0,
            "notes": [], "background_cores": 0.5,
        },
        "rows": [],
    }  # fmt: skip
    lines = cluster_report.report_lines(result)
    assert any("took 0.50 of the 2 cores" in line for line in lines)


def test_fit_wake_takes_the_middle_of_a_flat_minimum_whatever_the_rows_order() -> None:
    """Two gloo rows of one shape, measured at the model's time for GLOO_WAKE 400 and
    800 us: the absolute log error is flat in between, and wake.fit_wake takes the
    middle of the flat part (~600 us) in either order of the rows (it took the first
    point, 400 us, so the files' order on the command line could move an alpha)."""
    meta = {"rate": "1gbit", "machine": {"nproc": 2}}
    row = {"variant": "gloo", "hosts": 2, "local": 2, "bytes": 4 << 10, "median_s": 1.0}
    rows = []
    for alpha in (400e-6, 800e-6):
        truth = LinkTable({**LINKS.params, GLOO_WAKE: LinkParams(alpha, 0.0)}, {})
        rows.append({**row, "median_s": check.predict_row(row, meta, truth).predicted_s})
    fits = [
        wake.fit_wake([{"meta": meta, "rows": order}], LINKS)[GLOO_WAKE].alpha
        for order in (rows, rows[::-1])
    ]
    assert fits[0] == fits[1] == pytest.approx(600e-6, rel=0.02)

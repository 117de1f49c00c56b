"""The cost model (benchmarks/model/): formulas, fitting and the check, without processes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from benchmarks.model import check, costs, fit, plan
from benchmarks.model.links import GLOO_NET, KINDS, NET, LinkParams, LinkTable

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
    """Bytes per host link per direction: hierarchical large 2(H-1)/H x S whatever L is;
    the flat ring 2(N-1)/N x S (one ring edge per host); direct (H-1) x L^2 x S;
    star (H-1) x L x S; hierarchical small ceil(log2 H) x S."""
    s = 64 << 20
    shape = costs.Shape(h, local, s)
    n = h * local
    large = costs.host_link_bytes(costs.hier_large(shape, costs.ENTRENAR), NET)
    assert large == pytest.approx(2 * (h - 1) / h * s)
    ring = costs.host_link_bytes(costs.ring(shape, costs.ENTRENAR), NET)
    assert ring == pytest.approx(2 * (n - 1) / n * s)
    direct = costs.host_link_bytes(costs.direct(shape, costs.ENTRENAR), NET)
    assert direct == pytest.approx((h - 1) * local**2 * s)
    star = costs.host_link_bytes(costs.star(shape, costs.ENTRENAR), NET)
    assert star == pytest.approx((h - 1) * local * s)  # rank 0's host link; the fill moves nothing
    small = costs.host_link_bytes(costs.hier_small(shape, costs.ENTRENAR), NET)
    assert small == pytest.approx(math.ceil(math.log2(h)) * s)


@pytest.mark.parametrize("local", [2, 4, 8])
def test_hierarchical_on_one_host_is_the_shm_path(local: int) -> None:
    """H = 1: hierarchical large is the shm allreduce's chunked path (> 1 MiB),
    hierarchical small its one phase (<= 1 MiB), to the last bit of the sum."""
    shm = [(s, costs.predict("hier large", costs.Shape(1, local, s), LINKS)) for s in SIZES]
    for s, t in shm:
        want = costs.total_time(costs.shm(costs.Shape(1, local, s), costs.ENTRENAR), LINKS)
        other = "hier large" if s > costs.SHM_SMALL_MAX_BYTES else "hier small"
        got = costs.predict(other, costs.Shape(1, local, s), LINKS)
        assert got == want, (local, s)
        if s > costs.SHM_SMALL_MAX_BYTES:
            assert t == want
    # and not trivially: across hosts the cross-host phase adds time
    big = costs.Shape(2, local, 64 << 20)
    assert costs.predict("hier large", big, LINKS) > costs.total_time(
        costs.shm(costs.Shape(1, local, 64 << 20), costs.ENTRENAR), LINKS
    )


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


def test_check_predicts_todays_policy_and_flags_rows_off_by_more_than_25_percent() -> None:
    def predicted(variant: str, h: int, local: int, s: int) -> float:
        row = {"variant": variant, "hosts": h, "local": local, "bytes": s, "median_s": 1.0}
        return check.predict_row(row, {}, LINKS).predicted_s

    small, large = 64 << 10, 16 << 20
    # the policy: 2 ranks direct up to 256 KiB; more ranks star up to 1 MiB; ring above
    assert check.entrenar_algorithm(costs.Shape(2, 1, small), "auto")[0] == "direct"
    assert check.entrenar_algorithm(costs.Shape(2, 2, small), "auto")[0] == "star"
    assert check.entrenar_algorithm(costs.Shape(4, 2, large), "auto")[0] == "ring"
    assert check.entrenar_algorithm(costs.Shape(1, 2, large), "auto")[0] == "shm"
    t_star = costs.total_time(costs.star(costs.Shape(2, 2, small), costs.ENTRENAR), LINKS)
    assert predicted("entrenar", 2, 2, small) == t_star
    t_gloo = costs.total_time(costs.ring(costs.Shape(4, 2, large), costs.GLOO), LINKS)
    assert predicted("gloo", 4, 2, large) == t_gloo

    rows = [
        ("entrenar", 2, 2, small, 1.10),  # measured 10 % above the prediction: fine
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
    run = {"meta": {"rate": "1gbit"}, "rows": measured_rows}
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
    names = ["direct", "star", "ring", "hier large", "hier small"]
    found = 0
    for h, local in [(2, 2), (4, 8), (64, 1), (1024, 8)]:
        for c in plan.crossovers(h, local, LINKS, names):
            found += 1
            assert plan.best(h, local, int(c.nbytes * 0.99), LINKS, names) == c.before
            assert plan.best(h, local, int(c.nbytes * 1.01), LINKS, names) == c.after != c.before
    assert found >= 4

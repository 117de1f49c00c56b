"""Fit each link kind's alpha and beta from the 2-rank measurements (``measure.py``).

Each measured variant exercises one kind through a known algorithm
(``MEASURES``); its cost formula (``costs.py``) says how many messages and
bytes of that kind one call takes, so ``time = messages x alpha + bytes x
beta + known`` is linear in the two unknowns, where ``known`` is the time of
the phases on kinds fitted before (the ``reduce`` kind's combines). The
least squares (``numpy.linalg.lstsq``) weighs every row by 1 / its time, so
what is minimised is the *relative* error, as the check judges it; a
parameter fitted below zero is set to zero and the other refitted.

The shaped link is a token bucket (tc tbf, ``benchmarks/netns.py``): a burst
of bytes passes at the veth's speed before the rate binds, so a loop of small
calls is not charged for its bytes at all, which a real link always charges.
For the ``net`` kinds the two regimes are fitted apart: alpha from the
sizes below ``Measure.bucket_bytes`` (where a call costs its alpha only),
beta from the sizes above with that alpha fixed (where the rate binds):
the parameters of a real link of that rate, not of the bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.model import costs
from benchmarks.model.links import (
    GLOO_LOOPBACK,
    GLOO_NET,
    LOOPBACK,
    NET,
    REDUCE,
    SHM,
    SLOTS,
    LinkParams,
    LinkTable,
)


@dataclass(frozen=True)
class Measure:
    """Which kind a measured variant fits, through which algorithm, on which shape."""

    kind: str
    algorithm: costs.Algorithm
    fabric: costs.Fabric
    hosts: int
    local: int
    shaped: bool = False  # a token bucket: alpha and beta fitted apart (above)


# Below this size a measurement loop's bytes fit in the shaper's bucket
# (tbf's burst, 128 KiB: 20 calls of 4 KiB each way are 80 KiB); from
# BETA_FROM on the rate binds (measured: 8.7 ns/B from 256 KiB to 16 MiB at
# 1 Gbit/s, gloo and entrenar alike).
ALPHA_BELOW = 64 << 10
BETA_FROM = 256 << 10


def _combine_only(shape: costs.Shape, fabric: costs.Fabric) -> list[costs.Phase]:
    """The in-process ``a += b`` of ``reduce_sweep``: S bytes combined, nothing sent."""
    return [costs.Phase("combine", {REDUCE: 1}, {REDUCE: shape.nbytes})]


# In fitting order: the reduce kind first, since the others' formulas use it.
MEASURES: dict[str, Measure] = {
    "reduce": Measure(REDUCE, _combine_only, costs.ENTRENAR, 1, 1),
    "entrenar-shm-direct": Measure(SHM, costs.direct, costs.ENTRENAR, 1, 2),
    "entrenar-slots": Measure(SLOTS, costs.shm, costs.ENTRENAR, 1, 2),
    "entrenar-tcp-direct": Measure(LOOPBACK, costs.direct, costs.ENTRENAR_TCP, 1, 2),
    "gloo": Measure(GLOO_LOOPBACK, costs.ring, costs.GLOO, 1, 2),
    "entrenar-net-direct": Measure(NET, costs.direct, costs.ENTRENAR_TCP, 2, 1, shaped=True),
    "gloo-net": Measure(GLOO_NET, costs.ring, costs.GLOO, 2, 1, shaped=True),
}


def design_row(measure: Measure, nbytes: int, known: LinkTable) -> tuple[float, float, float]:
    """(messages, bytes, known seconds) of one call of ``measure`` at ``nbytes``."""
    shape = costs.Shape(measure.hosts, measure.local, nbytes)
    a = b = offset = 0.0
    for phase in measure.algorithm(shape, measure.fabric):
        if measure.kind in phase.kinds():
            others = phase.kinds() - {measure.kind}
            if others:
                raise ValueError(
                    f"phase {phase.name!r} mixes {measure.kind} with {sorted(others)}: not linear"
                )
            a += phase.messages.get(measure.kind, 0.0)
            b += phase.nbytes.get(measure.kind, 0.0)
        else:
            offset += phase.time(known)
    return a, b, offset


def least_squares(a: np.ndarray, b: np.ndarray, y: np.ndarray) -> LinkParams:
    """alpha, beta >= 0 minimising sum(((a alpha + b beta) - y) / y)^2."""
    w = 1.0 / y
    design = np.stack([a * w, b * w], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, y * w, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(np.dot(b * w, y * w) / np.dot(b * w, b * w))
    if beta < 0:
        beta = 0.0
        alpha = _one(a, y, y)
    return LinkParams(float(alpha), float(beta))


def _one(x: np.ndarray, y: np.ndarray, scale: np.ndarray) -> float:
    """c >= 0 minimising sum(((x c) - y) / scale)^2."""
    w = 1.0 / scale
    return max(0.0, float(np.dot(x * w, y * w) / np.dot(x * w, x * w)))


def two_regimes(
    a: np.ndarray, b: np.ndarray, y: np.ndarray, small: np.ndarray, big: np.ndarray
) -> LinkParams:
    """alpha from the rows ``small`` (bytes not charged), beta from ``big``, alpha fixed."""
    if not small.any() or not big.any():
        raise ValueError("a shaped link's fit needs sizes on both sides of the bucket")
    alpha = _one(a[small], y[small], y[small])
    beta = _one(b[big], y[big] - a[big] * alpha, y[big])
    return LinkParams(alpha, beta)


def fit(rows: Sequence[dict[str, Any]], meta: dict[str, Any] | None = None) -> LinkTable:
    """The link table fitted from measurement rows (``variant``, ``bytes``, ``median_s``)."""
    table = LinkTable({}, dict(meta or {}))
    residuals: dict[str, float] = {}
    for variant, measure in MEASURES.items():
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue
        terms = np.array([design_row(measure, int(r["bytes"]), table) for r in mine])
        y = np.array([float(r["median_s"]) for r in mine]) - terms[:, 2]
        if np.any(y <= 0):
            raise ValueError(f"{variant}: a measured time is below the known phases' time")
        a, b = terms[:, 0], terms[:, 1]
        if measure.shaped:
            sizes = np.array([int(r["bytes"]) for r in mine])
            small, big = sizes < ALPHA_BELOW, sizes >= BETA_FROM
            params = two_regimes(a, b, y, small, big)
            keep = small | big
            a, b, y = a[keep], np.where(small[keep], 0.0, b[keep]), y[keep]
            pred = a * params.alpha + b * params.beta
        else:
            params = least_squares(a, b, y)
            pred = a * params.alpha + b * params.beta
        table.params[measure.kind] = params
        residuals[measure.kind] = float(np.max(np.abs(pred - y) / y))
    table.meta["worst_relative_residual"] = residuals
    return table

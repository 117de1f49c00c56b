"""Fit each link kind's alpha and beta from the 2-rank measurements (``measure.py``).

Each measured variant exercises one kind through a known algorithm
(``MEASURES``); its cost formula (``costs.py``) says how many messages and
bytes of that kind one call takes, so ``time = messages x alpha + bytes x
beta + known`` is linear in the two unknowns, where ``known`` is the time of
the phases on kinds fitted before (the ``reduce`` kind's combines). The
least squares (``numpy.linalg.lstsq``) weighs every row by 1 / its time, so
what is minimised is the *relative* error, as the check judges it; a
parameter fitted below zero is set to zero and the other refitted.
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
    "entrenar-net-direct": Measure(NET, costs.direct, costs.ENTRENAR_TCP, 2, 1),
    "gloo-net": Measure(GLOO_NET, costs.ring, costs.GLOO, 2, 1),
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
        alpha = float(np.dot(a * w, y * w) / np.dot(a * w, a * w))
    return LinkParams(float(alpha), float(beta))


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
        params = least_squares(terms[:, 0], terms[:, 1], y)
        table.params[measure.kind] = params
        pred = terms[:, 0] * params.alpha + terms[:, 1] * params.beta
        residuals[measure.kind] = float(np.max(np.abs(pred - y) / y))
    table.meta["worst_relative_residual"] = residuals
    return table

"""The wake kinds' alphas: a hop's wait to be scheduled, fitted from emulated-cluster rows.

The links' alphas come from 2 ranks on 2 cores (``fit.py``): a core per
rank. The emulated clusters run H x L ranks on the same 2 cores (4 x 2: four
per core), and there every hop in sequence of a ring or a plan waits for its
rank to be scheduled: below 1 MiB that wait is most of the time (gloo's ring
at 4 x 2, 4 KiB: 14 steps, 17 ms measured quiet against 5 ms of link time).
``costs.Conditions`` charges it as each fabric waits (``costs.Fabric.spins``):
entrenar spins, so ``WAKE``'s alpha per turn of the others on the core (k - 1
turns per rooted hop, k/2 per symmetric round: ``costs.hop_wait``); gloo
blocks, so ``GLOO_WAKE``'s alpha per hop, after its own message arrived
(``costs.Phase.time``). Where the run recorded other jobs' load
(``costs.Conditions.busy_share``), each of entrenar's turns also waits
``LOAD``'s alpha x the share. This module fits each alpha from its own rows
below ``check.LARGE_BYTES`` (``WAKE`` and ``GLOO_WAKE`` from the quiet rows of
entrenar's variants and gloo's, then ``LOAD`` from entrenar's loaded rows:
``_fit_rows``), minimising the
absolute log ratio (robust to a row in the other mode); with the overlap the
time is not linear in the alpha, so by a search over a grid, refined. Fit on
one set of runs, check on another (``held_out``, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.model import check, costs, rooted, rooted_measure
from benchmarks.model.links import GLOO_WAKE, LOAD, WAKE, LinkParams, LinkTable

MAX_WAKE_S = 5e-3  # the search's range: 0 .. 5 ms per hop
_COARSE_S = 10e-6
_FINE_S = 0.25e-6


def _relative_error(rows: list[tuple[check.Modelled, float]], links: LinkTable) -> float:
    """Sum of |log(predicted / measured)|: a least-absolute fit of the ratio, so that
    a row whose median fell in the other mode (small medians here are bimodal: a
    fast mode where the woken thread finds its core idle) does not pull the alpha,
    and a row 2x over weighs what a row 2x under does; with three rows it follows
    the two that agree."""
    return sum(
        abs(math.log(costs.total_time(m.phases, links, m.where, m.fabric) / t)) for m, t in rows
    )


def _search(rows: list[tuple[check.Modelled, float]], base: LinkTable, kind: str) -> float:
    """The alpha of ``kind`` in [0, MAX_WAKE_S] that fits ``rows`` best (grid, then finer)."""
    return _best_alpha(functools.partial(_relative_error, rows), base, kind)


def _best_alpha(error_of: Callable[[LinkTable], float], base: LinkTable, kind: str) -> float:
    """The alpha of ``kind`` in [0, MAX_WAKE_S] where ``error_of`` (of the table with that
    alpha) is least: a grid, then a finer one around its best."""

    def error(alpha: float) -> float:
        params = {**base.params, kind: LinkParams(float(alpha), 0.0)}
        return error_of(LinkTable(params, base.meta))

    return best_seconds(error, MAX_WAKE_S)


def best_seconds(error: Callable[[float], float], upper: float) -> float:
    """The seconds in [0, ``upper``] where ``error`` is least: a grid of ``_COARSE_S``,
    then a finer one of ``_FINE_S`` around its best (the middle of a flat minimum)."""
    coarse = np.arange(0.0, upper + _COARSE_S, _COARSE_S)
    coarse = coarse[coarse <= upper]
    best = _middle_of_minimum(coarse, [error(a) for a in coarse])
    fine = np.arange(max(0.0, best - _COARSE_S), min(upper, best + _COARSE_S), _FINE_S)
    return _middle_of_minimum(fine, [error(a) for a in fine])


def shares_cores(runs: Sequence[dict[str, Any]]) -> bool:
    """Whether ``runs`` have a row below 1 MiB whose ranks share cores (``fit_wake``'s)."""
    by_kind = _fit_rows(runs)
    return bool(by_kind[WAKE] or by_kind[GLOO_WAKE])


def _middle_of_minimum(grid: np.ndarray, errors: list[float]) -> float:
    """The middle of the grid points where ``errors`` is least. An absolute error is
    flat between two rows (a median of an even count): the middle of the flat part,
    not its first point, which the rows' summation order would pick by rounding."""
    rounded = np.round(np.asarray(errors), 9)
    best = np.flatnonzero(rounded == rounded.min())
    return float(grid[best[len(best) // 2]])


# A run whose other processes took less than this share of the cores (over all its
# timed blocks: ``meta.background_cores``; a run that did not record it counts as
# quiet) fits the wake-ups; a loaded run's entrenar rows fit ``LOAD``.
QUIET_SHARE = 0.25

Pairs = list[tuple[check.Modelled, float]]


def is_quiet(run: dict[str, Any]) -> bool:
    """Whether other processes took less than ``QUIET_SHARE`` of the cores during ``run``.

    Judged per run, not per row: a row's own figure is a few blocks' (the
    ticks are coarse), and a loaded run's rows that read low still ran among
    the others' threads."""
    meta = run.get("meta", {})
    background, machine = meta.get("background_cores"), meta.get("machine")
    cores = machine.get("nproc") if isinstance(machine, dict) else None
    return background is None or not cores or background / int(cores) < QUIET_SHARE


def _fit_rows(runs: Sequence[dict[str, Any]]) -> dict[str, Pairs]:
    """The rows below 1 MiB each kind is fitted on: ``GLOO_WAKE`` gloo's where ranks
    share cores, ``WAKE`` entrenar's there, each from the quiet runs (all runs if
    none is quiet: gloo has no load term, and its loaded rows moved either way,
    +-30 %); ``LOAD`` entrenar's rows of the loaded runs (any layout: a rank alone
    on its core still yields to another job)."""
    gloo: dict[bool, Pairs] = {True: [], False: []}
    shared: dict[bool, Pairs] = {True: [], False: []}
    loaded: Pairs = []
    for run in runs:
        quiet = is_quiet(run)
        for row in run["rows"]:
            if int(row["bytes"]) >= check.LARGE_BYTES:
                continue
            m = check.model_row(row, run.get("meta", {}))
            pair = (m, float(row["median_s"]))  # (sums are order-free: _middle_of_minimum)
            if not m.fabric.spins:
                if m.where.ranks_per_core > 1:
                    gloo[quiet].append(pair)
                continue
            if m.where.ranks_per_core > 1:
                shared[quiet].append(pair)
            if not quiet and m.where.busy_share > 0:
                loaded.append(pair)
    return {
        GLOO_WAKE: gloo[True] or gloo[False],
        WAKE: shared[True] or shared[False],
        LOAD: loaded,
    }


def fit_wake(runs: Sequence[dict[str, Any]], links: LinkTable) -> LinkTable:
    """``links`` with ``GLOO_WAKE`` (gloo's rows), ``WAKE`` (entrenar's, quiet) and, where
    ``runs`` have loaded rows, ``LOAD`` (entrenar's loaded rows, given ``WAKE``) fitted
    from the rows below 1 MiB of ``runs`` (cluster.json)."""
    base = LinkTable(
        {k: v for k, v in links.params.items() if k not in (WAKE, GLOO_WAKE, LOAD)},
        dict(links.meta),
    )
    by_kind = _fit_rows(runs)
    if not by_kind[WAKE] and not by_kind[GLOO_WAKE]:
        raise ValueError("no row below 1 MiB with more ranks than cores to fit the wake-up on")
    for kind in (GLOO_WAKE, WAKE, LOAD):  # LOAD last: its rows also wait WAKE's turns
        if by_kind[kind]:
            base.params[kind] = LinkParams(_search(by_kind[kind], base, kind), 0.0)
    base.meta["wake_rows"] = {kind: len(rows) for kind, rows in by_kind.items()}
    return base


# measure-rooted files written before they recorded the machine: this one's cores.
ROOTED_CORES = 2


def rooted_cores(run: dict[str, Any]) -> int:
    """The cores a ``measure-rooted`` run's ranks shared (its ``machine.nproc``)."""
    machine = run.get("machine")
    cores = machine.get("nproc") if isinstance(machine, dict) else None
    return int(cores) if cores else ROOTED_CORES


RootedPairs = list[tuple[dict[str, Any], str, int]]  # (row, the run's rate, its cores)


def _rooted_error(rows: RootedPairs, links: LinkTable) -> float:
    """Sum of |log(predicted / measured)| over ``measure-rooted`` rows (as ``_relative_error``)."""
    return sum(
        abs(math.log(rooted_measure.predicted(r, links, rate, cores) / float(r["median_s"])))
        for r, rate, cores in rows
    )


def fit_rooted_wake(runs: Sequence[dict[str, Any]], links: LinkTable) -> LinkTable:
    """``links`` with ``WAKE`` fitted from entrenar's rows below 1 MiB of ``measure-rooted``
    runs (barrier, small broadcasts: ``rooted_measure.predicted``, frames at no cost).

    Their own fit, not the allreduce rows': a turn lasts as long as the rank
    holding the core keeps it, and in a barrier's or a small broadcast's rounds
    the others have a frame to handle, not a buffer to copy and sum; on the
    same machine and minutes the allreduce rows fit 20-40 % more per turn
    (docs/benchmarks.md, "The rooted ops' own turn")."""
    rows: RootedPairs = [
        (r, str(run.get("rate", "1gbit")), rooted_cores(run))
        for run in runs
        for r in run["rows"]
        if r["backend"] == "entrenar" and int(r["bytes"]) < check.LARGE_BYTES
    ]
    if not rows:
        raise ValueError("no entrenar row below 1 MiB in the measure-rooted runs to fit on")
    base = rooted.with_frame(
        LinkTable({k: v for k, v in links.params.items() if k != WAKE}, dict(links.meta)), 0.0
    )
    alpha = _best_alpha(functools.partial(_rooted_error, rows), base, WAKE)
    out = LinkTable({**links.params, WAKE: LinkParams(alpha, 0.0)}, dict(links.meta))
    out.meta["rooted_wake_rows"] = len(rows)
    return out

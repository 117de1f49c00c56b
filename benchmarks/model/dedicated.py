"""A core per rank: gloo's cost per call and entrenar's queued frames, fitted from cluster rows.

The links' alphas come from 2-rank sweeps (``fit.py``): a call's time over
its messages in sequence, two for gloo's 2-rank ring, one for entrenar's
2-rank exchange. With a core per rank (the 16-core machine's clusters,
``data/core16``) two costs that a 2-rank call cannot tell apart from its
alphas set the small calls' time:

- gloo pays part of its time once per call (its work handed to a thread and
  waited for), not per message. The sweep's alpha charges that part once per
  message, so a 14-step ring (4 x 2) paid it 7 times: 2.7 ms predicted, 1.3
  ms measured. ``GLOO_CALL``'s alpha is that part: each gloo kind's alpha
  gives up ``GLOO_CALL`` / the messages of its sweep (``with_gloo_call``),
  so the 2-rank call's time is what the sweep measured.
- entrenar's rooted hops: a star's root takes its N-1 peers' frames in one
  after another, then sends N-1 out (``costs.Phase.queued``: 2(N-2) frames
  beyond a 2-rank hop's one, none in a ring's or a doubling's symmetric
  hops). ``QUEUED_FRAME``'s alpha is one such frame's time.

Each is one number, fitted by least absolute log error (``wake.best_seconds``)
from the rows below ``check.LARGE_BYTES`` whose ranks each have a core
(``Conditions.ranks_per_core`` <= 1): ``GLOO_CALL`` from gloo's, ``QUEUED_FRAME``
from entrenar's rows with queued frames. Where ranks share cores the wake-up
terms (``wake.py``) are fitted instead; held out, each layout predicted from
the other's fit (``held_out``, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from benchmarks.model import check, costs, fit, wake
from benchmarks.model.links import GLOO_CALL, QUEUED_FRAME, LinkParams, LinkTable

MAX_QUEUED_FRAME_S = 1e-3  # the search's range per frame: 0 .. 1 ms

Pairs = list[tuple[check.Modelled, float]]


def sweep_messages(kind: str) -> float:
    """Messages in sequence of one call of the 2-rank sweep that fitted ``kind``."""
    for measure in fit.MEASURES.values():
        if measure.kind == kind:
            shape = costs.Shape(measure.hosts, measure.local, 1)
            return costs.hops(measure.algorithm(shape, measure.fabric))
    raise ValueError(f"no 2-rank sweep fits {kind!r}")


def _gloo_kinds() -> tuple[str, str]:
    return costs.GLOO.intra, costs.GLOO.inter


def max_gloo_call(links: LinkTable) -> float:
    """The largest cost per call that leaves no gloo kind's alpha below zero."""
    return min(links[k].alpha * sweep_messages(k) for k in _gloo_kinds())


def with_gloo_call(links: LinkTable, seconds: float) -> LinkTable:
    """``links`` (the sweeps' alphas) with ``GLOO_CALL`` at ``seconds`` and each gloo
    kind's alpha less ``seconds`` / its sweep's messages: the 2-rank call's time kept."""
    if seconds > max_gloo_call(links):
        raise ValueError(f"a gloo call of {seconds * 1e6:.0f} us leaves an alpha below zero")
    params = dict(links.params)
    for kind in _gloo_kinds():
        p = links[kind]
        params[kind] = LinkParams(p.alpha - seconds / sweep_messages(kind), p.beta)
    params[GLOO_CALL] = LinkParams(seconds, 0.0)
    return LinkTable(params, dict(links.meta))


def with_queued_frame(links: LinkTable, seconds: float) -> LinkTable:
    """``links`` with ``QUEUED_FRAME`` at ``seconds`` per frame."""
    return LinkTable({**links.params, QUEUED_FRAME: LinkParams(seconds, 0.0)}, dict(links.meta))


def _log_error(rows: Pairs, links: LinkTable) -> float:
    """Sum of |log(predicted / measured)| (as ``wake``: a row in another mode pulls little)."""
    return sum(
        abs(math.log(costs.total_time(m.phases, links, m.where, m.fabric) / t)) for m, t in rows
    )


def _gloo_call_error(rows: Pairs, links: LinkTable, seconds: float) -> float:
    return _log_error(rows, with_gloo_call(links, seconds))


def _queued_frame_error(rows: Pairs, links: LinkTable, seconds: float) -> float:
    return _log_error(rows, with_queued_frame(links, seconds))


def fit_rows(runs: Sequence[dict[str, Any]]) -> dict[str, Pairs]:
    """The rows below 1 MiB each term is fitted on, from ranks with a core each:
    ``GLOO_CALL`` gloo's, ``QUEUED_FRAME`` entrenar's with queued frames (only
    those depend on it)."""
    out: dict[str, Pairs] = {GLOO_CALL: [], QUEUED_FRAME: []}
    for run in runs:
        for row in run["rows"]:
            if int(row["bytes"]) >= check.LARGE_BYTES:
                continue
            m = check.model_row(row, run.get("meta", {}))
            if m.where.ranks_per_core > 1:
                continue
            pair = (m, float(row["median_s"]))
            if not m.fabric.spins:
                out[GLOO_CALL].append(pair)
            elif any(p.queued > 0 for p in m.phases):
                out[QUEUED_FRAME].append(pair)
    return out


def has_own_cores(runs: Sequence[dict[str, Any]]) -> bool:
    """Whether ``runs`` have a row below 1 MiB to fit ``fit_dedicated`` on."""
    return any(fit_rows(runs).values())


def fit_dedicated(runs: Sequence[dict[str, Any]], links: LinkTable) -> LinkTable:
    """``links`` (the sweeps' table) with ``GLOO_CALL`` (the gloo kinds' alphas split
    accordingly) and ``QUEUED_FRAME`` fitted from the rows below 1 MiB of ``runs``
    whose ranks have a core each; a term with no such row is left out."""
    if GLOO_CALL in links.params or QUEUED_FRAME in links.params:
        raise ValueError("the links already have a cost per call or per queued frame")
    by_kind = fit_rows(runs)
    if not any(by_kind.values()):
        raise ValueError("no row below 1 MiB with a core per rank to fit the call's terms on")
    table = LinkTable(dict(links.params), dict(links.meta))
    if by_kind[GLOO_CALL]:
        error = functools.partial(_gloo_call_error, by_kind[GLOO_CALL], table)
        table = with_gloo_call(table, wake.best_seconds(error, max_gloo_call(table)))
    if by_kind[QUEUED_FRAME]:
        error = functools.partial(_queued_frame_error, by_kind[QUEUED_FRAME], table)
        table = with_queued_frame(table, wake.best_seconds(error, MAX_QUEUED_FRAME_S))
    table.meta["dedicated_rows"] = {kind: len(rows) for kind, rows in by_kind.items()}
    return table

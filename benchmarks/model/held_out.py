"""Held out: the fitted terms from one layout's runs, every row of the other checked.

``python -m benchmarks.model held-out A.json B.json ... [--also C.json ...]
[--rooted R.json ...]``: the runs (``cluster.json``) grouped by layout (H x L;
two layouts); ``fit_layout`` on one layout's runs (where its ranks share
cores ``wake.fit_wake``: ``WAKE``, ``GLOO_WAKE`` and, where a run recorded a
loaded machine, ``LOAD``; where they have a core each
``dedicated.fit_dedicated``: ``GLOO_CALL`` and ``QUEUED_FRAME``), ``check`` on
every run of the other and on the ``--also`` runs (a third layout, fitted on
by neither direction), then the other way round; each ``measure-rooted`` file is predicted with the
turn (``WAKE``) fitted on the ``measure-rooted`` files of the *other* layouts
(``wake.fit_rooted_wake``: a barrier's turn is not an allreduce's), the rest of
the table from the other layout's cluster runs, and beside it with the cluster
rows' turn (what was done before); no row is predicted from its own layout.
The links (alpha, beta per kind) come from ``--links`` (the 2-rank sweeps:
``data/quiet/links.json`` for a quiet machine).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.model import check, costs, dedicated, rooted, rooted_measure, wake
from benchmarks.model.links import GLOO_CALL, GLOO_WAKE, LOAD, QUEUED_FRAME, WAKE, LinkTable
from benchmarks.sizes import format_bytes


def layout(run: dict[str, Any]) -> tuple[int, int]:
    """(H, L) of a cluster or measure-rooted run, from its rows."""
    shapes = {(int(r["hosts"]), int(r["local"])) for r in run["rows"]}
    if len(shapes) != 1:
        raise ValueError(f"a run of one layout expected, got {sorted(shapes)}")
    return shapes.pop()


@dataclass(frozen=True)
class Direction:
    """One way round: fitted on the runs of ``fitted_on``, every row of the other
    layout's runs checked (``per_run``: each run's start and load, its rows)."""

    fitted_on: tuple[int, int]
    table: LinkTable
    per_run: list[tuple[str, list[check.Checked]]]

    @property
    def checked(self) -> list[check.Checked]:
        return [c for _, rows in self.per_run for c in rows]

    @property
    def checked_when(self) -> str:
        """The checked runs' starts and loads (``when``)."""
        return "; ".join(w for w, _ in self.per_run)


def when(run: dict[str, Any]) -> str:
    """A cluster run's start and 1-minute load average at start and end, from its meta,
    and the cores other processes took during its timed blocks where it recorded them
    (``meta.background_cores``)."""
    meta = run.get("meta", {})
    start, end = meta.get("loadavg_start"), meta.get("loadavg_end")
    load = f", load {start[0]:.1f} -> {end[0]:.1f}" if start and end else ""
    others = meta.get("background_cores")
    busy = f", other processes {others:.2f} cores" if others is not None else ""
    return f"{meta.get('started', 'start not recorded')}{load}{busy}"


def without_load(run: dict[str, Any]) -> dict[str, Any]:
    """``run`` as if it had not recorded the load (``background_cores``, its rows' and
    its own)."""
    rows = [{k: v for k, v in r.items() if k != "background_cores"} for r in run["rows"]]
    meta = {k: v for k, v in run.get("meta", {}).items() if k != "background_cores"}
    return {**run, "meta": meta, "rows": rows}


def fit_layout(runs: Sequence[dict[str, Any]], links: LinkTable) -> LinkTable:
    """``links`` with the terms one layout's ``runs`` fit: from rows whose ranks have a
    core each ``dedicated.fit_dedicated``'s (gloo's cost per call, entrenar's queued
    frames), then from rows whose ranks share cores ``wake.fit_wake``'s."""
    own, shared = dedicated.has_own_cores(runs), wake.shares_cores(runs)
    if not own and not shared:
        raise ValueError("no row below 1 MiB to fit the call's terms or the wake-ups on")
    table = dedicated.fit_dedicated(runs, links) if own else links
    return wake.fit_wake(runs, table) if shared else table


def held_out(
    runs: Sequence[dict[str, Any]],
    links: LinkTable,
    use_load: bool = True,
    also: Sequence[dict[str, Any]] = (),
) -> list[Direction]:
    """The runs of two layouts: fit on each layout's runs, check the other's and
    the runs ``also`` (of other layouts, fitted on neither) (``use_load`` False:
    every row as if no load was recorded, no load term)."""
    by_layout: dict[tuple[int, int], list[tuple[str, dict[str, Any]]]] = {}
    for run in runs:  # each run's heading says its load, even where the model ignores it
        by_layout.setdefault(layout(run), []).append((when(run), _used(run, use_load)))
    if len(by_layout) != 2:
        raise ValueError(f"runs of two layouts expected, got {sorted(by_layout)}")
    if any(layout(run) in by_layout for run in also):
        raise ValueError("a run checked beside both directions is of a layout fitted on")
    extra = [(when(run), _used(run, use_load)) for run in also]
    first, second = by_layout
    out = []
    for fit_on, check_on in ((first, second), (second, first)):
        table = fit_layout([r for _, r in by_layout[fit_on]], links)
        per_run = [(w, check.check([r], table)) for w, r in [*by_layout[check_on], *extra]]
        out.append(Direction(fit_on, table, per_run))
    return out


def _used(run: dict[str, Any], use_load: bool) -> dict[str, Any]:
    return run if use_load else without_load(run)


def median_over_runs(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per layout whose rows are the median over ``runs`` of that layout
    (each row's median; its fastest sample the fastest of any run): the row's
    typical time when a row falls into a slow mode in some runs and not in others
    (the 4 x 2 flat star at 64 KiB). Every row is kept; the heading says how many
    runs and when. The meta (rate, machine, transport) is the first run's; the load
    the median of the runs' (none if a run did not record it)."""
    by_layout: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for run in runs:
        by_layout.setdefault(layout(run), []).append(run)
    out = []
    for same in by_layout.values():
        rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for run in same:
            for row in run["rows"]:
                rows.setdefault((str(row["variant"]), int(row["bytes"])), []).append(row)
        merged = []
        for group in rows.values():
            row = {k: v for k, v in group[0].items() if k != "samples_s"}
            row["median_s"] = statistics.median(float(r["median_s"]) for r in group)
            row["min_s"] = min(float(r.get("min_s", r["median_s"])) for r in group)
            loads = [r.get("background_cores") for r in group]
            row["background_cores"] = (
                None
                if None in loads
                else statistics.median(float(x) for x in loads if x is not None)
            )
            merged.append(row)
        starts = [str(r.get("meta", {}).get("started", "?")) for r in same]
        meta = dict(same[0].get("meta", {}))
        meta["started"] = f"median of {len(same)} runs ({', '.join(starts)})"
        loads = [r.get("meta", {}).get("background_cores") for r in same]
        meta["background_cores"] = (
            None if None in loads else statistics.median(float(x) for x in loads if x is not None)
        )
        for key in ("loadavg_start", "loadavg_end"):
            meta.pop(key, None)
        out.append({**same[0], "meta": meta, "rows": merged})
    return out


@dataclass(frozen=True)
class RootedRow:
    """One entrenar row of a ``measure-rooted`` run, predicted two ways: ``predicted_s``
    with ``WAKE`` fitted on the rooted runs of other layouts (``wake.fit_rooted_wake``;
    where there are none, the cluster rows' fit), ``from_cluster_s`` with the cluster
    rows' fit of another layout (the allreduce's turn), and the host-aware barrier's
    figure (``rooted.barrier_leaders_dissemination``, not code) for a barrier row."""

    row: dict[str, Any]
    predicted_s: float
    from_cluster_s: float
    host_aware_s: float | None
    fitted_on: tuple[tuple[int, int], ...]  # the rooted layouts the wake came from

    @property
    def error(self) -> float:
        return self.predicted_s / float(self.row["median_s"]) - 1


def rooted_rows(
    run: dict[str, Any],
    directions: Sequence[Direction],
    rooted_runs: Sequence[dict[str, Any]] = (),
) -> list[RootedRow]:
    """entrenar's rows of a ``measure-rooted`` run, each predicted with tables fitted on
    other layouts only: the cluster rows' (``directions``) and, where ``rooted_runs``
    hold runs of other layouts, their own turn (``wake.fit_rooted_wake``)."""
    here = layout(run)
    tables = [d.table for d in directions if d.fitted_on != here]
    if not tables:
        raise ValueError(f"no cluster run of a layout other than {here} to fit on")
    from_cluster = rooted.with_frame(tables[0], 0.0)
    others = [r for r in rooted_runs if layout(r) != here]
    own = rooted.with_frame(wake.fit_rooted_wake(others, tables[0]), 0.0) if others else None
    rate, cores = str(run.get("rate", "1gbit")), wake.rooted_cores(run)
    out = []
    for r in run["rows"]:
        if r["backend"] != "entrenar":
            continue
        cluster_s = rooted_measure.predicted(r, from_cluster, rate, cores)
        predicted = rooted_measure.predicted(r, own, rate, cores) if own else cluster_s
        host_aware = None
        if r["op"] == "barrier":
            host_aware = rooted_measure.predicted_host_aware_barrier(
                r, own or from_cluster, rate, cores
            )
        fitted = tuple(sorted({layout(o) for o in others}))
        out.append(RootedRow(r, predicted, cluster_s, host_aware, fitted))
    return out


def fitted_terms(table: LinkTable) -> str:
    """The terms a layout's runs fitted: the wake-ups where its ranks shared cores,
    the cost per call and per queued frame where they had a core each."""
    terms = []
    if WAKE in table.params:
        load = table.params.get(LOAD)
        loaded = f", load {load.alpha * 1e6:.0f} us" if load else ", load not fitted"
        terms.append(
            f"wake {table[WAKE].alpha * 1e6:.0f} us, "
            f"gloo-wake {table[GLOO_WAKE].alpha * 1e6:.0f} us{loaded}"
        )
    if GLOO_CALL in table.params:
        per_message = ", ".join(
            f"{k} {table[k].alpha * 1e6:.0f} us" for k in (costs.GLOO.intra, costs.GLOO.inter)
        )
        terms.append(
            f"gloo call {table[GLOO_CALL].alpha * 1e6:.0f} us (alpha per message then "
            f"{per_message})"
        )
    if QUEUED_FRAME in table.params:
        terms.append(f"queued frame {table[QUEUED_FRAME].alpha * 1e6:.1f} us")
    return "; ".join(terms)


def report(directions: Sequence[Direction], rooted_runs: Sequence[dict[str, Any]]) -> str:
    lines = []
    for d in directions:
        h, local = d.fitted_on
        lines.append(f"\n## fitted on {h} x {local}: {fitted_terms(d.table)}")
        for started, rows in d.per_run:
            lines.append(f"\n### checked: the run of {started}\n")
            lines.append(check.report(rows))
    for run in rooted_runs:
        h, local = layout(run)
        predicted = rooted_rows(run, directions, rooted_runs)
        fitted = ", ".join(f"{a} x {b}" for a, b in predicted[0].fitted_on) if predicted else ""
        source = f"the rooted runs of {fitted}" if fitted else "the other layout's cluster rows"
        lines.append(f"\n## measure-rooted {h} x {local} (turn fitted on {source})\n")
        lines.append(
            "| op | size | measured | predicted | error | with the cluster rows' turn "
            "| host-aware barrier (model, not code) |\n|---|---|---|---|---|---|---|"
        )
        for rr in predicted:
            m = float(rr.row["median_s"])
            flag = " **>25 %**" if abs(rr.error) > check.TOLERANCE else ""
            cluster = f"{check.duration(rr.from_cluster_s)} ({rr.from_cluster_s / m - 1:+.0%})"
            aware = "-"
            if rr.host_aware_s is not None:
                aware = f"{check.duration(rr.host_aware_s)} ({rr.host_aware_s / m - 1:+.0%})"
            lines.append(
                f"| {rr.row['op']} | {format_bytes(int(rr.row['bytes']))} | {check.duration(m)} "
                f"| {check.duration(rr.predicted_s)} | {rr.error:+.0%}{flag} | {cluster} "
                f"| {aware} |"
            )
    return "\n".join(lines)


def load(path: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data

"""The ``wake`` kind's alpha: a hop's wait to be scheduled, fitted from emulated-cluster rows.

The links' alphas come from 2 ranks on 2 cores (``fit.py``): a core per
rank. The emulated clusters run H x L ranks on the same 2 cores (4 x 2: four
per core, under other jobs' load), and there every hop in sequence of a
ring or a plan waits for its rank to be scheduled: below 1 MiB that wait is
most of the time (gloo's ring at 4 x 2, 4 KiB: 14 steps, 23 ms measured
against 2.5 ms of link time). ``costs.Conditions`` charges it as
``WAKE``'s alpha x hops x (ranks per core - 1); this module fits the one
alpha, shared by gloo and entrenar (it is the scheduler's, not either
library's: fitted apart they came out within 1 %), by least squares on the
relative error over the rows below ``check.LARGE_BYTES`` of the given runs.
Fit on one set of runs, check on another (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.model import check, costs
from benchmarks.model.fit import _one
from benchmarks.model.links import WAKE, LinkParams, LinkTable


def fit_wake(runs: Sequence[dict[str, Any]], links: LinkTable) -> LinkTable:
    """``links`` with ``WAKE`` fitted from the rows below 1 MiB of ``runs`` (cluster.json)."""
    base = LinkTable({k: v for k, v in links.params.items() if k != WAKE}, dict(links.meta))
    x, y, scale = [], [], []
    for run in runs:
        for row in run["rows"]:
            if int(row["bytes"]) >= check.LARGE_BYTES:
                continue
            m = check.model_row(row, run.get("meta", {}))
            extra = m.where.ranks_per_core - 1
            if extra <= 0:
                continue
            measured = float(row["median_s"])
            x.append(costs.hops(m.phases) * extra)
            y.append(measured - costs.total_time(m.phases, base, m.where))
            scale.append(measured)
    if not x:
        raise ValueError("no row below 1 MiB with more ranks than cores to fit the wake-up on")
    alpha = _one(np.array(x), np.array(y), np.array(scale))
    base.params[WAKE] = LinkParams(alpha, 0.0)
    base.meta["wake_rows"] = len(x)
    return base

"""Predicted against measured: every row of a cluster run (``cluster.json``).

A row's variant says what ran: ``gloo`` is gloo's ring; ``entrenar`` and
``entrenar-flat`` are what today's policy picks for that size and world
(``entrenar_pg.collectives.policy.choose``, asked directly so the model can
never drift from it: direct / star / ring over TCP between hosts, the shm
allreduce when every rank is on one host). The harness's ``entrenar-flat``
is entrenar with host awareness off; until the host-aware algorithms exist
both run the flat policy, and once they do, ``entrenar``'s rows should map
to ``costs.hier_large`` / ``costs.hier_small`` by the new policy's choice.
The shm transport carries the bytes between ranks of one host unless the
run's ``meta.transport`` is ``tcp``. A row is flagged when the prediction is off by more than
``TOLERANCE`` of the measured median; the error against the fastest
sample is shown beside it (a loaded machine inflates the median).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.model import costs
from benchmarks.model.links import LinkTable
from benchmarks.sizes import format_bytes
from entrenar_pg.collectives.policy import choose
from entrenar_pg.config import Options
from entrenar_pg.wire import Algo, OpCode

TOLERANCE = 0.25

_BY_ALGO: dict[Algo, costs.Algorithm] = {
    Algo.RING: costs.ring,
    Algo.TREE_RING: costs.ring,
    Algo.STAR: costs.star,
    Algo.DIRECT: costs.direct,
    Algo.SHM: costs.shm,
}


@dataclass(frozen=True)
class Checked:
    """One row: what ran, measured and predicted seconds."""

    variant: str
    algorithm: str
    hosts: int
    local: int
    nbytes: int
    measured_s: float
    predicted_s: float
    fastest_s: float  # the run's fastest sample: the closest to an idle machine
    link_bytes: float  # predicted bytes per host link per direction
    measured_link_bytes: float | None  # the run's busiest host link (frames), if counted

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def flagged(self) -> bool:
        return abs(self.error) > TOLERANCE


def _nothing(shape: costs.Shape, fabric: costs.Fabric) -> list[costs.Phase]:
    """One rank: nothing moves."""
    return []


def entrenar_algorithm(shape: costs.Shape, transport: str) -> tuple[str, costs.Algorithm]:
    """The name and formula of what the policy runs today for ``shape``."""
    opts = Options(transport=transport)
    local = shape.hosts == 1 and transport != "tcp"
    algo = choose(OpCode.ALLREDUCE, shape.nbytes, shape.world, opts, local).algo
    if algo is Algo.NONE:
        return "none", _nothing
    return algo.name.lower(), _BY_ALGO[algo]


def predict_row(row: dict[str, Any], meta: dict[str, Any], links: LinkTable) -> Checked:
    shape = costs.Shape(int(row["hosts"]), int(row["local"]), int(row["bytes"]))
    variant = str(row["variant"])
    algo: costs.Algorithm
    if variant == "gloo":
        name, algo, fabric = "gloo ring", costs.ring, costs.GLOO
    elif variant in ("entrenar", "entrenar-flat"):
        transport = str(meta.get("transport") or "auto")
        name, algo = entrenar_algorithm(shape, transport)
        fabric = costs.ENTRENAR_TCP if transport == "tcp" else costs.ENTRENAR
    else:
        raise ValueError(f"cluster row variant {variant!r}: no model for it")
    phases = algo(shape, fabric)
    predicted = costs.total_time(phases, links)
    link_bytes = costs.host_link_bytes(phases, fabric.inter)
    counted = row.get("xhost_bytes_per_host")
    measured, fastest = float(row["median_s"]), float(row.get("min_s", row["median_s"]))
    return Checked(
        variant,
        name,
        shape.hosts,
        shape.local,
        shape.nbytes,
        measured,
        predicted,
        fastest,
        link_bytes,
        None if counted is None else float(counted),
    )


def check(runs: Sequence[dict[str, Any]], links: LinkTable) -> list[Checked]:
    """Every row of every run, predicted."""
    return [predict_row(row, run.get("meta", {}), links) for run in runs for row in run["rows"]]


def _counted(c: Checked) -> str:
    """The counted bytes and their ratio to the prediction (frames: headers and ACKs too)."""
    if c.measured_link_bytes is None:
        return "-"
    ratio = f" ({c.measured_link_bytes / c.link_bytes:.2f}x)" if c.link_bytes else ""
    return _mib(c.measured_link_bytes) + ratio


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.3g} MiB"


def report(checked: Sequence[Checked]) -> str:
    """A markdown table, flagged rows marked, and a summary line."""
    lines = [
        "| variant | algorithm | H x L | size | measured (median) | predicted | error "
        "| min | error vs min | host link bytes: predicted | counted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in checked:
        mark = " **>25 %**" if c.flagged else ""
        lines.append(
            f"| {c.variant} | {c.algorithm} | {c.hosts} x {c.local} | {format_bytes(c.nbytes)} "
            f"| {c.measured_s * 1e3:.3g} ms | {c.predicted_s * 1e3:.3g} ms | {c.error:+.0%}{mark} "
            f"| {c.fastest_s * 1e3:.3g} ms | {(c.predicted_s - c.fastest_s) / c.fastest_s:+.0%} "
            f"| {_mib(c.link_bytes)} | {_counted(c)} |"
        )
    bad = sum(c.flagged for c in checked)
    lines.append("")
    lines.append(
        f"{len(checked) - bad} of {len(checked)} rows within {TOLERANCE:.0%}; {bad} flagged."
    )
    return "\n".join(lines)

"""Predicted against measured: every row of a cluster run (``cluster.json``).

A row's variant says what ran: ``gloo`` is gloo's ring; every entrenar
variant of the cluster harness (``benchmarks/cluster_config.CLUSTER_VARIANTS``:
``entrenar``, ``entrenar-flat``, ``entrenar-leaders``, ``entrenar-slices``)
runs what the policy picks with that variant's ``Options`` overrides, for
that size, world and *topology*: ``entrenar_pg.collectives.policy.choose``
is asked directly, with the ``transport.topology.Topology`` of H hosts x L
ranks placed as torchrun places them, so the model can never drift from
it (host-aware ``HOST_LEADERS`` / ``HOST_SLICES`` across hosts, the flat
direct / star / ring with ``topology="flat"`` or one rank per host, the
shm allreduce when every rank is on one host). The shm transport carries
the bytes between ranks of one host unless the run's ``meta.transport`` is
``tcp``. A row is flagged when the prediction is off by more than
``TOLERANCE`` of the measured median; the error against the fastest
sample is shown beside it (a loaded machine inflates the median).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.cluster_config import CLUSTER_VARIANTS
from benchmarks.model import costs
from benchmarks.model.links import LinkTable
from benchmarks.sizes import format_bytes
from entrenar_pg.collectives.policy import choose
from entrenar_pg.config import Options
from entrenar_pg.transport.topology import Topology
from entrenar_pg.wire import Algo, OpCode

TOLERANCE = 0.25

_BY_ALGO: dict[Algo, costs.Algorithm] = {
    Algo.RING: costs.ring,
    Algo.TREE_RING: costs.ring,
    Algo.STAR: costs.star,
    Algo.DIRECT: costs.direct,
    Algo.SHM: costs.shm,
    Algo.HOST_SLICES: costs.host_slices,
    Algo.HOST_LEADERS: costs.host_leaders,
    Algo.DOUBLING: costs.doubling,
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
    # gloo's fast mode where its ranks share cores: every wake-up finds its core
    # free (``without_wake_ups``); None where there is one mode (entrenar, a core per rank).
    fast_s: float | None = None
    background_cores: float | None = None  # the row's load, if the run recorded it

    @property
    def error(self) -> float:
        """(predicted - measured) / measured, against the one (slow-mode) prediction."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def mode(self) -> str:
        """Which of gloo's two modes the median fell into (the nearer by ratio); '' if one."""
        if self.fast_s is None:
            return ""
        slow_off = abs(math.log(self.predicted_s / self.measured_s))
        return "fast" if abs(math.log(self.fast_s / self.measured_s)) < slow_off else "slow"

    @property
    def mode_predicted_s(self) -> float:
        """The prediction of the mode the row fell into."""
        return self.fast_s if self.mode == "fast" and self.fast_s else self.predicted_s

    @property
    def mode_error(self) -> float:
        """(predicted - measured) / measured against the mode the row fell into."""
        return (self.mode_predicted_s - self.measured_s) / self.measured_s

    @property
    def flagged(self) -> bool:
        """Off by more than ``TOLERANCE`` from the mode it fell into (gloo: from both)."""
        return abs(self.mode_error) > TOLERANCE


def _nothing(shape: costs.Shape, fabric: costs.Fabric) -> list[costs.Phase]:
    """One rank: nothing moves."""
    return []


def topology_of(shape: costs.Shape) -> Topology:
    """H hosts x L ranks as torchrun places them: rank = host x L + local rank."""
    return Topology.from_keys([f"host{r // shape.local}" for r in range(shape.world)])


# The policy's thresholds in runs that do not record theirs (``meta``'s
# ``policy_defaults``): every run before the twenty-ninth session (2026-11-27),
# when the star on few hosts took up to 64 KiB of extra bytes and the leaders'
# direct exchange had no limit on a host link (docs/benchmarks.md, "A core per
# rank"). Without this, today's policy would name another algorithm for their
# 2 x 2 and 4 x 2 rows at 64 KiB than the one that ran.
POLICY_BEFORE_RECORDED: dict[str, Any] = {
    "host_star_max_bytes": 64 << 10,
    "host_leaders_link_bytes": 1 << 40,
}


def options_of(
    variant: str, transport: str = "auto", meta: dict[str, Any] | None = None
) -> Options:
    """The ``Options`` the cluster harness runs ``variant`` with (its overrides) on
    the policy's defaults: today's, or with ``meta`` a run's own (its recorded
    ``policy_defaults``; ``POLICY_BEFORE_RECORDED`` where it has none)."""
    overrides = {v.name: v.options for v in CLUSTER_VARIANTS if v.backend == "entrenar"}
    if variant not in overrides:
        raise ValueError(f"cluster row variant {variant!r}: no model for it")
    base: dict[str, Any] = {}
    if meta is not None:
        recorded = meta.get("policy_defaults") or POLICY_BEFORE_RECORDED
        names = {f.name for f in dataclasses.fields(Options)} - {"transport"}
        base = {k: v for k, v in recorded.items() if k in names}
    return Options(transport=transport, **{**base, **overrides[variant]})


def entrenar_algorithm(
    shape: costs.Shape, transport: str, options: Options | None = None
) -> tuple[str, costs.Algorithm]:
    """The name and formula of what the policy runs for ``shape`` (default ``Options``)."""
    opts = options if options is not None else Options(transport=transport)
    local = shape.hosts == 1 and transport != "tcp"
    topology = topology_of(shape)
    algo = choose(OpCode.ALLREDUCE, shape.nbytes, shape.world, opts, local, topology).algo
    if algo is Algo.NONE:
        return "none", _nothing
    return algo.name.lower(), _BY_ALGO[algo]


# tc tbf's burst on the emulated host links (benchmarks/netns.Shaping.tbf_burst,
# "128kb": tc's kilobytes are 1,024 bytes).
TBF_BURST_BYTES = 128 << 10


def conditions_of(
    meta: dict[str, Any], shape: costs.Shape, background_cores: float | None = None
) -> costs.Conditions:
    """What an emulated-cluster run adds to its links: every rank on the
    machine's cores (its ``meta.machine.nproc``; a run that does not say is
    taken as a core per rank), tbf's burst where the links were shaped, and
    the load: ``background_cores``, the cores other processes took while the
    row ran (``cluster.json``'s row field; None, as in runs before it was
    recorded: none)."""
    machine = meta.get("machine")
    cores = machine.get("nproc") if isinstance(machine, dict) else None
    per_core = shape.world / int(cores) if cores else 1.0
    free = TBF_BURST_BYTES if meta.get("rate") else 0.0
    share = background_cores / int(cores) if cores and background_cores else 0.0
    return costs.Conditions(ranks_per_core=per_core, free_net_bytes=free, busy_share=share)


@dataclass(frozen=True)
class Modelled:
    """One measured row as the model sees it: what ran, its phases, under what."""

    variant: str
    algorithm: str
    shape: costs.Shape
    fabric: costs.Fabric
    phases: list[costs.Phase]
    where: costs.Conditions


def model_row(row: dict[str, Any], meta: dict[str, Any]) -> Modelled:
    shape = costs.Shape(int(row["hosts"]), int(row["local"]), int(row["bytes"]))
    variant = str(row["variant"])
    algo: costs.Algorithm
    if variant == "gloo":
        name, algo, fabric = "gloo ring", costs.ring, costs.GLOO
    else:
        transport = str(meta.get("transport") or "auto")
        name, algo = entrenar_algorithm(shape, transport, options_of(variant, transport, meta))
        fabric = costs.ENTRENAR_TCP if transport == "tcp" else costs.ENTRENAR
    where = conditions_of(meta, shape, row.get("background_cores"))
    return Modelled(variant, name, shape, fabric, algo(shape, fabric), where)


def without_wake_ups(links: LinkTable, fabric: costs.Fabric) -> LinkTable:
    """``links`` without ``fabric``'s wake kind: every wake-up finds its core free."""
    params = {k: v for k, v in links.params.items() if k != fabric.wake}
    return LinkTable(params, links.meta)


def predict_row(row: dict[str, Any], meta: dict[str, Any], links: LinkTable) -> Checked:
    m = model_row(row, meta)
    predicted = costs.total_time(m.phases, links, m.where, m.fabric)
    fast = None
    if not m.fabric.spins and costs.hop_wait(links, m.where, m.fabric) > 0:
        fast = costs.total_time(m.phases, without_wake_ups(links, m.fabric), m.where, m.fabric)
        if predicted <= fast * (1 + TOLERANCE):
            fast = None  # the wake-ups hide behind the bytes: one mode, within the tolerance
    link_bytes = costs.host_link_bytes(m.phases, m.fabric.inter)
    counted = row.get("xhost_bytes_per_host")
    measured, fastest = float(row["median_s"]), float(row.get("min_s", row["median_s"]))
    return Checked(
        m.variant,
        m.algorithm,
        m.shape.hosts,
        m.shape.local,
        m.shape.nbytes,
        measured,
        predicted,
        fastest,
        link_bytes,
        None if counted is None else float(counted),
        fast,
        row.get("background_cores"),
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


def duration(seconds: float) -> str:
    """``1.23 s`` or ``45.6 ms``."""
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.3g} MiB"


def _load(c: Checked) -> str:
    return "-" if c.background_cores is None else f"{c.background_cores:.2f}"


def _fast(c: Checked) -> str:
    """gloo's fast-mode prediction, its error, and the mode the row fell into."""
    if c.fast_s is None:
        return "-"
    fast_error = (c.fast_s - c.measured_s) / c.measured_s
    return f"{duration(c.fast_s)} ({fast_error:+.0%}); row: {c.mode}"


def report(checked: Sequence[Checked]) -> str:
    """A markdown table, flagged rows marked, and a summary line."""
    lines = [
        "| variant | algorithm | H x L | size | load (cores) | measured (median) | predicted "
        "| error | gloo's fast mode | min | error vs min | host link bytes: predicted "
        "| counted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in checked:
        mark = " **>25 %**" if c.flagged else ""
        lines.append(
            f"| {c.variant} | {c.algorithm} | {c.hosts} x {c.local} | {format_bytes(c.nbytes)} "
            f"| {_load(c)} | {duration(c.measured_s)} | {duration(c.predicted_s)} "
            f"| {c.error:+.0%}{mark} | {_fast(c)} | {duration(c.fastest_s)} "
            f"| {(c.predicted_s - c.fastest_s) / c.fastest_s:+.0%} "
            f"| {_mib(c.link_bytes)} | {_counted(c)} |"
        )
    bad = sum(c.flagged for c in checked)
    one = sum(abs(c.error) <= TOLERANCE for c in checked)
    banded = [c for c in checked if c.fast_s is not None]
    fast = sum(c.mode == "fast" for c in banded)
    lines.append("")
    lines.append(
        f"{len(checked) - bad} of {len(checked)} rows within {TOLERANCE:.0%} of the mode they "
        f"fell into; {bad} flagged. Against the one (slow-mode) prediction: {one} of "
        f"{len(checked)}. gloo's rows with two modes (ranks sharing cores): {len(banded)}, "
        f"{fast} in the fast mode."
    )
    lines += summary(checked)
    return "\n".join(lines)


LARGE_BYTES = 1 << 20  # from here up the host link's rate binds at 1 Gbit/s (the fit's regime)


def summary(checked: Sequence[Checked]) -> list[str]:
    """Rows within the tolerance per H x L, below ``LARGE_BYTES`` and from it up."""
    out = []
    for h, local in sorted({(c.hosts, c.local) for c in checked}):
        cells = []
        for label, large in (("below 1 MiB", False), ("from 1 MiB", True)):
            rows = [
                c
                for c in checked
                if (c.hosts, c.local) == (h, local) and (c.nbytes >= LARGE_BYTES) == large
            ]
            ok = sum(not c.flagged for c in rows)
            cells.append(f"{label} {ok} of {len(rows)}")
        out.append(f"- {h} x {local}: " + ", ".join(cells))
    return out


PLOT_TITLE = "Cost model against emulated clusters (1 Gbit/s host links, loaded 2-core machine)"


def plot(
    checked: Sequence[Checked],
    path: Path,
    title: str = PLOT_TITLE,
) -> None:
    """Measured (median, bar down to the fastest sample) against predicted (of the mode
    the row fell into), one panel per H x L."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(c.hosts, c.local) for c in checked})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 5.5), squeeze=False)
    markers = dict(zip(sorted({c.variant for c in checked}), "osD^v<>", strict=False))
    for ax, (h, local) in zip(axes[0], shapes, strict=True):
        rows = [c for c in checked if (c.hosts, c.local) == (h, local)]
        lo = min(min(c.mode_predicted_s, c.fastest_s) for c in rows) / 2
        hi = max(max(c.mode_predicted_s, c.measured_s) for c in rows) * 2
        ax.loglog([lo, hi], [lo, hi], "k-", linewidth=0.8)
        ax.fill_between(
            [lo, hi],
            [lo / (1 + TOLERANCE), hi / (1 + TOLERANCE)],
            [lo / (1 - TOLERANCE), hi / (1 - TOLERANCE)],
            color="grey",
            alpha=0.2,
            label=f"within {TOLERANCE:.0%}",
        )
        for variant, marker in markers.items():
            mine = [c for c in rows if c.variant == variant]
            if not mine:
                continue
            xs = [c.mode_predicted_s for c in mine]
            ys = [c.measured_s for c in mine]
            below = [c.measured_s - min(c.fastest_s, c.measured_s) for c in mine]
            ax.errorbar(
                xs, ys, yerr=[below, [0.0] * len(mine)], fmt=marker, label=variant, capsize=2
            )
        ax.set_xlabel("predicted seconds")
        ax.set_ylabel("measured median seconds (bar: to the fastest sample)")
        sizes = sorted({c.nbytes for c in rows})
        span = f"{format_bytes(sizes[0])} .. {format_bytes(sizes[-1])}"
        ax.set_title(f"{h} hosts x {local} ranks, {span}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)

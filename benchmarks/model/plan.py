"""Plan the scale we cannot run here: predicted times, crossovers and a plot.

For every hosts H in {2, 4, ..., 1024}, local ranks L in {1, 2, 8} and size
4 KiB .. 256 MiB: the predicted time of each algorithm of
``costs.ALGORITHMS``, the fastest, and the crossovers (the size, found by
bisection on a log scale, where the fastest changes). ``scale_table``: what
the policy picks (asked with the topology, ``check.entrenar_algorithm``) at
H in {8, 64, 1024} x 8 against the flat ring and the model's fastest;
``threshold_lines``: where ``HOST_LEADERS`` and ``HOST_SLICES`` cross for
each H, against ``Options.host_leaders_max_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.model import check, costs
from benchmarks.model.links import LinkTable
from benchmarks.sizes import format_bytes
from entrenar_pg.collectives.policy import leaders_fit
from entrenar_pg.config import Options

HOSTS = tuple(2**i for i in range(1, 11))
LOCALS = (1, 2, 8)
SIZES = tuple(4096 * 4**i for i in range(9))  # 4 KiB .. 256 MiB
PLOT_HOSTS = (2, 4, 64, 1024)
PLOT_LOCALS = (2, 8)
SCALE_HOSTS = (8, 64, 1024)
SCALE_LOCAL = 8
SCALE_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
THRESHOLD_SIZES = tuple(256 * 2**i for i in range(21))  # 256 B .. 256 MiB
BISECT_STEPS = 20


@dataclass(frozen=True)
class Crossover:
    """Above ``nbytes`` (about), ``after`` beats ``before`` on hosts x local."""

    hosts: int
    local: int
    nbytes: int
    before: str
    after: str


def times(
    hosts: int, local: int, nbytes: int, links: LinkTable, names: Sequence[str]
) -> dict[str, float]:
    shape = costs.Shape(hosts, local, nbytes)
    return {n: costs.predict(n, shape, links) for n in names}


def best(hosts: int, local: int, nbytes: int, links: LinkTable, names: Sequence[str]) -> str:
    t = times(hosts, local, nbytes, links, names)
    return min(t, key=lambda n: t[n])


def crossovers(
    hosts: int, local: int, links: LinkTable, names: Sequence[str], sizes: Sequence[int] = SIZES
) -> list[Crossover]:
    """Where the fastest algorithm changes between consecutive ``sizes``, located by bisection."""
    found = []
    for lo, hi in zip(sizes, sizes[1:], strict=False):
        a, b = best(hosts, local, lo, links, names), best(hosts, local, hi, links, names)
        if a == b:
            continue
        x, y = math.log(lo), math.log(hi)
        for _ in range(BISECT_STEPS):
            mid = (x + y) / 2
            if best(hosts, local, round(math.exp(mid)), links, names) == a:
                x = mid
            else:
                y = mid
        found.append(
            Crossover(
                hosts,
                local,
                round(math.exp(y)),
                a,
                best(hosts, local, round(math.exp(y)), links, names),
            )
        )
    return found


def table(links: LinkTable, names: Sequence[str], hosts: Sequence[int] = HOSTS) -> str:
    """Markdown: per (H, L), the fastest algorithm and its time at each size."""
    head = "| H x L | " + " | ".join(format_bytes(s) for s in SIZES) + " |"
    lines = [head, "|---" * (len(SIZES) + 1) + "|"]
    for h in hosts:
        for local in LOCALS:
            cells = []
            for s in SIZES:
                t = times(h, local, s, links, names)
                name = min(t, key=lambda n: t[n])
                cells.append(f"{name} {_ms(t[name])}")
            lines.append(f"| {h} x {local} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def full_table(links: LinkTable, names: Sequence[str], hosts: int, local: int) -> str:
    """Markdown: every algorithm's predicted time per size, for one (H, L)."""
    lines = ["| size | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for s in SIZES:
        t = times(hosts, local, s, links, names)
        lines.append(f"| {format_bytes(s)} | " + " | ".join(_ms(t[n]) for n in names) + " |")
    return "\n".join(lines)


def crossover_lines(links: LinkTable, names: Sequence[str]) -> list[str]:
    out = []
    for h in HOSTS:
        for local in LOCALS:
            xs = crossovers(h, local, links, names)
            steps = ", ".join(f"{c.before} -> {c.after} at {format_bytes(c.nbytes)}" for c in xs)
            first = best(h, local, SIZES[0], links, names)
            out.append(f"- {h} x {local}: {first} first; {steps or 'no change'}")
    return out


@dataclass(frozen=True)
class Picked:
    """What the policy runs for one (H, L, size), and its prediction."""

    algorithm: str  # the policy's Algo, lower case
    seconds: float
    link_bytes: float  # per host link per direction


def policy_pick(hosts: int, local: int, nbytes: int, links: LinkTable) -> Picked:
    """The policy's choice for H x L ranks placed as torchrun places them (default Options)."""
    shape = costs.Shape(hosts, local, nbytes)
    name, algo = check.entrenar_algorithm(shape, "auto")
    phases = algo(shape, costs.ENTRENAR)
    return Picked(name, costs.total_time(phases, links), costs.host_link_bytes(phases, costs.NET))


def scale_table(links: LinkTable) -> str:
    """Markdown: H in ``SCALE_HOSTS`` x ``SCALE_LOCAL``, the policy's pick against the flat ring."""
    names = list(costs.ALGORITHMS)
    lines = [
        "| H x L | size | policy picks | predicted | flat ring | gloo ring | picks / flat ring "
        "| fastest in the model | host link bytes / bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for h in SCALE_HOSTS:
        for s in SCALE_SIZES:
            pick = policy_pick(h, SCALE_LOCAL, s, links)
            t = times(h, SCALE_LOCAL, s, links, names)
            fastest = min(t, key=lambda n: t[n])
            bound = 2 * (h - 1) / h * s
            lines.append(
                f"| {h} x {SCALE_LOCAL} | {format_bytes(s)} | {pick.algorithm} "
                f"| {_ms(pick.seconds)} | {_ms(t['ring'])} | {_ms(t['gloo ring'])} "
                f"| {pick.seconds / t['ring']:.2f} | {fastest} {_ms(t[fastest])} "
                f"| {pick.link_bytes / bound:.2f} |"
            )
    return "\n".join(lines)


def leaders_to_slices(hosts: int, local: int, links: LinkTable) -> int | None:
    """The size above which ``HOST_SLICES`` beats ``HOST_LEADERS`` (None: no change in range)."""
    pair = ["host leaders", "host slices"]
    found = crossovers(hosts, local, links, pair, THRESHOLD_SIZES)
    return found[0].nbytes if found else None


def policy_leaders_max(hosts: int) -> int:
    """The largest message, to a KiB, that the policy sends through the leaders on
    ``hosts`` hosts: asked of ``policy.leaders_fit`` itself, size by size."""
    o = Options()
    return max(s for s in range(1 << 10, (1 << 20) + 1, 1 << 10) if leaders_fit(hosts, s, o))


def threshold_lines(links: LinkTable) -> list[str]:
    """Per H and L: the leaders -> slices crossover, against the policy's threshold.

    With the leaders' direct exchange (up to 4 hosts) both grow linearly in
    H (leaders: (H-1) x S x beta; slices: 2(H-1) x alpha), so the crossover
    falls towards 2 alpha / beta of the link; from 8 hosts the leaders double
    (log2 H x S, log2 H hops: ``hierarchical.leaders_doubling``) and it rises.
    """
    net = links[costs.NET]
    threshold = Options().host_leaders_max_bytes
    out = [
        f"policy: host_leaders_max_bytes = {format_bytes(threshold)}, the direct exchange's "
        f"{format_bytes(Options().host_leaders_link_bytes)} a link (host_leaders_link_bytes), so "
        + ", ".join(f"{h}: {_kib(policy_leaders_max(h))}" for h in HOSTS)
        + "; "
        f"2 alpha / beta = {_kib(2 * net.alpha / net.beta)} "
        "(the direct exchange's large-H limit; the doubling's crossover rises with H)"
    ]
    for local in PLOT_LOCALS:
        cells = []
        for h in HOSTS:
            x = leaders_to_slices(h, local, links)
            cells.append(f"{h}: {_kib(x) if x else '-'}")
        out.append(f"- L = {local}: " + ", ".join(cells))
    return out


def _ms(seconds: float) -> str:
    return check.duration(seconds)


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:.0f} KiB"


def plot(links: LinkTable, names: Sequence[str], path: Path) -> None:
    """Time against size per algorithm; one panel per (L, H) of ``LOCALS`` x ``PLOT_HOSTS``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PLOT_LOCALS), len(PLOT_HOSTS), figsize=(16, 8), sharex=True)
    for i, local in enumerate(PLOT_LOCALS):
        for j, h in enumerate(PLOT_HOSTS):
            ax = axes[i][j]
            for n in names:
                ys = [costs.predict(n, costs.Shape(h, local, s), links) for s in SIZES]
                style = ":" if n in costs.PROPOSALS else "-"
                ax.loglog(SIZES, ys, style, marker=".", label=n)
            picked = [policy_pick(h, local, s, links).seconds for s in SIZES]
            ax.loglog(SIZES, picked, "k--", linewidth=2.5, alpha=0.4, label="policy's pick")
            # star and direct grow as H x L x S: keep the panel on the contenders
            ring_max = costs.predict("ring", costs.Shape(h, local, SIZES[-1]), links)
            ax.set_ylim(top=10 * ring_max)
            ax.set_title(f"{h} hosts x {local} ranks")
            ax.grid(True, which="both", alpha=0.3)
            if i == len(PLOT_LOCALS) - 1:
                ax.set_xlabel("bytes per rank")
            if j == 0:
                ax.set_ylabel("predicted seconds")
    axes[0][0].legend(fontsize=8)
    rate = links.meta.get("rate", "?")
    fig.suptitle(
        f"Cost model: predicted allreduce time, host links at {rate} (fitted parameters; "
        "dotted: proposals, not code)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_threshold(links: LinkTable, path: Path) -> None:
    """The leaders -> slices crossover against H, per L, and the policy's own
    (``policy_leaders_max``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for local in PLOT_LOCALS:
        pts = [(h, leaders_to_slices(h, local, links)) for h in HOSTS]
        xs = [h for h, x in pts if x]
        ax.loglog(xs, [x for _, x in pts if x], marker="o", label=f"model, L = {local}")
    ax.loglog(HOSTS, [policy_leaders_max(h) for h in HOSTS], "k--", label="policy")
    net = links[costs.NET]
    ax.axhline(2 * net.alpha / net.beta, color="grey", linestyle=":", label="2 alpha / beta")
    ax.set_xlabel("hosts H")
    ax.set_ylabel("bytes: HOST_SLICES faster above")
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("HOST_LEADERS -> HOST_SLICES crossover (cost model)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)

"""Plan the scale we cannot run here: predicted times, crossovers and a plot.

For every hosts H in {2, 4, ..., 1024}, local ranks L in {1, 2, 8} and size
4 KiB .. 256 MiB: the predicted time of each algorithm of
``costs.ALGORITHMS``, the fastest, and the crossovers (the size, found by
bisection on a log scale, where the fastest changes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.model import costs
from benchmarks.model.links import LinkTable
from benchmarks.sizes import format_bytes

HOSTS = tuple(2**i for i in range(1, 11))
LOCALS = (1, 2, 8)
SIZES = tuple(4096 * 4**i for i in range(9))  # 4 KiB .. 256 MiB
PLOT_HOSTS = (2, 4, 64, 1024)
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
            if best(hosts, local, int(math.exp(mid)), links, names) == a:
                x = mid
            else:
                y = mid
        found.append(
            Crossover(
                hosts,
                local,
                int(math.exp(y)),
                a,
                best(hosts, local, int(math.exp(y)), links, names),
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


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def plot(links: LinkTable, names: Sequence[str], path: Path) -> None:
    """Time against size per algorithm; one panel per (L, H) of ``LOCALS`` x ``PLOT_HOSTS``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(LOCALS), len(PLOT_HOSTS), figsize=(16, 11), sharex=True)
    for i, local in enumerate(LOCALS):
        for j, h in enumerate(PLOT_HOSTS):
            ax = axes[i][j]
            for n in names:
                ys = [costs.predict(n, costs.Shape(h, local, s), links) for s in SIZES]
                ax.loglog(SIZES, ys, marker=".", label=n)
            ax.set_title(f"{h} hosts x {local} ranks")
            ax.grid(True, which="both", alpha=0.3)
            if i == len(LOCALS) - 1:
                ax.set_xlabel("bytes per rank")
            if j == 0:
                ax.set_ylabel("predicted seconds")
    axes[0][0].legend(fontsize=8)
    rate = links.meta.get("rate", "?")
    fig.suptitle(f"Cost model: predicted allreduce time, host links at {rate} (fitted parameters)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)

"""The flat rows' small allreduce at large N: the star against recursive doubling.

``python -m benchmarks.model flat``. Where the policy runs the flat rows
(one rank per host, uneven hosts, a fast cross-host link, or one host over
TCP) the star's root talks to all N - 1 ranks: N - 1 sockets, 2(N - 1)
frames handled one after another (the ``FRAME`` kind of rooted.py, CPU per
frame at the busiest rank) and (N - 1) x S through its link each way.
Recursive doubling (collectives/doubling.py) takes ceil(log2 N) hops
instead of 2, each rank handling two frames a round (and its ring
neighbours' headers), log2 N x S per link. The model below adds those
frames to ``costs.star`` and ``costs.doubling`` (a phase of its own, in
sequence with the hops: it is the root's CPU on the critical path), and
finds the smallest N from which doubling is faster, per size, on:

- ``one rank per host``: H x 1, every hop over the network kind (``net``);
- ``one host, TCP``: 1 x N over loopback (``ENTRENAR_TRANSPORT=tcp``).

Both on dedicated cores (``costs.DEDICATED``: a core per rank, as on a
cluster). ``this machine`` repeats the first with every rank on 2 cores
(``Conditions.ranks_per_core`` N/2: each hop in sequence waits ``wake`` per
turn of the others on its core, ``costs.hop_wait``), which is what
``benchmarks.scale --calls`` measures here: there the star's two hops beat
doubling's log2 N at every N, as measured (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.model import costs
from benchmarks.model.links import LinkTable
from benchmarks.model.rooted import FRAME, with_frame
from benchmarks.sizes import format_bytes
from entrenar_pg.collectives.policy import FLAT_DOUBLING_MIN_WORLD

WORLDS = tuple(2**i for i in range(2, 11))  # 4 .. 1,024
SIZES = (4 << 10, 64 << 10, 1 << 20)
CORES = 2  # this machine


def star_frames(shape: costs.Shape) -> list[costs.Phase]:
    """``costs.star`` and its root's 2(N - 1) frames (N - 1 in, N - 1 out) in sequence."""
    n = shape.world
    return [
        *costs.star(shape, costs.ENTRENAR),
        costs.Phase("root's frames", {}, {FRAME: 2 * (n - 1)}),
    ]


def doubling_frames(shape: costs.Shape) -> list[costs.Phase]:
    """``costs.doubling`` and each rank's frames: one in and one out per round, and the
    ring neighbours' two headers."""
    rounds = sum(costs.doubling_rounds(shape))
    frames = costs.Phase("a rank's frames", {}, {FRAME: 2 * rounds + 2})
    return [*costs.doubling(shape, costs.ENTRENAR), frames]


LAYOUTS = {
    "one rank per host": lambda n, s: costs.Shape(n, 1, s),
    "one host, TCP": lambda n, s: costs.Shape(1, n, s),
}


def seconds(
    algo: str, shape: costs.Shape, links: LinkTable, where: costs.Conditions = costs.DEDICATED
) -> float:
    phases = star_frames(shape) if algo == "star" else doubling_frames(shape)
    if shape.hosts == 1:  # one host over TCP: loopback, not shared memory
        phases = [_on_loopback(p) for p in phases]
    return costs.total_time(phases, with_frame(links), where)


def _on_loopback(phase: costs.Phase) -> costs.Phase:
    swap = {costs.SHM: costs.LOOPBACK}
    return costs.Phase(
        phase.name,
        {swap.get(k, k): v for k, v in phase.messages.items()},
        {swap.get(k, k): v for k, v in phase.nbytes.items()},
        phase.fill,
    )


def this_machine(shape: costs.Shape) -> costs.Conditions:
    return costs.Conditions(ranks_per_core=shape.world / CORES)


def crossover(layout: str, nbytes: int, links: LinkTable, machine: bool = False) -> int | None:
    """The smallest N of ``WORLDS`` from which doubling is at least as fast as the star
    at every larger N of ``WORLDS`` (None: not within them)."""
    make = LAYOUTS[layout]
    found = None
    for n in reversed(WORLDS):
        shape = make(n, nbytes)
        where = this_machine(shape) if machine else costs.DEDICATED
        if seconds("doubling", shape, links, where) > seconds("star", shape, links, where):
            break
        found = n
    return found


def table(links: LinkTable, worlds: Sequence[int] = WORLDS) -> str:
    """Markdown: per layout, N and size, star and doubling predicted, their ratio."""
    lines = [
        "| layout | N | " + " | ".join(f"{format_bytes(s)} star / doubling" for s in SIZES) + " |",
        "|---|---|" + "---|" * len(SIZES),
    ]
    for layout, make in LAYOUTS.items():
        for n in worlds:
            cells = []
            for s in SIZES:
                a, b = seconds("star", make(n, s), links), seconds("doubling", make(n, s), links)
                cells.append(f"{_ms(a)} / {_ms(b)} ({b / a:.2f})")
            lines.append(f"| {layout} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_lines(links: LinkTable, worlds: Sequence[int] = (8, 16, 32, 64, 128, 256)) -> list[str]:
    """Doubling / star at 4 KiB on this machine (N ranks on 2 cores, one rank per host)."""
    out = []
    for n in worlds:
        shape = costs.Shape(n, 1, 4 << 10)
        where = this_machine(shape)
        a, b = seconds("star", shape, links, where), seconds("doubling", shape, links, where)
        out.append(f"- N = {n}: star {_ms(a)}, doubling {_ms(b)} ({b / a:.2f})")
    return out


def report(links: LinkTable) -> str:
    parts = [
        "Star (with its root's frames) against recursive doubling, dedicated cores; "
        "doubling / star in brackets:",
        "",
        table(links),
        "",
        f"Smallest N from which doubling is as fast (policy: FLAT_DOUBLING_MIN_WORLD = "
        f"{FLAT_DOUBLING_MIN_WORLD}):",
    ]
    for layout in LAYOUTS:
        cells = [f"{format_bytes(s)}: {crossover(layout, s, links)}" for s in SIZES]
        parts.append(f"- {layout}: " + ", ".join(cells))
    parts += ["", "This machine (N ranks on 2 cores, each hop waiting its turns, hop_wait):", ""]
    parts += machine_lines(links)
    return "\n".join(parts)


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"

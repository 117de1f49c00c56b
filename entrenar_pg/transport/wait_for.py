"""The wait-for walk: which rank everyone waits on, from what the ranks answer.

Sans-IO: the walk asks a ``WaitForGraph`` (the control channel, or a table in
a test) what each rank waits on and how a silent one ended, and returns
the ``Blame``. Before a rank raises on no progress it walks from the peers
it waits on; a peer that is itself waiting names the ranks it waits on, and
the walk goes on until it reaches a rank that does not answer (stopped or
hung), has ended, or is not in the collective: that rank is blamed, on every
rank, instead of the first neighbour whose timer fired. Among the ranks asked
in one round, the strongest evidence wins: a verdict or an ended rank's
culprit over a rank outside the collective, and that over silence; and a
walk that ends on silence alone takes the verdict of any rank that failed
meanwhile (its evidence was stronger, and every rank then names one rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from .in_flight import Terms


@dataclass(frozen=True, slots=True)
class PeerState:
    """A peer's answer to a query: the collective it is in and whom it waits on."""

    what: str | None  # None: not inside a collective
    waiting_on: tuple[int, ...]
    blamed: int | None = None  # whom its own walk blamed (it is failing with that)
    call: Terms | None = None  # the call it runs, with its terms (``in_flight.py``)


@dataclass(frozen=True, slots=True)
class Gone:
    """How a rank that no longer answers ended, as this rank heard it."""

    why: str  # "has left the group", "failed: <its message>", ...
    culprit: int | None = None  # the rank its abort blamed, if any


@dataclass(frozen=True, slots=True)
class Blame:
    """The end of a wait-for walk: the rank everyone waits on, and the path to it."""

    culprit: int | None
    story: str


class WaitForGraph(Protocol):
    """What the walk asks: each peer's state, and how a silent one ended."""

    def ask(self, peers: list[int], answer_s: float) -> dict[int, PeerState | None]: ...
    def gone(self, peer: int) -> Gone | None: ...
    def verdict(self, wait_s: float) -> tuple[int, int] | None:
        """The first rank heard to fail naming a culprit (origin, culprit),
        waiting up to ``wait_s`` for one."""
        ...


SILENT = 2  # the weakest evidence: no answer (a loaded machine can make it of a live rank)


def walk(
    graph: WaitForGraph, rank: int, waiting_on: Iterable[int], what: str, answer_s: float
) -> Blame:
    """Walk the wait-for graph from the peers ``rank`` waits on (module docstring).

    Silence is asked twice: where a round's strongest evidence is that a rank
    did not answer, the silent ranks are asked once more before it counts
    (the suite under load: rank 0, alive and waiting on the culprit, missed
    one 0.5 s window and was blamed by one rank while the rest named rank 5).
    Still silent, it waits one more window for the verdict of any rank that
    failed meanwhile and takes it: that rank named a culprit on stronger
    evidence than silence (a live rank slower than two windows under load
    is not blamed by one rank while the others name the culprit).
    """
    frontier = sorted(set(waiting_on))
    if not frontier:
        return Blame(None, "")
    asked: set[int] = {rank}
    path: list[str] = []
    while frontier:
        answers = graph.ask(frontier, answer_s)
        found, nxt, hops = _judge(graph, frontier, answers, asked, path, what, answer_s)
        if found and min(kind for kind, _ in found) == SILENT:
            silent = [b.culprit for kind, b in found if kind == SILENT and b.culprit is not None]
            answers.update({q: s for q, s in graph.ask(silent, answer_s).items() if s is not None})
            found, nxt, hops = _judge(graph, frontier, answers, asked, path, what, answer_s)
        if found and min(kind for kind, _ in found) == SILENT:
            heard = graph.verdict(answer_s)
            if heard is not None:
                origin, culprit = heard
                mute = ", ".join(str(b.culprit) for kind, b in found if kind == SILENT)
                story = f"rank(s) {mute} did not answer; rank {origin} failed naming rank {culprit}"
                return Blame(culprit, "; ".join([*path, *hops, story]))
        asked.update(frontier)
        path.extend(hops)
        if found:
            return min(found, key=lambda f: f[0])[1]  # the first of the strongest kind
        frontier = sorted(nxt)
    return Blame(None, "; ".join(path) + " (a cycle: every rank waits on another)")


def _judge(
    graph: WaitForGraph,
    frontier: list[int],
    answers: dict[int, PeerState | None],
    asked: set[int],
    path: list[str],
    what: str,
    answer_s: float,
) -> tuple[list[tuple[int, Blame]], list[int], list[str]]:
    """One round's evidence: (strength, blame) per rank that ends the walk
    (0 strongest), the ranks to ask next, and the round's hops for the story.

    The frontier's strongest evidence wins, not its lowest rank: a peer's own
    verdict or an ended rank's culprit, then a rank that answered it is not in
    the collective (or ended), and only then one that did not answer (the
    suite: a silent rank 0 blamed beside rank 5, not in the collective)."""
    seen = asked | set(frontier)
    found: list[tuple[int, Blame]] = []
    nxt: list[int] = []
    hops: list[str] = []
    for q in frontier:
        state = answers.get(q)
        if state is not None and state.blamed is not None:
            b = state.blamed
            story = "; ".join([*path, *hops, f"rank {q} found rank {b} stalled"])
            found.append((0, Blame(b, story)))
        elif state is None:
            gone = graph.gone(q)
            if gone is not None and gone.culprit not in (None, q):
                found.append(
                    (0, Blame(gone.culprit, "; ".join([*path, *hops, f"rank {q} {gone.why}"])))
                )
                continue
            why = (
                gone.why
                if gone is not None
                else f"does not answer within {answer_s:.1f}s, asked twice (stopped or hung)"
            )
            strength = SILENT if gone is None else 1
            found.append((strength, Blame(q, "; ".join([*path, *hops, f"rank {q} {why}"]))))
        elif state.what is None:
            found.append((1, Blame(
                q,
                "; ".join([*path, *hops, f"rank {q} is not inside any collective (it has not "
                           f"issued {what}, or issued it on another group)"]),
            )))  # fmt: skip
        else:
            onward = [r for r in state.waiting_on if r not in seen and r not in nxt]
            hops.append(f"rank {q} is in {state.what} waiting on rank(s) {list(state.waiting_on)}")
            nxt.extend(onward)
    return found, nxt, hops

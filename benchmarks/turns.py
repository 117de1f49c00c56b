"""Two jobs alive at once that take turns, block by block (``--baseline-tree``).

A before/after comparison whose two sides run as separate jobs, one after
the other, reads the machine's drift between them as a difference of code:
on this 2-core machine, shared with other work, an A/A run (the same tree
on both sides) read 0.23x-1.61x at single sizes that way
(docs/benchmarks.md, "Before and after"). So both sides' ranks are started
together and run the same sequence of timed blocks (the sweep's
size x round x variant blocks, then the DDP step's), taking turns: side A
runs block 0, then side B block 0, A block 1, B block 1, ... Every block
starts right after the other side's, so both start alike (caches and the
cores just used by the other job). The order A B B A, tried first, let each
side run two blocks back to back every other turn, and such a block ran
5-15 % faster than one that followed the other side's (9 pinned runs:
the median ratio of the blocks where A followed itself 0.86-1.07x, where
B did 0.99-1.23x), which moved a run's median by up to 10 %. Only one side runs
at a time; the other's ranks sleep (rank 0 on the turn, the others in
their job's barrier).

Rank 0 of each side calls :meth:`Turns.wait` before a block and
:meth:`Turns.done` after it; the job's own barriers keep its other ranks in
step. A side that finished its blocks says so (:meth:`Turns.finish`), so a
side with more blocks (a column only it could run) never waits for it; a
side that waits longer than the job's timeout raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


class TurnTimeout(RuntimeError):
    """The other side did not give the turn back within the timeout."""


@dataclass
class Turns:
    """One side's view of the turn shared by two jobs (see the module).

    ``cond``, ``turn`` and ``finished`` are a ``multiprocessing`` Condition,
    Value('q') and Array('b', 2) made by the parent and handed to both
    sides' rank 0 (they pickle for spawned processes as arguments).
    """

    cond: Any
    turn: Any
    finished: Any
    side: int  # 0 or 1
    timeout_s: float
    block: int = 0

    def slot(self, block: int) -> int:
        """The turn number of this side's ``block`` (A B, A B, ...)."""
        return 2 * block + self.side

    def wait(self) -> None:
        """Sleep until it is this side's turn for its next block."""
        mine = self.slot(self.block)
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while self.turn.value < mine and not self.finished[1 - self.side]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TurnTimeout(
                        f"side {self.side} waited {self.timeout_s:.0f} s for turn {mine} "
                        f"(at {self.turn.value})"
                    )
                self.cond.wait(left)

    def done(self) -> None:
        """This side's block is over: the turn goes on."""
        with self.cond:
            self.turn.value = self.slot(self.block) + 1
            self.cond.notify_all()
        self.block += 1

    def finish(self) -> None:
        """This side has no more blocks: the other never waits for it again."""
        with self.cond:
            self.finished[self.side] = 1
            self.cond.notify_all()


def new_turns(ctx: Any, timeout_s: float) -> tuple[Turns, Turns]:
    """The two sides' ``Turns`` over one shared turn (``ctx``: a multiprocessing context)."""
    cond, turn, finished = ctx.Condition(), ctx.Value("q", 0), ctx.Array("b", 2)
    return (
        Turns(cond, turn, finished, 0, timeout_s),
        Turns(cond, turn, finished, 1, timeout_s),
    )

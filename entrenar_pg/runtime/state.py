"""GroupState: the one healthy / broken / closed state of a process group.

A group is *healthy* until its first failure, then *broken* for good: the
first error and the call it happened in are kept, and every later call is
refused with an error of the same class naming them. Independently, the group
*stops* (its comm thread ends): ``abort()`` stops it, and so does closing it
(``shutdown()``, ``destroy_process_group``, interpreter exit), which also
refuses later calls as destroyed. The engine, the runtime and the process
group all read and change this one object; no other part keeps a flag of its
own for the group (the transport's sockets have their own open/closed state,
which the break hooks drive).

``fail`` records the first failure and then runs the break hooks once, in
the order registered (the runtime's: the p2p channel's abort, which fails its
pending ops with the error, then the transport's, which tells the peers), outside
the lock. The engine's condition variable is built on ``lock``, so a stop and
the queue's emptying are one step for every thread that waits on the queue.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

from ..errors import EntrenarError, group_destroyed

log = logging.getLogger(__name__)

BreakHook = Callable[[EntrenarError], None]


class Phase(enum.Enum):
    RUNNING = "running"  # jobs run (the group may be broken: they then fail at once)
    ABORTED = "aborted"  # abort(): broken and stopped, not destroyed
    CLOSED = "closed"  # shutdown() or interpreter exit: destroyed


class GroupState:
    """The group's first failure (if any) and whether it still runs jobs."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.error: EntrenarError | None = None  # the first failure
        self.failed_at = ""  # the call it happened in ("allreduce#7", "abort()")
        self.phase = Phase.RUNNING
        self._hooks: list[BreakHook] = []

    @property
    def running(self) -> bool:
        """Jobs may still be queued and run (they fail at once if the group is broken)."""
        return self.phase is Phase.RUNNING

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    def on_break(self, hook: BreakHook) -> None:
        """Run ``hook(error)`` once, when the group first fails."""
        self._hooks.append(hook)

    # ------------------------------------------------------------ refusals

    def check(self, call: str) -> None:
        """Refuse ``call`` on a destroyed or broken group (before anything is sent)."""
        if self.phase is Phase.CLOSED:
            raise group_destroyed(self.rank, call)
        if self.error is not None:
            raise self.broken_error(call)

    def broken_error(self, what: str) -> EntrenarError:
        """The error for a call on a group that failed earlier (same class as the first)."""
        assert self.error is not None
        return type(self.error)(
            f"rank {self.rank}: {what} refused: this process group failed at "
            f"{self.failed_at} and cannot be used any more (recreate it). "
            f"First error: {self.error}",
            culprit=self.error.culprit,
        )

    # ------------------------------------------------------------ transitions

    def fail(self, error: EntrenarError, at: str) -> bool:
        """Record ``error`` (in call ``at``) as the group's failure unless one is
        recorded already; the first time, run the break hooks. True if it was the first."""
        with self.lock:
            if self.error is not None:
                return False
            self.error = error
            self.failed_at = at
        for hook in self._hooks:
            try:
                hook(error)
            except Exception:  # the error itself is what matters; keep going
                log.exception("rank %d: a break hook after %s failed", self.rank, at)
        return True

    def stop(self, phase: Phase) -> None:
        """Stop running jobs (``ABORTED`` or ``CLOSED``); the caller holds ``lock``.

        Closing wins over aborting: a closed group reports itself destroyed.
        """
        if phase is Phase.CLOSED or self.phase is Phase.RUNNING:
            self.phase = phase

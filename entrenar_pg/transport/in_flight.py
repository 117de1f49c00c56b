"""The call a rank is in, as its control thread tells a peer that asks.

A rank waiting for a lower rank's first data connection (``data_links.py``)
asks that rank which call it is in, to tell a late rank (its connect will
come) from one whose plan never makes it (a mismatch). The collective and
the sequence number alone cannot tell the same collective issued with other
arguments: an allreduce whose size makes a star on one rank and a ring on
the others. So the runtime publishes the call it runs (``InFlight``: the
long path stores its job's context, one reference per call; the thin path
stores nothing, and finds its call when asked), and only a question reads
it: ``Terms``, the call's sequence number, its request's collective and
what every rank of that call must agree on (its size, dtype, root, reduce
op: fields the header rule checks anyway, so terms that differ are a
mismatch whatever the plans do). Legal differences (an all-gather's uneven
pieces) are left out; a call with nothing to compare says None.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol

log = logging.getLogger(__name__)


class Terms(NamedTuple):
    """One call as a rank describes it to its peers."""

    seq: int
    op: str  # the request's collective (``allreduce``), whichever phase runs
    agreed: str  # what every rank must agree on, e.g. "float32, 4096 elements, sum"

    def describe(self) -> str:
        return f"{self.op}#{self.seq}({self.agreed})"


class CallInFlight(Protocol):
    """What the runtime publishes: a job's context, or the thin path."""

    def terms(self) -> Terms | None: ...


class InFlight:
    """The call this rank runs now: the long path's job context, stored by
    the thread that runs it (and dropped after), else the thin path, which
    finds its own when asked; read by the control thread when a peer asks
    (``ControlChannel``)."""

    __slots__ = ("call", "thin")

    def __init__(self) -> None:
        self.call: CallInFlight | None = None  # a job of the long path, while it runs
        self.thin: CallInFlight | None = None  # the group's thin path (set once)

    def terms(self) -> Terms | None:
        """The running call's terms (None: none, or nothing to compare).
        Read in another thread while the call runs: a call that changes
        under the read answers None rather than fail the control thread
        (a question compares sequence numbers, so a stale answer concludes
        nothing)."""
        call = self.call if self.call is not None else self.thin
        if call is None:
            return None
        try:
            return call.terms()
        except Exception:  # noqa: BLE001 -- the control thread must keep serving
            log.debug("the call in flight could not be described", exc_info=True)
            return None

"""The error hierarchy. Every message names this rank, and the peer and call involved."""

from __future__ import annotations

import errno


class EntrenarError(RuntimeError):
    """Base of every error entrenar raises for a failed collective.

    ``culprit``: the rank that caused the failure, where it is known (the rank
    that died, stopped, left, or that every other rank was waiting on); the
    same on every rank, since aborting ranks pass it on with their cause.
    """

    def __init__(self, message: str = "", *, culprit: int | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit

    def __reduce__(self) -> tuple[object, ...]:  # keep ``culprit`` through pickling
        return (_rebuild, (type(self), str(self), self.culprit))


class PeerConnectionError(EntrenarError):
    """A peer died, a link broke or a wait timed out: the group is unusable, recreate it."""


class GroupDestroyedError(PeerConnectionError, ValueError):
    """A call on a destroyed group (``shutdown()``, ``destroy_process_group``,
    interpreter exit), or one still pending when it was destroyed.

    One class wherever the group notices (the call's own checks, the comm
    thread's queue, the p2p channel), with one message shape
    (``group_destroyed``). A ``ValueError`` too, because torch raises
    ValueError for a destroyed group ("Invalid process group specified or has
    been destroyed"), so code written for gloo catches it; a
    ``PeerConnectionError`` too, the class of "this group is unusable,
    recreate it", so fault-tolerance code that catches entrenar's errors
    (torchft) does as well.
    """


def group_destroyed(rank: int, call: str) -> GroupDestroyedError:
    """The error of ``call`` on this rank's destroyed group."""
    return GroupDestroyedError(f"rank {rank}: {call}: the process group was destroyed")


class CollectiveMismatchError(EntrenarError):
    """Two ranks issued different collectives (op, dtype, size, algorithm or order)."""


class OptionsMismatchError(EntrenarError, ValueError):
    """Ranks of one group set an Options field that must agree differently
    (``config.AGREED_FIELDS``): raised on every rank at the group's creation,
    before any collective. A ``ValueError`` too: it is bad input, as an
    invalid Options value is."""


class ContractViolation(EntrenarError):
    """A contract (C-RING-001, C-DDP-001, F-DP-003) failed on some rank."""


def _rebuild(cls: type[EntrenarError], message: str, culprit: int | None) -> EntrenarError:
    return cls(message, culprit=culprit)


# Errors that may cross the wire (in a control link's ABORT frame) by name.
ERROR_TYPES: dict[str, type[EntrenarError]] = {
    cls.__name__: cls
    for cls in (EntrenarError, PeerConnectionError, CollectiveMismatchError, ContractViolation)
}


# The one errno classifier: an OSError on a link with one of these means the
# peer's end is gone (closed, reset, or our own socket closed under us); any
# other is a failure of the link itself.
_PEER_GONE = frozenset(
    {errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF, errno.ECONNABORTED}
)


def peer_gone(e: OSError) -> bool:
    """True when ``e``, raised on a link, means the other end closed or reset it."""
    return e.errno in _PEER_GONE

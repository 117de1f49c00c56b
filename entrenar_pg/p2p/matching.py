"""Which recv a p2p message is for: the matching, sans-IO.

No sockets, threads, tensors or futures. The channel (``channel.py``) feeds
a ``Matching`` events: a recv posted (``post``), a message's header in
(``arrive``, which answers where its payload goes), its payload in
(``arrived``), a deadline passed (``expire``), a peer's link down
(``peer_down``, ``all_peers_down``), the channel closing (``close``). It reads back the recvs
that finished, and the buffers no longer needed, with ``take``. So the rules
are tested on their own (tests/test_p2p_matching.py):

- an arriving message matches the first posted recv for (its peer or
  ANY_SOURCE, its tag), in post order; with none, it is unexpected: its
  payload goes to a buffer of its own;
- a posted recv matches the first unexpected message for (its peer, or any
  peer for ANY_SOURCE, its tag), in arrival order; with none, it waits;
- so between two ranks, one tag's messages match in order (torch's rule),
  and tags let independent streams overtake each other;
- a recv completes once its message's payload is in (straight into the
  recv's buffer, or copied from the message's: ``Delivered.buffered``);
- a size or dtype that differs from the matched send's fails the recv alone
  (``CollectiveMismatchError`` naming this rank, the recv and the sender);
  the message is drained into a buffer, so the link stays in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import (
    CollectiveMismatchError,
    EntrenarError,
    GroupDestroyedError,
    PeerConnectionError,
    group_destroyed,
)

if TYPE_CHECKING:
    import torch

ANY_SOURCE = -1


@dataclass(frozen=True, slots=True)
class PostedRecv:
    """A recv as the matching sees it; ``id`` is the channel's, unique among its recvs."""

    id: int
    peer: int  # the source rank, or ANY_SOURCE
    tag: int
    nbytes: int
    dtype: torch.dtype
    deadline: float  # when it fails if no message matched it (time.monotonic())
    what: str  # "recv from rank 1 (tag 0)": how errors name it


@dataclass(frozen=True, slots=True)
class Message:
    """An arriving message (its header); ``id`` is given by the matching."""

    id: int
    peer: int
    tag: int
    nbytes: int
    dtype: torch.dtype | None  # None: the sender's dtype code is unknown here


# Where a payload goes (``arrive``'s answer).


@dataclass(frozen=True, slots=True)
class IntoRecv:
    """Receive ``msg``'s payload straight into ``recv``'s buffer."""

    msg: Message
    recv: PostedRecv


@dataclass(frozen=True, slots=True)
class IntoBuffer:
    """Receive ``msg``'s payload into a buffer of its own (``msg.nbytes``): nobody
    waits for it yet, or its recv failed on a size mismatch and it is drained."""

    msg: Message


Placement = IntoRecv | IntoBuffer

# What ``take`` hands back.


@dataclass(frozen=True, slots=True)
class Delivered:
    """``recv`` holds ``msg``'s payload once the channel copies it out of the
    message's buffer (``buffered``: then drop that buffer); it completes."""

    recv: PostedRecv
    msg: Message
    buffered: bool


@dataclass(frozen=True, slots=True)
class Failed:
    """``recv`` fails with ``error``."""

    recv: PostedRecv
    error: EntrenarError


@dataclass(frozen=True, slots=True)
class Discarded:
    """``msg``'s buffer is no longer needed (drained, or its link failed mid-payload)."""

    msg: Message


Outcome = Delivered | Failed | Discarded


class Matching:
    """Posted recvs and unexpected messages of one rank's p2p channel.

    Not locked: the channel holds its lock around every call.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._posted: list[PostedRecv] = []  # unmatched recvs, in post order
        self._unexpected: list[Message] = []  # unmatched messages, in arrival order
        self._partial: dict[int, Message] = {}  # messages whose payload is still coming
        self._buffered: set[int] = set()  # ids of messages that have a buffer
        self._waiting: dict[int, PostedRecv] = {}  # partial message id -> its recv
        self._outcomes: list[Outcome] = []
        self._next_id = 0

    # ------------------------------------------------------------ events

    def post(self, recv: PostedRecv) -> None:
        """A recv is posted: match the first unexpected message for it, or wait."""
        msg = next((m for m in self._unexpected if _fits(m, recv)), None)
        if msg is None:
            self._posted.append(recv)
            return
        self._unexpected.remove(msg)
        error = self._mismatch(msg, recv)
        if error is not None:
            self._outcomes.append(Failed(recv, error))
            if msg.id not in self._partial:  # else ``arrived`` discards it
                self._drop_buffer(msg)
        elif msg.id in self._partial:
            self._waiting[msg.id] = recv
        else:
            self._buffered.discard(msg.id)
            self._outcomes.append(Delivered(recv, msg, buffered=True))

    def arrive(self, peer: int, tag: int, nbytes: int, dtype: torch.dtype | None) -> Placement:
        """A message's header is in: say where its payload goes."""
        msg = Message(self._next_id, peer, tag, nbytes, dtype)
        self._next_id += 1
        self._partial[msg.id] = msg
        recv = next((r for r in self._posted if _fits(msg, r)), None)
        if recv is None:
            self._unexpected.append(msg)
            self._buffered.add(msg.id)
            return IntoBuffer(msg)
        self._posted.remove(recv)
        error = self._mismatch(msg, recv)
        if error is not None:
            self._outcomes.append(Failed(recv, error))
            self._buffered.add(msg.id)
            return IntoBuffer(msg)
        self._waiting[msg.id] = recv
        return IntoRecv(msg, recv)

    def arrived(self, msg: Message) -> None:
        """``msg``'s payload is in (where ``arrive`` said)."""
        del self._partial[msg.id]
        recv = self._waiting.pop(msg.id, None)
        if recv is not None:
            buffered = msg.id in self._buffered
            self._buffered.discard(msg.id)
            self._outcomes.append(Delivered(recv, msg, buffered))
        elif msg not in self._unexpected:  # drained: its recv failed on the sizes
            self._drop_buffer(msg)

    def expire(self, now: float, timeout_s: float) -> None:
        """Fail the recvs nothing matched by their deadline (their links are fine)."""
        for recv in [r for r in self._posted if r.deadline <= now]:
            self._posted.remove(recv)
            why = (
                f"no matching send arrived within {timeout_s:.1f}s "
                "(the peer stalled, died, or never sent it)"
            )
            self._outcomes.append(Failed(recv, op_error(self.rank, recv.what, None, why)))

    def peer_down(self, peer: int, cause: EntrenarError) -> None:
        """``peer``'s link failed with ``cause``: fail the recvs posted for it and
        the one its half-received message was for; forget that message.
        Messages from ``peer`` already in stay receivable."""
        for recv in [r for r in self._posted if r.peer == peer]:
            self._posted.remove(recv)
            self._outcomes.append(Failed(recv, op_error(self.rank, recv.what, cause)))
        for msg in [m for m in self._partial.values() if m.peer == peer]:
            self._forget(msg, cause, "")

    def all_peers_down(self) -> None:
        """Every link is down: recvs from any rank fail too (nothing can come)."""
        why = "every peer's connection is closed"
        for recv in [r for r in self._posted if r.peer == ANY_SOURCE]:
            self._posted.remove(recv)
            self._outcomes.append(Failed(recv, op_error(self.rank, recv.what, None, why)))

    def close(self, cause: EntrenarError | None, why: str) -> None:
        """The channel stops: every pending recv fails (with ``cause``, else
        for reason ``why``); every message is forgotten."""
        for msg in list(self._partial.values()):
            self._forget(msg, cause, why)
        for recv in self._posted:
            self._outcomes.append(Failed(recv, op_error(self.rank, recv.what, cause, why)))
        self._posted.clear()
        for msg in self._unexpected:
            self._drop_buffer(msg)
        self._unexpected.clear()

    # ------------------------------------------------------------ answers

    def take(self) -> list[Outcome]:
        """The outcomes since the last ``take``, in the order they happened."""
        out, self._outcomes = self._outcomes, []
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline of a posted recv (None: nothing is posted)."""
        return min((r.deadline for r in self._posted), default=None)

    def has_message_for(self, recv: PostedRecv) -> bool:
        """Whether an unexpected message already in matches ``recv``."""
        return any(_fits(m, recv) for m in self._unexpected)

    @property
    def posted(self) -> tuple[PostedRecv, ...]:
        return tuple(self._posted)

    @property
    def unexpected(self) -> tuple[Message, ...]:
        return tuple(self._unexpected)

    # ------------------------------------------------------------ internals

    def _forget(self, msg: Message, cause: EntrenarError | None, why: str) -> None:
        del self._partial[msg.id]
        recv = self._waiting.pop(msg.id, None)
        if recv is not None:
            self._outcomes.append(Failed(recv, op_error(self.rank, recv.what, cause, why)))
        if msg in self._unexpected:
            self._unexpected.remove(msg)
        self._drop_buffer(msg)

    def _drop_buffer(self, msg: Message) -> None:
        if msg.id in self._buffered:
            self._buffered.discard(msg.id)
            self._outcomes.append(Discarded(msg))

    def _mismatch(self, msg: Message, recv: PostedRecv) -> CollectiveMismatchError | None:
        if msg.nbytes == recv.nbytes and (msg.dtype is None or msg.dtype == recv.dtype):
            return None
        theirs = _dtype_name(msg.dtype) if msg.dtype is not None else "?"
        return CollectiveMismatchError(
            f"rank {self.rank}: {recv.what} of {recv.nbytes} bytes "
            f"({_dtype_name(recv.dtype)}) matched a send of "
            f"{msg.nbytes} bytes ({theirs}) from rank {msg.peer}: the sizes must agree"
        )


def _fits(msg: Message, recv: PostedRecv) -> bool:
    return msg.tag == recv.tag and recv.peer in (ANY_SOURCE, msg.peer)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def failure_class(cause: EntrenarError) -> type[EntrenarError]:
    """A p2p op's error class for ``cause``: its own, except that a bare
    EntrenarError (a peer's or this group's abort()) reads as a lost peer."""
    return PeerConnectionError if type(cause) is EntrenarError else type(cause)


def op_error(rank: int, what: str, cause: EntrenarError | None, why: str = "") -> EntrenarError:
    """The error of p2p op ``what``: its link's (or the group's) failure ``cause``,
    same class and culprit, this op named; with no cause, a PeerConnectionError
    for reason ``why``."""
    if cause is None:
        return PeerConnectionError(f"rank {rank}: p2p {what} failed: {why}")
    if isinstance(cause, GroupDestroyedError):  # one shape for every call on a destroyed group
        return group_destroyed(rank, f"p2p {what}")
    return failure_class(cause)(f"rank {rank}: p2p {what} failed: {cause}", culprit=cause.culprit)

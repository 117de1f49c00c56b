"""The abort protocol: the control channel, and the one place a link's end is named.

Every way a link can end (a peer's abort, its goodbye, its death, a stall, an
OSError, our own abort) becomes an error here, for collectives and p2p alike
(``Causes``), so both name the same culprit with the same words.

The control channel: small frames between ranks, beside the data streams.

Why a channel of its own: when something goes wrong a data stream is
somewhere inside a collective's payload, so nothing can be inserted into it,
and the store may be gone (under env:// it lives in rank 0's process). The
control socket of each pair carries only these frames, so they can always be
sent and always be parsed:

- ``ABORT`` (error class, culprit rank, message): a failing rank sends it to
  every peer *before* closing its links, so each peer that sees a link close
  learns the root cause and the rank that caused it, store or no store.
- ``BYE``: sent before a rank closes its links on ``shutdown`` /
  ``destroy_process_group``, so "it left" and "its process died" differ.
- ``QUERY`` / ``STATE``: "what are you waiting on?". Before a rank raises on
  no progress it asks the peers it waits on; a peer that is itself waiting
  names the ranks it waits on, and the walk goes on until it reaches a rank
  that does not answer (stopped, hung, or not in the collective): that rank
  is blamed, on every rank, instead of the first neighbour whose timer fired.

A frame is ``u32 length | u8 kind | payload`` with a JSON payload. The frames
are tiny and rare (none on the hot path), so one lock serialises every use
of the control sockets.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import ERROR_TYPES, EntrenarError, PeerConnectionError, group_destroyed, peer_gone

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<IB")
_MAX_FRAME = 1 << 20
ABORT, BYE, QUERY, STATE = 1, 2, 3, 4


@dataclass(frozen=True, slots=True)
class AbortRecord:
    """What a failing rank said when it aborted."""

    kind: str  # the error class name (errors.ERROR_TYPES)
    culprit: int | None  # the rank that caused the failure, if known
    message: str


@dataclass(frozen=True, slots=True)
class PeerState:
    """A peer's answer to QUERY: the collective it is in and whom it waits on."""

    what: str | None  # None: not inside a collective
    waiting_on: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Blame:
    """The end of a wait-for walk: the rank everyone waits on, and the path to it."""

    culprit: int | None
    story: str


# How a peer's link ended, when it did not abort.
LEFT = "left"  # it sent BYE: shutdown or destroy_process_group
DIED = "died"  # its control socket closed with no frame: the process is gone


class _Peer:
    __slots__ = ("peer", "sock", "buf", "ended", "abort", "state")

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.buf = bytearray()
        self.ended: str | None = None  # LEFT / DIED once the peer's side is closed
        self.abort: AbortRecord | None = None
        self.state: PeerState | None = None  # the latest STATE answer


class ControlChannel:
    """One rank's control sockets to every peer (see the module docstring)."""

    def __init__(self, rank: int, socks: dict[int, socket.socket]) -> None:
        self.rank = rank
        self._peers = {p: _Peer(p, s) for p, s in socks.items()}
        self._by_fd = {s.fileno(): self._peers[p] for p, s in socks.items()}
        self._lock = threading.RLock()
        self._closed = False
        # Set by the mesh while it sleeps waiting for peers: (what, receiving
        # from, sending to); what a QUERY is answered with.
        self.waiting: tuple[str, Iterable[int], Iterable[int]] | None = None

    @property
    def fds(self) -> list[int]:
        return list(self._by_fd)

    def peer_of(self, fd: int) -> int | None:
        p = self._by_fd.get(fd)
        return None if p is None else p.peer

    # ------------------------------------------------------------------ reading

    def service(self, fd: int) -> AbortRecord | None:
        """Read what arrived on control socket ``fd``; answer queries. Returns a new abort."""
        p = self._by_fd[fd]
        with self._lock:
            had = p.abort
            self._read(p)
            return p.abort if p.abort is not None and had is None else None

    def _read(self, p: _Peer) -> None:
        if p.ended is not None or self._closed:
            return
        while True:
            try:
                chunk = p.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                p.ended = p.ended or DIED
                break
            p.buf += chunk
        while len(p.buf) >= _FRAME.size:
            length, kind = _FRAME.unpack_from(p.buf)
            if length > _MAX_FRAME:
                log.warning("rank %d: garbage on rank %d's control link", self.rank, p.peer)
                p.buf.clear()
                break
            if len(p.buf) < _FRAME.size + length:
                break
            body = bytes(p.buf[_FRAME.size : _FRAME.size + length])
            del p.buf[: _FRAME.size + length]
            self._handle(p, kind, json.loads(body) if body else {})

    def _handle(self, p: _Peer, kind: int, body: dict[str, Any]) -> None:
        if kind == ABORT:
            culprit = body.get("culprit")
            p.abort = AbortRecord(
                str(body.get("kind", "PeerConnectionError")),
                None if culprit is None else int(culprit),
                str(body.get("message", "")),
            )
        elif kind == BYE:
            p.ended = LEFT
        elif kind == QUERY:
            self._send(p, STATE, self._state_body())
        elif kind == STATE:
            what = body.get("what")
            p.state = PeerState(what, tuple(int(x) for x in body.get("waiting_on", ())))

    def _state_body(self) -> dict[str, Any]:
        waiting = self.waiting
        if waiting is None:
            return {"what": None, "waiting_on": []}
        what, recv_from, send_to = waiting
        return {"what": what, "waiting_on": sorted(set(recv_from) | set(send_to))}

    # ------------------------------------------------------------------ writing

    def _send(self, p: _Peer, kind: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        try:
            p.sock.send(_FRAME.pack(len(raw), kind) + raw)  # tiny: all or nothing in practice
        except OSError:
            pass  # the peer is gone; its own end says so

    def has_ended(self, peer: int) -> bool:
        """True once ``peer``'s control link is closed (it will say no more)."""
        return self._peers[peer].ended is not None

    def how_ended(self, peer: int, wait_s: float) -> AbortRecord | str | None:
        """Why ``peer``'s links closed: its abort record, LEFT or DIED; None if it
        still has not said after ``wait_s`` (frames and closes on two sockets are
        not ordered, so its data link may close before its control frame is in)."""
        p = self._peers[peer]
        deadline = time.monotonic() + wait_s
        poller = select.poll()
        poller.register(p.sock.fileno(), select.POLLIN)
        while True:
            with self._lock:
                self._read(p)
                if p.abort is not None:
                    return p.abort
                if p.ended is not None:
                    return p.ended
                if self._closed:
                    return None  # this rank closed its links: nothing more will be read
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            poller.poll(left * 1000.0)

    # ------------------------------------------------------------------ blame

    def find_stalled(self, waiting_on: Iterable[int], what: str, answer_s: float) -> Blame:
        """Walk the wait-for graph from the peers this rank waits on; see the module docstring."""
        start = sorted(set(waiting_on))
        if not start:
            return Blame(None, "")
        asked: set[int] = {self.rank}
        frontier = start
        path: list[str] = []
        while frontier:
            answers = self._ask(frontier, answer_s)
            nxt: list[int] = []
            for q in frontier:
                asked.add(q)
                state = answers.get(q)
                if state is None:
                    gone = self._peers[q].ended
                    why = (
                        "has left the group" if gone == LEFT else
                        "is gone (its process died)" if gone == DIED else
                        f"does not answer within {answer_s:.1f}s (stopped, hung, or busy outside "
                        "any collective)"
                    )  # fmt: skip
                    return Blame(q, "; ".join([*path, f"rank {q} {why}"]))
                if state.what is None:
                    return Blame(
                        q,
                        "; ".join([*path, f"rank {q} is not inside any collective (it has not "
                                   f"issued {what}, or issued it on another group)"]),
                    )  # fmt: skip
                onward = [r for r in state.waiting_on if r not in asked and r not in nxt]
                path.append(
                    f"rank {q} is in {state.what} waiting on rank(s) {list(state.waiting_on)}"
                )
                nxt.extend(onward)
            frontier = sorted(nxt)
        return Blame(None, "; ".join(path) + " (a cycle: every rank waits on another)")

    def _ask(self, peers: list[int], answer_s: float) -> dict[int, PeerState | None]:
        """QUERY each peer; their STATE answers within ``answer_s`` (None: no answer).
        Queries from others that arrive meanwhile are answered too."""
        with self._lock:
            for q in peers:
                p = self._peers[q]
                p.state = None
                if p.ended is None:
                    self._send(p, QUERY, {})
        poller = select.poll()
        for fd in self._by_fd:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + answer_s
        while True:
            with self._lock:
                pending = [
                    q
                    for q in peers
                    if self._peers[q].state is None and self._peers[q].ended is None
                ]
            left = deadline - time.monotonic()
            if not pending or left <= 0 or self._closed:
                break  # (closed: abort() or shutdown under this wait; no answer will come)
            for fd, _ in poller.poll(left * 1000.0):
                p = self._by_fd[fd]
                with self._lock:
                    self._read(p)
                if p.ended is not None:
                    poller.unregister(fd)
        return {q: self._peers[q].state for q in peers}

    # ------------------------------------------------------------------ closing

    def close(self, abort: AbortRecord | None = None) -> None:
        """Say goodbye (or why this rank aborts) to every peer, then close.

        Unread input is drained first: closing a socket with unread data makes
        the kernel send a reset, which may discard the frame just sent.
        """
        with self._lock:
            if self._closed:
                return
            for p in self._peers.values():
                self._read(p)
            self._closed = True
            for p in self._peers.values():
                if abort is None:
                    self._send(p, BYE, {})
                else:
                    body = {"kind": abort.kind, "culprit": abort.culprit, "message": abort.message}
                    self._send(p, ABORT, body)
                try:
                    p.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                p.sock.close()


# How long a rank that saw a peer's link close waits for that peer's control
# frame (or its control link's close) to learn why: the two sockets' events
# are not ordered, but they come from one close, microseconds apart.
CAUSE_WAIT_S = 1.0


def abort_record(rank: int, error: BaseException) -> AbortRecord:
    """What this rank tells its peers when it fails with ``error``."""
    if isinstance(error, EntrenarError):
        return AbortRecord(type(error).__name__, error.culprit, str(error))
    return AbortRecord("PeerConnectionError", None, f"rank {rank}: {error!r}")


class Causes:
    """Names why a link stopped: the error every rank raises for it.

    Collectives (``loop.Progress``) and p2p (``entrenar_pg.p2p``) both ask
    here, so a peer's abort, goodbye, death or stall reads the same whichever
    kind of call saw it, and carries the same ``culprit``.
    """

    def __init__(self, rank: int, control: ControlChannel | None) -> None:
        self.rank = rank
        self.control = control
        self.closed_here = False  # set when this rank closed or aborted its own links
        self.destroyed = False  # ... and closed them because the group was destroyed

    def how_ended(self, peer: int, wait_s: float = CAUSE_WAIT_S) -> AbortRecord | str | None:
        """Why ``peer``'s link closed, from its control link (see ``ControlChannel``)."""
        if self.control is None:
            return None
        return self.control.how_ended(peer, wait_s)

    def peer_closed(
        self, peer: int, what: str, ended: AbortRecord | str | None = None
    ) -> EntrenarError:
        """``peer``'s end of a link closed during ``what``: its abort, its goodbye or its death."""
        if self.closed_here:
            return self.here_closed(what)
        if ended is None:
            ended = self.how_ended(peer)
        if isinstance(ended, AbortRecord):
            cls = ERROR_TYPES.get(ended.kind, PeerConnectionError)
            culprit = ended.culprit if ended.culprit is not None else peer
            return cls(
                f"rank {self.rank}: {what} aborted because rank {peer} failed: {ended.message}",
                culprit=culprit,
            )
        if ended == LEFT:
            return PeerConnectionError(
                f"rank {self.rank}: {what}: rank {peer} left the group mid-collective "
                f"(it called destroy_process_group or exited); culprit: rank {peer}",
                culprit=peer,
            )
        return PeerConnectionError(
            f"rank {self.rank}: {what}: rank {peer} closed the connection without a word "
            f"(its process died or was killed); culprit: rank {peer}",
            culprit=peer,
        )

    def here_closed(self, what: str) -> EntrenarError:
        """This rank's own links were closed under ``what`` (abort() or shutdown)."""
        if self.destroyed:
            return group_destroyed(self.rank, what)
        return PeerConnectionError(
            f"rank {self.rank}: {what}: this rank's links were closed under it "
            "(the group was aborted or shut down)",
            culprit=self.rank,
        )

    def link_failed(self, peer: int, what: str, e: OSError) -> EntrenarError:
        """An OSError on the link to ``peer``: the one errno classifier (``errors.peer_gone``)."""
        if self.closed_here:
            return self.here_closed(what)
        if peer_gone(e):
            return self.peer_closed(peer, what)
        return PeerConnectionError(f"rank {self.rank}: {what}: link to rank {peer} failed: {e}")

    def stalled(
        self, what: str, recv_from: list[int], send_to: list[int], timeout_s: float
    ) -> PeerConnectionError:
        """Nothing moved for ``timeout_s``: ask the peers we wait on what they wait on,
        and blame the rank at the end of that walk (``ControlChannel.find_stalled``)."""
        recv_from, send_to = sorted(recv_from), sorted(send_to)
        head = (
            f"rank {self.rank}: {what}: no progress for {timeout_s:.1f}s "
            f"(waiting to receive from rank(s) {recv_from}, to send to rank(s) {send_to})"
        )
        if self.control is None:
            return PeerConnectionError(
                f"{head}: a peer stalled, died, or issued a different collective"
            )
        answer_s = min(2.0, max(0.25, timeout_s / 4))
        blame = self.control.find_stalled([*recv_from, *send_to], what, answer_s)
        if blame.culprit is None:
            return PeerConnectionError(f"{head}: {blame.story}")
        return PeerConnectionError(
            f"{head}: {blame.story}; culprit: rank {blame.culprit}", culprit=blame.culprit
        )

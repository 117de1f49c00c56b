"""The abort protocol: the control channel, and the one place a link's end is named.

Every way a link can end (a peer's abort, its goodbye, its death, a stall, an
OSError, our own abort) becomes an error here, for collectives and p2p alike
(``Causes``), so both name the same culprit with the same words.

The control channel: small frames between ranks, beside the data streams,
over an overlay, not a full mesh: rank r holds a control link to each rank
differing from it in one bit (``overlay``: at most ceil(log2 N) links, the
graph connected for any N). A thread per rank serves them
(``ControlChannel._serve``) whatever the rank is doing, so words travel
hop by hop: a rank's end (ABORT, BYE, or GONE: a neighbour's link closed with
no word) is passed on by every rank that learns it to its other links (a
flood; the first word about a rank wins), and a QUERY to a rank with no link
of its own goes along ``route`` (bit by bit), its STATE answer back the same
way. The progress loop polls one descriptor (``fds``) that says an abort
came in.

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
- ``QUERY`` / ``STATE``: "what are you waiting on?", the questions of the
  wait-for walk (``wait_for.walk``: which rank everyone waits on), and
  "which call do you run?" (its ``in_flight.Terms``, what a first-use wait
  compares: ``data_links.py``). A rank's
  control thread answers for it, so a rank outside any collective answers
  too. A query to a rank with no link goes out once through each overlay
  neighbour (a route each), so a stopped rank on one route does not
  silence the rank behind it; only a rank whose every route crosses a
  stopped one looks silent (the stopped one cuts the overlay).

A frame is ``u32 length | u8 kind | payload`` with a JSON payload. The frames
are tiny and rare (none on the hot path), so one lock serialises every use
of the control sockets.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from ..errors import ERROR_TYPES, EntrenarError, PeerConnectionError, group_destroyed, peer_gone
from .in_flight import InFlight, Terms
from .wait_for import Gone, PeerState, walk

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_FRAME = struct.Struct("<IB")
_MAX_FRAME = 1 << 20
ABORT, BYE, QUERY, STATE, GONE = 1, 2, 3, 4, 5


@dataclass(frozen=True, slots=True)
class AbortRecord:
    """What a failing rank said when it aborted."""

    kind: str  # the error class name (errors.ERROR_TYPES)
    culprit: int | None  # the rank that caused the failure, if known
    message: str


# How a peer's link ended, when it did not abort.
LEFT = "left"  # it sent BYE: shutdown or destroy_process_group
DIED = "died"  # its control socket closed with no frame: the process is gone


def overlay(rank: int, world: int) -> list[int]:
    """The ranks ``rank`` holds a control link to: those differing from it in
    one bit (a hypercube, cut to ``world``): at most ceil(log2 N) each, and
    connected whatever N (any rank reaches 0 by clearing its bits one at a
    time), so floods and routed queries reach every rank."""
    return [
        rank ^ (1 << k) for k in range(max(world - 1, 1).bit_length()) if rank ^ (1 << k) < world
    ]


def route(src: int, dst: int) -> list[int]:
    """A path of overlay links from ``src`` to ``dst`` (both ends included):
    clear the bits ``dst`` lacks, then set the ones it has; every rank on the
    way is at most max(src, dst), so inside the group."""
    path = [src]
    at = src
    for k in reversed(range(max(src, dst).bit_length())):
        if at >> k & 1 and not dst >> k & 1:
            at ^= 1 << k
            path.append(at)
    for k in range(dst.bit_length()):
        if dst >> k & 1 and not at >> k & 1:
            at ^= 1 << k
            path.append(at)
    return path


class _Peer:
    """One control link: the overlay neighbour at its other end."""

    __slots__ = ("peer", "sock", "buf", "closed")

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.buf = bytearray()
        self.closed = False  # its end closed: it will say no more


class ControlChannel:
    """One rank's control links (the overlay) and the thread that serves them
    (see the module docstring)."""

    def __init__(
        self, rank: int, socks: dict[int, socket.socket], in_flight: InFlight | None = None
    ) -> None:
        self.rank = rank
        # The call this rank runs, read only to answer a QUERY (``in_flight.py``).
        self._in_flight = in_flight or InFlight()
        self._peers = {p: _Peer(p, s) for p, s in socks.items()}
        self._by_fd = {s.fileno(): self._peers[p] for p, s in socks.items()}
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # an end or an answer arrived
        self._closed = False
        # How every rank that ended did (learnt first-hand or relayed): its
        # abort record, LEFT or DIED; by rank.
        self._ends: dict[int, AbortRecord | str] = {}
        self._unseen: list[tuple[int, AbortRecord]] = []  # aborts the loop has not raised yet
        self._states: dict[int, PeerState | None] = {}  # answers to this rank's queries
        # Set by the mesh while it sleeps waiting for peers: (what, receiving
        # from, sending to); what a QUERY is answered with.
        self.waiting: tuple[str, Iterable[int], Iterable[int]] | None = None
        # The rank this one's own stall walk blamed: it fails with that, and a
        # QUERY answered between its walk and its abort says so (else it would
        # read as "not inside any collective" and be blamed itself).
        self.blamed: int | None = None
        # The loop sleeps on ``news`` (readable once an abort came in); the
        # thread on the links and ``_wake`` (to stop).
        self._news = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(
            target=self._serve, name=f"entrenar-control-r{rank}", daemon=True
        )
        self._thread.start()

    @property
    def fds(self) -> list[int]:
        """What the progress loop polls for control news (one descriptor)."""
        return [self._news]

    @property
    def links(self) -> list[int]:
        """The ranks this one holds a control link to."""
        return sorted(self._peers)

    # ------------------------------------------------------------------ the thread

    def _serve(self) -> None:
        poller = select.poll()
        poller.register(self._wake, select.POLLIN)
        for fd in self._by_fd:
            poller.register(fd, select.POLLIN)
        while not self._closed:
            for fd, _ in poller.poll():
                if fd == self._wake:
                    continue
                p = self._by_fd[fd]
                with self._lock:
                    if self._closed:
                        return
                    self._read(p)
                    if p.closed:
                        poller.unregister(fd)

    def _read(self, p: _Peer) -> None:
        while True:
            try:
                chunk = p.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                p.closed = True
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
        if p.closed:
            # Its end closed with no word of how (an ABORT or BYE comes
            # before the close on the same link): its process is gone.
            self._learn(p.peer, DIED, p.peer)

    def _handle(self, p: _Peer, kind: int, body: dict[str, Any]) -> None:
        if kind == ABORT:
            culprit = body.get("culprit")
            record = AbortRecord(
                str(body.get("kind", "PeerConnectionError")),
                None if culprit is None else int(culprit),
                str(body.get("message", "")),
            )
            self._learn(int(body.get("origin", p.peer)), record, p.peer)
        elif kind == BYE:
            self._learn(int(body.get("origin", p.peer)), LEFT, p.peer)
        elif kind == GONE:
            self._learn(int(body["origin"]), DIED, p.peer)
        elif kind in (QUERY, STATE):
            self._routed(kind, body)

    def _learn(self, origin: int, end: AbortRecord | str, via: int) -> None:
        """How ``origin`` ended, first-hand or relayed by ``via``: kept (the first
        word wins) and passed on to every other link, so it reaches every rank."""
        if origin == self.rank or origin in self._ends:
            return
        self._ends[origin] = end
        if isinstance(end, AbortRecord):
            self._unseen.append((origin, end))
            os.eventfd_write(self._news, 1)
        self._changed.notify_all()
        kind, body = _end_frame(origin, end)
        for q in self._peers.values():
            if q.peer not in (via, origin) and not q.closed:
                self._send(q, kind, body)

    def _routed(self, kind: int, body: dict[str, Any]) -> None:
        """A QUERY on its way to its target (the last rank of its route) or a
        STATE on its way back (to the first): pass it on, or answer / keep it."""
        path = [int(x) for x in body.get("route", ())]
        if self.rank not in path:
            return
        at = path.index(self.rank)
        if kind == QUERY and at == len(path) - 1:
            # A rank that heard an abort naming a culprit is failing with it: it
            # says so, else a walk that reaches it just after its call ended
            # would read "not inside any collective" and blame it.
            named = self._first_named()
            blamed = self.blamed if self.blamed is not None or named is None else named[1]
            answer = _state_answer(blamed, self._in_flight.terms(), self.waiting)
            kind, body = STATE, {"route": path, **answer}
            nxt = at - 1
        elif kind == STATE and at == 0:
            what = body.get("what")
            blamed = body.get("blamed")
            call = body.get("call")
            state = PeerState(
                what,
                tuple(int(x) for x in body.get("waiting_on", ())),
                None if blamed is None else int(blamed),
                None if call is None else Terms(int(call[0]), str(call[1]), str(call[2])),
            )
            if path[-1] in self._states:
                self._states[path[-1]] = state
                self._changed.notify_all()
            return
        else:
            nxt = at + 1 if kind == QUERY else at - 1
        q = self._peers.get(path[nxt]) if 0 <= nxt < len(path) else None
        if q is not None and not q.closed:
            self._send(q, kind, body)

    # ------------------------------------------------------------------ writing

    def _send(self, p: _Peer, kind: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        try:
            p.sock.send(_FRAME.pack(len(raw), kind) + raw)  # tiny: all or nothing in practice
        except OSError:
            pass  # the peer is gone; its own end says so

    # ------------------------------------------------------------------ the loop's side

    def service(self, fd: int) -> tuple[int, AbortRecord] | None:
        """The loop saw news: the first abort it has not raised yet (its origin, record)."""
        try:
            os.eventfd_read(self._news)
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            return self._unseen.pop(0) if self._unseen else None

    def how_ended(self, peer: int, wait_s: float) -> AbortRecord | str | None:
        """Why ``peer``'s links closed: its abort record, LEFT or DIED (told by
        its own control link or relayed); None if nothing came within
        ``wait_s`` (a close on a data link may come before the word of it)."""
        return self._await(partial(self._ends.get, peer), wait_s)

    def _await(self, pick: Callable[[], _T], wait_s: float) -> _T:
        """``pick()`` under the lock, again after each end or answer, until it
        gives something other than None, this rank closes, or ``wait_s`` has passed."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                got = pick()
                left = deadline - time.monotonic()
                if got is not None or self._closed or left <= 0:
                    return got
                self._changed.wait(left)

    def first_abort(self) -> tuple[int, AbortRecord] | None:
        """The first abort this rank heard of (its origin and record), if any."""
        with self._lock:
            for origin, end in self._ends.items():
                if isinstance(end, AbortRecord):
                    return origin, end
        return None

    # ------------------------------------------------------------------ blame

    def gone(self, peer: int) -> Gone | None:
        """How ``peer`` ended, if this rank heard (the walk's ``WaitForGraph``)."""
        with self._lock:
            end = self._ends.get(peer)
        if isinstance(end, AbortRecord):
            return Gone(f"failed: {end.message}", end.culprit)
        if end == LEFT:
            return Gone("has left the group")
        if end == DIED:
            return Gone("is gone (its process died)")
        return None

    def verdict(self, wait_s: float) -> tuple[int, int] | None:
        """The first rank heard to fail naming a culprit (origin, culprit),
        waiting up to ``wait_s`` for one (the walk's ``WaitForGraph``)."""
        return self._await(self._first_named, wait_s)

    def _first_named(self) -> tuple[int, int] | None:
        """The first abort heard that names a culprit: (its origin, the culprit)."""
        for origin, end in self._ends.items():
            if isinstance(end, AbortRecord) and end.culprit is not None:
                return origin, end.culprit
        return None

    def ask(self, peers: list[int], answer_s: float) -> dict[int, PeerState | None]:
        """QUERY each peer (along the overlay, relayed by the ranks between);
        their STATE answers within ``answer_s`` (None: no answer)."""
        with self._lock:
            for q in peers:
                self._states[q] = None
                if q in self._ends:
                    continue
                for path in _routes(self.rank, self._peers, q):
                    first = self._peers[path[1]]
                    if not first.closed:
                        self._send(first, QUERY, {"route": path})
            deadline = time.monotonic() + answer_s
            while not self._closed:
                pending = [q for q in peers if self._states[q] is None and q not in self._ends]
                left = deadline - time.monotonic()
                if not pending or left <= 0:
                    break
                self._changed.wait(left)
            return {q: self._states.pop(q, None) for q in peers}

    # ------------------------------------------------------------------ closing

    def close(self, abort: AbortRecord | None = None) -> None:
        """Say goodbye (or why this rank aborts) on every link, then close.

        The thread stops first, then unread input is drained: closing a
        socket with unread data makes the kernel send a reset, which may
        discard the frame just sent. Each neighbour passes the word on.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        os.eventfd_write(self._wake, 1)
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)
        with self._lock:
            for p in self._peers.values():
                if not p.closed:
                    self._read(p)
            if abort is None:
                kind, body = BYE, {"origin": self.rank}
            else:
                kind, body = _end_frame(self.rank, abort)
            for p in self._peers.values():
                self._send(p, kind, body)
                try:
                    p.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                p.sock.close()
            for fd in (self._news, self._wake):
                os.close(fd)


def _routes(rank: int, links: Iterable[int], q: int) -> list[list[int]]:
    """The ways ``rank``'s QUERY goes to ``q``: the direct link, or one route
    through each overlay neighbour in ``links`` (a stopped rank on one route
    leaves the others: the first answer counts)."""
    if q in links:
        return [[rank, q]]
    routes: list[list[int]] = []
    for n in sorted(links):
        path = [rank, *route(n, q)]
        if rank not in path[1:] and len(set(path)) == len(path) and path not in routes:
            routes.append(path)
    return routes or [route(rank, q)]


def _state_answer(
    blamed: int | None, call: Terms | None, waiting: tuple[str, Iterable[int], Iterable[int]] | None
) -> dict[str, Any]:
    """A QUERY's answer: the collective this rank waits in and on whom, whom
    its walk (or a heard abort) blamed, and the call it runs with its terms,
    whether or not it waits now: a late rank and a mismatched one differ
    there (``data_links.DataLinks._ask``)."""
    if waiting is None:
        return {"what": None, "waiting_on": [], "blamed": blamed, "call": call}
    what, recv_from, send_to = waiting
    on = sorted(set(recv_from) | set(send_to))
    return {"what": what, "waiting_on": on, "blamed": blamed, "call": call}


def _end_frame(origin: int, end: AbortRecord | str) -> tuple[int, dict[str, Any]]:
    """The frame that tells how ``origin`` ended."""
    if isinstance(end, AbortRecord):
        body = {"kind": end.kind, "culprit": end.culprit, "message": end.message}
        return ABORT, {"origin": origin, **body}
    return (BYE if end == LEFT else GONE), {"origin": origin}


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

    def first_abort(self) -> tuple[int, AbortRecord] | None:
        """The first abort heard of, from any rank (``ControlChannel.first_abort``)."""
        return None if self.control is None else self.control.first_abort()

    def calls(self, peers: list[int], answer_s: float) -> dict[int, PeerState | None]:
        """What each of ``peers`` says of the call it is in (``Call.what`` and
        its ``in_flight.Terms``), asked over the control channel (a QUERY);
        None: ended, or no answer within ``answer_s``."""
        if self.control is None:
            return {}
        return self.control.ask(peers, answer_s)

    def peer_closed(
        self, peer: int, what: str, ended: AbortRecord | str | None = None
    ) -> EntrenarError:
        """``peer``'s end of a link closed during ``what``: its abort, its goodbye or its death."""
        if self.closed_here:
            return self.here_closed(what)
        if ended is None:
            ended = self.how_ended(peer)
        if ended is None:
            # No word of it reached this rank (the ranks that would relay it
            # may be aborting too): another rank's abort, if one came, is the
            # group's cause, and it names the culprit.
            heard = self.first_abort()
            if heard is not None and heard[0] != peer:
                origin, record = heard
                cls = ERROR_TYPES.get(record.kind, PeerConnectionError)
                return cls(
                    f"rank {self.rank}: {what}: rank {peer} closed its link after rank "
                    f"{origin} failed: {record.message}",
                    culprit=record.culprit if record.culprit is not None else origin,
                )
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
        and blame the rank at the end of that walk (``wait_for.walk``)."""
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
        blame = walk(self.control, self.rank, [*recv_from, *send_to], what, answer_s)
        if blame.culprit is not None and self.control.blamed is None:
            self.control.blamed = blame.culprit
        if blame.culprit is None:
            return PeerConnectionError(f"{head}: {blame.story}")
        return PeerConnectionError(
            f"{head}: {blame.story}; culprit: rank {blame.culprit}", culprit=blame.culprit
        )

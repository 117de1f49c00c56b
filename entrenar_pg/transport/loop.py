"""TCP mesh: the plan model and the one progress loop every collective runs on.

Set-up (``entrenar_pg.rendezvous``): every rank listens on one port, publishes
it in the group's store, and each pair of ranks shares one authenticated data
socket and, beside it, one control socket (``entrenar_pg.control``).

Data: after set-up the sockets are non-blocking and driven by ``Mesh.run``, a
single progress loop that executes a ``Plan``: for each peer, an ordered list
of byte ranges to send and an ordered list of byte ranges to receive into.
A send may wait for a receive to finish (``ready``), a receive may run a
callback when it completes (``done``: reduce a segment, mark it forwardable).
That is all an algorithm needs; algorithms live in ``entrenar_pg.algorithms``
and never touch a socket. Sending never waits on the peer's receive (the loop
sends what the kernel takes and keeps receiving), so no size deadlocks.

Failure: a rank that fails sends an ABORT frame (error class, culprit rank,
message) on every control link *before* closing its sockets. A peer that sees
a link close reads that frame and raises the same error class naming the
same culprit, so the root cause reaches every rank without the store (which
may have died with its host rank). Every peer socket is watched for a hang-up
(POLLRDHUP) and every control socket for frames during every exchange, so a
rank blocked on another link still learns at once. A rank that sees no
progress for the timeout asks the peers it waits on what they wait on, and
blames the rank at the end of that walk.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .config import Options
from .control import LEFT, AbortRecord, ControlChannel
from .errors import ERROR_TYPES, CollectiveMismatchError, EntrenarError, PeerConnectionError
from .rendezvous import CONTROL, DATA, Rendezvous
from .wire import HEADER_BYTES, Header, stamp_seq

log = logging.getLogger(__name__)

# How long a rank that saw a peer's data link close waits for that peer's
# control frame (or its control link's close) to learn why: the two sockets'
# events are not ordered, but they come from one close, microseconds apart.
_CAUSE_WAIT_S = 1.0

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)
_POLLHANG = select.POLLHUP | select.POLLERR | _POLLRDHUP
_MAX_IOV = 64  # buffers per sendmsg/recvmsg_into (the kernel allows 1024)


@dataclass(slots=True)
class Send:
    """Bytes to send to a peer, once ``ready()`` (if given) is true."""

    view: memoryview
    ready: Callable[[], bool] | None = None


@dataclass(slots=True)
class Recv:
    """A buffer to fill from a peer; ``done()`` runs once it is full.

    ``chain``: the next piece's buffer is distinct from this one, so both may
    be filled by one syscall (false for pieces that share a scratch buffer).
    """

    view: memoryview
    done: Callable[[], None] | None = None
    chain: bool = False


@dataclass(slots=True)
class _Stamp:
    """A header as this rank sends it and expects it back, packed once.

    ``packed`` is the truth: ``Plan.restamp`` rewrites its sequence number in
    place, so ``header`` (what the plan was built with) may carry an older one.
    """

    header: Header
    packed: bytearray


@dataclass(slots=True)
class _Link:
    """One direction of one link in a plan, as ``Mesh.run`` drives it.

    ``whole``: every piece's view, when the link can go in one syscall from
    the start (sends: no piece waits on a receive; receives: every piece but
    the last is ``chain``), else None. Computed once per plan (cached plans
    reuse it), so a small collective's first attempt on a link is one
    ``sendmsg`` / ``recvmsg_into`` with no per-piece work.
    """

    peer: int
    pieces: list[Any]
    whole: list[memoryview] | None
    total: int


@dataclass(slots=True)
class _Tally:
    """How many of a plan's received headers have passed their check (see ``Plan.acknowledge``)."""

    expected: int = 0
    passed: int = 0

    def all_passed(self) -> bool:
        return self.passed == self.expected


@dataclass
class Plan:
    """Per-peer ordered sends and receives of one collective on one rank.

    The header rule: no rank may complete a collective before every peer's
    header has been compared with its own, here or (through data that peer
    sent only after its own checks) on the way. A plan whose data reaches
    every rank through every other (ring, star, direct) gets that from its
    data; one where some rank only sends or only hears from some peers adds
    ``confirm_peers`` (header-only frames on the links it does not use), and
    one whose links carry different headers (all-to-all: per-link sizes)
    adds ``acknowledge``. Every plan also exchanges headers with its ring
    neighbours (star plans through ``confirm_neighbours``), so two different
    plans for one call always meet (a large reduce's final move to the root
    is the exception: every rank agreed in the reduce-scatter before it).
    docs/architecture.md, "The header rule", says which algorithm does what.
    """

    rank: int
    sends: dict[int, list[Send]] = field(default_factory=dict)
    recvs: dict[int, list[Recv]] = field(default_factory=dict)
    _stamps: list[_Stamp] = field(default_factory=list)
    _tally: _Tally = field(default_factory=_Tally)
    _links: tuple[list[_Link], list[_Link]] | None = None

    def open(self, peer: int, header: Header, *, send: bool = True, recv: bool = True) -> None:
        """Start this collective's frame on the link(s) with ``peer``.

        The header goes first in each direction used; the received one must
        equal ``header`` (same collective, seq, dtype, size, algorithm), else
        CollectiveMismatchError. A direction opens once, before its pieces.
        """
        assert peer != self.rank
        stamp = self._stamp(header)
        if send:
            assert peer not in self.sends, "internal: a link direction opens once, first"
            self.send(peer, memoryview(stamp.packed))
        if recv:
            assert peer not in self.recvs, "internal: a link direction opens once, first"
            self._expect(peer, stamp, self._tally)

    def confirm_peers(self, world: int, header: Header) -> None:
        """Exchange ``header`` alone on every link direction this plan leaves unused.

        Call it after every ``open``. Afterwards this rank sends its header to
        every peer and receives every peer's, so it completes only once it has
        compared every peer's call with its own, and every peer compares ours:
        if any two ranks disagree, every rank sees a header unlike its own.
        Costs one 32-byte frame per unused direction, sent at the start (no
        extra round trip).
        """
        for peer in range(world):
            if peer != self.rank and (peer not in self.sends or peer not in self.recvs):
                self.open(peer, header, send=peer not in self.sends, recv=peer not in self.recvs)

    def confirm_neighbours(self, world: int, header: Header) -> None:
        """Send ``header`` to the next rank and receive the previous rank's, if the
        plan does not already (header-only frames); call it after every ``open``.

        Every plan talks to its ring neighbours this way or through its own
        links, so when ranks run different plans for one call (a star beside a
        ring, when their sizes or thresholds disagree) some rank always reads
        a header from a rank whose plan differs, instead of all waiting for
        messages that go elsewhere until the timeout.
        """
        right, left = (self.rank + 1) % world, (self.rank - 1) % world
        if right not in self.sends:
            self.open(right, header, recv=False)
        if left not in self.recvs:
            self.open(left, header, send=False)

    def acknowledge(self, peer: int, header: Header) -> None:
        """End the link with ``peer`` with an acknowledgement both ways.

        For plans whose links carry different headers (all-to-all: each
        link's sizes), where comparing headers on every link does not compare
        every pair of calls: a third rank cannot see that two others disagree
        about the link between them. The acknowledgement is ``header`` (the
        link's) again, sent only once every header this plan receives has
        passed its check, and received and checked like a header; so a rank
        completes only after every peer found all of its own links in
        agreement. One more hop; 32 bytes per direction.
        """
        stamp = self._stamp(header)
        self.send(peer, memoryview(stamp.packed), self._tally.all_passed)
        self._expect(peer, stamp, None)

    def restamp(self, seq: int) -> None:
        """Re-arm a cached plan (one header on every link) for its next call:
        the same collective on the same buffers, only the sequence number new."""
        assert len(self._stamps) == 1, "internal: restamp needs a one-header plan"
        stamp_seq(self._stamps[0].packed, seq)
        self._tally.passed = 0

    def links(self) -> tuple[list[_Link], list[_Link]]:
        """The plan's send and receive links, for ``Mesh.run`` (built on first use)."""
        if self._links is None:
            sends = [
                _Link(p, lst, _whole(lst, all(s.ready is None for s in lst)), _total(lst))
                for p, lst in self.sends.items()
            ]
            recvs = [
                _Link(p, lst, _whole(lst, all(r.chain for r in lst[:-1])), _total(lst))
                for p, lst in self.recvs.items()
            ]
            self._links = (sends, recvs)
        return self._links

    def send(self, peer: int, view: memoryview, ready: Callable[[], bool] | None = None) -> None:
        assert self._links is None, "internal: plan changed after it ran"
        if not len(view):
            # Nothing to move, and the send loop must not stop at an empty
            # piece whose successor waits (sendmsg of nothing "moves" forever).
            return
        self.sends.setdefault(peer, []).append(Send(view, ready))

    def recv(
        self,
        peer: int,
        view: memoryview,
        done: Callable[[], None] | None = None,
        chain: bool = False,
    ) -> None:
        assert self._links is None, "internal: plan changed after it ran"
        self.recvs.setdefault(peer, []).append(Recv(view, done, chain))

    def _stamp(self, header: Header) -> _Stamp:
        """The packed form of ``header``: the plan's last one when equal (the same
        header on several links is packed once), else a new one."""
        stamps = self._stamps
        if stamps and (stamps[-1].header is header or stamps[-1].header == header):
            return stamps[-1]
        stamp = _Stamp(header, bytearray(HEADER_BYTES))
        header.pack_into(stamp.packed)
        stamps.append(stamp)
        return stamp

    def _expect(self, peer: int, stamp: _Stamp, tally: _Tally | None) -> None:
        """Receive a header from ``peer`` and compare it with ``stamp`` (counted in ``tally``)."""
        raw = bytearray(HEADER_BYTES)
        if tally is not None:
            tally.expected += 1
        self.recv(peer, memoryview(raw), _header_check(self.rank, peer, stamp, raw, tally), True)


def _whole(pieces: list[Any], one_go: bool) -> list[memoryview] | None:
    if not one_go or len(pieces) > _MAX_IOV:
        return None
    return [p.view for p in pieces]


def _total(pieces: list[Any]) -> int:
    return sum(len(p.view) for p in pieces)


def _consume(st: list[Any], n: int, complete: bool) -> None:
    """Advance link state ``st`` (see ``Mesh._first_attempt``) over ``n`` bytes just
    moved; on a receiving link (``complete``) run each piece's ``done`` as it fills."""
    pieces = st[2]
    i = st[3]
    off = st[4]
    while n > 0:
        piece = pieces[i]
        left = len(piece.view) - off
        if n < left:
            off += n
            break
        n -= left
        i += 1
        off = 0
        if complete and piece.done is not None:
            piece.done()
    st[3] = i
    st[4] = off


def _header_check(
    rank: int, peer: int, stamp: _Stamp, raw: bytearray, tally: _Tally | None
) -> Callable[[], None]:
    def check() -> None:
        if raw == stamp.packed:  # the common case: byte-equal headers are equal headers
            if tally is not None:
                tally.passed += 1
            return
        mine = Header.unpack(stamp.packed)  # with the current seq (see _Stamp)
        try:
            theirs = Header.unpack(raw)
        except ValueError as e:
            raise CollectiveMismatchError(
                f"rank {rank}: garbage from rank {peer} where the header of "
                f"{mine.describe()} was due ({e}); the ranks are out of step"
            ) from None
        if theirs != mine:
            raise CollectiveMismatchError(
                f"rank {rank}: collective mismatch with rank {peer}: this rank called "
                f"{mine.describe()}, rank {peer} called {theirs.describe()}"
            )
        if tally is not None:  # equal after all (bytes that parse alike)
            tally.passed += 1

    return check


class Mesh:
    """One authenticated TCP socket to every other rank of a group (and, with
    ``control``, a control socket beside each: see ``entrenar_pg.control``)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        options: Options,
        timeout: timedelta,
        name: str = "",
        *,
        control: bool = True,
    ) -> None:
        self.rank = rank
        self.world = world
        self.name = name
        self.timeout_s = max(timeout.total_seconds(), 0.001)
        self._store = store
        self._options = options
        self._socks: dict[int, socket.socket] = {}
        self._closed = False
        self._close_lock = threading.Lock()
        # How long run() busy-polls before sleeping in poll(); whoever runs a
        # job sets it (the comm thread and a caller's thread differ).
        self.spin_s = options.spin_us / 1e6
        ctrl_socks: dict[int, socket.socket] = {}
        if world > 1:
            channels = (DATA, CONTROL) if control else (DATA,)
            links = Rendezvous(store, rank, world, options, self.timeout_s, channels).connect_all()
            self._socks = {p: s for (p, ch), s in links.items() if ch == DATA}
            ctrl_socks = {p: s for (p, ch), s in links.items() if ch == CONTROL}
        self.control: ControlChannel | None = (
            ControlChannel(rank, ctrl_socks) if ctrl_socks else None
        )
        self._poller = select.poll()
        self._masks: dict[int, int] = {}
        self._fd_peer: dict[int, int] = {}
        for peer, sock in self._socks.items():
            fd = sock.fileno()
            self._poller.register(fd, _POLLRDHUP)
            self._masks[fd] = _POLLRDHUP
            self._fd_peer[fd] = peer
        if self.control is not None:
            for fd in self.control.fds:
                self._poller.register(fd, _POLLIN)  # constant: never in _masks

    @property
    def sockets(self) -> dict[int, socket.socket]:
        """The authenticated, non-blocking socket to each peer (for channels built on a mesh)."""
        return dict(self._socks)

    @property
    def store(self) -> Any:
        return self._store

    # ------------------------------------------------------------------ data

    def run(self, plan: Plan, what: str) -> None:
        """Execute ``plan``: all its sends and receives, overlapped, in order per link.

        Raises PeerConnectionError if a peer closes, errors, or nothing moves
        for the group's timeout; exceptions from ``done`` callbacks propagate.
        """
        if self._closed:
            raise PeerConnectionError(f"rank {self.rank}: {what}: the group's sockets are closed")
        # No abort check up front: a peer that aborted earlier has closed its
        # links, which this exchange reads as a close (and then its record),
        # and the check at the end covers peers this plan does not talk to.
        sending, receiving = self._first_attempt(plan, what)
        spin_until = 0.0
        waited = False
        try:
            while sending or receiving:
                # Pump every link not known to be blocked on its socket (a
                # blocked one only moves once poll() says so: no syscall just
                # to hear EAGAIN again).
                moved = finished = False
                for st in sending:
                    if not st[5] and self._pump_send(st, what):
                        moved = True
                        finished = finished or st[3] == st[6]
                for st in receiving:
                    if not st[5] and self._pump_recv(st, what):
                        moved = True
                        finished = finished or st[3] == st[6]
                if moved:
                    if finished:
                        sending = [st for st in sending if st[3] < st[6]]
                        receiving = [st for st in receiving if st[3] < st[6]]
                    spin_until = 0.0
                    continue
                want: dict[int, int] = {}
                for st in sending:
                    if st[5]:
                        want[st[1].fileno()] = _POLLOUT
                for st in receiving:
                    if st[5]:
                        fd = st[1].fileno()
                        want[fd] = want.get(fd, 0) | _POLLIN
                assert want, f"rank {self.rank}: {what}: a send waits on nothing"
                spinning = False
                if self.spin_s:
                    # Busy-poll a little before sleeping in poll(): a small
                    # message's answer usually comes within tens of us, and a
                    # sleeping thread costs tens of us to wake on these
                    # machines. Each turn yields the core, so a peer (or a
                    # thread of ours) waiting for it runs first.
                    now = time.perf_counter()
                    if spin_until == 0.0:
                        spin_until = now + self.spin_s
                    spinning = now < spin_until
                    if spinning:
                        os.sched_yield()
                if not spinning:
                    self._wait(want, plan, sending, receiving, what)
                    waited = True
                    spin_until = 0.0
                for st in sending:  # after a spin or a wait, try every link again
                    st[5] = False
                for st in receiving:
                    st[5] = False
            # All our bytes moved, but a peer may have failed after sending its
            # part (e.g. it timed out waiting for us): then this collective did
            # not complete on every rank, and this rank must not think it did.
            self._check_aborts(what)
        finally:
            if waited:
                for fd, mask in self._masks.items():
                    if mask != _POLLRDHUP:
                        self._poller.modify(fd, _POLLRDHUP)
                        self._masks[fd] = _POLLRDHUP
                if self.control is not None:
                    self.control.waiting = None  # a QUERY now hears "not in a collective"

    def _first_attempt(self, plan: Plan, what: str) -> tuple[list[list[Any]], list[list[Any]]]:
        """One syscall per link whose pieces can go together; the state of the rest.

        A small collective's frame usually leaves in this one ``sendmsg`` and,
        when the peer was first, arrives in this one ``recvmsg_into``, so such
        a link never enters the progress loop. A link that did not finish is
        returned as loop state, marked blocked (the kernel took or had less
        than asked: wait for poll). Link state is
        ``[peer, sock, pieces, index, offset, blocked-on-the-socket, n_pieces]``.
        """
        socks = self._socks
        send_links, recv_links = plan.links()
        sending: list[list[Any]] = []
        receiving: list[list[Any]] = []
        for link in send_links:
            sock = socks[link.peer]
            n = 0
            if link.whole is not None:
                try:
                    n = sock.sendmsg(link.whole)
                except BlockingIOError:
                    pass
                except OSError as e:
                    raise self._link_error(link.peer, what, e) from e
                if n == link.total:
                    continue
            st = [link.peer, sock, link.pieces, 0, 0, link.whole is not None, len(link.pieces)]
            _consume(st, n, False)
            sending.append(st)
        for link in recv_links:
            sock = socks[link.peer]
            n = 0
            if link.whole is not None and link.total:
                try:
                    n = sock.recvmsg_into(link.whole)[0]
                except BlockingIOError:
                    n = -1
                except OSError as e:
                    raise self._link_error(link.peer, what, e) from e
                if n == 0:
                    raise self._closed_error(link.peer, what)
                if n == link.total:
                    for piece in link.pieces:  # all full: their callbacks, in order
                        if piece.done is not None:
                            piece.done()
                    continue
            st = [link.peer, sock, link.pieces, 0, 0, n != 0, len(link.pieces)]
            _consume(st, n, True)
            receiving.append(st)
        return sending, receiving

    def _pump_send(self, st: list[Any], what: str) -> bool:
        """Send what the kernel takes on one link; True if anything moved.

        Consecutive ready pieces go out in one ``sendmsg`` (a header and a
        small payload: one syscall, one TCP segment). Sets ``st[5]`` when the
        socket is full (wait for POLLOUT); a piece that is not ready yet waits
        on a receive, not on this socket.
        """
        peer, sock, pieces, i, off, _, n_pieces = st
        moved = False
        st[5] = False
        while i < n_pieces:
            views: list[memoryview] = []
            total = 0
            j = i
            stop = min(n_pieces, i + _MAX_IOV)
            while j < stop:
                piece = pieces[j]
                if (j > i or off == 0) and piece.ready is not None and not piece.ready():
                    break
                v = piece.view[off:] if j == i and off else piece.view
                views.append(v)
                total += len(v)
                j += 1
            if not views:
                break
            try:
                n = sock.sendmsg(views)
            except BlockingIOError:
                st[5] = True
                break
            except OSError as e:
                raise self._link_error(peer, what, e) from e
            moved = True
            _consume(st, n, False)
            i, off = st[3], st[4]
            if n != total:
                st[5] = True
                break
        return moved

    def _pump_recv(self, st: list[Any], what: str) -> bool:
        """Receive what has arrived on one link and run completed pieces' callbacks.

        A piece marked ``chain`` (its buffer is not reused by the next) is
        filled in one ``recvmsg_into`` together with the pieces after it, so
        a header and its payload cost one syscall. Sets ``st[5]`` when the
        socket is drained (wait for POLLIN).
        """
        peer, sock, pieces, i, off, _, n_pieces = st
        moved = False
        st[5] = False
        while i < n_pieces:
            piece = pieces[i]
            size = len(piece.view)
            if size == 0:
                if piece.done is not None:
                    piece.done()
                moved = True
                i += 1
                st[3] = i
                continue
            views = [piece.view[off:] if off else piece.view]
            j = i + 1
            while pieces[j - 1].chain and j < n_pieces and len(views) < _MAX_IOV:
                views.append(pieces[j].view)
                j += 1
            try:
                if len(views) == 1:
                    n = sock.recv_into(views[0])
                else:
                    n = sock.recvmsg_into(views)[0]
            except BlockingIOError:
                st[5] = True
                break
            except OSError as e:
                raise self._link_error(peer, what, e) from e
            if n == 0:
                raise self._closed_error(peer, what)
            moved = True
            _consume(st, n, True)  # completes, in order, every piece now full
            i, off = st[3], st[4]
            if i < j:  # the kernel had no more for now
                st[5] = True
                break
        return moved  # st[3], st[4] are kept current by _consume and the empty-piece branch

    def _wait(
        self,
        want: dict[int, int],
        plan: Plan,
        sending: list[list[Any]],
        receiving: list[list[Any]],
        what: str,
    ) -> None:
        """Sleep in poll() until a link in ``want`` is ready, a peer hangs up or
        aborts, or nothing has moved for the timeout (then find whom to blame)."""
        masks = self._masks
        for fd in masks:
            mask = want.get(fd, 0) | _POLLRDHUP
            if masks[fd] != mask:
                self._poller.modify(fd, mask)
                masks[fd] = mask
        control = self.control
        if control is not None:
            control.waiting = (what, [st[0] for st in receiving], [st[0] for st in sending])
        deadline = time.monotonic() + self.timeout_s
        while True:
            events = self._poller.poll(max(deadline - time.monotonic(), 0.0) * 1000.0)
            if self._closed:  # abort() or shutdown from another thread closed our links
                raise self._closed_here_error(what)
            if not events and time.monotonic() >= deadline:
                raise self._stalled_error(receiving, sending, what)
            data_event = False
            for fd, ev in events:
                peer = self._fd_peer.get(fd)
                if peer is None:  # a control frame (or a control link's close)
                    self._on_control(fd, what)
                    continue
                data_event = True
                if not ev & _POLLHANG or want.get(fd, 0) & _POLLIN:
                    continue  # recv drains what is left, then reports the close itself
                ended = self._how_ended(peer)
                if isinstance(ended, AbortRecord) or fd in want:
                    raise self._closed_error(peer, what, ended)
                # A peer not in this collective left (it finished and destroyed the
                # group, or died: whoever talks to it next will say so).
                self._poller.unregister(fd)
                del masks[fd]
                del self._fd_peer[fd]
            if data_event:
                return

    # ------------------------------------------------------------------ failure

    def _on_control(self, fd: int, what: str) -> None:
        """A control socket is readable: answer queries; raise a peer's abort."""
        assert self.control is not None
        record = self.control.service(fd)
        peer = self.control.peer_of(fd)
        if record is not None and peer is not None:
            raise self._closed_error(peer, what, record)
        if peer is not None and self.control.has_ended(peer):
            self._poller.unregister(fd)  # its end is closed: it says no more

    def _stalled_error(
        self, receiving: list[list[Any]], sending: list[list[Any]], what: str
    ) -> PeerConnectionError:
        """No byte moved for the timeout: ask the peers we wait on what they wait on,
        and blame the rank at the end of that walk (see ``control.find_stalled``)."""
        recv_from = sorted(st[0] for st in receiving)
        send_to = sorted(st[0] for st in sending)
        head = (
            f"rank {self.rank}: {what}: no progress for {self.timeout_s:.1f}s "
            f"(waiting to receive from rank(s) {recv_from}, to send to rank(s) {send_to})"
        )
        if self.control is None:
            return PeerConnectionError(
                f"{head}: a peer stalled, died, or issued a different collective"
            )
        answer_s = min(2.0, max(0.25, self.timeout_s / 4))
        blame = self.control.find_stalled([*recv_from, *send_to], what, answer_s)
        if blame.culprit is None:
            return PeerConnectionError(f"{head}: {blame.story}")
        return PeerConnectionError(
            f"{head}: {blame.story}; culprit: rank {blame.culprit}", culprit=blame.culprit
        )

    def _check_aborts(self, what: str) -> None:
        """Raise the abort of any peer that aborted or hung up with one (no waiting)."""
        for fd, ev in self._poller.poll(0):
            peer = self._fd_peer.get(fd)
            if peer is None:
                self._on_control(fd, what)
                continue
            if not ev & _POLLHANG:
                continue
            ended = self._how_ended(peer)
            if isinstance(ended, AbortRecord):
                raise self._closed_error(peer, what, ended)
            # It left without failing (destroyed its group); whoever needs it
            # next will read the close itself.
            self._poller.unregister(fd)
            del self._masks[fd]
            del self._fd_peer[fd]

    def _how_ended(self, peer: int) -> AbortRecord | str | None:
        """Why ``peer``'s data link closed, from its control link (see ``control``)."""
        if self.control is None:
            return None
        return self.control.how_ended(peer, _CAUSE_WAIT_S)

    def _closed_error(
        self, peer: int, what: str, ended: AbortRecord | str | None = None
    ) -> EntrenarError:
        if ended is None:
            ended = self._how_ended(peer)
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

    def _closed_here_error(self, what: str) -> EntrenarError:
        return PeerConnectionError(
            f"rank {self.rank}: {what}: this rank's links were closed under it "
            "(the group was aborted or shut down)",
            culprit=self.rank,
        )

    def _link_error(self, peer: int, what: str, e: OSError) -> EntrenarError:
        if self._closed:
            return self._closed_here_error(what)
        if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
            return self._closed_error(peer, what)
        return PeerConnectionError(f"rank {self.rank}: {what}: link to rank {peer} failed: {e}")

    def abort(self, error: BaseException) -> None:
        """Tell every peer why this rank fails (an ABORT frame on each control
        link), then drop every link. The frame goes first, so a peer that sees
        a link close can name the cause, even when the store is gone."""
        if isinstance(error, EntrenarError):
            record = AbortRecord(type(error).__name__, error.culprit, str(error))
        else:
            record = AbortRecord("PeerConnectionError", None, f"rank {self.rank}: {error!r}")
        self._close(hard=True, abort=record)

    def close(self, hard: bool = False) -> None:
        """Close every link, saying goodbye on the control links first."""
        self._close(hard=hard, abort=None)

    def _close(self, *, hard: bool, abort: AbortRecord | None) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            if self.control is not None:
                self.control.close(abort)
            for sock in self._socks.values():
                try:
                    if hard:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

"""The one progress loop: moves a plan's bytes (collectives) and p2p messages alike.

``Progress`` drives one set of links (one socket per peer). Collectives call
``run(plan)``, which returns once every send and receive of the plan is done;
the p2p thread drives its endless per-peer streams with the same pumps and
the same sleep (``pump_send``, ``pump_recv``, ``sleep``). Either way:

- a link moves what the kernel takes or has, never waiting on the peer's
  receive (so no size deadlocks), consecutive pieces in one syscall;
- a blocked link is retried only once ``poll()`` says so; before sleeping the
  loop busy-polls for the job's ``spin_s`` (a small message's answer usually
  comes within tens of microseconds, and waking a sleeping thread costs as
  much);
- one timeout rule: a wait fails once nothing it waits on has moved for the
  job's ``timeout_s``; the error (``control.Causes``) names whom every rank
  waits on. Both come with each ``run`` (``Pace``): nothing of the loop's
  changes from job to job;
- a link is a socket, or anything that answers a socket's calls; one whose
  peer wakes this rank only when asked (a shared-memory ring, ``WokenLink``)
  is asked before the loop sleeps on it;
- a spin whose yield gave the core away before a peer's bytes came tells
  the mesh's ``CoreWatch`` (``tcp_placement.py``: the peer may share this
  core; two ranks on one core are ~4-10x slower per small call);
- one errno classifier (``errors.peer_gone``) and one abort protocol: a link
  that closes is explained from the peer's control link (its abort record,
  its goodbye or its death), also for peers this plan does not talk to.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import SHM_SLEEP_CAP_S
from ..errors import peer_gone
from .control import AbortRecord, Causes, ControlChannel
from .plan import MAX_IOV, Plan
from .spin import GAVE_AWAY_S, Spin

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)
POLLHANG = select.POLLHUP | select.POLLERR | POLLRDHUP


class Pace(Protocol):
    """A job's pace, read by the loop for one ``run``: how long to busy-poll
    before sleeping, and how long nothing may move before the wait fails
    (``collectives.Call`` is one)."""

    @property
    def spin_s(self) -> float: ...
    @property
    def timeout_s(self) -> float: ...


class CoreWatch(Protocol):
    """What the loop tells when a spin found a peer's bytes only after its
    ``sched_yield`` gave the core away (``tcp_placement.TcpPlacement``: the
    peer probably runs on this core; move off it if so)."""

    @property
    def active(self) -> bool: ...
    def shared_core(self) -> None: ...


class WokenLink(Protocol):
    """A link whose peer wakes this rank only when asked (``shm/ring.py``'s
    ``ShmLink``). Its ``fileno`` is ``sock``'s, the pair's TCP socket, which
    carries the wake-up bytes (poll it for input, whichever way the link
    waits) and the hang-up."""

    @property
    def sock(self) -> socket.socket: ...
    def arm_send(self) -> bool:
        """Ask for a wake-up when the outgoing side has room; True if it has now."""
        ...

    def arm_recv(self) -> bool:
        """Ask for a wake-up when data arrives; True if some has now."""
        ...


@dataclass(slots=True, eq=False)
class LinkState:
    """One direction of one link while the loop moves it.

    ``pieces[index]`` is the next piece, ``offset`` bytes of it moved;
    ``blocked``: the kernel took (or had) less than asked, so wait for poll.
    A plan's links have a fixed ``n``; a p2p stream grows (``push``).
    """

    peer: int
    sock: socket.socket
    pieces: list[Any]
    n: int
    index: int = 0
    offset: int = 0
    blocked: bool = False

    def push(self, piece: Any) -> None:
        self.pieces.append(piece)
        self.n += 1

    def idle(self) -> bool:
        return self.index == self.n

    def trim(self) -> None:
        """Forget the pieces already moved (a long-lived stream's list stays short)."""
        if self.index:
            del self.pieces[: self.index]
            self.n -= self.index
            self.index = 0


def consume(st: LinkState, n: int) -> None:
    """Advance ``st`` over ``n`` bytes just moved, running each filled piece's ``done``."""
    pieces = st.pieces
    i = st.index
    off = st.offset
    while n > 0:
        piece = pieces[i]
        left = len(piece.view) - off
        if n < left:
            off += n
            break
        n -= left
        i += 1
        off = 0
        if piece.done is not None:
            piece.done()  # may push pieces (a p2p stream), never reads index/offset
    st.index = i
    st.offset = off


class Links:
    """One channel's links to every peer: the pumps that move bytes and the one sleep.

    The p2p thread drives its streams with these directly; ``Progress`` adds
    the run of a collective's plan.
    """

    def __init__(
        self,
        rank: int,
        socks: dict[int, socket.socket],
        causes: Causes,
        *,
        control: ControlChannel | None = None,
        wakeable: bool = False,
        woken: Mapping[int, WokenLink] | None = None,
        placement: CoreWatch | None = None,
        idle_spin_s: float = 0.0,
    ) -> None:
        self.rank = rank
        self.causes = causes
        # How long a wait spins (``spin.py``; past its job's spin by at most
        # ``Options.idle_spin_us``): one ``Spin`` for this rank's waits, one at
        # a time, the slot area's included (``shm.slots.Sleeper``).
        self.spin = Spin(idle_spin_s)
        self.control = control
        self._socks = socks
        # The links (by peer) to ask for a wake-up before sleeping on them.
        self._woken: Mapping[int, WokenLink] = woken or {}
        # Told when a spin's yield gave the core away (None: nobody to move from).
        self.placement = placement if placement is not None and placement.active else None
        self._poller = select.poll()
        self._masks: dict[int, int] = {}
        self._fd_peer: dict[int, int] = {}
        for peer, sock in socks.items():
            fd = sock.fileno()
            self._poller.register(fd, POLLRDHUP)
            self._masks[fd] = POLLRDHUP
            self._fd_peer[fd] = peer
        if control is not None:
            for fd in control.fds:
                self._poller.register(fd, _POLLIN)  # constant: never in _masks
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        if wakeable:
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._poller.register(self._wake_r.fileno(), _POLLIN)

    @property
    def sockets(self) -> dict[int, socket.socket]:
        return dict(self._socks)

    def linked(self, peer: int) -> bool:
        """Whether a data link to ``peer`` exists (made at set-up or attached since)."""
        return peer in self._socks

    def peer_of(self, fd: int) -> int | None:
        """The peer whose link ``fd`` is; None for the wake-up and control fds."""
        return self._fd_peer.get(fd)

    # ---------------------------------------------------------- pumps (collectives and p2p)
    def pump_send(self, st: LinkState, what: str) -> bool:
        """Send what the kernel takes on one link; True if anything moved.

        Consecutive ready pieces go out in one ``sendmsg`` (a header and a
        small payload: one syscall, one TCP segment). Sets ``st.blocked``
        when the socket is full (wait for POLLOUT); a piece that is not ready
        yet waits on a receive, not on this socket.
        """
        sock = st.sock
        pieces = st.pieces
        moved = False
        st.blocked = False
        while st.index < st.n:
            i, off = st.index, st.offset
            views: list[memoryview] = []
            total = 0
            j = i
            stop = min(st.n, i + MAX_IOV)
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
                st.blocked = True
                break
            except OSError as e:
                raise self.causes.link_failed(st.peer, what, e) from e
            moved = True
            consume(st, n)
            if n != total:
                st.blocked = True
                break
        return moved

    def pump_recv(self, st: LinkState, what: str) -> bool:
        """Receive what has arrived on one link and run completed pieces' callbacks.

        A piece marked ``chain`` (its buffer is not reused by the next) is
        filled in one ``recvmsg_into`` together with the pieces after it, so
        a header and its payload cost one syscall. Sets ``st.blocked`` when
        the socket is drained (wait for POLLIN); a piece whose ``ready`` is
        false stops the link unblocked (it waits on other links).
        """
        sock = st.sock
        pieces = st.pieces
        moved = False
        st.blocked = False
        while st.index < st.n:
            i, off = st.index, st.offset
            piece = pieces[i]
            if not len(piece.view):
                st.index = i + 1
                if piece.done is not None:
                    piece.done()
                moved = True
                continue
            if not off and piece.ready is not None and not piece.ready():
                break  # it waits on another link's receives, not on this socket
            views = [piece.view[off:] if off else piece.view]
            j = i + 1
            while pieces[j - 1].chain and j < st.n and len(views) < MAX_IOV:
                views.append(pieces[j].view)
                j += 1
            try:
                if len(views) == 1:
                    n = sock.recv_into(views[0])
                else:
                    n = sock.recvmsg_into(views)[0]
            except BlockingIOError:
                st.blocked = True
                break
            except OSError as e:
                raise self.causes.link_failed(st.peer, what, e) from e
            if n == 0:
                raise self.causes.peer_closed(st.peer, what)
            moved = True
            consume(st, n)  # completes, in order, every piece now full
            if st.index < j and (st.offset or len(pieces[st.index].view)):
                st.blocked = True  # the kernel had no more for now
                break
            # Else an empty piece is next (a call of no elements: its payload
            # behind the header): the loop's top completes it now. Marked
            # blocked, it waited for bytes that never come (only a spin's
            # next turn, or the next call's bytes, had unblocked it).
        return moved

    # ------------------------------------------------------------------ sleeping

    def _arm(self, want: dict[int, int]) -> None:
        """Watch the links in ``want`` for its events, every link for a hang-up."""
        masks = self._masks
        for fd in masks:
            mask = want.get(fd, 0) | POLLRDHUP
            if masks[fd] != mask:
                self._poller.modify(fd, mask)
                masks[fd] = mask

    def sleep(self, want: dict[int, int], wait_s: float) -> list[tuple[int, int]]:
        """Sleep until a link in ``want`` is ready, any link hangs up, a control
        frame or a wake-up arrives, or ``wait_s`` passes; the (fd, events) seen.
        A wake-up is drained here (and reported as the wake fd's event)."""
        self._arm(want)
        events = self._poller.poll(max(wait_s, 0.0) * 1000.0)
        if self._wake_r is not None:
            wake_fd = self._wake_r.fileno()
            if any(fd == wake_fd for fd, _ in events):
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
        return events

    def wake(self) -> None:
        """Make a ``sleep`` in another thread return now (wakeable loops only)."""
        if self._wake_w is None:
            return
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # already awake (buffer full) or closed

    def add(self, peer: int, sock: socket.socket) -> None:
        """Watch one more link to ``peer`` (a connection made on first use), from
        the thread that sleeps here."""
        fd = sock.fileno()
        self._poller.register(fd, POLLRDHUP)
        self._masks[fd] = POLLRDHUP
        self._fd_peer[fd] = peer

    def attach(self, peer: int, sock: socket.socket) -> None:
        """A link to ``peer`` made after set-up (``data_links.py``): used by
        later plans and watched for hang-ups (from the thread that runs plans)."""
        self._socks[peer] = sock
        self.add(peer, sock)

    def forget(self, fd: int) -> None:
        """Stop watching link ``fd`` (its peer has left; a closed socket polls forever)."""
        if fd in self._masks:
            self._poller.unregister(fd)
            del self._masks[fd]
            self._fd_peer.pop(fd, None)

    def close(self) -> None:
        """Release the wake-up pair (the links belong to the transport)."""
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()


class Progress(Links):
    """The progress loop of a collective: runs one plan to completion (module docstring)."""

    def run(self, plan: Plan, what: str, pace: Pace) -> None:
        """Execute ``plan``: all its sends and receives, overlapped, in order per link.

        Raises PeerConnectionError if a peer closes, errors, or nothing moves
        for ``pace.timeout_s``; exceptions from ``done`` callbacks propagate.
        """
        if self.causes.closed_here:
            raise self.causes.here_closed(what)
        # No abort check up front: a peer that aborted earlier has closed its
        # links, which this exchange reads as a close (and then its record),
        # and the check at the end covers peers this plan does not talk to.
        sending, receiving = self._first_attempt(plan, what)
        spin_s = pace.spin_s
        spin = self.spin
        spinning = False  # a spin has started since the last bytes moved
        waited = False
        placement = self.placement
        away = False  # the last spin's yield gave the core away
        try:
            while sending or receiving:
                # Pump every link not known to be blocked on its socket (a
                # blocked one only moves once poll() says so: no syscall just
                # to hear EAGAIN again).
                moved = finished = False
                for st in sending:
                    if not st.blocked and self.pump_send(st, what):
                        moved = True
                        finished = finished or st.index == st.n
                for st in receiving:
                    if not st.blocked and self.pump_recv(st, what):
                        moved = True
                        finished = finished or st.index == st.n
                if moved:
                    if finished:
                        sending = [st for st in sending if st.index < st.n]
                        receiving = [st for st in receiving if st.index < st.n]
                    spinning = False
                    if away:
                        # The bytes came while this core was away: from a
                        # peer on it? (``tcp_placement.py``)
                        away = False
                        assert placement is not None
                        placement.shared_core()
                    continue
                turn = False
                if spin_s:
                    # Busy-poll before sleeping in poll() (``spin.py``: how
                    # long). Each turn yields the core, so a peer (or a thread
                    # of ours) waiting for it runs first.
                    now = time.perf_counter()
                    if not spinning:
                        spin.start(now, spin_s)
                        spinning = True
                    turn = spin.on(now)
                    if turn:
                        os.sched_yield()
                        if placement is not None:
                            away = time.perf_counter() - now > GAVE_AWAY_S
                if not turn:
                    self._wait(sending, receiving, what, pace.timeout_s)
                    waited = True
                    spinning = False
                    away = False
                for st in sending:  # after a spin or a wait, try every link again
                    st.blocked = False
                for st in receiving:
                    st.blocked = False
            # All our bytes moved, but a peer may have failed after sending its
            # part (e.g. it timed out waiting for us): then this collective did
            # not complete on every rank, and this rank must not think it did.
            self._check_aborts(what)
        finally:
            if waited:
                self._arm({})
                if self.control is not None:
                    self.control.waiting = None  # a QUERY now hears "not in a collective"

    def _first_attempt(self, plan: Plan, what: str) -> tuple[list[LinkState], list[LinkState]]:
        """One syscall per link whose pieces can go together; the state of the rest.

        A small collective's frame usually leaves in this one ``sendmsg`` and,
        when the peer was first, arrives in this one ``recvmsg_into``, so such
        a link never enters the progress loop. A link that did not finish is
        returned as loop state, marked blocked (the kernel took or had less
        than asked: wait for poll).
        """
        socks = self._socks
        send_links, recv_links = plan.links()
        sending: list[LinkState] = []
        receiving: list[LinkState] = []
        for link in send_links:
            sock = socks[link.peer]
            n = 0
            if link.whole is not None:
                try:
                    n = sock.sendmsg(link.whole)
                except BlockingIOError:
                    pass
                except OSError as e:
                    raise self.causes.link_failed(link.peer, what, e) from e
                if n == link.total:
                    continue
            st = LinkState(link.peer, sock, link.pieces, len(link.pieces))
            st.blocked = link.whole is not None
            consume(st, n)
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
                    raise self.causes.link_failed(link.peer, what, e) from e
                if n == 0:
                    raise self.causes.peer_closed(link.peer, what)
                if n == link.total:
                    for piece in link.pieces:  # all full: their callbacks, in order
                        if piece.done is not None:
                            piece.done()
                    continue
            st = LinkState(link.peer, sock, link.pieces, len(link.pieces))
            st.blocked = n != 0
            if n > 0:
                consume(st, n)
            receiving.append(st)
        return sending, receiving

    # ---------------------------------------------------------- a plan's wait and its failures

    def _wait(
        self, sending: list[LinkState], receiving: list[LinkState], what: str, timeout_s: float
    ) -> None:
        """Sleep until a blocked link of this plan can move, a peer hangs up or
        aborts, or nothing has moved for the timeout (then find whom to blame)."""
        want: dict[int, int] = {}
        woken = self._woken
        shm: list[tuple[WokenLink, bool]] = []  # (link, sending): armed before each sleep
        for st in sending:
            if st.blocked:
                link = woken.get(st.peer)
                if link is not None:
                    shm.append((link, True))
                    want[st.sock.fileno()] = _POLLIN  # the reader's wake-up byte
                else:
                    want[st.sock.fileno()] = _POLLOUT
        for st in receiving:
            if st.blocked:
                link = woken.get(st.peer)
                if link is not None:
                    shm.append((link, False))
                fd = st.sock.fileno()
                want[fd] = want.get(fd, 0) | _POLLIN
        assert want, f"rank {self.rank}: {what}: a send waits on nothing"
        control = self.control
        if control is not None:
            control.waiting = (what, [st.peer for st in receiving], [st.peer for st in sending])
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if shm:
                # Ask the shared-memory peers for a wake-up; one that moved
                # meanwhile means no sleep. The bounded sleep re-checks the
                # rings (a lost wake-up costs at most SHM_SLEEP_CAP_S, not the timeout).
                if any([link.arm_send() if out else link.arm_recv() for link, out in shm]):
                    return
                left = min(left, SHM_SLEEP_CAP_S)
            events = self.sleep(want, left)
            if self.causes.closed_here:  # abort() or shutdown from another thread
                raise self.causes.here_closed(what)
            if not events and time.monotonic() >= deadline:
                raise self.causes.stalled(
                    what,
                    [st.peer for st in receiving],
                    [st.peer for st in sending],
                    timeout_s,
                )
            data_event = False
            for fd, ev in events:
                peer = self._fd_peer.get(fd)
                if peer is None:  # a control frame (or a control link's close)
                    self._on_control(fd, what)
                    continue
                data_event = True
                if not ev & POLLHANG or want.get(fd, 0) & _POLLIN:
                    continue  # recv drains what is left, then reports the close itself
                ended = self.causes.how_ended(peer)
                if isinstance(ended, AbortRecord) or fd in want:
                    raise self.causes.peer_closed(peer, what, ended)
                # A peer not in this collective left (it finished and destroyed the
                # group, or died: whoever talks to it next will say so).
                self.forget(fd)
            if data_event:
                return

    # ------------------------------------------------- a slot area's sleep (shm/slots.py)

    def sleep_on(
        self, waiting_on: list[int], peers: list[int], what: str, wait_s: float
    ) -> list[int]:
        """One sleep of a shared-memory slot wait: until a wake-up byte arrives
        on a data socket of ``peers``, a control frame, a hang-up, or
        ``wait_s`` passes. Wake-up bytes are drained; a peer's abort raises
        (``Causes``). Returns the peers whose data socket hung up: the caller
        decides (one that already did its part of the call may leave; one
        still awaited is named at once, ``Causes.peer_closed``). ``waiting_on``
        is what a QUERY hears this rank waits on."""
        socks = self._socks
        want = {socks[p].fileno(): _POLLIN for p in peers}
        if self.control is not None:
            self.control.waiting = (what, waiting_on, [])
        events = self.sleep(want, wait_s)
        if self.causes.closed_here:
            raise self.causes.here_closed(what)
        closed = []
        for fd, _ in events:
            peer = self._fd_peer.get(fd)
            if peer is None:
                self._on_control(fd, what)
                continue
            woken = self._woken.get(peer)
            sock = woken.sock if woken is not None else socks[peer]
            try:
                while sock.recv(4096):
                    pass
                closed.append(peer)  # end of stream
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                if not peer_gone(e):
                    raise self.causes.link_failed(peer, what, e) from e
                closed.append(peer)
        return closed

    def done_sleeping(self) -> None:
        """After a slot wait: poll watches hang-ups only again; QUERY hears "not waiting"."""
        self._arm({})
        if self.control is not None:
            self.control.waiting = None

    def _on_control(self, fd: int, what: str) -> None:
        """Control news (``ControlChannel.service``): raise an abort not raised yet."""
        control = self.control
        if control is None:
            return
        news = control.service(fd)
        if news is not None:
            origin, record = news
            raise self.causes.peer_closed(origin, what, record)

    def _check_aborts(self, what: str) -> None:
        """Raise the abort of any peer that aborted or hung up with one (no waiting)."""
        self._service(self._poller.poll(0), what)

    def watch_control(self, what: str, waiting_on: list[int], wait_s: float) -> None:
        """Sleep up to ``wait_s`` outside a plan (a data link being made,
        ``data_links.py``), answering control queries as one waiting on
        ``waiting_on``; a peer's abort raises. ``done_sleeping`` after."""
        if self.control is not None:
            self.control.waiting = (what, waiting_on, [])
        events = self.sleep({}, wait_s)
        if self.causes.closed_here:
            raise self.causes.here_closed(what)
        self._service(events, what)

    def _service(self, events: list[tuple[int, int]], what: str) -> None:
        for fd, ev in events:
            peer = self._fd_peer.get(fd)
            if peer is None:
                self._on_control(fd, what)
                continue
            if not ev & POLLHANG:
                continue
            ended = self.causes.how_ended(peer)
            if isinstance(ended, AbortRecord):
                raise self.causes.peer_closed(peer, what, ended)
            # It left without failing (destroyed its group); whoever needs it
            # next will read the close itself.
            self.forget(fd)

"""TCP mesh: listen, publish the address in the store, connect, authenticate, exchange.

Set-up: every rank listens on one port and publishes ``host:port`` in the
group's store; rank 0 puts a random per-group secret there. Rank i connects to
every rank j < i and accepts from every rank j > i, so each pair shares exactly
one socket. The handshake is a challenge-response: the acceptor sends a nonce,
the connector answers with its rank, the world size and an HMAC of the nonce
under the secret, the acceptor answers with its own HMAC. Anything else is
refused and closed, so a stray connection (or a process of another job) never
becomes a peer.

Data: after set-up the sockets are non-blocking and driven by ``Mesh.run``, a
single progress loop that executes a ``Plan``: for each peer, an ordered list
of byte ranges to send and an ordered list of byte ranges to receive into.
A send may wait for a receive to finish (``ready``), a receive may run a
callback when it completes (``done``: reduce a segment, mark it forwardable).
That is all an algorithm needs; algorithms live in ``entrenar_pg.algorithms``
and never touch a socket. Sending never waits on the peer's receive (the loop
sends what the kernel takes and keeps receiving), so no size deadlocks.

Failure: a rank that fails writes ``abort/<rank>`` (error class and message)
into the store *before* closing its sockets. A peer that sees the connection
close reads that record and raises the same error class, so the root cause
reaches every rank. Every peer socket is watched for a hang-up (POLLRDHUP)
during every exchange, so a rank blocked on another link still learns at once.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .config import Options
from .errors import ERROR_TYPES, CollectiveMismatchError, EntrenarError, PeerConnectionError
from .wire import HEADER_BYTES, Header, stamp_seq

log = logging.getLogger(__name__)

_HELLO = struct.Struct("<4sII")  # magic, rank, world size
_HELLO_MAGIC = b"ENTR"
_NONCE_BYTES = 16
_MAC_BYTES = 32
_SECRET_KEY = "entrenar/a{attempt}/secret"
_ADDR_KEY = "entrenar/a{attempt}/addr/{rank}"
_ABORT_KEY = "entrenar/a{attempt}/abort/{rank}"

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


def _mac(secret: bytes, nonce: bytes, role: bytes, rank: int, world: int) -> bytes:
    msg = nonce + role + struct.pack("<II", rank, world)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed during handshake")
        got += k
    return bytes(buf)


def choose_host(options: Options) -> str:
    """The address to listen on and publish (see ``Options.host``)."""
    if options.host:
        return options.host
    if options.ifname:
        return _ifname_address(options.ifname)
    if options.master_addr:
        try:
            # Connecting a UDP socket sends nothing; it only asks the kernel for
            # the route, whose source address is the one peers can reach us on.
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                probe.connect((options.master_addr, 9))
                return str(probe.getsockname()[0])
            finally:
                probe.close()
        except OSError:
            log.debug("no route to MASTER_ADDR=%s; listening on 127.0.0.1", options.master_addr)
    return "127.0.0.1"


def _ifname_address(ifname: str) -> str:
    import fcntl

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = struct.pack("256s", ifname.encode()[:15])
        raw = fcntl.ioctl(s.fileno(), 0x8915, packed)  # SIOCGIFADDR
        return socket.inet_ntoa(raw[20:24])
    except OSError as e:
        raise ValueError(f"ENTRENAR_IFNAME={ifname!r}: no IPv4 address ({e})") from None
    finally:
        s.close()


class Mesh:
    """One authenticated TCP socket to every other rank of a group."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        options: Options,
        timeout: timedelta,
        name: str = "",
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
        if world > 1:
            self._connect_all()
        self._poller = select.poll()
        self._masks: dict[int, int] = {}
        self._fd_peer: dict[int, int] = {}
        for peer, sock in self._socks.items():
            fd = sock.fileno()
            self._poller.register(fd, _POLLRDHUP)
            self._masks[fd] = _POLLRDHUP
            self._fd_peer[fd] = peer

    @property
    def sockets(self) -> dict[int, socket.socket]:
        """The authenticated, non-blocking socket to each peer (for channels built on a mesh)."""
        return dict(self._socks)

    @property
    def store(self) -> Any:
        return self._store

    # ------------------------------------------------------------------ set-up

    def _connect_all(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        host = choose_host(self._options)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, 0))
        except OSError as e:
            listener.close()
            raise PeerConnectionError(f"rank {self.rank}: cannot listen on {host}: {e}") from e
        listener.listen(self.world)
        port = listener.getsockname()[1]
        try:
            if self.rank == 0:
                self._store.set(self._key(_SECRET_KEY), secrets.token_hex(32))
            secret = self._store_get(self._key(_SECRET_KEY), deadline)
            self._store.set(self._key(_ADDR_KEY, self.rank), f"{host}:{port}")
            log.debug("rank %d listening on %s:%d", self.rank, host, port)
            expected = set(range(self.rank + 1, self.world))
            acceptor = threading.Thread(
                target=self._accept_loop,
                args=(listener, secret, expected, deadline),
                name=f"entrenar-accept-r{self.rank}",
                daemon=True,
            )
            acceptor.start()
            accept_error: list[BaseException] = []
            self._accept_error = accept_error
            for peer in range(self.rank):
                self._connect_to(peer, secret, deadline)
            acceptor.join(max(deadline - time.monotonic(), 0) + 1.0)
            if accept_error:
                raise accept_error[0]
            missing = sorted(set(range(self.world)) - set(self._socks) - {self.rank})
            if missing:
                raise PeerConnectionError(
                    f"rank {self.rank}: timed out after {self.timeout_s:.0f}s waiting for "
                    f"rank(s) {missing} to connect"
                )
        except BaseException:
            for s in self._socks.values():
                s.close()
            raise
        finally:
            listener.close()
        for sock in self._socks.values():
            self._tune(sock)
            sock.setblocking(False)

    def _key(self, template: str, rank: int = 0) -> str:
        return template.format(attempt=self._options.attempt, rank=rank)

    def _store_get(self, key: str, deadline: float) -> bytes:
        """``store.get`` bounded by the group's timeout, not the store's own."""
        left = max(deadline - time.monotonic(), 0.001)
        try:
            self._store.wait([key], timedelta(seconds=left))
        except Exception as e:  # torch raises DistStoreError / RuntimeError on timeout
            raise PeerConnectionError(
                f"rank {self.rank}: timed out after {self.timeout_s:.0f}s waiting for {key!r} "
                f"in the store (a rank of this group did not start or crashed): {e}"
            ) from e
        return bytes(self._store.get(key))

    def _tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self._options.socket_buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._options.socket_buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._options.socket_buffer_bytes)

    def _connect_to(self, peer: int, secret: bytes, deadline: float) -> None:
        addr = self._store_get(self._key(_ADDR_KEY, peer), deadline).decode()
        host, port = addr.rsplit(":", 1)
        last: Exception | None = None
        while time.monotonic() < deadline:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(max(min(deadline - time.monotonic(), 10.0), 0.01))
            try:
                sock.connect((host, int(port)))
                nonce = _recv_exact(sock, _NONCE_BYTES)
                sock.sendall(
                    _HELLO.pack(_HELLO_MAGIC, self.rank, self.world)
                    + _mac(secret, nonce, b"C", self.rank, self.world)
                )
                answer = _recv_exact(sock, _MAC_BYTES)
                if not hmac.compare_digest(answer, _mac(secret, nonce, b"A", peer, self.world)):
                    raise PeerConnectionError(
                        f"rank {self.rank}: {addr} (rank {peer}'s published address) failed "
                        "authentication: another job's process?"
                    )
                self._socks[peer] = sock
                return
            except PeerConnectionError:
                sock.close()
                raise
            except OSError as e:
                sock.close()
                last = e
                time.sleep(0.05)
        raise PeerConnectionError(
            f"rank {self.rank}: could not connect to rank {peer} at {addr} "
            f"within {self.timeout_s:.0f}s: {last}"
        )

    def _accept_loop(
        self, listener: socket.socket, secret: bytes, expected: set[int], deadline: float
    ) -> None:
        try:
            while expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                listener.settimeout(left)
                try:
                    sock, addr = listener.accept()
                except TimeoutError:
                    return
                peer = self._authenticate(sock, addr, secret, expected, deadline)
                if peer is None:
                    sock.close()
                    continue
                expected.discard(peer)
                self._socks[peer] = sock
        except BaseException as e:  # surfaced by the connecting thread
            self._accept_error.append(e)

    def _authenticate(
        self, sock: socket.socket, addr: Any, secret: bytes, expected: set[int], deadline: float
    ) -> int | None:
        sock.settimeout(max(min(deadline - time.monotonic(), 10.0), 0.01))
        try:
            nonce = os.urandom(_NONCE_BYTES)
            sock.sendall(nonce)
            magic, peer, world = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
            mac = _recv_exact(sock, _MAC_BYTES)
        except (OSError, struct.error) as e:
            log.warning(
                "rank %d: dropped connection from %s during handshake: %s", self.rank, addr, e
            )
            return None
        if (
            magic != _HELLO_MAGIC
            or world != self.world
            or peer not in expected
            or not hmac.compare_digest(mac, _mac(secret, nonce, b"C", peer, world))
        ):
            log.warning(
                "rank %d: refused connection from %s (claims rank %s of %s)",
                self.rank,
                addr,
                peer,
                world,
            )
            return None
        try:
            sock.sendall(_mac(secret, nonce, b"A", self.rank, self.world))
        except OSError:
            return None
        return int(peer)

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
        masks = self._masks
        for fd in masks:
            mask = want.get(fd, 0) | _POLLRDHUP
            if masks[fd] != mask:
                self._poller.modify(fd, mask)
                masks[fd] = mask
        events = self._poller.poll(self.timeout_s * 1000.0)
        if not events:
            raise PeerConnectionError(
                f"rank {self.rank}: {what}: no progress for {self.timeout_s:.1f}s "
                f"(waiting to receive from rank(s) {sorted(st[0] for st in receiving)}, "
                f"to send to rank(s) {sorted(st[0] for st in sending)}): "
                "a peer stalled, died, or issued a different collective"
            )
        for fd, ev in events:
            if not ev & _POLLHANG:
                continue
            peer = self._fd_peer[fd]
            if want.get(fd, 0) & _POLLIN:
                continue  # recv drains what is left, then reports the close itself
            record = self._abort_record(peer)
            if record is not None or fd in want:
                raise self._closed_error(peer, what, record)
            # A peer not in this collective left (it finished and destroyed the
            # group, or died: whoever talks to it next will say so).
            self._poller.unregister(fd)
            del masks[fd]

    # ------------------------------------------------------------------ failure

    def _check_aborts(self, what: str) -> None:
        """Raise the abort of any peer that hung up with an abort record (no waiting)."""
        for fd, ev in self._poller.poll(0):
            if not ev & _POLLHANG:
                continue
            peer = self._fd_peer[fd]
            record = self._abort_record(peer)
            if record is not None:
                raise self._closed_error(peer, what, record)
            # It left without failing (destroyed its group); whoever needs it
            # next will read the close itself.
            self._poller.unregister(fd)
            del self._masks[fd]

    def _abort_record(self, peer: int) -> tuple[str, str] | None:
        key = self._key(_ABORT_KEY, peer)
        try:
            if not self._store.check([key]):
                return None
            kind, _, message = bytes(self._store.get(key)).decode().partition("|")
            return kind, message
        except Exception:  # the store itself may be gone with the job
            return None

    def _closed_error(
        self, peer: int, what: str, record: tuple[str, str] | None = None
    ) -> EntrenarError:
        record = record or self._abort_record(peer)
        if record is not None:
            kind, message = record
            cls = ERROR_TYPES.get(kind, PeerConnectionError)
            return cls(f"rank {self.rank}: {what} aborted because rank {peer} failed: {message}")
        return PeerConnectionError(
            f"rank {self.rank}: {what}: rank {peer} closed the connection "
            "(its process died, or it destroyed the group mid-collective)"
        )

    def _link_error(self, peer: int, what: str, e: OSError) -> EntrenarError:
        if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
            return self._closed_error(peer, what)
        return PeerConnectionError(f"rank {self.rank}: {what}: link to rank {peer} failed: {e}")

    def abort(self, error: BaseException) -> None:
        """Publish ``error`` as this rank's abort record, then drop every link.

        The record is written first, so a peer that sees the close can read it.
        """
        if isinstance(error, EntrenarError):
            kind, message = type(error).__name__, str(error)
        else:
            kind, message = "PeerConnectionError", f"rank {self.rank}: {error!r}"
        try:
            self._store.set(self._key(_ABORT_KEY, self.rank), f"{kind}|{message}")
        except Exception as e:  # best effort: the close below still wakes the peers
            log.debug("rank %d: could not write abort record: %s", self.rank, e)
        self.close(hard=True)

    def close(self, hard: bool = False) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            for sock in self._socks.values():
                try:
                    if hard:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

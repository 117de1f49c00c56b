"""Set-up of a group's links: address choice, listen, publish, connect, authenticate.

Every rank listens on one port and publishes ``host:port`` and its host key
(``shm.offered_key``) in the group's store; rank 0 puts a random per-group
secret there. Each rank learns every rank's address and key in one store
round trip (``exchange``), so set-up work per rank grows like N, and then
makes the set-up *pairs* the mesh picks (``connect_set_up``): rank i connects
to the lower rank of each pair and accepts from the higher ones. A pair may
be connected once per *channel*: the data channel carries collectives, the
p2p channel send/recv, and the control channel the small frames of
``control.py`` (abort causes, goodbyes, wait-for queries), so that they can
be sent whatever state a data stream is in.

The handshake is a challenge-response: the acceptor sends a nonce, the
connector answers with its rank, the world size, the channel and an HMAC of
all of it under the secret, the acceptor answers with its own HMAC. Anything
else is refused and closed, so a stray connection (or a process of another
job) never becomes a peer.

Channels named *lazy* (p2p, and data beyond the set-up pairs) may be
connected after set-up: a rank connects such a channel to a peer on first
use (``connect``), and the listener and its acceptor stay up for the group's
life to admit them (``on_lazy`` receives each). Who connects is the caller's
rule: p2p, each end its own connection; data, the lower rank
(``data_links.py``).

Strangers cannot hold set-up hostage: the acceptor runs every handshake at
once on one selector, each with its own short deadline, so a connection that
connects and then says nothing (or a flood of connect-and-close) costs a
socket for a few seconds, never a peer's turn.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..config import MIN_TIMEOUT_S, Options
from ..errors import PeerConnectionError
from . import options_agreement
from .acceptor import HANDSHAKE_S, HELLO, HELLO_MAGIC, MAC_BYTES, NONCE_BYTES, Acceptor, mac

log = logging.getLogger(__name__)

DATA = 0  # collectives
CONTROL = 1  # the abort protocol's frames (control.py)
P2P = 2  # send / recv
CHANNEL_NAMES = {DATA: "data", CONTROL: "control", P2P: "p2p"}

SECRET_KEY = "entrenar/a{attempt}/secret"
ADDR_KEY = "entrenar/a{attempt}/addr/{rank}"
HOST_KEY = "entrenar/a{attempt}/host/{rank}"  # shm.offered_key: which ranks share a host
# The Options every rank must set alike (options_agreement.py), checked here:
# each rank's digest rides in front of its host key (HOST_KEY's value, so
# set-up reads no more keys than before); the texts are published and read
# only where the digests differ.
OPTIONS_KEY = "entrenar/a{attempt}/options/{rank}"
# The listen backlog: a flood of strangers must not fill the kernel's queue
# and make a peer's connect wait for a SYN retransmission (1 s and more).
_BACKLOG = 1024


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


class Rendezvous:
    """Forms one authenticated socket per (peer, channel); see the module docstring."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        options: Options,
        timeout_s: float,
        lazy: tuple[int, ...] = (),
        on_lazy: Callable[[int, int, socket.socket], None] | None = None,
    ) -> None:
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self._store = store
        self._options = options
        # Channels connected on first use; ``on_lazy(peer, channel, sock)``
        # gets each one a peer opens (in the acceptor's thread).
        self._lazy = lazy
        self._on_lazy = on_lazy
        self.links: dict[tuple[int, int], socket.socket] = {}
        self._addrs: dict[int, str] = {}  # every peer's listening address (lazy connects)
        self._deadline = 0.0  # set-up's (exchange)
        self._secret = b""
        self._listener: socket.socket | None = None
        self._acceptor: Acceptor | None = None
        self._accept_thread: threading.Thread | None = None

    def key(self, template: str, rank: int = 0) -> str:
        return template.format(attempt=self._options.attempt, rank=rank)

    def store_get(self, key: str, deadline: float) -> bytes:
        """``store.get`` bounded by the group's timeout, not the store's own."""
        self.store_wait([key], deadline)
        return bytes(self._store.get(key))

    def store_wait(self, keys: list[str], deadline: float) -> None:
        """``store.wait`` bounded by the group's timeout, not the store's own."""
        left = max(deadline - time.monotonic(), MIN_TIMEOUT_S)
        what = repr(keys[0]) if len(keys) == 1 else f"{len(keys)} keys from {keys[0]!r}"
        try:
            self._store.wait(keys, timedelta(seconds=left))
        except Exception as e:  # torch raises DistStoreError / RuntimeError on timeout
            raise PeerConnectionError(
                f"rank {self.rank}: timed out after {self.timeout_s:.0f}s waiting for "
                f"{what} in the store (a rank of this group "
                f"did not start or crashed): {e}"
            ) from e

    def exchange(self, host_key: str) -> list[str]:
        """Listen, publish this rank's address, ``host_key`` and the Options that
        must agree, and learn every rank's, in one store wait and one round trip
        (lazy connects go to any peer, later, when the store may be gone). Ranks
        whose Options differ raise ``OptionsMismatchError`` here, every one of
        them, before any link is made. Returns the host keys by rank."""
        self._deadline = deadline = time.monotonic() + self.timeout_s
        host = choose_host(self._options)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, 0))
        except OSError as e:
            listener.close()
            raise PeerConnectionError(f"rank {self.rank}: cannot listen on {host}: {e}") from e
        listener.listen(_BACKLOG)
        self._listener = listener
        port = listener.getsockname()[1]
        try:
            if self.rank == 0:
                self._store.set(self.key(SECRET_KEY), secrets.token_hex(32))
            self._secret = self.store_get(self.key(SECRET_KEY), deadline)
            options = options_agreement.encode(self._options)
            digest = options_agreement.digest(options)
            self._store.set(self.key(HOST_KEY, self.rank), digest + host_key)
            self._store.set(self.key(ADDR_KEY, self.rank), f"{host}:{port}")
            log.debug("rank %d listening on %s:%d", self.rank, host, port)
            n = self.world
            keys = [self.key(ADDR_KEY, p) for p in range(n)]
            keys += [self.key(HOST_KEY, p) for p in range(n)]
            self.store_wait(keys, deadline)
            got = [bytes(raw).decode() for raw in self._store.multi_get(keys)]
            cut = options_agreement.DIGEST_CHARS
            if not options_agreement.alike([v[:cut] for v in got[n:]]):
                # Every rank sees the same digests, so every rank comes here:
                # each publishes its text and reads all N to name the field.
                self._store.set(self.key(OPTIONS_KEY, self.rank), options)
                text_keys = [self.key(OPTIONS_KEY, p) for p in range(n)]
                self.store_wait(text_keys, deadline)
                texts = [bytes(raw).decode() for raw in self._store.multi_get(text_keys)]
                options_agreement.check(self.rank, texts)
            self._addrs = dict(enumerate(got[:n]))
            host_keys = [v[cut:] for v in got[n:]]
        except BaseException:
            self.stop()
            raise
        return host_keys

    def connect_set_up(self, pairs: set[tuple[int, int]]) -> dict[tuple[int, int], socket.socket]:
        """The (peer, channel) sockets of ``pairs`` (the same pairs on both
        ends), tuned and non-blocking: this rank connects to lower ranks and
        accepts from higher ones; raises on timeout. With lazy channels the
        listener and its acceptor stay up until ``stop``."""
        deadline = self._deadline
        assert self._listener is not None, "exchange() first"
        try:
            expected = {(p, ch) for (p, ch) in pairs if p > self.rank}
            acceptor = self._acceptor = Acceptor(
                self.rank,
                self.world,
                self._listener,
                self._secret,
                expected,
                deadline,
                self.links,
                self._lazy,
                self._on_lazy,
                self._tune,
            )
            self._accept_thread = threading.Thread(
                target=acceptor.run, name=f"entrenar-accept-r{self.rank}", daemon=True
            )
            self._accept_thread.start()
            for peer, ch in sorted(pairs):
                if peer < self.rank:
                    self.links[(peer, ch)] = self._connect_to(
                        peer, ch, self._addrs[peer], self._secret, deadline
                    )
            acceptor.set_up.wait(max(deadline - time.monotonic(), 0) + 1.0)
            if acceptor.errors:
                raise acceptor.errors[0]
            missing = sorted({p for (p, ch) in pairs - set(self.links)})
            if missing:
                raise PeerConnectionError(
                    f"rank {self.rank}: timed out after {self.timeout_s:.0f}s waiting for "
                    f"rank(s) {missing} to connect"
                )
        except BaseException:
            self.stop()
            for s in self.links.values():
                s.close()
            raise
        if not self._lazy:
            self.stop()
        for sock in self.links.values():
            self._tune(sock)
            sock.setblocking(False)
        return self.links

    def connect(self, peer: int, channel: int, timeout_s: float) -> socket.socket:
        """A lazy channel's connection to ``peer``, made now, tuned and non-blocking.

        The peer listened since set-up, so a refused connection means it is
        gone: no retry. Bounded by ``timeout_s`` (a stopped peer's kernel
        accepts, but nobody answers). Raises ``PeerConnectionError`` (its
        ``__cause__`` the ``OSError``)."""
        deadline = time.monotonic() + timeout_s
        addr = self._addrs[peer]
        sock = self._connect_to(peer, channel, addr, self._secret, deadline, retry=False)
        self._tune(sock)
        sock.setblocking(False)
        return sock

    def stop(self) -> None:
        """Close the listener and end the acceptor (bounded; idempotent)."""
        if self._acceptor is not None:
            self._acceptor.stopping = True
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor's select (Linux)
            except OSError:
                pass
        thread = self._accept_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        if listener is not None:
            listener.close()

    def _tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self._options.socket_buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._options.socket_buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._options.socket_buffer_bytes)

    # ------------------------------------------------------------------ connector

    def _connect_to(
        self,
        peer: int,
        channel: int,
        addr: str,
        secret: bytes,
        deadline: float,
        retry: bool = True,
    ) -> socket.socket:
        host, port = addr.rsplit(":", 1)
        last: Exception | None = None
        while time.monotonic() < deadline:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            left = deadline - time.monotonic()
            sock.settimeout(max(min(left, HANDSHAKE_S * 2) if retry else left, 0.01))
            try:
                sock.connect((host, int(port)))
                nonce = _recv_exact(sock, NONCE_BYTES)
                sock.sendall(
                    HELLO.pack(HELLO_MAGIC, self.rank, self.world, channel)
                    + mac(secret, nonce, b"C", self.rank, self.world, channel)
                )
                answer = _recv_exact(sock, MAC_BYTES)
                if not hmac.compare_digest(
                    answer, mac(secret, nonce, b"A", peer, self.world, channel)
                ):
                    raise PeerConnectionError(
                        f"rank {self.rank}: {addr} (rank {peer}'s published address) failed "
                        "authentication: another job's process?"
                    )
                return sock
            except PeerConnectionError:
                sock.close()
                raise
            except OSError as e:
                sock.close()
                last = e
                if not retry:
                    break
                time.sleep(0.05)
        raise PeerConnectionError(
            f"rank {self.rank}: could not connect to rank {peer} at {addr} "
            f"within {self.timeout_s:.0f}s: {last}"
        ) from last

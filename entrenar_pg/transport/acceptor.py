"""The server half of set-up's handshake: accept and authenticate a group's incoming connections.

Every connector (``rendezvous.Rendezvous``) dials this rank's listener; the
acceptor's thread answers every one at once (a nonce, then it reads the
connector's hello and HMAC, and answers with its own HMAC), so a slow or
hostile stranger never delays a peer. Connections the set-up expects go
into the set-up's links; with lazy channels (p2p) the acceptor stays up
after set-up and hands each later connection to ``on_lazy``.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

HELLO = struct.Struct("<4sIII")  # magic, rank, world size, channel
HELLO_MAGIC = b"ENTR"
NONCE_BYTES = 16
MAC_BYTES = 32
HELLO_AND_MAC = HELLO.size + MAC_BYTES
# One handshake may take this long at most (a legitimate peer answers in
# microseconds; the bound only limits what a silent stranger costs).
HANDSHAKE_S = 5.0
# Handshakes in progress at once; beyond this the oldest is dropped (a flood).
_MAX_PENDING = 1024


def mac(secret: bytes, nonce: bytes, role: bytes, rank: int, world: int, channel: int) -> bytes:
    msg = nonce + role + struct.pack("<III", rank, world, channel)
    return hmac.new(secret, msg, hashlib.sha256).digest()


@dataclass(slots=True)
class _Handshake:
    """One accepted connection, not yet authenticated."""

    sock: socket.socket
    addr: Any
    nonce: bytes
    deadline: float
    got: bytearray = field(default_factory=bytearray)


class Acceptor:
    """One rank's incoming connections of one group (``run`` is its thread)."""

    def __init__(
        self,
        rank: int,
        world: int,
        listener: socket.socket,
        secret: bytes,
        expected: set[tuple[int, int]],
        deadline: float,
        links: dict[tuple[int, int], socket.socket],
        lazy: tuple[int, ...],
        on_lazy: Callable[[int, int, socket.socket], None] | None,
        tune: Callable[[socket.socket], None],
    ) -> None:
        self.rank = rank
        self.world = world
        self._listener = listener
        self._secret = secret
        self._expected = expected  # (peer, channel) the set-up still waits for
        self._deadline = deadline  # the set-up's
        self._links = links  # the set-up's links: expected connections go here
        self._lazy = lazy
        self._on_lazy = on_lazy
        self._tune = tune
        self.set_up = threading.Event()  # the set-up's expected connections are in
        self.errors: list[BaseException] = []  # a failure before set_up, for the set-up
        self.stopping = False

    def run(self) -> None:
        """Accept and authenticate every connection at once: until ``expected``
        is empty, and then, with lazy channels, until ``stopping``."""
        listener, secret, expected, deadline = (
            self._listener,
            self._secret,
            self._expected,
            self._deadline,
        )
        # poll, not epoll: no descriptor of its own (it lives as long as the group).
        sel = selectors.PollSelector()
        pending: dict[int, _Handshake] = {}
        try:
            listener.setblocking(False)
            sel.register(listener, selectors.EVENT_READ)
            while not self.stopping:
                if not expected:
                    self.set_up.set()
                    if not self._lazy:
                        return
                now = time.monotonic()
                if expected and now >= deadline:
                    return
                end = deadline if expected else None
                soonest = min((h.deadline for h in pending.values()), default=end)
                wait = None if soonest is None else max(soonest - now, 0.0)
                for key, _ in sel.select(wait):
                    if self.stopping:
                        return
                    if key.fileobj is listener:
                        self._accept_ready(listener, sel, pending)
                    else:
                        self._advance(pending[key.fd], sel, pending, secret, expected)
                now = time.monotonic()
                for h in list(pending.values()):
                    if now >= h.deadline:
                        log.warning(
                            "rank %d: dropped connection from %s: no handshake within %.0fs",
                            self.rank,
                            h.addr,
                            HANDSHAKE_S,
                        )
                        self._drop(h, sel, pending)
        except BaseException as e:  # surfaced by the connecting thread
            if not self.set_up.is_set():
                self.errors.append(e)
            elif not self.stopping:
                log.exception("rank %d: the acceptor of lazy connections failed", self.rank)
        finally:
            self.set_up.set()
            for h in list(pending.values()):
                self._drop(h, sel, pending)
            sel.close()

    def _accept_ready(
        self, listener: socket.socket, sel: selectors.BaseSelector, pending: dict[int, _Handshake]
    ) -> None:
        while True:
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue  # the stranger left before we got to it
                raise
            sock.setblocking(False)
            nonce = os.urandom(NONCE_BYTES)
            try:
                sock.send(nonce)  # 16 bytes into a fresh socket's buffer: never partial
            except OSError:
                sock.close()
                continue
            if len(pending) >= _MAX_PENDING:
                oldest = min(pending.values(), key=lambda h: h.deadline)
                self._drop(oldest, sel, pending)
            h = _Handshake(sock, addr, nonce, time.monotonic() + HANDSHAKE_S)
            pending[sock.fileno()] = h
            sel.register(sock, selectors.EVENT_READ)

    def _advance(
        self,
        h: _Handshake,
        sel: selectors.BaseSelector,
        pending: dict[int, _Handshake],
        secret: bytes,
        expected: set[tuple[int, int]],
    ) -> None:
        """Read what the connector sent; once hello and MAC are in, admit or refuse it."""
        try:
            chunk = h.sock.recv(HELLO_AND_MAC - len(h.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(h, sel, pending)
            return
        h.got += chunk
        if len(h.got) < HELLO_AND_MAC:
            return
        magic, peer, world, channel = HELLO.unpack(bytes(h.got[: HELLO.size]))
        their_mac = bytes(h.got[HELLO.size :])
        if (
            magic != HELLO_MAGIC
            or world != self.world
            or not ((peer, channel) in expected or self._admits_lazy(peer, channel))
            or not hmac.compare_digest(their_mac, mac(secret, h.nonce, b"C", peer, world, channel))
        ):
            log.warning(
                "rank %d: refused connection from %s (claims rank %s of %s, channel %s)",
                self.rank,
                h.addr,
                peer,
                world,
                channel,
            )
            self._drop(h, sel, pending)
            return
        sel.unregister(h.sock)
        del pending[h.sock.fileno()]
        try:
            h.sock.setblocking(True)
            h.sock.settimeout(HANDSHAKE_S)
            h.sock.sendall(mac(secret, h.nonce, b"A", self.rank, self.world, channel))
        except OSError:
            h.sock.close()
            return
        if (peer, channel) in expected:
            expected.discard((peer, channel))
            self._links[(int(peer), int(channel))] = h.sock
            return
        self._tune(h.sock)
        h.sock.setblocking(False)
        if self._on_lazy is None:
            h.sock.close()
            return
        self._on_lazy(int(peer), int(channel), h.sock)

    def _admits_lazy(self, peer: int, channel: int) -> bool:
        return channel in self._lazy and 0 <= peer < self.world and peer != self.rank

    @staticmethod
    def _drop(h: _Handshake, sel: selectors.BaseSelector, pending: dict[int, _Handshake]) -> None:
        fd = h.sock.fileno()
        if pending.pop(fd, None) is not None:
            try:
                sel.unregister(h.sock)
            except (KeyError, ValueError):
                pass
        h.sock.close()

"""A pair's byte rings in shared memory: ``ShmLink``, one peer's two rings.

Each pair of ranks on one host moves its collective bytes through two
single-producer single-consumer byte rings (one per direction), instead of
through the kernel's loopback TCP. A ring link answers the few socket calls
the progress loop makes (``sendmsg``, ``recv_into``, ``recvmsg_into``,
``fileno``), and asks its peer for a wake-up before the loop sleeps on it
(``arm_send``, ``arm_recv``: the loop's ``WokenLink``), so every plan runs
over it unchanged. Wake-ups (one byte, sent only when the peer said it
sleeps) and death detection (its hang-up) stay on the pair's TCP data socket.
"""

from __future__ import annotations

import errno
import mmap
import socket

from .fence import Fence

# Bytes of one direction's ring. Large enough that a big message costs few
# trips through the Python pumps (each trip copies up to this much), small
# enough to stay in the caches of a 2-core machine at mid sizes.
RING_BYTES = 4 << 20
_PAGE = mmap.PAGESIZE
_CTL_BYTES = _PAGE  # the control words, then the ring's data from a page boundary
BLOCK_BYTES = _CTL_BYTES + RING_BYTES
NONCE_BYTES = 16  # a block starts with its nonce (set-up checks it)

# Control words (u64 indices into the block's first page viewed as 'Q'), each
# on a cache line of its own: the writer owns HEAD, the reader TAIL; either
# side sets its SLEEPS flag before sleeping and the other clears it when it
# sends the wake-up byte.
_HEAD = 64 // 8  # bytes ever written (the writer's)
_TAIL = 128 // 8  # bytes ever read (the reader's)
_READER_SLEEPS = 192 // 8
_WRITER_SLEEPS = 256 // 8

_WAKE = b"w"


class ShmLink:
    """One peer's pair of rings, with the socket calls the progress loop makes.

    ``out_block`` is this rank's ring to the peer (in this rank's segment),
    ``in_block`` the peer's ring to this rank (in the peer's segment);
    ``sock`` is the pair's TCP data socket, kept for wake-ups and hang-ups.
    Not thread-safe: one plan runs at a time on a group (the engine's token).
    """

    __slots__ = (
        "peer",
        "sock",
        "_fd",
        "_out",
        "_out_data",
        "_in",
        "_in_data",
        "_cap",
        "_fence",
        "_armed",
        "_eof",
        "_maps",
    )

    def __init__(
        self, peer: int, sock: socket.socket, out_block: memoryview, in_block: memoryview
    ) -> None:
        self.peer = peer
        self.sock = sock
        self._fd = sock.fileno()
        self._out = out_block[:_CTL_BYTES].cast("Q")
        self._out_data = out_block[_CTL_BYTES:BLOCK_BYTES]
        self._in = in_block[:_CTL_BYTES].cast("Q")
        self._in_data = in_block[_CTL_BYTES:BLOCK_BYTES]
        self._cap = RING_BYTES
        self._fence = Fence()
        self._armed = False  # a sleep flag of ours may be set: drain wake-ups before moving
        self._eof = False  # the peer's end of the TCP socket closed
        self._maps: list[memoryview] = [out_block, in_block]

    def fileno(self) -> int:
        """The TCP data socket's: poll sleeps on its wake-up bytes and hang-up."""
        return self._fd

    # ---------------------------------------------------------------- moving bytes

    def sendmsg(self, views: list[memoryview]) -> int:
        """Copy what fits of ``views`` into the outgoing ring; the bytes taken.

        BlockingIOError when the ring is full (like a full socket); an OSError
        once the peer is known to be gone (like a reset)."""
        if self._armed:
            self._disarm()
        ctl = self._out
        head = ctl[_HEAD]
        free = self._cap - (head - ctl[_TAIL])
        if self._eof:
            raise OSError(errno.EPIPE, f"rank {self.peer}'s end of the link is closed")
        if free == 0:
            raise BlockingIOError
        data = self._out_data
        cap = self._cap
        n = 0
        for v in views:
            k = len(v)
            room = free - n
            if k > room:
                k = room
                v = v[:k]
            pos = (head + n) % cap
            end = pos + k
            if end <= cap:
                data[pos:end] = v
            else:
                split = cap - pos
                data[pos:] = v[:split]
                data[: k - split] = v[split:]
            n += k
            if n == free:
                break
        ctl[_HEAD] = head + n  # after the data (x86-64 keeps stores in order)
        self._fence()
        if ctl[_READER_SLEEPS]:
            ctl[_READER_SLEEPS] = 0
            self._wake()
        return n

    def recv_into(self, view: memoryview) -> int:
        return self._recv([view])

    def recvmsg_into(self, views: list[memoryview]) -> tuple[int, list[object], int, None]:
        return self._recv(views), [], 0, None

    def _recv(self, views: list[memoryview]) -> int:
        """Copy what the incoming ring holds into ``views``; 0 once the peer is
        gone and nothing is left (like a socket's end of stream)."""
        if self._armed:
            self._disarm()
        ctl = self._in
        tail = ctl[_TAIL]
        avail = ctl[_HEAD] - tail
        if avail == 0:
            if self._eof:
                return 0
            raise BlockingIOError
        data = self._in_data
        cap = self._cap
        n = 0
        for v in views:
            k = len(v)
            room = avail - n
            if k > room:
                k = room
            pos = (tail + n) % cap
            end = pos + k
            if end <= cap:
                v[:k] = data[pos:end]
            else:
                split = cap - pos
                v[:split] = data[pos:]
                v[split:k] = data[: k - split]
            n += k
            if n == avail:
                break
        ctl[_TAIL] = tail + n
        self._fence()
        if ctl[_WRITER_SLEEPS]:
            ctl[_WRITER_SLEEPS] = 0
            self._wake()
        return n

    def peek(self, n: int) -> bytes | None:
        """The first ``n`` bytes the incoming ring holds, left there; None if
        it holds fewer (the shm-native allreduce looks for a peer's plan
        header: a peer running another collective, ``slots.ForeignTraffic``)."""
        ctl = self._in
        tail = ctl[_TAIL]
        if ctl[_HEAD] - tail < n:
            return None
        pos = tail % self._cap
        end = pos + n
        if end <= self._cap:
            return bytes(self._in_data[pos:end])
        return bytes(self._in_data[pos:]) + bytes(self._in_data[: end - self._cap])

    # ---------------------------------------------------------------- sleeping

    def arm_recv(self) -> bool:
        """Before sleeping on incoming data: ask the peer for a wake-up. True if
        data arrived meanwhile (then do not sleep)."""
        self._armed = True
        ctl = self._in
        ctl[_READER_SLEEPS] = 1
        self._fence()
        return ctl[_HEAD] != ctl[_TAIL] or self._eof

    def arm_send(self) -> bool:
        """Before sleeping on a full ring: ask the peer for a wake-up. True if
        room appeared meanwhile (then do not sleep)."""
        self._armed = True
        ctl = self._out
        ctl[_WRITER_SLEEPS] = 1
        self._fence()
        return ctl[_HEAD] - ctl[_TAIL] < self._cap or self._eof

    def _disarm(self) -> None:
        """Awake again: withdraw our sleep flags, read the wake-up bytes (and
        learn whether the peer hung up)."""
        self._armed = False
        self._in[_READER_SLEEPS] = 0
        self._out[_WRITER_SLEEPS] = 0
        while not self._eof:
            try:
                if not self.sock.recv(4096):
                    self._eof = True
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._eof = True

    def _wake(self) -> None:
        try:
            self.sock.send(_WAKE)
        except BlockingIOError:
            pass  # a socket full of wake-ups wakes the peer anyway
        except OSError:
            self._eof = True  # gone; the next receive or send says so

    def close(self) -> None:
        """Drop this link's views of the rings. The mappings go when nothing
        references them any more (never under a running plan in another
        thread: unmapping under it would crash the process, not raise)."""
        self._maps.clear()

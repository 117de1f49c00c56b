"""One peer's p2p link: its two streams and the messages framed on them."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from ..errors import EntrenarError, PeerConnectionError
from ..transport.loop import LinkState
from ..transport.plan import Recv, Send, bytes_of
from ..wire import HEADER_BYTES, Header, OpCode, p2p_header
from .matching import Message
from .ops import Op

if TYPE_CHECKING:
    from ..transport.control import Causes
    from ..transport.loop import Links

_TRIM_AT = 64  # moved pieces kept on a stream before its list is trimmed


# A stream's socket until its connection exists (never pumped before:
# ``out_open`` / ``in_open`` say when it is real).
_NOT_CONNECTED = cast(socket.socket, None)


@dataclass(eq=False)
class PeerLink:
    """One peer's two streams, which the loop moves, and the messages framed on
    them: a ``wire.p2p_header`` (numbered, carrying the tag and the byte
    count), then the payload; where sending and reading stand.

    Each stream has its own connection, made on first use: ``out`` the one
    this rank opened to the peer, ``inc`` the one the peer opened to it.
    Messages can be queued on ``out`` and a header awaited on ``inc`` before
    either exists."""

    peer: int
    out: LinkState  # header, payload, header, payload, ... of queued sends
    inc: LinkState  # header, then the payload it announces, then the next header
    header: bytearray = field(default_factory=lambda: bytearray(HEADER_BYTES))
    sending: list[Op] = field(default_factory=list)  # sends on ``out``, oldest first
    incoming: Message | None = None  # the message whose payload is being received
    sent_index: int = 0
    recv_index: int = 0
    last_progress: float = 0.0  # when a byte last moved either way
    dead: EntrenarError | None = None  # why the link is unusable (None while it works)
    out_open: bool = False  # ``out`` has its connection
    in_open: bool = False  # ``inc`` has its connection
    connecting: bool = False  # ``out``'s connection is being opened
    # The peer hung up ``out`` before its own connection reached this rank
    # (``P2PChannel._out_event``): the error, and when to give up waiting for it.
    ending: tuple[EntrenarError, float] | None = None

    @classmethod
    def unconnected(cls, peer: int) -> PeerLink:
        out = LinkState(peer, _NOT_CONNECTED, [], 0)
        return cls(peer, out, LinkState(peer, _NOT_CONNECTED, [], 0))

    def attach(self, sock: socket.socket, *, outgoing: bool) -> None:
        """Give a stream its connection (``outgoing``: the one this rank opened)."""
        if outgoing:
            self.out.sock, self.out_open = sock, True
        else:
            self.inc.sock, self.in_open = sock, True

    @property
    def what(self) -> str:
        return f"p2p link to rank {self.peer}"

    def busy(self) -> bool:
        """Bytes are due on this link (a send queued, or a message half received)."""
        return not self.out.idle() or self.incoming is not None or self.inc.offset > 0

    def queue(self, op: Op, sent: Callable[[], None]) -> None:
        """Queue ``op``'s message: its header, then its payload; ``sent`` runs
        once the last byte left."""
        header = p2p_header(self.sent_index, op.host.dtype, op.nbytes, op.tag)
        self.sent_index += 1
        if not self.busy():
            self.last_progress = time.monotonic()
        if op.nbytes:
            self.out.push(Send(memoryview(header.pack())))
            self.out.push(Send(bytes_of(op.host), None, sent))
        else:
            self.out.push(Send(memoryview(header.pack()), None, sent))
        self.sending.append(op)

    def sent(self, op: Op) -> None:
        """``op``'s last byte left: it is no longer pending here."""
        if self.sending and self.sending[0] is op:
            self.sending.pop(0)

    def expect_header(self, arrived: Callable[[], None]) -> None:
        """Read the next message's header into ``header``; then ``arrived`` runs."""
        self.inc.push(Recv(memoryview(self.header), arrived))

    def read_header(self, rank: int) -> Header:
        """The header just received, checked: a p2p message, the one due next."""
        try:
            header = Header.unpack(bytes(self.header))
        except ValueError as e:
            raise PeerConnectionError(
                f"rank {rank}: {self.what}: garbage from rank {self.peer} where a "
                f"message header was due ({e}): the stream is corrupt",
                culprit=self.peer,
            ) from None
        if header.op is not OpCode.SEND or header.seq != self.recv_index:
            raise PeerConnectionError(
                f"rank {rank}: {self.what}: rank {self.peer} sent {header.describe()} "
                f"where p2p message #{self.recv_index} was due: the stream is corrupt",
                culprit=self.peer,
            )
        self.recv_index += 1
        return header

    def pump(self, loop: Links, *, receiving: bool) -> None:
        """Move what one stream can (raises the loop's error if the link fails)."""
        if receiving:
            if not self.in_open:
                return
            moved = loop.pump_recv(self.inc, self.what)
        else:
            if not self.out_open:
                return
            moved = loop.pump_send(self.out, self.what)
        if moved:
            self.last_progress = time.monotonic()
        for st in (self.inc, self.out):
            if st.index >= _TRIM_AT:
                st.trim()

    def stall(self, now: float, timeout_s: float, causes: Causes) -> EntrenarError | None:
        """The error if bytes are due and nothing moved for ``timeout_s``; else None."""
        if self.dead is not None or not self.busy() or self.last_progress + timeout_s > now:
            return None
        recv_from = [self.peer] if self.incoming is not None or self.inc.offset else []
        send_to = [self.peer] if not self.out.idle() else []
        return causes.stalled(self.what, recv_from, send_to, timeout_s)

    def out_ended(self, causes: Causes) -> EntrenarError | None:
        """``out`` is readable: the peer never writes on it, so this is its
        close (the error naming why) or garbage; None if nothing is there."""
        try:
            chunk = self.out.sock.recv(1)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            return causes.link_failed(self.peer, self.what, e)
        if not chunk:
            return causes.peer_closed(self.peer, self.what)
        return PeerConnectionError(
            f"rank {causes.rank}: {self.what}: rank {self.peer} wrote on this rank's own "
            "connection: the stream is corrupt",
            culprit=self.peer,
        )

    def drop_pending(self) -> list[Op]:
        """Give up what is pending: the sends not yet sent (returned), a message half read."""
        dropped = list(self.sending)
        self.sending.clear()
        self.incoming = None
        return dropped

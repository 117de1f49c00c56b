"""Point-to-point messages: send / recv / recv_anysource over a group's own p2p channel.

Collectives run in issue order on the group's comm thread; p2p cannot: a recv
may wait for a send that its peer issues only after some collective, and
pipeline schedules post sends and recvs in orders that differ from rank to
rank. So every group has a second TCP mesh (built at group creation over
``PrefixStore("p2p", store)``, authenticated like the first) and one progress
thread that owns it:

- a send is queued on its peer's FIFO and written as a framed message (a
  ``wire.p2p_header`` carrying the tag and byte count, then the payload). Its
  Work completes once the kernel has taken the last byte: a send never waits
  for the matching recv (up to the socket buffers and the receiver's
  buffering, below), so ``send; recv`` on both ends never deadlocks;
- every link is read all the time. An arriving message matches the first
  posted recv for (its peer or any peer, its tag), in post order, and is
  received straight into that tensor; a message nobody waits for yet is
  buffered (unexpected message) and copied when its recv is posted. So
  messages between two ranks with one tag match in order, as torch requires,
  and tags let independent streams overtake each other;
- a send to this rank itself is matched locally (torch allows ``isend`` /
  ``irecv`` to self).

Failures: a peer whose connection closes or breaks fails every pending send
to it and recv from it with PeerConnectionError naming this rank, the peer
and the tag; a recv not matched, or a send not taken, within the group's
timeout fails the same way. A recv whose tensor size differs from the
matched send's fails with CollectiveMismatchError (the message is drained,
the link stays usable). Collectives are unaffected either way.
"""

from __future__ import annotations

import collections
import errno
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .algorithms.common import bytes_of
from .config import Options
from .errors import CollectiveMismatchError, EntrenarError, PeerConnectionError
from .transport import Mesh
from .wire import HEADER_BYTES, Header, OpCode, p2p_header
from .work import EntrenarWork

log = logging.getLogger(__name__)

ANY_SOURCE = -1
_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)
_POLLHANG = select.POLLHUP | select.POLLERR | _POLLRDHUP
_READS_PER_WAKE = 64  # bound the time one busy link holds the loop


class P2PWork(EntrenarWork):
    """The Work of a send or recv; a recv's knows the rank it came from (``_source_rank``)."""

    def __init__(self, future: torch.futures.Future, what: str, rank: int, src: int) -> None:
        super().__init__(future, what, rank)
        self.src = src

    def _source_rank(self) -> int:
        if self.src < 0:
            raise ValueError(f"rank {self._rank}: {self._what}: not received yet")
        return self.src

    def source_rank(self) -> int:
        return self._source_rank()


@dataclass(eq=False)
class _Op:
    """A posted send or recv: the user's tensor, the flat host tensor on the wire, its Work."""

    peer: int  # destination (send), source or ANY_SOURCE (recv)
    tag: int
    user: torch.Tensor
    host: torch.Tensor
    future: torch.futures.Future
    work: P2PWork
    deadline: float
    what: str
    is_recv: bool

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


@dataclass(eq=False)
class _Out:
    """A send being written: header then payload."""

    op: _Op
    pieces: list[memoryview]
    index: int = 0
    offset: int = 0


@dataclass(eq=False)
class _Msg:
    """An arriving message: its own buffer until matched, or the matched recv's tensor."""

    peer: int
    header: Header
    view: memoryview
    buf: torch.Tensor | None  # set while unmatched (buffered)
    recv: _Op | None = None
    error: EntrenarError | None = None  # a size mismatch found at matching
    got: int = 0
    complete: bool = False


@dataclass(eq=False)
class _Link:
    """Per-peer state of the progress thread."""

    peer: int
    sock: socket.socket
    out: collections.deque[_Out] = field(default_factory=collections.deque)
    header: bytearray = field(default_factory=lambda: bytearray(HEADER_BYTES))
    header_got: int = 0
    incoming: _Msg | None = None
    sent_index: int = 0
    recv_index: int = 0
    last_progress: float = 0.0  # when a byte last moved either way
    dead: str = ""  # why the link is unusable ("" while it works)

    def busy(self) -> bool:
        """Bytes are due on this link (a send queued, or a message half received)."""
        return bool(self.out) or self.incoming is not None or self.header_got > 0


_Done = tuple[_Op, BaseException | None]


class P2PChannel:
    """A group's p2p mesh and the thread that moves its messages."""

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
        self.timeout_s = max(timeout.total_seconds(), 0.001)
        self._lock = threading.Lock()
        self._closing = False
        self._posted: list[_Op] = []  # recvs waiting for a message, in post order
        self._unexpected: list[_Msg] = []  # messages waiting for a recv, in arrival order
        self._mesh: Mesh | None = None
        self._links: dict[int, _Link] = {}
        if world > 1:
            self._mesh = Mesh(
                dist.PrefixStore("p2p", store),
                rank,
                world,
                options,
                timeout,
                name=f"{name}/p2p",
                control=False,
            )
            for peer, sock in self._mesh.sockets.items():
                self._links[peer] = _Link(peer, sock)
        self._fd_link = {link.sock.fileno(): link for link in self._links.values()}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = select.poll()
        self._masks: dict[int, int] = {}
        self._poller.register(self._wake_r.fileno(), select.POLLIN)
        for fd in self._fd_link:
            self._poller.register(fd, select.POLLIN | _POLLRDHUP)
            self._masks[fd] = select.POLLIN | _POLLRDHUP
        self._thread = threading.Thread(
            target=self._loop, name=f"entrenar-p2p-r{rank}-{name or 'pg'}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ caller side

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> P2PWork:
        what = f"send to rank {dst} (tag {tag})"
        if tensor.is_cuda:  # synchronous on the caller's stream: the producer is done
            host = tensor.detach().to("cpu").reshape(-1)
        elif tensor.is_contiguous():
            host = tensor.detach().reshape(-1)
        else:
            host = tensor.detach().contiguous().reshape(-1)
        op = self._op(dst, tag, tensor, host, what, is_recv=False)
        done: list[_Done] = []
        with self._lock:
            if dst == self.rank:
                self._deliver_local(op, done)
            else:
                link = self._links[dst]
                if self._closing or link.dead:
                    done.append((op, self._dead_error(op, link.dead or "the group was destroyed")))
                else:
                    header = p2p_header(link.sent_index, host.dtype, op.nbytes, tag)
                    link.sent_index += 1
                    if not link.busy():
                        link.last_progress = time.monotonic()
                    link.out.append(_Out(op, [memoryview(header.pack()), bytes_of(host)]))
        self._finish(done)
        self._wake()
        return op.work

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> P2PWork:
        """Post a recv from ``src`` (ANY_SOURCE: from whichever rank's message matches first)."""
        who = "any rank" if src == ANY_SOURCE else f"rank {src}"
        what = f"recv from {who} (tag {tag})"
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            host = tensor.detach().reshape(-1)
        else:
            host = torch.empty(tensor.numel(), dtype=tensor.dtype)
        op = self._op(src, tag, tensor, host, what, is_recv=True)
        done: list[_Done] = []
        with self._lock:
            msg = next(
                (
                    m
                    for m in self._unexpected
                    if m.recv is None and m.header.aux == tag and src in (ANY_SOURCE, m.peer)
                ),
                None,
            )
            if msg is not None:
                self._match(msg, op)
                if msg.complete:
                    self._unexpected.remove(msg)
                    self._complete_msg(msg, done)
            elif self._closing:
                done.append((op, self._dead_error(op, "the group was destroyed")))
            elif src != ANY_SOURCE and src != self.rank and self._links[src].dead:
                done.append((op, self._dead_error(op, self._links[src].dead)))
            elif src == ANY_SOURCE and self._links and all(ln.dead for ln in self._links.values()):
                done.append((op, self._dead_error(op, "every peer's connection is closed")))
            else:
                self._posted.append(op)
        self._finish(done)
        self._wake()  # the loop recomputes its next deadline
        return op.work

    def close(self, hard: bool = False) -> None:
        """Stop the thread, fail what is pending, close the sockets. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        done: list[_Done] = []
        with self._lock:
            for op in self._pending_ops():
                done.append((op, self._dead_error(op, "the process group was destroyed")))
            self._posted.clear()
            self._unexpected.clear()
            for link in self._links.values():
                link.out.clear()
                link.incoming = None
        self._finish(done)
        if self._mesh is not None:
            self._mesh.close(hard=hard)
        self._wake_r.close()
        self._wake_w.close()

    def _op(
        self,
        peer: int,
        tag: int,
        user: torch.Tensor,
        host: torch.Tensor,
        what: str,
        *,
        is_recv: bool,
    ) -> _Op:
        fut: torch.futures.Future[list[torch.Tensor]] = (
            torch.futures.Future(devices=[user.device]) if user.is_cuda else torch.futures.Future()
        )
        src = peer if peer != ANY_SOURCE else -1
        work = P2PWork(fut, what, self.rank, src)
        deadline = time.monotonic() + self.timeout_s
        return _Op(peer, tag, user, host, fut, work, deadline, what, is_recv)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already awake (buffer full) or closed

    # ------------------------------------------------------------ matching (lock held)

    def _deliver_local(self, op: _Op, done: list[_Done]) -> None:
        """A send to this rank: match a posted recv or buffer a copy."""
        header = p2p_header(0, op.host.dtype, op.nbytes, op.tag)
        buf = op.host.clone().view(torch.uint8) if op.nbytes else torch.empty(0, dtype=torch.uint8)
        msg = _Msg(self.rank, header, bytes_of(buf), buf, got=op.nbytes, complete=True)
        recv = self._take_posted(self.rank, op.tag)
        if recv is None:
            self._unexpected.append(msg)
        else:
            self._match(msg, recv)
            self._complete_msg(msg, done)
        done.append((op, None))

    def _take_posted(self, peer: int, tag: int) -> _Op | None:
        for i, op in enumerate(self._posted):
            if op.tag == tag and op.peer in (ANY_SOURCE, peer):
                return self._posted.pop(i)
        return None

    def _match(self, msg: _Msg, recv: _Op) -> None:
        """Pair ``msg`` with ``recv``; an unbuffered message is then received straight into it."""
        msg.recv = recv
        recv.work.src = msg.peer
        theirs = msg.header
        if theirs.numel != recv.nbytes or (
            theirs.dtype is not None and theirs.dtype != recv.host.dtype
        ):
            dt = str(theirs.dtype).removeprefix("torch.") if theirs.dtype else "?"
            msg.error = CollectiveMismatchError(
                f"rank {self.rank}: {recv.what} of {recv.nbytes} bytes "
                f"({str(recv.host.dtype).removeprefix('torch.')}) matched a send of "
                f"{theirs.numel} bytes ({dt}) from rank {msg.peer}: the sizes must agree"
            )
            if msg.buf is None:  # drain into a throwaway buffer, keep the link in step
                msg.buf = torch.empty(theirs.numel, dtype=torch.uint8)
                msg.view = bytes_of(msg.buf)
        elif msg.buf is None:
            msg.view = bytes_of(recv.host)

    def _complete_msg(self, msg: _Msg, done: list[_Done]) -> None:
        recv = msg.recv
        assert recv is not None
        if msg.error is None and msg.buf is not None and recv.nbytes:
            recv.host.view(torch.uint8).copy_(msg.buf)
        done.append((recv, msg.error))

    def _pending_ops(self) -> list[_Op]:
        ops = list(self._posted)
        ops += [m.recv for m in self._unexpected if m.recv is not None]
        for link in self._links.values():
            ops += [o.op for o in link.out]
            if link.incoming is not None and link.incoming.recv is not None:
                ops.append(link.incoming.recv)
        return ops

    def _dead_error(self, op: _Op, why: str) -> PeerConnectionError:
        return PeerConnectionError(f"rank {self.rank}: p2p {op.what} failed: {why}")

    # ------------------------------------------------------------ completion (no lock)

    def _finish(self, done: list[_Done]) -> None:
        for op, error in done:
            if error is not None:
                op.future.set_exception(error)
                continue
            try:
                if op.is_recv and op.nbytes and op.host.data_ptr() != op.user.data_ptr():
                    op.user.detach().copy_(op.host.view(op.user.shape))  # CUDA / non-contiguous
            except BaseException as e:  # a failed copy-back fails the recv, not the thread
                op.future.set_exception(e)
                continue
            op.future.set_result([op.user])

    # ------------------------------------------------------------ progress thread

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing:
                        return
                    self._update_masks()
                    wait_s = self._next_deadline() - time.monotonic()
                events = self._poller.poll(max(wait_s, 0.0) * 1000.0 + 1.0)
                done: list[_Done] = []
                with self._lock:
                    if self._closing:
                        return
                    for fd, ev in events:
                        link = self._fd_link.get(fd)
                        if link is None:
                            self._drain_wake()
                            continue
                        if link.dead:
                            continue
                        if ev & (select.POLLIN | _POLLHANG):
                            self._read(link, done)
                        if ev & select.POLLOUT and not link.dead:
                            self._write(link, done)
                    for link in self._links.values():
                        if link.out and not link.dead:
                            self._write(link, done)  # new sends: try at once, no poll round
                    self._expire(done)
                self._finish(done)
        except BaseException as e:  # keep the process alive; fail what is pending
            log.exception("rank %d: p2p thread failed", self.rank)
            done = []
            with self._lock:
                for op in self._pending_ops():
                    done.append((op, self._dead_error(op, f"the p2p thread failed: {e!r}")))
                self._posted.clear()
                for link in self._links.values():
                    link.out.clear()
                    link.dead = link.dead or f"the p2p thread failed: {e!r}"
                self._closing = True
            self._finish(done)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _update_masks(self) -> None:
        for fd, link in self._fd_link.items():
            old = self._masks.get(fd, 0)
            if link.dead:
                if old:  # a closed socket polls readable forever: stop watching it
                    self._poller.unregister(fd)
                    self._masks[fd] = 0
                continue
            mask = select.POLLIN | _POLLRDHUP | (select.POLLOUT if link.out else 0)
            if mask != old:
                self._poller.modify(fd, mask)
                self._masks[fd] = mask

    def _next_deadline(self) -> float:
        """The earliest time a posted recv or a busy link times out."""
        deadlines = [op.deadline for op in self._posted]
        deadlines += [
            ln.last_progress + self.timeout_s
            for ln in self._links.values()
            if ln.busy() and not ln.dead
        ]
        return min(deadlines) if deadlines else time.monotonic() + 3600.0

    def _expire(self, done: list[_Done]) -> None:
        now = time.monotonic()
        for op in [op for op in self._posted if op.deadline <= now]:
            self._posted.remove(op)
            done.append(
                (
                    op,
                    self._dead_error(
                        op,
                        f"no matching send arrived within {self.timeout_s:.1f}s "
                        "(the peer stalled, died, or never sent it)",
                    ),
                )
            )
        for link in self._links.values():
            if not link.dead and link.busy() and link.last_progress + self.timeout_s <= now:
                self._kill(
                    link,
                    f"rank {link.peer} moved no data for {self.timeout_s:.1f}s "
                    "(it stalled or died)",
                    done,
                )

    def _kill(self, link: _Link, why: str, done: list[_Done]) -> None:
        """Give up on a link: fail everything pending with its peer."""
        if link.dead:
            return
        link.dead = why
        pending = link.busy() or any(op.peer == link.peer for op in self._posted)
        # A peer that finished and destroyed its group closes its links: normal.
        log.log(
            logging.WARNING if pending else logging.DEBUG,
            "rank %d: p2p link to rank %d down: %s",
            self.rank,
            link.peer,
            why,
        )
        for out in link.out:
            done.append((out.op, self._dead_error(out.op, why)))
        link.out.clear()
        msg = link.incoming
        if msg is not None and msg.recv is not None:
            done.append((msg.recv, self._dead_error(msg.recv, why)))
        link.incoming = None
        for m in [m for m in self._unexpected if m.peer == link.peer and not m.complete]:
            self._unexpected.remove(m)
        for op in [op for op in self._posted if op.peer == link.peer]:
            self._posted.remove(op)
            done.append((op, self._dead_error(op, why)))
        if all(ln.dead for ln in self._links.values()):
            for op in [op for op in self._posted if op.peer == ANY_SOURCE]:
                self._posted.remove(op)
                done.append((op, self._dead_error(op, "every peer's connection is closed")))

    def _closed_reason(self, link: _Link, e: OSError | None = None) -> str:
        if e is None:
            return (
                f"rank {link.peer} closed the connection (its process exited or died, "
                "or it destroyed the group)"
            )
        return f"the link to rank {link.peer} failed: {e}"

    def _write(self, link: _Link, done: list[_Done]) -> None:
        while link.out:
            out = link.out[0]
            while out.index < len(out.pieces):
                piece = out.pieces[out.index]
                if out.offset < len(piece):
                    try:
                        n = link.sock.send(piece[out.offset :] if out.offset else piece)
                    except BlockingIOError:
                        return
                    except OSError as e:
                        if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                            self._kill(link, self._closed_reason(link), done)
                        else:
                            self._kill(link, self._closed_reason(link, e), done)
                        return
                    out.offset += n
                    link.last_progress = time.monotonic()
                    if out.offset < len(piece):
                        return
                out.index += 1
                out.offset = 0
            link.out.popleft()
            done.append((out.op, None))

    def _read(self, link: _Link, done: list[_Done]) -> None:
        for _ in range(_READS_PER_WAKE):
            msg = link.incoming
            if msg is None:
                view = memoryview(link.header)[link.header_got :]
            else:
                view = msg.view[msg.got :]
            if len(view):
                try:
                    n = link.sock.recv_into(view)
                except BlockingIOError:
                    return
                except OSError as e:
                    self._kill(link, self._closed_reason(link, e), done)
                    return
                if n == 0:
                    self._kill(link, self._closed_reason(link), done)
                    return
                link.last_progress = time.monotonic()
            else:
                n = 0
            if msg is None:
                link.header_got += n
                if link.header_got == HEADER_BYTES:
                    link.header_got = 0
                    if not self._start_msg(link, done):
                        return
            else:
                msg.got += n
                if msg.got == len(msg.view):
                    self._end_msg(link, msg, done)

    def _start_msg(self, link: _Link, done: list[_Done]) -> bool:
        try:
            header = Header.unpack(bytes(link.header))
        except ValueError as e:
            self._kill(
                link,
                f"garbage from rank {link.peer} where a message header was due "
                f"({e}): the stream is corrupt",
                done,
            )
            return False
        if header.op is not OpCode.SEND or header.seq != link.recv_index:
            self._kill(
                link,
                f"rank {link.peer} sent {header.describe()} where p2p message "
                f"#{link.recv_index} was due: the stream is corrupt",
                done,
            )
            return False
        link.recv_index += 1
        recv = self._take_posted(link.peer, header.aux)
        if recv is None:
            buf = torch.empty(header.numel, dtype=torch.uint8)
            msg = _Msg(link.peer, header, bytes_of(buf), buf)
            self._unexpected.append(msg)
        else:
            msg = _Msg(link.peer, header, memoryview(b""), None)
            self._match(msg, recv)
        link.incoming = msg
        if msg.got == len(msg.view):
            self._end_msg(link, msg, done)
        return True

    def _end_msg(self, link: _Link, msg: _Msg, done: list[_Done]) -> None:
        link.incoming = None
        msg.complete = True
        if msg.recv is None:
            return  # buffered: a later recv takes it
        if msg in self._unexpected:
            self._unexpected.remove(msg)
        self._complete_msg(msg, done)

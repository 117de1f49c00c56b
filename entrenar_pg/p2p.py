"""Point-to-point messages: send / recv / recv_anysource, matched by peer and tag.

Collectives run in issue order on the group's comm thread; p2p cannot: a recv
may wait for a send that its peer issues only after some collective, and
pipeline schedules post sends and recvs in orders that differ from rank to
rank. So p2p has its own channel of the group's transport (one p2p socket per
pair, set up with the others) and one thread that drives it with the
transport's progress loop (``transport.loop``): the same pumps, the same
sleep, the same errno classifier and the same naming of causes as the
collectives. This module is the matching:

- a send is queued on its peer's stream as a framed message (a
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

Failures: a link that fails while something is pending on it (the peer
aborted, left or died; the link broke; nothing moved for the timeout) fails
every pending op with it, naming the culprit as a collective would, and
breaks the group (``on_failure``). A recv not matched within the timeout
fails alone (the link is fine); a recv whose size differs from the matched
send's fails with CollectiveMismatchError alone (the message is drained, the
link stays in step). A peer that leaves with nothing pending is normal.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.autograd import profiler as _profiler

from .api.work import EntrenarWork
from .errors import CollectiveMismatchError, EntrenarError, PeerConnectionError
from .flight_recorder import Entry, FlightRecorder, p2p_name
from .profiling import event_until
from .transport.loop import POLLHANG, Links, LinkState
from .transport.plan import Recv, Send, bytes_of
from .transport.tcp import Mesh
from .wire import HEADER_BYTES, Header, OpCode, p2p_header

log = logging.getLogger(__name__)

ANY_SOURCE = -1
_TRIM_AT = 64  # moved pieces kept on a stream before its list is trimmed
# How long a break hook (abort() among them) waits for the p2p thread to end.
ABORT_JOIN_S = 0.3


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
    record: Entry | None = None  # its flight-recorder entry, when the group records

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


@dataclass(eq=False)
class _Msg:
    """An arriving message: its own buffer until matched, or the matched recv's tensor."""

    peer: int
    header: Header
    view: memoryview
    buf: torch.Tensor | None  # set while unmatched (buffered)
    recv: _Op | None = None
    error: EntrenarError | None = None  # a size mismatch found at matching
    complete: bool = False


@dataclass(eq=False)
class _Link:
    """Per-peer state: the two streams the loop moves, and where matching stands."""

    peer: int
    out: LinkState  # header, payload, header, payload, ... of queued sends
    inc: LinkState  # header, then the payload it announces, then the next header
    header: bytearray = field(default_factory=lambda: bytearray(HEADER_BYTES))
    sending: list[_Op] = field(default_factory=list)  # sends on ``out``, oldest first
    incoming: _Msg | None = None  # the message whose payload is being received
    sent_index: int = 0
    recv_index: int = 0
    last_progress: float = 0.0  # when a byte last moved either way
    dead: EntrenarError | None = None  # why the link is unusable (None while it works)

    @property
    def what(self) -> str:
        return f"p2p link to rank {self.peer}"

    def busy(self) -> bool:
        """Bytes are due on this link (a send queued, or a message half received)."""
        return not self.out.idle() or self.incoming is not None or self.inc.offset > 0


_Done = tuple[_Op, BaseException | None]


class Matching:
    """Which recv a message is for: posted recvs and unexpected messages, matched
    by (peer or ANY_SOURCE, tag) in post and arrival order. The channel's lock
    is held around every call; completions collect in ``done`` and are run
    after the lock is released (``complete``)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.posted: list[_Op] = []  # recvs waiting for a message, in post order
        self.unexpected: list[_Msg] = []  # messages waiting for a recv, in arrival order
        self.done: list[_Done] = []

    def take_done(self) -> list[_Done]:
        done, self.done = self.done, []
        return done

    def post(self, op: _Op) -> bool:
        """Match a new recv with a message already here; False if none is."""
        msg = next(
            (
                m
                for m in self.unexpected
                if m.recv is None and m.header.aux == op.tag and op.peer in (ANY_SOURCE, m.peer)
            ),
            None,
        )
        if msg is None:
            return False
        self.match(msg, op)
        if msg.complete:
            self.unexpected.remove(msg)
            self.complete_msg(msg)
        return True

    def arrive(self, peer: int, header: Header) -> _Msg:
        """A message's header came in: match it with a posted recv, or buffer it."""
        recv = self.take_posted(peer, header.aux)
        if recv is None:
            buf = torch.empty(header.numel, dtype=torch.uint8)
            msg = _Msg(peer, header, bytes_of(buf), buf)
            self.unexpected.append(msg)
        else:
            msg = _Msg(peer, header, memoryview(b""), None)
            self.match(msg, recv)
        return msg

    def arrived(self, msg: _Msg) -> None:
        """``msg``'s payload is in."""
        msg.complete = True
        if msg.recv is not None:
            if msg in self.unexpected:
                self.unexpected.remove(msg)
            self.complete_msg(msg)

    def deliver_local(self, op: _Op) -> None:
        """A send to this rank: match a posted recv or buffer a copy."""
        header = p2p_header(0, op.host.dtype, op.nbytes, op.tag)
        buf = op.host.clone().view(torch.uint8) if op.nbytes else torch.empty(0, dtype=torch.uint8)
        msg = _Msg(self.rank, header, bytes_of(buf), buf, complete=True)
        recv = self.take_posted(self.rank, op.tag)
        if recv is None:
            self.unexpected.append(msg)
        else:
            self.match(msg, recv)
            self.complete_msg(msg)
        self.done.append((op, None))

    def take_posted(self, peer: int, tag: int) -> _Op | None:
        for i, op in enumerate(self.posted):
            if op.tag == tag and op.peer in (ANY_SOURCE, peer):
                return self.posted.pop(i)
        return None

    def match(self, msg: _Msg, recv: _Op) -> None:
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

    def complete_msg(self, msg: _Msg) -> None:
        recv = msg.recv
        assert recv is not None
        if msg.error is None and msg.buf is not None and recv.nbytes:
            recv.host.view(torch.uint8).copy_(msg.buf)
        self.done.append((recv, msg.error))

    def fail(self, op: _Op, cause: EntrenarError | None, why: str) -> None:
        """Fail ``op``: with its link's failure (``cause``), else for reason ``why``."""
        if cause is not None:
            self.done.append((op, _op_error(self.rank, op, cause)))
        else:
            self.done.append(
                (op, PeerConnectionError(f"rank {self.rank}: p2p {op.what} failed: {why}"))
            )

    def expire(self, now: float, timeout_s: float) -> None:
        """Fail the recvs nobody sent to within the timeout (their links are fine)."""
        for op in [op for op in self.posted if op.deadline <= now]:
            self.posted.remove(op)
            self.fail(
                op,
                None,
                f"no matching send arrived within {timeout_s:.1f}s "
                "(the peer stalled, died, or never sent it)",
            )

    def drop_peer(self, peer: int, error: EntrenarError, all_dead: bool) -> list[_Op]:
        """``peer``'s link failed with ``error``: fail the recvs posted for it (and,
        when every link is down, those for any rank); forget its partial messages."""
        failed = [op for op in self.posted if op.peer == peer]
        for op in failed:
            self.posted.remove(op)
            self.done.append((op, _op_error(self.rank, op, error)))
        for m in [m for m in self.unexpected if m.peer == peer and not m.complete]:
            self.unexpected.remove(m)
        if all_dead:
            for op in [op for op in self.posted if op.peer == ANY_SOURCE]:
                self.posted.remove(op)
                self.fail(op, None, "every peer's connection is closed")
        return failed

    def pending(self) -> list[_Op]:
        return list(self.posted) + [m.recv for m in self.unexpected if m.recv is not None]

    def clear(self) -> None:
        self.posted.clear()
        self.unexpected.clear()


def complete(done: list[_Done]) -> None:
    """Complete the futures of finished ops (outside the channel's lock)."""
    for op, error in done:
        if op.record is not None:
            if error is None:
                op.record.complete()
            else:
                op.record.retire()
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


class P2PChannel:
    """A group's p2p matching and the thread that moves its messages."""

    def __init__(self, mesh: Mesh, timeout_s: float, name: str = "") -> None:
        self.rank = mesh.rank
        self.world = mesh.world
        self.timeout_s = timeout_s
        # Called (outside the lock, once per failed link) with a link failure
        # that left work pending: the group breaks, as for a collective.
        self.on_failure: Callable[[EntrenarError], None] | None = None
        self.recorder: FlightRecorder | None = None  # the group's flight recorder, if on
        self._lock = threading.Lock()
        self._closing = False
        self._matching = Matching(self.rank)
        self._failures: list[EntrenarError] = []  # link failures to report, likewise
        self._loop: Links = mesh.p2p_links()
        self._causes = mesh.causes
        self._links: dict[int, _Link] = {}
        for peer, sock in self._loop.sockets.items():
            link = _Link(peer, LinkState(peer, sock, [], 0), LinkState(peer, sock, [], 0))
            self._expect_header(link)
            self._links[peer] = link
        self._fd_link = {link.out.sock.fileno(): link for link in self._links.values()}
        self._thread = threading.Thread(
            target=self._run, name=f"entrenar-p2p-r{self.rank}-{name or 'pg'}", daemon=True
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
        op = _new_op(self.rank, self.timeout_s, dst, tag, tensor, host, what, is_recv=False)
        if self.recorder is not None:
            op.record = self.recorder.p2p(False, dst, tensor, self.timeout_s)
        if _profiler._is_profiler_enabled:  # one attribute test when no profiler runs
            event_until(op.future, p2p_name(False, self.rank, dst), tensor, op.nbytes, tag)
        with self._lock:
            if dst == self.rank:
                self._matching.deliver_local(op)
            else:
                link = self._links[dst]
                if self._closing or link.dead is not None:
                    self._matching.fail(op, link.dead, "the group was destroyed")
                else:
                    header = p2p_header(link.sent_index, host.dtype, op.nbytes, tag)
                    link.sent_index += 1
                    if not link.busy():
                        link.last_progress = time.monotonic()
                    sent = partial(self._sent, link, op)  # runs when the last byte left
                    if op.nbytes:
                        link.out.push(Send(memoryview(header.pack())))
                        link.out.push(Send(bytes_of(host), None, sent))
                    else:
                        link.out.push(Send(memoryview(header.pack()), None, sent))
                    link.sending.append(op)
            done = self._matching.take_done()
        complete(done)
        self._loop.wake()
        return op.work

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> P2PWork:
        """Post a recv from ``src`` (ANY_SOURCE: from whichever rank's message matches first)."""
        who = "any rank" if src == ANY_SOURCE else f"rank {src}"
        what = f"recv from {who} (tag {tag})"
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            host = tensor.detach().reshape(-1)
        else:
            host = torch.empty(tensor.numel(), dtype=tensor.dtype)
        op = _new_op(self.rank, self.timeout_s, src, tag, tensor, host, what, is_recv=True)
        if self.recorder is not None:
            op.record = self.recorder.p2p(True, src, tensor, self.timeout_s)
        if _profiler._is_profiler_enabled:  # one attribute test when no profiler runs
            event_until(op.future, p2p_name(True, self.rank, src), tensor, op.nbytes, tag)
        matching = self._matching
        with self._lock:
            if matching.post(op):
                pass
            elif self._closing:
                matching.fail(op, None, "the group was destroyed")
            elif src != ANY_SOURCE and src != self.rank and self._links[src].dead is not None:
                matching.fail(op, self._links[src].dead, "")
            elif (
                src == ANY_SOURCE
                and self._links
                and all(ln.dead is not None for ln in self._links.values())
            ):
                matching.fail(op, None, "every peer's connection is closed")
            else:
                matching.posted.append(op)
            done = matching.take_done()
        complete(done)
        self._loop.wake()  # the loop recomputes its next deadline
        return op.work

    def close(self) -> None:
        """Stop the thread and fail what is pending (the transport owns the sockets)."""
        self._stop(None, join_s=5.0)

    def abort(self, error: EntrenarError) -> None:
        """The group failed with ``error``: fail everything pending with it, stop.

        A break hook, so it runs inside ``abort()``: the join is short (the
        thread wakes at once; only a completion callback of the caller's can
        keep it), and pending ops fail here either way."""
        self._stop(error, join_s=ABORT_JOIN_S)

    def _stop(self, error: EntrenarError | None, join_s: float) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._loop.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(join_s)
        matching = self._matching
        with self._lock:
            for op in self._pending_ops():
                if error is None:
                    matching.fail(op, None, "the process group was destroyed")
                else:
                    matching.fail(op, error, "")
            matching.clear()
            for link in self._links.values():
                link.sending.clear()
                link.incoming = None
            done = matching.take_done()
        complete(done)
        self._loop.close()

    def _pending_ops(self) -> list[_Op]:
        ops = self._matching.pending()
        for link in self._links.values():
            ops += link.sending
            if link.incoming is not None and link.incoming.recv is not None:
                ops.append(link.incoming.recv)
        return ops

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing:
                        return
                    want = {
                        fd: select.POLLIN | (0 if link.out.idle() else select.POLLOUT)
                        for fd, link in self._fd_link.items()
                        if link.dead is None
                    }
                    wait_s = self._next_deadline() - time.monotonic()
                events = self._loop.sleep(want, wait_s + 0.001)
                with self._lock:
                    if self._closing:
                        return
                    for fd, ev in events:
                        link = self._fd_link.get(fd)
                        if link is None or link.dead is not None:
                            continue  # the wake-up (drained by sleep), or a link given up
                        if ev & (select.POLLIN | POLLHANG):
                            self._pump(link, receiving=True)
                        if ev & select.POLLOUT and link.dead is None:
                            self._pump(link, receiving=False)
                    for link in self._links.values():
                        if not link.out.idle() and link.dead is None:
                            self._pump(link, receiving=False)  # new sends: try at once
                    self._expire()
                    done = self._matching.take_done()
                    failures, self._failures = self._failures, []
                # The group breaks before the failed ops complete: whoever
                # wakes from their wait finds errored() set already.
                for error in failures:
                    if self.on_failure is not None:
                        self.on_failure(error)
                complete(done)
        except BaseException as e:  # keep the process alive; fail what is pending
            log.exception("rank %d: p2p thread failed", self.rank)
            error = PeerConnectionError(f"rank {self.rank}: the p2p thread failed: {e!r}")
            with self._lock:
                for op in self._pending_ops():
                    self._matching.fail(op, error, "")
                self._matching.clear()
                for link in self._links.values():
                    link.sending.clear()
                    link.dead = link.dead or error
                self._closing = True
                done = self._matching.take_done()
            complete(done)

    def _pump(self, link: _Link, *, receiving: bool) -> None:
        """Move what one stream of ``link`` can; a failure gives the link up."""
        try:
            if receiving:
                moved = self._loop.pump_recv(link.inc, link.what)
            else:
                moved = self._loop.pump_send(link.out, link.what)
        except EntrenarError as e:
            self._link_down(link, e)
            return
        if moved:
            link.last_progress = time.monotonic()
        for st in (link.inc, link.out):
            if st.index >= _TRIM_AT:
                st.trim()

    def _next_deadline(self) -> float:
        """The earliest time a posted recv or a busy link times out."""
        deadlines = [op.deadline for op in self._matching.posted]
        deadlines += [
            ln.last_progress + self.timeout_s
            for ln in self._links.values()
            if ln.busy() and ln.dead is None
        ]
        return min(deadlines) if deadlines else time.monotonic() + 3600.0

    def _expire(self) -> None:
        """The one timeout rule: a recv nobody sent to, or a link on which
        nothing moved, for the timeout."""
        now = time.monotonic()
        self._matching.expire(now, self.timeout_s)
        for link in self._links.values():
            if link.dead is None and link.busy() and link.last_progress + self.timeout_s <= now:
                recv_from = [link.peer] if link.incoming is not None or link.inc.offset else []
                send_to = [link.peer] if not link.out.idle() else []
                self._link_down(
                    link, self._causes.stalled(link.what, recv_from, send_to, self.timeout_s)
                )

    def _link_down(self, link: _Link, error: EntrenarError) -> None:
        """Give up on a link: fail everything pending with its peer, with ``error``."""
        if link.dead is not None:
            return
        link.dead = _failure_class(error)(str(error), culprit=error.culprit)
        affected = list(link.sending)
        if link.incoming is not None and link.incoming.recv is not None:
            affected.append(link.incoming.recv)
        for op in affected:
            self._matching.fail(op, link.dead, "")
        link.sending.clear()
        link.incoming = None
        self._loop.forget(link.out.sock.fileno())
        all_dead = all(ln.dead is not None for ln in self._links.values())
        affected += self._matching.drop_peer(link.peer, link.dead, all_dead)
        # A peer that finished and destroyed its group closes its links: normal.
        log.log(
            logging.WARNING if affected else logging.DEBUG,
            "rank %d: p2p link to rank %d down: %s",
            self.rank,
            link.peer,
            error,
        )
        if affected and not self._closing:
            self._failures.append(link.dead)

    # ------------------------------------------------------------ stream callbacks

    def _expect_header(self, link: _Link) -> None:
        link.inc.push(Recv(memoryview(link.header), partial(self._header_in, link)))

    def _sent(self, link: _Link, op: _Op) -> None:
        """A send's last byte left: its Work completes."""
        if link.sending and link.sending[0] is op:
            link.sending.pop(0)
        self._matching.done.append((op, None))

    def _header_in(self, link: _Link) -> None:
        try:
            header = Header.unpack(bytes(link.header))
        except ValueError as e:
            raise PeerConnectionError(
                f"rank {self.rank}: {link.what}: garbage from rank {link.peer} where a "
                f"message header was due ({e}): the stream is corrupt",
                culprit=link.peer,
            ) from None
        if header.op is not OpCode.SEND or header.seq != link.recv_index:
            raise PeerConnectionError(
                f"rank {self.rank}: {link.what}: rank {link.peer} sent {header.describe()} "
                f"where p2p message #{link.recv_index} was due: the stream is corrupt",
                culprit=link.peer,
            )
        link.recv_index += 1
        msg = self._matching.arrive(link.peer, header)
        link.incoming = msg
        link.inc.push(Recv(msg.view, partial(self._payload_in, link, msg)))

    def _payload_in(self, link: _Link, msg: _Msg) -> None:
        link.incoming = None
        self._matching.arrived(msg)
        self._expect_header(link)


def _op_error(rank: int, op: _Op, cause: EntrenarError) -> EntrenarError:
    """``op`` fails because its link (or the group) failed with ``cause``: same class
    and culprit, this op named."""
    return _failure_class(cause)(
        f"rank {rank}: p2p {op.what} failed: {cause}", culprit=cause.culprit
    )


def _failure_class(cause: EntrenarError) -> type[EntrenarError]:
    """A p2p op's error class for ``cause``: its own, except that a bare
    EntrenarError (a peer's or this group's abort()) reads as a lost peer."""
    return PeerConnectionError if type(cause) is EntrenarError else type(cause)


def _new_op(
    rank: int,
    timeout_s: float,
    peer: int,
    tag: int,
    user: torch.Tensor,
    host: torch.Tensor,
    what: str,
    *,
    is_recv: bool,
) -> _Op:
    """A posted send or recv with its future (CUDA: stream-synchronizing) and Work."""
    fut: torch.futures.Future[list[torch.Tensor]] = (
        torch.futures.Future(devices=[user.device]) if user.is_cuda else torch.futures.Future()
    )
    work = P2PWork(fut, what, rank, peer if peer != ANY_SOURCE else -1)
    return _Op(peer, tag, user, host, fut, work, time.monotonic() + timeout_s, what, is_recv)

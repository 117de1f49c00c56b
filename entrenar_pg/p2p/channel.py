"""The p2p channel: one thread that moves a group's point-to-point messages.

Collectives run in issue order on the group's comm thread; p2p cannot: a recv
may wait for a send that its peer issues only after some collective, and
pipeline schedules post sends and recvs in orders that differ from rank to
rank. So p2p has its own channel of the group's transport (one p2p socket per
pair, set up with the others) and one thread that drives it with the
transport's progress loop (``transport.loop``): the same pumps, the same
sleep, the same errno classifier and the same naming of causes as the
collectives. Which recv a message is for is ``matching.Matching``'s
decision; this module does the I/O around it:

- a send is queued on its peer's stream as a framed message (a
  ``wire.p2p_header`` carrying the tag and byte count, then the payload). Its
  Work completes once the kernel has taken the last byte: a send never waits
  for the matching recv (up to the socket buffers and the receiver's
  buffering), so ``send; recv`` on both ends never deadlocks;
- every link is read all the time; each header is handed to the matching,
  whose answer says where the payload goes (a recv's tensor, or a buffer);
- a send to this rank itself is matched locally (torch allows ``isend`` /
  ``irecv`` to self);
- tensors are staged by ``runtime.staging`` as collectives' are: a CUDA
  send's device -> host copy runs on the group's p2p stream after the
  caller's stream (the producer) is done; a recv's host -> device copy runs
  on that stream, and its future (``devices=[device]``) completes with that
  stream current.

Failures: a link that fails while something is pending on it (the peer
aborted, left or died; the link broke; nothing moved for the timeout) fails
every pending op with it, naming the culprit as a collective would, and
breaks the group (``on_failure``). A recv not matched within the timeout
fails alone (the link is fine); a recv whose size differs from the matched
send's fails with CollectiveMismatchError alone (the message is drained, the
link stays in step). A peer that leaves with nothing pending is normal.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
from torch.autograd import profiler as _profiler

from ..call.work import P2PWork
from ..config import ABORT_JOIN_S, GroupTimeout
from ..errors import EntrenarError, PeerConnectionError, group_destroyed
from ..flight_recorder import Entry, FlightRecorder, p2p_name
from ..profiling import event_until
from ..transport.loop import POLLHANG, Links, LinkState
from ..transport.mesh import Mesh
from ..transport.plan import Recv, Send, bytes_of
from ..wire import HEADER_BYTES, Header, OpCode, p2p_header
from .matching import (
    ANY_SOURCE,
    Discarded,
    Failed,
    IntoRecv,
    Matching,
    Message,
    PostedRecv,
    failure_class,
    op_error,
)


class StagedTensor(Protocol):
    """One staged tensor (``runtime.staging.Staged``): the user's and its host copy."""

    user: torch.Tensor
    host: torch.Tensor | None


class Staging(Protocol):
    """What an op needs of its staging. The runtime (which builds this channel, a
    floor up) owns ``runtime.staging`` and hands each op one (``Runtime.p2p_staging``)."""

    def add(
        self, tensors: Sequence[torch.Tensor], *, read: bool, write: bool
    ) -> Sequence[StagedTensor]: ...
    def load(self) -> None: ...
    def store(self) -> None: ...
    def new_future(self) -> torch.futures.Future[Any]: ...
    def completion_context(
        self,
    ) -> Callable[[], contextlib.AbstractContextManager[Any]] | None: ...


log = logging.getLogger(__name__)

_TRIM_AT = 64  # moved pieces kept on a stream before its list is trimmed


@dataclass(eq=False)
class _Op:
    """A send or recv: the user's tensor staged (``item.host`` is the flat host
    tensor on the wire), its future and Work."""

    peer: int  # destination (send), source or ANY_SOURCE (recv)
    tag: int
    staging: Staging
    item: StagedTensor
    future: torch.futures.Future
    work: P2PWork
    what: str
    is_recv: bool
    record: Entry | None = None  # its flight-recorder entry, when the group records

    @property
    def host(self) -> torch.Tensor:
        assert self.item.host is not None, "internal: p2p op not staged"
        return self.item.host

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


@dataclass(eq=False)
class _Link:
    """Per-peer state: the two streams the loop moves, and where reading stands."""

    peer: int
    out: LinkState  # header, payload, header, payload, ... of queued sends
    inc: LinkState  # header, then the payload it announces, then the next header
    header: bytearray = field(default_factory=lambda: bytearray(HEADER_BYTES))
    sending: list[_Op] = field(default_factory=list)  # sends on ``out``, oldest first
    incoming: Message | None = None  # the message whose payload is being received
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


def complete(done: list[_Done]) -> None:
    """Complete the futures of finished ops (outside the channel's lock): a
    recv's data goes back into the user's tensor first (``Staging.store``),
    and the future completes in the staging's completion context (CUDA: the
    p2p stream current, so its event follows the copy)."""
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
            if op.is_recv:
                op.staging.store()
        except BaseException as e:  # a failed copy-back fails the recv, not the thread
            op.future.set_exception(e)
            continue
        context = op.staging.completion_context()
        if context is None:
            op.future.set_result([op.item.user])
        else:
            with context():
                op.future.set_result([op.item.user])


class P2PChannel:
    """A group's p2p messages: the matching, and the thread that moves them.

    ``staging(device)`` gives each op its ``Staging`` (the runtime's
    ``p2p_staging``: on CUDA, buffers of the op's own and the group's p2p
    stream).
    """

    def __init__(
        self,
        mesh: Mesh,
        timeout: GroupTimeout,
        staging: Callable[[torch.device], Staging],
        name: str = "",
    ) -> None:
        self.rank = mesh.rank
        self.world = mesh.world
        self.timeout = timeout  # the group's, shared with the runtime (set_timeout)
        self.staging = staging
        # Called (outside the lock, once per failed link) with a link failure
        # that left work pending: the group breaks, as for a collective.
        self.on_failure: Callable[[EntrenarError], None] | None = None
        self.recorder: FlightRecorder | None = None  # the group's flight recorder, if on
        self._lock = threading.Lock()
        # Why the channel stopped (close(): the group was destroyed; abort():
        # the group's failure; the thread's own failure); None while it runs.
        self._stopped_by: EntrenarError | None = None
        self._matching = Matching(self.rank)
        self._recvs: dict[int, _Op] = {}  # the recvs the matching knows, by PostedRecv.id
        self._buffers: dict[int, torch.Tensor] = {}  # message payloads, by Message.id
        self._next_recv = 0
        self._done: list[_Done] = []  # finished ops, completed outside the lock
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
        # CUDA: the p2p stream waits for the caller's stream, copies to host,
        # and this thread waits for that copy (the bytes must be final before
        # they are queued).
        op = self._new_op(tensor, dst, tag, f"send to rank {dst} (tag {tag})", is_recv=False)
        with self._lock:
            if dst == self.rank:
                self._deliver_local(op)
            else:
                link = self._links[dst]
                cause = link.dead or self._stopped_by
                if cause is not None:
                    self._done.append((op, op_error(self.rank, op.what, cause)))
                else:
                    self._queue(link, op)
            done, self._done = self._done, []
        complete(done)
        self._loop.wake()
        return op.work

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> P2PWork:
        """Post a recv from ``src`` (ANY_SOURCE: from whichever rank's message matches first)."""
        who = "any rank" if src == ANY_SOURCE else f"rank {src}"
        op = self._new_op(tensor, src, tag, f"recv from {who} (tag {tag})", is_recv=True)
        with self._lock:
            recv = PostedRecv(
                self._next_recv,
                src,
                tag,
                op.nbytes,
                op.host.dtype,
                time.monotonic() + self.timeout.seconds,
                op.what,
            )
            self._next_recv += 1
            gone = self._cannot_arrive(src)
            if gone is not None and not self._matching.has_message_for(recv):
                self._done.append((op, op_error(self.rank, op.what, *gone)))
            else:
                self._recvs[recv.id] = op
                self._matching.post(recv)
                self._settle()
            done, self._done = self._done, []
        complete(done)
        self._loop.wake()  # the loop recomputes its next deadline
        return op.work

    def close(self) -> None:
        """Stop the thread and fail what is pending (the transport owns the sockets)."""
        self._stop(group_destroyed(self.rank, "p2p"), join_s=5.0)

    def abort(self, error: EntrenarError) -> None:
        """The group failed with ``error``: fail everything pending with it, stop.

        A break hook, so it runs inside ``abort()``: the join is short (the
        thread wakes at once; only a completion callback of the caller's can
        keep it), and pending ops fail here either way."""
        self._stop(error, join_s=ABORT_JOIN_S)

    def _new_op(
        self, tensor: torch.Tensor, peer: int, tag: int, what: str, *, is_recv: bool
    ) -> _Op:
        """Stage ``tensor`` (read by a send, written by a recv) and make its op and Work."""
        staging = self.staging(tensor.device)
        (item,) = staging.add([tensor], read=not is_recv, write=is_recv)
        staging.load()
        fut = staging.new_future()  # devices=[device] on CUDA: stream-synchronizing
        seen = fut  # the caller's; under a profiler, complete once the event ended
        if _profiler._is_profiler_enabled:  # one attribute test when no profiler runs
            name = p2p_name(is_recv, self.rank, peer)
            seen = event_until(fut, name, tensor, tensor.numel() * tensor.element_size(), tag)
        work = P2PWork(seen, what, self.rank, peer if peer != ANY_SOURCE else -1)
        op = _Op(peer, tag, staging, item, fut, work, what, is_recv)
        if self.recorder is not None:
            op.record = self.recorder.p2p(is_recv, peer, tensor, self.timeout.seconds)
        return op

    def _cannot_arrive(self, src: int) -> tuple[EntrenarError | None, str] | None:
        """Why no message from ``src`` can arrive any more, as ``op_error``'s
        (cause, why); None: one can."""
        if self._stopped_by is not None:
            return self._stopped_by, ""
        if src == ANY_SOURCE:
            if self._links and all(ln.dead is not None for ln in self._links.values()):
                return None, "every peer's connection is closed"
        elif src != self.rank and self._links[src].dead is not None:
            return self._links[src].dead, ""
        return None

    def _queue(self, link: _Link, op: _Op) -> None:
        """Queue ``op``'s message on ``link``: header, then payload."""
        header = p2p_header(link.sent_index, op.host.dtype, op.nbytes, op.tag)
        link.sent_index += 1
        if not link.busy():
            link.last_progress = time.monotonic()
        sent = partial(self._sent, link, op)  # runs when the last byte left
        if op.nbytes:
            link.out.push(Send(memoryview(header.pack())))
            link.out.push(Send(bytes_of(op.host), None, sent))
        else:
            link.out.push(Send(memoryview(header.pack()), None, sent))
        link.sending.append(op)

    def _deliver_local(self, op: _Op) -> None:
        """A send to this rank: the matching places it like an arriving message."""
        data = op.host.view(torch.uint8) if op.nbytes else torch.empty(0, dtype=torch.uint8)
        place = self._matching.arrive(self.rank, op.tag, op.nbytes, op.host.dtype)
        if isinstance(place, IntoRecv):
            if op.nbytes:
                self._recvs[place.recv.id].host.view(torch.uint8).copy_(data)
        else:
            self._buffers[place.msg.id] = data.clone()
        self._matching.arrived(place.msg)
        self._done.append((op, None))
        self._settle()

    def _settle(self) -> int:
        """Act on the matching's outcomes (under the lock): copy buffered
        payloads into their recvs, queue completions, drop buffers. Returns
        how many recvs failed."""
        failed = 0
        for outcome in self._matching.take():
            if isinstance(outcome, Discarded):
                self._buffers.pop(outcome.msg.id, None)
                continue
            op = self._recvs.pop(outcome.recv.id)
            if isinstance(outcome, Failed):
                self._done.append((op, outcome.error))
                failed += 1
                continue
            op.work.src = outcome.msg.peer
            if outcome.buffered:
                buf = self._buffers.pop(outcome.msg.id)
                if op.nbytes:
                    op.host.view(torch.uint8).copy_(buf)
            self._done.append((op, None))
        return failed

    def _stop(self, error: EntrenarError, join_s: float) -> None:
        with self._lock:
            if self._stopped_by is not None:
                return
            self._stopped_by = error
        self._loop.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(join_s)
        with self._lock:
            self._fail_all(error, "")
            done, self._done = self._done, []
        complete(done)
        self._loop.close()

    def _fail_all(self, error: EntrenarError | None, why: str) -> None:
        """Fail every pending op (under the lock)."""
        for link in self._links.values():
            for op in link.sending:
                self._done.append((op, op_error(self.rank, op.what, error, why)))
            link.sending.clear()
            link.incoming = None
        self._matching.close(error, why)
        self._settle()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopped_by is not None:
                        return
                    want = {
                        fd: select.POLLIN | (0 if link.out.idle() else select.POLLOUT)
                        for fd, link in self._fd_link.items()
                        if link.dead is None
                    }
                    wait_s = self._next_deadline() - time.monotonic()
                events = self._loop.sleep(want, wait_s + 0.001)
                with self._lock:
                    if self._stopped_by is not None:
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
                    self._settle()
                    done, self._done = self._done, []
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
                self._fail_all(error, "")
                for link in self._links.values():
                    link.dead = link.dead or error
                self._stopped_by = error
                done, self._done = self._done, []
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
        deadlines = [
            ln.last_progress + self.timeout.seconds
            for ln in self._links.values()
            if ln.busy() and ln.dead is None
        ]
        posted = self._matching.next_deadline()
        if posted is not None:
            deadlines.append(posted)
        return min(deadlines) if deadlines else time.monotonic() + 3600.0

    def _expire(self) -> None:
        """The one timeout rule: a recv nobody sent to, or a link on which
        nothing moved, for the timeout."""
        now = time.monotonic()
        timeout_s = self.timeout.seconds
        self._matching.expire(now, timeout_s)
        for link in self._links.values():
            if link.dead is None and link.busy() and link.last_progress + timeout_s <= now:
                recv_from = [link.peer] if link.incoming is not None or link.inc.offset else []
                send_to = [link.peer] if not link.out.idle() else []
                self._link_down(
                    link, self._causes.stalled(link.what, recv_from, send_to, timeout_s)
                )

    def _link_down(self, link: _Link, error: EntrenarError) -> None:
        """Give up on a link: fail everything pending with its peer, with ``error``."""
        if link.dead is not None:
            return
        link.dead = failure_class(error)(str(error), culprit=error.culprit)
        # Outcomes so far first, so the count below is this link's alone.
        self._settle()
        affected = len(link.sending)
        for op in link.sending:
            self._done.append((op, op_error(self.rank, op.what, link.dead)))
        link.sending.clear()
        link.incoming = None
        self._loop.forget(link.out.sock.fileno())
        self._matching.peer_down(link.peer, link.dead)
        affected += self._settle()
        if all(ln.dead is not None for ln in self._links.values()):
            self._matching.all_peers_down()  # not this link's ops: no group failure
            self._settle()
        # A peer that finished and destroyed its group closes its links: normal.
        log.log(
            logging.WARNING if affected else logging.DEBUG,
            "rank %d: p2p link to rank %d down: %s",
            self.rank,
            link.peer,
            error,
        )
        if affected and self._stopped_by is None:
            self._failures.append(link.dead)

    # ------------------------------------------------------------ stream callbacks

    def _expect_header(self, link: _Link) -> None:
        link.inc.push(Recv(memoryview(link.header), partial(self._header_in, link)))

    def _sent(self, link: _Link, op: _Op) -> None:
        """A send's last byte left: its Work completes."""
        if link.sending and link.sending[0] is op:
            link.sending.pop(0)
        self._done.append((op, None))

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
        place = self._matching.arrive(link.peer, header.aux, header.numel, header.dtype)
        if isinstance(place, IntoRecv):
            view = bytes_of(self._recvs[place.recv.id].host)
        else:
            buf = torch.empty(header.numel, dtype=torch.uint8)
            self._buffers[place.msg.id] = buf
            view = bytes_of(buf)
        link.incoming = place.msg
        link.inc.push(Recv(view, partial(self._payload_in, link, place.msg)))

    def _payload_in(self, link: _Link, msg: Message) -> None:
        link.incoming = None
        self._matching.arrived(msg)
        self._expect_header(link)

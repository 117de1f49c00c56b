"""The p2p channel: one thread that moves a group's point-to-point messages.

Collectives run in issue order on the group's comm thread; p2p cannot: a recv
may wait for a send that its peer issues only after some collective, and
pipeline schedules post sends and recvs in orders that differ from rank to
rank. So p2p has its own channel of the group's transport (one p2p socket per
pair, set up with the others) and one thread that drives it with the
transport's progress loop (``transport.loop``): the same pumps, the same
sleep, the same errno classifier and the same naming of causes as the
collectives. Which recv a message is for is ``matching.Matching``'s
decision, carried out by ``inbox.Inbox``; this module does the I/O around it:

- connections are made on first use, not at set-up (``connections.py``):
  the first send to a peer, or recv from it, opens this rank's connection
  to it; sends queue meanwhile. A recv opens one too: its hang-up is how a
  peer that dies before sending is noticed;

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

import logging
import select
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from ..call.work import P2PWork
from ..config import ABORT_JOIN_S, P2P_ENDING_GRACE_S, GroupTimeout
from ..errors import EntrenarError, PeerConnectionError, group_destroyed
from ..flight_recorder import FlightRecorder
from ..transport.loop import POLLHANG, Links
from ..transport.mesh import Mesh
from .connections import Connections
from .inbox import Inbox
from .link import PeerLink
from .matching import ANY_SOURCE, failure_class, op_error
from .ops import Done, Op, Staging, complete, new_op

log = logging.getLogger(__name__)


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
        self._inbox = Inbox(self.rank)
        self._done: list[Done] = []  # finished ops, completed outside the lock
        self._failures: list[EntrenarError] = []  # link failures to report, likewise
        self._loop: Links = mesh.p2p_links()
        self._mesh = mesh
        self._causes = mesh.causes
        self._conns = Connections(mesh, self._loop, timeout, self._lock, self._stopped)
        # Every peer's link, without connections until first use.
        self._links: dict[int, PeerLink] = {}
        for peer in range(self.world):
            if peer != self.rank:
                link = PeerLink.unconnected(peer)
                self._inbox.expect_header(link)
                self._links[peer] = link
                self._conns.register(link)
        self._thread = threading.Thread(
            target=self._run, name=f"entrenar-p2p-r{self.rank}-{name or 'pg'}", daemon=True
        )
        self._thread.start()
        mesh.serve_p2p(self._conns.opened)

    # ------------------------------------------------------------ caller side

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> P2PWork:
        # CUDA: the p2p stream waits for the caller's stream, copies to host,
        # and this thread waits for that copy (the bytes must be final before
        # they are queued).
        op = self._new_op(tensor, dst, tag, f"send to rank {dst} (tag {tag})", is_recv=False)
        with self._lock:
            if dst == self.rank:
                self._inbox.deliver_local(op, self._done)
            else:
                link = self._links[dst]
                cause = link.dead or self._stopped_by
                if cause is not None:
                    self._done.append((op, op_error(self.rank, op.what, cause)))
                else:
                    link.queue(op, partial(self._sent, link, op))
                    self._conns.reach(link)
            done, self._done = self._done, []
        complete(done)
        self._loop.wake()
        return op.work

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> P2PWork:
        """Post a recv from ``src`` (ANY_SOURCE: from whichever rank's message matches first)."""
        who = "any rank" if src == ANY_SOURCE else f"rank {src}"
        op = self._new_op(tensor, src, tag, f"recv from {who} (tag {tag})", is_recv=True)
        with self._lock:
            recv = self._inbox.new_recv(op, src, time.monotonic() + self.timeout.seconds)
            gone = self._cannot_arrive(src)
            if gone is not None and not self._inbox.matching.has_message_for(recv):
                self._done.append((op, op_error(self.rank, op.what, *gone)))
            else:
                self._inbox.post(recv, op, self._done)
                if src not in (ANY_SOURCE, self.rank):
                    self._conns.reach(self._links[src])
            done, self._done = self._done, []
        complete(done)
        self._loop.wake()  # the loop recomputes its next deadline
        return op.work

    def _stopped(self) -> bool:
        return self._stopped_by is not None

    def close(self) -> None:
        """Stop the thread and fail what is pending (the transport owns the sockets)."""
        self._stop(group_destroyed(self.rank, "p2p"), join_s=5.0)

    def abort(self, error: EntrenarError) -> None:
        """The group failed with ``error``: fail everything pending with it, stop.

        A break hook, so it runs inside ``abort()``: the join is short (the
        thread wakes at once; only a completion callback of the caller's can
        keep it), and pending ops fail here either way."""
        self._stop(error, join_s=ABORT_JOIN_S)

    def _new_op(self, tensor: torch.Tensor, peer: int, tag: int, what: str, *, is_recv: bool) -> Op:
        staging = self.staging(tensor.device)
        return new_op(
            staging,
            tensor,
            self.rank,
            peer,
            tag,
            what,
            is_recv=is_recv,
            recorder=self.recorder,
            timeout_s=self.timeout.seconds,
        )

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
            for op in link.drop_pending():
                self._done.append((op, op_error(self.rank, op.what, error, why)))
        self._inbox.matching.close(error, why)
        self._inbox.settle(self._done)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopped_by is not None:
                        return
                    self._conns.watch()
                    for link, error, breaks in self._conns.take_unreached():
                        self._link_down(link, error, breaks_group=breaks)
                    want = self._conns.poll_mask()
                    wait_s = self._next_deadline() - time.monotonic()
                    if self._done or self._failures:
                        wait_s = 0.0  # (a failed connect's ops: complete them now)
                events = self._loop.sleep(want, wait_s + 0.001)
                with self._lock:
                    if self._stopped_by is not None:
                        return
                    self._conns.watch()  # (new sends' connections: pumped below)
                    for fd, ev in events:
                        role = self._conns.role(fd)
                        if role is None:
                            continue  # the wake-up (drained by sleep), or a link given up
                        link, own = role
                        if own:
                            if ev & (select.POLLIN | POLLHANG):
                                self._out_event(link)
                            if ev & select.POLLOUT and link.dead is None:
                                self._pump(link, receiving=False)
                        elif ev & (select.POLLIN | POLLHANG):
                            self._pump(link, receiving=True)
                    for link in self._conns.active:
                        if not link.out.idle() and link.dead is None:
                            self._pump(link, receiving=False)  # new sends: try at once
                    self._expire()
                    self._inbox.settle(self._done)
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

    def _pump(self, link: PeerLink, *, receiving: bool) -> None:
        """Move what one stream of ``link`` can; a failure gives the link up."""
        try:
            link.pump(self._loop, receiving=receiving)
        except EntrenarError as e:
            self._link_down(link, e)

    def _out_event(self, link: PeerLink) -> None:
        """This rank's own connection is readable: the peer hung up (or wrote garbage)."""
        error = link.out_ended(self._causes)
        if error is None:
            return
        if not link.in_open:
            # The peer's own connection may still be on its way (its
            # handshake done, the acceptor thread not yet through
            # ``Connections.opened``): what it sent before closing would be
            # lost. Wait for it up to ``P2P_ENDING_GRACE_S`` (``_expire``); the closed
            # socket leaves the poll meanwhile (it would read as ready forever),
            # and comes back with the peer's connection (``Connections.watch``).
            if link.ending is None:
                link.ending = (error, time.monotonic() + P2P_ENDING_GRACE_S)
                self._conns.forget(link)
            return
        # What the peer sent before it closed may be waiting, unread, on its
        # own connection (both hang-ups and the data can come in one poll,
        # this one first): take it, so its recvs complete.
        self._pump(link, receiving=True)
        self._link_down(link, error)

    def _next_deadline(self) -> float:
        """The earliest time a posted recv or a busy link times out."""
        deadlines = [
            ln.last_progress + self.timeout.seconds
            for ln in self._conns.active
            if ln.busy() and ln.dead is None
        ]
        posted = self._inbox.matching.next_deadline()
        if posted is not None:
            deadlines.append(posted)
        deadlines += [ln.ending[1] for ln in self._links.values() if ln.ending and not ln.dead]
        return min(deadlines) if deadlines else time.monotonic() + 3600.0

    def _expire(self) -> None:
        """The one timeout rule: a recv nobody sent to, or a link on which
        nothing moved, for the timeout."""
        now = time.monotonic()
        timeout_s = self.timeout.seconds
        self._inbox.matching.expire(now, timeout_s)
        for link in self._conns.active:
            error = link.stall(now, timeout_s, self._causes)
            if error is not None:
                self._link_down(link, error)
        for link in self._links.values():
            if link.ending is not None and link.dead is None and now >= link.ending[1]:
                self._link_down(link, link.ending[0])  # the peer's connection never came

    def _link_down(self, link: PeerLink, error: EntrenarError, breaks_group: bool = True) -> None:
        """Give up on a link: fail everything pending with its peer, with
        ``error``; the group breaks too if anything was pending and
        ``breaks_group``."""
        if link.dead is not None:
            return
        link.dead = failure_class(error)(str(error), culprit=error.culprit)
        # Outcomes so far first, so the count below is this link's alone.
        self._inbox.settle(self._done)
        dropped = link.drop_pending()
        for op in dropped:
            self._done.append((op, op_error(self.rank, op.what, link.dead)))
        affected = len(dropped)
        self._conns.forget(link)
        self._inbox.matching.peer_down(link.peer, link.dead)
        affected += self._inbox.settle(self._done)
        if all(ln.dead is not None for ln in self._links.values()):
            self._inbox.matching.all_peers_down()  # not this link's ops: no group failure
            self._inbox.settle(self._done)
        # A peer that finished and destroyed its group closes its links: normal.
        log.log(
            logging.WARNING if affected else logging.DEBUG,
            "rank %d: p2p link to rank %d down: %s",
            self.rank,
            link.peer,
            error,
        )
        if affected and breaks_group and self._stopped_by is None:
            self._failures.append(link.dead)

    def _sent(self, link: PeerLink, op: Op) -> None:
        """A send's last byte left: its Work completes."""
        link.sent(op)
        self._done.append((op, None))

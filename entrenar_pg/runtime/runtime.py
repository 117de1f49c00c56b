"""The runtime of one process group: a request in, a Work out, the job run in issue order.

``Runtime`` owns what the group's collectives run on: the collective mesh,
the p2p channel, the ``GroupState``, the engine (FIFO and executor token),
the scratch and pinned-buffer pools and the per-device comm streams.
``submit(request, opts)`` is the one path every collective takes: stage the
request's tensors, take the next sequence number and create the job under
one lock (so seq order = issue order), decide where it runs, and return an
``EntrenarWork``. When the job runs, ``run`` builds the call's
``JobContext`` (``runtime/context.py``: its seq, its pace, what it runs on),
loads the staged tensors, hands both to the request kind's job
(``runtime/jobs.py``), stores the results, and the engine completes the
future.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any, NamedTuple

import torch
from torch.autograd import profiler as _profiler

from .. import config, flight_recorder
from ..call.requests import Request, custom
from ..call.work import EntrenarWork
from ..collectives import ScratchPool, op_name
from ..config import GroupTimeout, Options, timeout_seconds
from ..errors import EntrenarError
from ..flight_recorder import PROFILING_NAMES, FlightRecorder
from ..p2p import P2PChannel
from ..profiling import event_until
from ..transport import Mesh
from ..wire import OpCode
from .context import Choices, JobContext
from .engine import Engine, Job
from .jobs import JOBS
from .staging import PinnedPool, Staged, Staging, new_comm_stream
from .state import GroupState, Phase

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_UNSET = timedelta(0)  # torch's unset per-call timeout is -1 ms; 0 means unset too


def profile_call(future: torch.futures.Future, seq: int, req: Request) -> torch.futures.Future:
    """Collective ``seq``'s profiler event (``entrenar:all_reduce``) until ``future`` completes.

    Its inputs are the call's tensors (their shapes and dtypes under
    ``record_shapes=True``), then the payload's bytes and the seq number (the
    chrome trace's "Concrete Inputs"; the seq is the flight recorder's too).
    """
    args: list[Any] = []
    for tensors, _read, _write in req.io:
        args += tensors
    return event_until(future, PROFILING_NAMES[req.op], *args, req.nbytes, seq)


class _Blocking(NamedTuple):
    """Call options of a job its caller waits for at once (torch's ``asyncOp=False``)."""

    asyncOp: bool = False  # noqa: N815 (torch's name)
    timeout: Any = None  # the group's


_BLOCKING = _Blocking()


class Runtime:
    """Where and when a group's collectives run; what they run on."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        options: Options,
        timeout: timedelta,
        name: str,
    ) -> None:
        self.rank = rank
        self.options = options
        self.state = GroupState(rank)
        # The no-progress bound of a collective or p2p call whose opts carry
        # no timeout of their own (set_timeout changes it for later calls);
        # the p2p channel reads this same object.
        self.timeout = GroupTimeout(timeout)
        self.seq = 0
        self.checker: Any | None = None  # the contract checker, if the group has one
        self._lock = threading.Lock()  # orders seq assignment with enqueueing
        self.scratch = ScratchPool()
        self.choices: Choices = {}  # the policy's answers (JobContext.call)
        self.pinned: PinnedPool | None = None
        self.cuda_streams: dict[int, Any] = {}  # the comm thread's, by device index
        self.p2p_streams: dict[int, Any] = {}  # the p2p channel's, likewise
        self._comm_spin_s = options.spin_us / 1e6
        self._caller_spin_s = options.caller_spin_us / 1e6
        self.mesh = Mesh(store, rank, size, options, timeout, name=name)
        # p2p has its own channel and thread: a recv must never block the collectives.
        self.p2p = P2PChannel(self.mesh, self.timeout, self.p2p_staging, name=name)
        self.p2p.on_failure = self._p2p_failed  # a p2p link failure breaks the group too
        # The break hooks, in order: pending p2p fails with the group's error
        # (before its sockets go), then the peers learn of the failure and a
        # job blocked on the network wakes.
        self.state.on_break(self.p2p.abort)
        self.state.on_break(self.mesh.abort)
        self.engine = Engine(self.state, f"r{rank}-{name or 'pg'}", options.spin_us)
        # The flight recorder (None when off: the hot path tests only that).
        self.recorder: FlightRecorder | None = None
        if options.fr_buffer_size > 0:
            self.recorder = FlightRecorder(
                options.fr_buffer_size, rank, size, name, options.dump_prefix()
            )
            self.p2p.recorder = self.recorder
            # Last: the peers hear of the failure before this rank writes its file.
            self.state.on_break(self._record_break)

    def _p2p_failed(self, error: EntrenarError) -> None:
        self.state.fail(error, "p2p")

    def _record_break(self, error: EntrenarError) -> None:
        """A break hook: the recorder keeps the failure; dump if asked to."""
        assert self.recorder is not None
        self.recorder.fail(error, self.state.failed_at)
        if self.options.fr_dump_on_timeout:
            path = flight_recorder.write()
            log.error("rank %d: flight recorder dumped to %s", self.rank, path)

    # ------------------------------------------------------------ issuing

    def staging(self, device: torch.device) -> Staging:
        """The staging of one call's tensors on ``device`` (CUDA: pinned buffers, comm stream)."""
        if device == _CPU or device.type != "cuda":  # the first test spares a str per call
            return Staging(device, None, None)
        if self.pinned is None:
            self.pinned = PinnedPool()
        index, stream = _stream_of(self.cuda_streams, device)
        return Staging(torch.device("cuda", index), self.pinned, stream)

    def p2p_staging(self, device: torch.device) -> Staging:
        """The staging of one p2p op's tensor (CUDA: buffers of its own, the p2p stream)."""
        if device == _CPU or device.type != "cuda":
            return Staging(device, None, None)
        index, stream = _stream_of(self.p2p_streams, device)
        return Staging(torch.device("cuda", index), None, stream)

    def submit_check(self, run: Callable[[Any], None]) -> EntrenarWork:
        """The contract checker's job ``run(call)`` (op CHECK, the next seq), blocking.

        It runs in issue order with the group's collectives on every rank, so
        ``run`` may exchange data through ``call`` and raise a verdict (which
        breaks the group like a failed collective). Its caller waits at once,
        so it runs in the caller's thread when the group is idle.
        """
        return self.submit(custom(OpCode.CHECK, run), _BLOCKING)

    def mark_issue(self, marks: deque[tuple[int, Any]], value: Any) -> None:
        """Append ``(seq, value)`` to ``marks``, ``seq`` the last issued job's, while no
        job can be issued: every job issued before has a seq <= it, every later
        one more. The checker marks an optimizer step so, in issue order, with
        no job of its own (its jobs read the marks)."""
        with self._lock:
            marks.append((self.seq, value))

    def submit(self, req: Request, opts: Any = None) -> EntrenarWork:
        """Run ``req`` as the group's next job; return a Work completing with ``req.result``.

        Where the job runs: a blocking call (torch's ``async_op=False`` sets
        ``opts.asyncOp = False``; the caller waits on the Work at once) on CPU
        tensors runs in the caller's thread when the group has nothing queued
        or running, sparing the two thread wake-ups (~50-100 us each here) a
        hand-off costs; so does an async call of at most ``inline_max_bytes``.
        Everything else (async calls, CUDA staging, a busy group) goes to the
        comm thread's FIFO. Either way jobs run one at a time in issue order.
        """
        staging = self.staging(req.device)
        staged = []
        for tensors, read, write in req.io:  # a loop: a comprehension is a call (3.11)
            staged.append(staging.add(tensors, read=read, write=write))
        fut = staging.new_future()  # devices=[device] on CUDA: stream-synchronizing
        name = op_name(req.op)
        engine = self.engine
        blocking = opts is not None and getattr(opts, "asyncOp", True) is False
        timeout_s = self.timeout.seconds
        if opts is not None:
            # torch's per-call timeout; its default (kUnsetTimeout, -1 ms)
            # means the group's, as it does for gloo.
            per_call = getattr(opts, "timeout", None)
            if per_call is not None and per_call > _UNSET:
                timeout_s = timeout_seconds(per_call)
        nbytes = req.nbytes
        with self._lock:  # seq order == queue order
            self.seq += 1
            seq = self.seq
            # Under a profiler the caller's future is the one that completes
            # after the event ended (profiling.event_until); opened in the
            # caller's thread, before the job can run.
            seen = profile_call(fut, seq, req) if _profiler._is_profiler_enabled else fut
            work = EntrenarWork(seen, name, self.rank, seq)
            job = Job(
                seq,
                name,
                nbytes,
                partial(self.run, seq, staging, req, staged, timeout_s),
                fut,
                staging.completion_context(),
                work,
            )
            if self.recorder is not None:
                job.record = self.recorder.collective(seq, req.op, req.io, timeout_s)
            inline = (
                (blocking or nbytes <= self.options.inline_max_bytes)
                and not staging.is_cuda
                and engine.try_claim()
            )
            if not inline:
                engine.submit(job)
        if inline:
            engine.run_claimed(job)
        elif engine.holds_token():
            engine.drain_until(job)  # issued from a future callback: see drain_until
        else:
            # Let the comm thread start now. It was just woken, but when every
            # core is busy computing (a DDP backward on each rank) the
            # scheduler may leave it waiting for our time slice to end:
            # measured here, the hand-off's 90th percentile fell from 2.5-3.7 ms
            # to 0.2-0.7 ms with this yield. It costs one syscall.
            os.sched_yield()
        return work

    # ------------------------------------------------------------ running

    def run(
        self,
        seq: int,
        staging: Staging,
        req: Request,
        staged: list[list[Staged]],
        timeout_s: float,
    ) -> Any:
        """A job's work, in whichever thread holds the engine's token."""
        mesh = self.mesh
        ctx = JobContext(
            mesh,
            self.rank,
            mesh.world,
            seq,
            self.scratch,
            # The comm thread may share its core with a caller that computes;
            # a caller's thread waits anyway: each has its own spin.
            self._comm_spin_s if self.engine.in_comm_thread() else self._caller_spin_s,
            timeout_s,  # the call's own timeout, or the group's when it set none
            self.choices,
            self.options,
            req,
        )
        # What a peer that asks hears this rank runs (transport/in_flight.py).
        in_flight = mesh.in_flight
        in_flight.call = ctx
        staging.load()
        hosts = []
        for items in staged:
            group = []
            for it in items:
                assert it.host is not None, "internal: staging.load() not run"
                group.append(it.host)
            hosts.append(group)
        checker = self.checker
        if checker is None:
            JOBS[type(req)](ctx, req, hosts)
        else:  # the contract checker measures the job's inputs and outputs around it
            measuring = checker.before(ctx, seq, req, hosts)
            JOBS[type(req)](ctx, req, hosts)
            if measuring is not None:
                checker.after(ctx, seq, req, hosts, measuring)
        staging.store()
        # Dropped once done, so it keeps no tensor alive (a job that raised is
        # kept alive anyway: its error's traceback holds this frame).
        in_flight.call = None
        return req.result

    # ------------------------------------------------------------ lifecycle

    def close(self, *, at_exit: bool = False) -> None:
        """Destroy: later calls are refused, queued jobs fail, threads stop, links close.

        ``shutdown`` (``at_exit`` False) lets the running job finish (up to
        ``config.SHUTDOWN_DRAIN_S``; a job still running then has its links dropped
        under it, which fails it at once), then says BYE to every peer; at
        interpreter exit the links are dropped first (that wakes a comm thread
        blocked in poll), so no thread of ours is still inside torch when
        Python finalizes. Idempotent.
        """
        with self.state.lock:
            if self.state.closed:
                return
            self.state.stop(Phase.CLOSED)
        # p2p stops before the transport closes the sockets its thread polls.
        if at_exit:
            self.p2p.close()
            self.mesh.close(hard=True)
            self.engine.stop(Phase.CLOSED, timeout_s=2.0)
        else:
            drained = self.engine.stop(Phase.CLOSED, timeout_s=config.SHUTDOWN_DRAIN_S)
            self.p2p.close()
            # Closing an fd does not wake a thread polling it; shutting the
            # socket down does.
            self.mesh.close(hard=not drained)
            if not drained:  # the job fails at once now: join its thread
                self.engine.stop(Phase.CLOSED, timeout_s=config.ABORT_JOIN_S)

    def abort(self, error: EntrenarError) -> None:
        """Break the group with ``error`` (first, so ``errored()`` never misses it;
        the break hooks fail pending p2p, tell the peers and drop the links,
        which fails a job blocked on the network at once), then stop the comm
        thread and fail the queued jobs.

        Returns within a second whatever the peers and the store do: nothing
        here touches the store, no send blocks (sockets are non-blocking and
        close without lingering), and its only waits are two bounded joins
        (the p2p thread's, then the comm thread's, ``config.ABORT_JOIN_S``
        each); a thread still busy after its bound (a future
        callback of the caller's) ends on its own, as a daemon, once its job
        fails."""
        self.state.fail(error, "abort()")
        self.engine.stop(Phase.ABORTED, timeout_s=config.ABORT_JOIN_S)

    # ------------------------------------------------------------ timeouts

    def set_timeout(self, timeout: timedelta) -> None:
        """The no-progress timeout of later collectives and p2p calls."""
        self.timeout.set(timeout)


def _stream_of(streams: dict[int, Any], device: torch.device) -> tuple[int, Any]:
    """``device``'s index and its stream in ``streams``, made on first use."""
    # A CUDA tensor's device always has an index (never current_device()).
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = new_comm_stream(index)
        streams[index] = stream
    return index, stream

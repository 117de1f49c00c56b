"""The group's comm thread: runs jobs in issue order, completes futures, turns failures into errors.

Every rank issues a group's collectives in the same order (torch's contract,
and ours), so one FIFO thread per group is enough to keep the ranks in step:
the caller gets a Work back at once and keeps computing (DDP's backward
overlaps the bucket in flight), and the thread runs the jobs one after another.

The first failure breaks the group (``GroupState.fail``): the job's future
gets the error, the break hooks abort the transport (publishing the error so
that peers raise it too), every queued and later job fails with the same
error class, naming the first failure.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import EntrenarError, group_destroyed
from .state import GroupState, Phase

log = logging.getLogger(__name__)
# Module names for the claim's hot path: ``Phase.RUNNING`` looks the member
# up on its class (~0.1 us in 3.11), ``threading.get_ident`` on the module.
_RUNNING = Phase.RUNNING
_get_ident = threading.get_ident


@dataclass(slots=True)
class Job:
    """One collective: ``run()`` does the work and returns the future's value."""

    seq: int
    kind: str
    nbytes: int
    run: Callable[[], Any]
    future: torch.futures.Future
    # Entered around set_result (a CUDA stream context, so the future's event
    # is recorded on the stream that wrote the results).
    completion_context: Callable[[], Any] | None = None
    # The Work handed to the caller: held here until the job is done, so a
    # Python Work passed to C++ (DDP's reducer) is not collected while pending.
    work: Any = None
    # Its flight-recorder entry (flight_recorder.Entry), when the group records.
    record: Any = None


class Stats:
    """Per-kind counters: calls, payload bytes, seconds spent running the jobs."""

    def __init__(self) -> None:
        # kind -> [calls, bytes, seconds]: one dict lookup per job on the hot path
        self._rows: dict[str, list[float]] = {}

    def record(self, kind: str, nbytes: int, seconds: float) -> None:
        row = self.row(kind)
        row[0] += 1
        row[1] += nbytes
        row[2] += seconds

    def row(self, kind: str) -> list[float]:
        """``kind``'s counters, [calls, bytes, seconds] (made at its first job):
        a caller that counts its jobs itself adds to them in place."""
        row = self._rows.get(kind)
        if row is None:
            row = self._rows[kind] = [0, 0, 0.0]
        return row

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind in sorted(self._rows):
            calls, nbytes, seconds = self._rows[kind]
            out[f"{kind}_calls"] = int(calls)
            out[f"{kind}_bytes"] = int(nbytes)
            out[f"{kind}_seconds"] = seconds
        return out


class Engine:
    """A FIFO of jobs and the one thread that runs them."""

    def __init__(self, state: GroupState, name: str, spin_us: int = 0) -> None:
        self.rank = state.rank
        self.stats = Stats()
        self._state = state
        self._spin_s = spin_us / 1e6
        self._queue: collections.deque[Job] = collections.deque()
        # The group state's plain Lock under the Condition: `with self._mutex`
        # is a C-level context manager (Condition's own __enter__ is Python,
        # and its default lock an RLock), and the hot path takes it twice per
        # collective; sharing it with the state makes a stop and the queue's
        # emptying one step.
        self._mutex = state.lock
        self._cv = threading.Condition(self._mutex)
        # The executor token: the thread running this group's jobs, if any.
        self._owner: int | None = None
        self._thread = threading.Thread(target=self._loop, name=f"entrenar-{name}", daemon=True)
        self._thread.start()
        self._comm_ident = self._thread.ident

    def submit(self, job: Job) -> None:
        with self._mutex:
            if not self._state.running:
                raise group_destroyed(self.rank, f"{job.kind}#{job.seq}")
            self._queue.append(job)
            self._cv.notify()

    def try_claim(self) -> bool:
        """Take the executor token for the calling thread if nothing is queued or running.

        Whoever holds the token is the only thread running this group's jobs;
        a caller that gets it runs its job itself (``run_claimed``), in issue
        order, since any later job is queued behind the token.

        The caller holds the runtime's submit lock (``Runtime._lock``, as
        ``Runtime.submit`` and the thin path do), under which every job is
        queued: while it looks, no job can be queued and no other caller can
        claim, and the comm thread takes the token only for a queued job,
        taking it before it pops the job (``_next``). So a queue found empty,
        then no owner, stays so, and plain reads and one store (ordered by
        the GIL) claim it without the mutex: ~0.2 us less per inline call,
        ~3% of a 64 KiB shm allreduce.
        """
        state = self._state
        if (
            self._queue
            or self._owner is not None
            or state.phase is not _RUNNING
            or state.error is not None
        ):
            return False
        self._owner = _get_ident()
        return True

    def run_claimed(self, job: Job) -> None:
        """Run ``job`` in the calling thread, which holds the token (``try_claim``)."""
        assert self._owner == threading.get_ident(), "internal: run without the token"
        try:
            self.execute(job)
        finally:
            self._release()

    def _release(self) -> None:
        """Give the token back, waking the comm thread if jobs were queued
        behind it. The store comes first, then the look at the queue: a job
        queued after the look finds no owner, and its own ``notify`` wakes
        the thread (which checks both under the mutex, ``_next``); one queued
        before it is woken for here. No mutex where nothing is queued."""
        self._owner = None
        if self._queue:
            with self._mutex:
                self._cv.notify()

    def in_comm_thread(self) -> bool:
        """True in this group's comm thread."""
        return threading.get_ident() == self._comm_ident

    def holds_token(self) -> bool:
        """True in the thread running this group's jobs (the comm thread, or a
        caller running its own job), e.g. inside a future callback it runs."""
        return self._owner == threading.get_ident()

    def drain_until(self, job: Job) -> None:
        """Run queued jobs, in order, in the token-holding thread until ``job`` has run.

        A future callback runs in the thread completing a job. If that callback
        issues a collective and waits for it (DDP's PowerSGD hook does), the
        job would sit in the queue behind a thread that is waiting for it.
        Running the queue up to it here keeps issue order and cannot deadlock.
        """
        assert self.holds_token(), "internal: drain_until without the token"
        while True:
            with self._mutex:
                if not self._queue:
                    return  # already run (or failed with the group)
                nxt = self._queue.popleft()
            self.execute(nxt)
            if nxt is job:
                return

    def _next(self) -> Job | None:
        if self._spin_s and not self._queue:
            # Busy-poll for the next job before sleeping on the condition.
            # Each turn yields the core and, with it, the GIL: a caller that
            # is about to issue that job (or to run Python after the last one
            # completed) must not wait for this loop.
            end = time.perf_counter() + self._spin_s
            while not self._queue and self._state.running and time.perf_counter() < end:
                os.sched_yield()
        with self._mutex:
            # A caller running its own job holds the token: wait for it too.
            while (not self._queue or self._owner is not None) and self._state.running:
                self._cv.wait()
            if not self._queue or self._owner is not None:
                return None
            self._owner = threading.get_ident()  # before the pop: ``try_claim``
            return self._queue.popleft()

    def _loop(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                self.execute(job)
            finally:
                self._release()

    def execute(self, job: Job) -> None:
        record = job.record
        if self._state.error is not None:
            if record is not None:
                record.retire()
            job.future.set_exception(self._state.broken_error(f"{job.kind}#{job.seq}"))
            return
        if record is not None:
            record.start()
        start = time.perf_counter()
        try:
            value = job.run()
        except BaseException as e:
            if record is not None:
                record.retire()  # still "started": it never completed
            self._fail(job, e)
            if not isinstance(e, Exception) and not self.in_comm_thread():
                raise  # Ctrl-C in a caller running its own job: the group is broken, stop
            return
        self.stats.record(job.kind, job.nbytes, time.perf_counter() - start)
        if record is not None:
            record.complete()
        if job.completion_context is None:
            job.future.set_result(value)
        else:
            with job.completion_context():
                job.future.set_result(value)

    def _fail(self, job: Job, e: BaseException) -> None:
        what = f"{job.kind}#{job.seq}"
        if isinstance(e, EntrenarError):
            err = e
        else:
            err = EntrenarError(f"rank {self.rank}: {what} failed: {e!r}")
            err.__cause__ = e
        state = self._state
        if state.fail(err, what):
            log.error("rank %d: %s failed: %s", self.rank, what, err)
        else:
            # The group broke while this job ran (abort() closed its links):
            # the group's first failure is the cause, not what the job then saw.
            first = state.error
            assert first is not None
            err = type(first)(
                f"rank {self.rank}: {what} interrupted: this process group failed at "
                f"{state.failed_at} ({first}); the collective then saw: {err}",
                culprit=first.culprit,
            )
            err.__cause__ = e
        job.future.set_exception(err)
        with self._mutex:
            queued = list(self._queue)
            self._queue.clear()
        for other in queued:
            other.future.set_exception(state.broken_error(f"{other.kind}#{other.seq}"))

    def stop(self, phase: Phase, timeout_s: float = 10.0) -> bool:
        """Stop after the running job (``abort()``: ``ABORTED``; ``shutdown``:
        ``CLOSED``); queued jobs fail. Idempotent. True once the comm thread
        has ended (waited for up to ``timeout_s``)."""
        state = self._state
        with self._mutex:
            state.stop(phase)
            queued = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for job in queued:
            what = f"{job.kind}#{job.seq}"
            job.future.set_exception(
                state.broken_error(what)
                if state.error is not None
                else group_destroyed(self.rank, what)
            )
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

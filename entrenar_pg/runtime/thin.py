"""The thin path: the common allreduce run straight through, in the caller's thread.

Most allreduces a program makes are ``dist.all_reduce(t)``: blocking, one
contiguous CPU tensor, torch's options form, a plain reduce op, on a group
with nothing queued or running. For that call the long path
(``normalize`` → ``requests.allreduce`` → ``Runtime.submit`` →
``Engine.run_claimed``/``execute`` → ``Runtime.run`` → ``jobs.allreduce``
→ ``JobContext.call`` → the algorithm) already runs the job inline in the
caller's thread, and most of its ~30 Python calls build objects the call
then never uses: a request tuple, a ``Staging`` and its items, a torch
``Future``, a ``Job`` and a ``Call`` per call. ``ThinPath.allreduce`` does
the same work for that call alone, in a few calls of its own, and answers
None for every other call, which then takes the long path unchanged.

What it keeps from the long path, so that nothing observable differs:

- The checks, by accepting only calls the long path would accept: exactly
  a ``list`` of one plain ``torch.Tensor`` (no subclass, no ``Parameter``),
  CPU, strided, contiguous (so staging would use it in place and the
  overlap check is not needed), torch's ``AllreduceOptions`` with
  ``asyncOp`` False, and a (reduce op, dtype) pair the long path's
  ``reduce_ops.resolve`` found valid before (PREMUL_SUM, whose factor
  varies, never). Anything else, including every call that should fail,
  goes the long path and gets its error.
- Where it runs and in what order: the runtime's lock, then
  ``Engine.try_claim`` (nothing queued or running, the group running and
  not broken: else the long path, which queues it or refuses it), then
  the next sequence number, as ``submit`` does. So seq order is issue
  order and every header carries the same seq as on the long path.
- The job itself: the caller's busy-poll (``caller_spin_us``; a thread
  that gets the token here is never the comm thread, which only runs
  with the token in hand) and the call's timeout (its own, else the
  group's) carried in the ``Call`` as ``Runtime.run``'s job context does;
  the ``Call`` of ``JobContext.call`` (the policy's cached choice: deterministic mode's tree
  order and the header flags come with it), one per route, reused with
  its seq rewritten (a peer's question finds the running call by it:
  ``terms``); the algorithm from ``jobs._ALLREDUCE`` looked up per call,
  as ``allreduce_flat`` does, except where the choice is SHM and two ranks
  sum a small message: the route (one per op, dtype and size: the
  Reduction, the Call, the shape) then runs ``shm_allreduce.allreduce_shm_pair``
  on the caller's tensor, the steps and bits ``allreduce_shm`` would run
  for it without finding its shape again (~0.6 us less at 64 KiB); the
  engine's stats.
- Failure as ``Engine.execute``'s: a group broken between the claim and
  the job fails the call without running it; an error in the job breaks
  the group (``Engine._fail``: the break hooks, queued jobs failed) and
  comes back in the Work (``wait()`` raises it); a ``KeyboardInterrupt``
  breaks it and then propagates as itself.
- What a peer that asks which call this rank runs hears (``terms``,
  ``transport/in_flight.py``): the words the long path's job context gives
  (``call/agreement.allreduce``), found when asked: nothing is stored per call.
- What it returns: a ``DoneWork``, an ``EntrenarWork`` whose call has
  completed: ``wait()`` returns True, ``get_future()`` is a completed
  future whose value is ``[t]``; no torch ``Future`` is made unless asked
  for. The last one again while nothing else holds it (torch's blocking
  call drops it after ``wait()``); a caller that kept one gets a new one.

It steps aside (None) whenever something watches the call: the profiler
(its event opens in ``submit``), the contract checker (it runs around the
job) and the flight recorder (its entry is made in ``submit``).

``ThinPath.check`` is the same route for the contract checker's own job
(``Runtime.submit_check``: op CHECK, no tensors, its caller waits at once):
once per optimizer step, right after the backward pass, when every cache
is cold, the long path's objects cost ~0.15 ms of the step's check
(measured inside a DDP job; 9 us warm). The same lock, claim and sequence
number, the same ``Call`` (``JobContext.call``'s, of op CHECK), the same
stats and failure handling; the same steps aside (profiler, flight
recorder, a busy group). Only the checker watches nothing of its own job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from sys import getrefcount
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.autograd import profiler as _profiler

from ..call import agreement
from ..call.work import EntrenarWork
from ..collectives import Call
from ..collectives import shm_allreduce as shm
from ..config import timeout_seconds
from ..reduce_ops import Kind, Reduction, resolve
from ..transport.in_flight import Terms
from ..wire import Algo, OpCode
from .context import JobContext
from .engine import Job
from .jobs import _ALLREDUCE

if TYPE_CHECKING:
    from .runtime import Runtime

_OPTIONS = dist.AllreduceOptions
_TENSOR = torch.Tensor
_STRIDED = torch.strided
_UNSET = timedelta(0)  # torch's unset per-call timeout is -1 ms (as in Runtime.submit)
_ALLREDUCE_OP = OpCode.ALLREDUCE
_clock = time.perf_counter  # a module name for the hot path: one lookup, not two
_KIND = "allreduce"  # the stats' kind and the Work's label, as op_name(ALLREDUCE)
_CHECK_KIND = "check"  # likewise for the checker's job, as op_name(CHECK)
# The last DoneWork is returned again when nothing else holds it (torch's
# blocking call drops it after ``wait()``): making one costs ~1 us, a
# quarter of the whole 4 KiB call. References then: ``_done``, the local
# and getrefcount's argument; one more is a caller that kept it, which
# gets its own from then on (a Work's ``result()`` never changes under it).
_HELD_HERE_ONLY = 3
_MAX_CACHED = 1024  # sizes (Calls) and (op, dtype) pairs kept, like the runtime's choices


class DoneWork(EntrenarWork):
    """The Work of a call the thin path ran to completion: nothing is pending.

    Made with ``dist.Work``'s own constructor (no Python ``__init__``); the
    thin path sets ``_seq``, ``_rank`` and ``_result`` (the call's ``[t]``).
    ``EntrenarWork``'s other methods read ``_future``: here a completed
    future, made when asked for.
    """

    __init__ = dist.Work.__init__  # type: ignore[assignment]
    _kind = _KIND
    _seq: int
    _rank: int
    _result: list[torch.Tensor]

    @property
    def _future(self) -> torch.futures.Future:  # type: ignore[override]
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut

    def wait(self, timeout: timedelta | float | None = _UNSET) -> bool:
        # torch's blocking call passes nothing: one identity test, then done
        if timeout is not _UNSET and timeout is not None and not isinstance(timeout, timedelta):
            float(timeout)  # EntrenarWork.wait's conversion: a bad argument raises alike
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def result(self) -> Any:
        return self._result


@dataclass(slots=True)
class _Route:
    """What every thin call of one (op, dtype, size) reuses."""

    red: Reduction
    call: Call  # its own; its seq, and but for a pair sum (its own pace) its timeout, per call
    pair: _PairSum | None  # two ranks' shm sum: run straight (``allreduce_shm_pair``)
    agreed: str  # ``agreement.allreduce`` of its dtype, size and op: the long path's words


@dataclass(slots=True)
class _PairSum:
    """A two-rank shm sum's shape, and its wait's pace (``transport.loop.Pace``):
    the caller's spin, and the call's timeout read from torch's options only
    when the wait comes to sleep. Reading ``opts.timeout`` costs ~0.2 us (a
    pybind property making a timedelta), ~3% of a 64 KiB call, and a call
    whose peer is already there never needs it."""

    shape: shm.PairShape
    spin_s: float
    opts: Any = None  # this call's AllreduceOptions
    group_s: float = 0.0  # the group's timeout when the call was issued (``set_timeout``)

    @property
    def timeout_s(self) -> float:
        return _timeout_s(self.opts.timeout, self.group_s)


def _timeout_s(per_call: timedelta, group_s: float) -> float:
    """A call's timeout: its own (torch's per-call option), else the group's
    (torch's unset one is -1 ms, as in ``Runtime.submit``)."""
    return timeout_seconds(per_call) if per_call > _UNSET else group_s


class ThinPath:
    """One group's thin path (made with the group; reads its runtime's parts)."""

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._rank = runtime.rank
        self._engine = runtime.engine
        self._state = runtime.state
        self._stats = runtime.engine.stats
        # The allreduce counters (``Stats.row``), taken at the first thin call:
        # three additions in place cost half a ``Stats.record`` call.
        self._row: list[float] | None = None
        # The caller's busy-poll (a thread that gets the token here is never
        # the comm thread), as Runtime.run picks it for its job context.
        self._spin_s = runtime.options.caller_spin_us / 1e6
        self._reductions: dict[tuple[int, torch.dtype], Reduction] = {}
        self._routes: dict[tuple[int, torch.dtype, int], _Route] = {}  # (op, dtype, bytes)
        # Two ranks' small shm sums run straight (``allreduce_shm_pair``); False:
        # through ``jobs._ALLREDUCE`` like every other call (benchmarks/shm_ab.py
        # swaps the algorithm there).
        self.pair_sums = True
        self._done = DoneWork()
        self._done._rank = self._rank
        self._check_call: Call | None = None  # the checker's job's Call (only its seq changes)
        # Asked, not told: a peer's question finds the route of the call this
        # rank runs (``terms``), so a thin call publishes nothing.
        runtime.mesh.in_flight.thin = self

    def allreduce(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> EntrenarWork | None:
        """Run ``EntrenarProcessGroup.allreduce(*args, **kwargs)`` if it is the
        common call (module docstring), returning its Work; else None, and
        nothing happened."""
        if kwargs or len(args) != 2:
            return None
        tensors, opts = args
        if type(opts) is not _OPTIONS or type(tensors) is not list or len(tensors) != 1:
            return None
        t = tensors[0]
        rt = self._rt
        if (
            type(t) is not _TENSOR
            or opts.asyncOp
            or not t.is_cpu
            or t.layout is not _STRIDED
            or not t.is_contiguous()
            or _profiler._is_profiler_enabled
            or rt.checker is not None
            or rt.recorder is not None
        ):
            return None
        nbytes = t.nbytes
        # hash(ReduceOp) is its op's value (torch's __hash__; checked when learnt):
        # half the cost of ``.op.value``, which makes a RedOpType first.
        key = (hash(opts.reduceOp), t.dtype, nbytes)
        route = self._routes.get(key)
        if route is None and not self._knows(key, opts.reduceOp):
            return None  # this time the long path (it checks the op itself)
        engine = self._engine
        with rt._lock:  # as in Runtime.submit: seq order == issue order
            if not engine.try_claim():
                return None  # busy, stopped or broken: the long path queues or refuses it
            rt.seq += 1
            seq = rt.seq
        try:
            if self._state.error is not None:  # broken since the claim (Engine.execute)
                return self._refused(seq)
            if route is None:
                route = self._route(key, seq, t)
            call = route.call
            call.seq = seq
            pair = route.pair
            if pair is not None:  # two ranks' shm sum: the caller's buffer, in place
                pair.opts = opts  # its timeout, read if the wait sleeps
                pair.group_s = rt.timeout.seconds
                start = _clock()
                shm.allreduce_shm_pair(call, t, pair.shape, _ALLREDUCE_OP, start, pair)
            else:
                call.timeout_s = _timeout_s(opts.timeout, rt.timeout.seconds)  # the job's pace
                start = _clock()
                flat = t.detach() if t.requires_grad else t  # as Staging.load
                if flat.dim() != 1:
                    flat = flat.view(-1)
                algo = _ALLREDUCE.get(call.choice.algo)  # None: Algo.NONE, nothing to do
                if algo is not None:
                    algo(call, flat, route.red)
            row = self._row or self._counters()
            row[0] += 1
            row[1] += nbytes
            row[2] += _clock() - start
        except BaseException as e:
            return self._failed(seq, nbytes, e)
        finally:
            engine._release()
        work = self._done
        if getrefcount(work) > _HELD_HERE_ONLY:  # a caller kept the last one: a new one
            work = self._done = DoneWork()
            work._rank = self._rank
        work._seq = seq
        work._result = [t]
        return work

    def check(self, run: Callable[[Call], None]) -> EntrenarWork | None:
        """Run the contract checker's job ``run(call)`` (``Runtime.submit_check``)
        in the caller's thread, returning its completed Work; else None (the
        group is busy, stopped or broken, or a profiler or the flight recorder
        watches), and nothing happened."""
        rt = self._rt
        if _profiler._is_profiler_enabled or rt.recorder is not None:
            return None
        engine = self._engine
        with rt._lock:  # as in Runtime.submit: seq order == issue order
            if not engine.try_claim():
                return None
            rt.seq += 1
            seq = rt.seq
        try:
            if self._state.error is not None:  # broken since the claim (Engine.execute)
                return self._refused(seq, _CHECK_KIND)
            call = self._check_call
            if call is None:
                call = self._check_call = self._new_call(seq, OpCode.CHECK, 0)
            call.seq = seq
            call.timeout_s = rt.timeout.seconds  # the group's: the checker passes no options
            start = time.perf_counter()
            run(call)
            self._stats.record(_CHECK_KIND, 0, time.perf_counter() - start)
        except BaseException as e:
            return self._failed(seq, 0, e, _CHECK_KIND)
        finally:
            engine._release()
        done = DoneWork()  # the step waits at once and drops it: one per step
        done._kind = _CHECK_KIND
        done._rank = self._rank
        done._seq = seq
        done._result = []
        return done

    def terms(self) -> Terms | None:
        """The thin call this rank runs now, as a peer that asks is told
        (``transport/in_flight.py``): the route whose Call carries the group's
        latest seq (None: the latest call is not a thin one). Read in the
        control thread, only when asked."""
        seq = self._rt.seq
        for route in list(self._routes.values()):
            if route.call.seq == seq:
                return Terms(seq, _KIND, route.agreed)
        return None

    # ------------------------------------------------------------ first calls, failures

    def _counters(self) -> list[float]:
        """The engine's allreduce counters, kept for every later thin call."""
        self._row = self._stats.row(_KIND)
        return self._row

    def _knows(self, key: tuple[int, torch.dtype, int], op: Any) -> bool:
        """Whether the (op, dtype) of a route ``key`` not made yet was learnt
        (its route is made in the call); if not, learn it now (the long path
        runs this call and checks the op itself)."""
        if (key[0], key[1]) in self._reductions:
            return True
        self._learn_reduction(op, key[1])
        return False

    def _learn_reduction(self, op: Any, dtype: torch.dtype) -> None:
        """Remember ``op`` on ``dtype`` once ``resolve`` finds it valid (a plain
        op: its Reduction never changes); an invalid one is left to the long path."""
        if op.op.value == Kind.PREMUL_SUM:
            return  # its factor varies per call: the long path every time
        try:
            red = resolve(op, dtype, where="thin path")
        except ValueError:
            return
        key = hash(op)  # what ``allreduce`` looks up: only where it is the op's value
        if red.kind is not Kind.PREMUL_SUM and key == int(red.kind):
            if len(self._reductions) >= _MAX_CACHED:
                self._reductions.clear()
            self._reductions[(key, dtype)] = red

    def _route(self, key: tuple[int, torch.dtype, int], seq: int, t: torch.Tensor) -> _Route:
        """The route of ``key`` (op, dtype, bytes), kept for every later call
        with it: the Reduction, a Call of that size (the runtime's: its
        cached policy choice; only its seq and timeout change) and, where the
        choice is SHM between two ranks summing a small message, that sum's
        shape (``shm_allreduce.shm_pair_shape``)."""
        red = self._reductions[(key[0], key[1])]
        # A Call of its own (not one per size): its seq says which route runs now (``terms``).
        call = self._new_call(seq, OpCode.ALLREDUCE, key[2])
        pair = None
        if self.pair_sums and call.choice.algo is Algo.SHM:
            shape = shm.shm_pair_shape(call, t.detach().view(-1), red)
            if shape is not None:
                pair = _PairSum(shape, call.spin_s)
        agreed = agreement.allreduce(t.dtype, t.numel(), red.kind)
        route = _Route(red, call, pair, agreed)
        if len(self._routes) >= _MAX_CACHED:
            self._routes.clear()
        self._routes[key] = route
        return route

    def _new_call(self, seq: int, op: OpCode, nbytes: int) -> Call:
        """``JobContext.call``'s Call of ``op`` and ``nbytes`` in the caller's thread."""
        rt = self._rt
        mesh = rt.mesh
        ctx = JobContext(
            mesh, rt.rank, mesh.world, seq, rt.scratch, self._spin_s, 0.0, rt.choices, rt.options
        )
        return ctx.call(op, nbytes)

    def _refused(self, seq: int, kind: str = _KIND) -> EntrenarWork:
        """Engine.execute's answer for a job of a group broken before it ran."""
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(self._state.broken_error(f"{kind}#{seq}"))
        return EntrenarWork(fut, kind, self._rank, seq)

    def _failed(self, seq: int, nbytes: int, e: BaseException, kind: str = _KIND) -> EntrenarWork:
        """Engine.execute's handling of a job that raised ``e``: the group breaks
        (``Engine._fail``) and the Work holds the error; a ``KeyboardInterrupt``
        (Ctrl-C in the caller's own job) then propagates as itself."""
        fut: torch.futures.Future = torch.futures.Future()
        work = EntrenarWork(fut, kind, self._rank, seq)
        self._engine._fail(Job(seq, kind, nbytes, _never_run, fut, None, work), e)
        if not isinstance(e, Exception):
            raise e
        return work


def _never_run() -> None:
    raise AssertionError("internal: a thin-path job is never run by the engine")

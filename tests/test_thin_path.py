"""The thin path (entrenar_pg/runtime/thin.py): the common allreduce, short and unchanged.

Differential: the same calls with the thin path and with it switched off
(the long path, as before it existed) give the same bits, sequence numbers,
Work answers and errors; every condition it must step aside for takes the
long path; and one blocking 4 KiB allreduce makes at most 40 Python calls of
ours (counted as ``python -m benchmarks.calls`` counts them).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks

from benchmarks.calls import Pair
from entrenar_pg import (
    EntrenarError,
    EntrenarProcessGroup,
    GroupDestroyedError,
    Options,
    PeerConnectionError,
)
from entrenar_pg.call.work import EntrenarWork
from entrenar_pg.errors import CollectiveMismatchError
from entrenar_pg.runtime.thin import DoneWork

MAX_OUR_CALLS = 40  # issue 25, item 6
R = dist.ReduceOp


def blocking(op: Any = R.SUM, timeout: timedelta | None = None) -> dist.AllreduceOptions:
    """The options torch's ``dist.all_reduce(t, op)`` passes (``async_op=False``)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.asyncOp = False
    if timeout is not None:
        opts.timeout = timeout
    return opts


class NoThin:
    """Stands in for a group's thin path: every call takes the long path."""

    def allreduce(self, args: Any, kwargs: Any) -> None:
        return None


class Paths:
    """Counts, per group, the calls that reached the long path (``Runtime.submit``)."""

    def __init__(self, pg: EntrenarProcessGroup) -> None:
        self.long = 0
        self._submit = pg._runtime.submit
        pg._runtime.submit = self._counting  # type: ignore[method-assign]

    def _counting(self, *args: Any) -> Any:
        self.long += 1
        return self._submit(*args)


def went_thin(pg: EntrenarProcessGroup, paths: Paths, *args: Any) -> tuple[bool, Any]:
    """Call ``pg.allreduce(*args)``; (whether the thin path ran it, its Work)."""
    before = paths.long
    work = pg.allreduce(*args)
    thin = paths.long == before
    assert thin == isinstance(work, DoneWork)
    return thin, work


def wait_idle(pg: EntrenarProcessGroup, timeout_s: float = 10.0) -> None:
    """Until nothing is queued or running on ``pg``: the thin path's condition.

    A job the comm thread ran completes its Work before the thread gives the
    token back (a future callback runs holding it, ``Engine.drain_until``),
    so the caller woken by ``wait()`` can issue its next call while the token
    is still held; that call then takes the long path, rightly (the suite
    under load: a call this test expects thin went long once in nine runs).
    """
    engine = pg._runtime.engine
    deadline = time.monotonic() + timeout_s
    while engine._owner is not None or engine._queue:
        assert time.monotonic() < deadline, "the group stayed busy"
        time.sleep(0.0005)


# ---------------------------------------------------------------------- the count


@pytest.fixture(params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param, timeout_s=20.0)
    try:
        p.warm_up()
        yield p
    finally:
        p.close()


@pytest.mark.timeout(60)
def test_a_blocking_4k_allreduce_makes_at_most_40_python_calls_of_ours(pair: Pair) -> None:
    """benchmarks/calls.py's count (rank 0, the peer there first, warmed up):
    before the thin path 63 (shm) and 51 (tcp)."""
    # A count, not a timing; but should the peer come late on a loaded
    # machine, rank 0 also counts its wait (more calls, never fewer): the
    # fewest of three is the call's own path.
    counts = [pair.count()["calls"]["ours"] for _ in range(3)]
    assert min(counts) <= MAX_OUR_CALLS, f"{pair.transport}: {counts} Python calls of ours"


# ---------------------------------------------------------------------- same bits


OPS_DTYPES = [
    (op, dtype)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32)
    for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX)
] + [
    (op, dtype)
    for dtype in (torch.int64, torch.uint8, torch.bool)
    for op in (R.BAND, R.BOR, R.BXOR, R.SUM, R.MAX)
]
SHAPES = [(1,), (1024,), (7, 33), (0,)]


def _input(rank: int, dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    return torch.randint(1, 5, shape, generator=g, dtype=dtype)


def _sweep(rank: int, pg: EntrenarProcessGroup, thin: bool) -> list[Any]:
    """Every (op, dtype, shape) case, each call twice (the first teaches the thin
    path the op); the results, the seqs and which path each second call took."""
    if not thin:
        pg._thin = NoThin()  # type: ignore[assignment]
    paths = Paths(pg)
    out = []
    for i, (op, dtype) in enumerate(OPS_DTYPES):
        for j, shape in enumerate(SHAPES):
            for _ in range(2):
                t = _input(rank, dtype, shape, i * 100 + j)
                before = paths.long
                dist.all_reduce(t, op=op, group=pg)  # torch's own entry point
            out.append((t, pg._runtime.seq, paths.long == before))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("world", "options"),
    [
        (2, Options(transport="shm")),
        (2, Options(transport="tcp")),
        (3, Options(transport="shm", deterministic=True)),
        (3, Options(transport="tcp")),
    ],
    ids=["shm-2", "tcp-2", "shm-3-det", "tcp-3"],
)
def test_same_bits_and_seqs_as_the_long_path(world: int, options: Options) -> None:
    thin = run_ranks(world, lambda r, pg: _sweep(r, pg, True), options=options, timeout_s=150)
    long = run_ranks(world, lambda r, pg: _sweep(r, pg, False), options=options, timeout_s=150)
    for rank in range(world):
        for (a, seq_a, thin_a), (b, seq_b, thin_b) in zip(thin[rank], long[rank], strict=True):
            assert seq_a == seq_b
            assert thin_a and not thin_b
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (rank, seq_a)
    # and the ranks agree with each other
    for r in range(1, world):
        for (a, _, _), (b, _, _) in zip(thin[0], thin[r], strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---------------------------------------------------------------------- the Work


@pytest.mark.timeout(60)
def test_the_work_answers_as_the_long_paths() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> list[Any]:
        paths = Paths(pg)
        got = []
        for thin_on in (True, False):
            if not thin_on:
                pg._thin = NoThin()  # type: ignore[assignment]
            t = torch.full((4, 4), float(rank + 1))
            pg.allreduce([t], blocking()).wait()  # teaches the thin path SUM on float32
            thin, w = went_thin(pg, paths, [t], blocking())
            fut = w.get_future()
            got.append(
                (
                    thin,
                    w.is_completed(),
                    w.is_success(),
                    w.exception(),
                    w.wait(),
                    w.wait(timedelta(seconds=1)),
                    w.wait(None),
                    fut.done(),
                    fut.value()[0] is t,
                    len(fut.value()),
                    w.result()[0] is t,
                    repr(w).replace(f"#{pg._runtime.seq}", "#N"),
                    t.clone(),
                )
            )
            with pytest.raises((TypeError, ValueError)):
                w.wait("soon")  # type: ignore[arg-type]
        return got

    for thin, long in run_ranks(2, fn, timeout_s=40):
        assert thin[0] and not long[0]
        assert thin[1:-1] == long[1:-1]
        assert torch.equal(thin[-1], long[-1])
        assert thin[1:4] == (True, True, None)


def test_a_kept_work_keeps_its_result_and_a_dropped_one_is_reused() -> None:
    """The thin path returns its last DoneWork again only when nobody else holds
    it (torch's blocking call drops it after wait()): a Work a caller kept
    answers for its own call, whatever runs after it."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[int, int, bool, bool, bool]:
        paths = Paths(pg)
        first, second = torch.ones(8), torch.full((8,), 2.0)
        pg.allreduce([first], blocking()).wait()  # teaches the thin path SUM on float32
        made = set()
        for _ in range(5):  # dropped after each call, as dist.all_reduce drops it
            thin, w = went_thin(pg, paths, [first], blocking())
            assert thin
            made.add(weakref.ref(w))  # alive after the del only where the path keeps it
            del w
        live = {r() for r in made} - {None}
        _, kept = went_thin(pg, paths, [first], blocking())
        _, later = went_thin(pg, paths, [second], blocking())
        return (
            len(made) if len(live) == 1 else -len(live),
            len({id(kept), id(later)}),
            kept.result()[0] is first,
            kept.get_future().value()[0] is first,
            later.result()[0] is second,
        )

    for got in run_ranks(2, fn, timeout_s=40):
        assert got == (1, 2, True, True, True)


# ---------------------------------------------------------------------- stepping aside


@pytest.mark.timeout(90)
def test_every_other_call_takes_the_long_path() -> None:
    """Each condition the thin path cannot prove sends the call the long way,
    which still runs it (right result) or refuses it."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> dict[str, bool]:
        paths = Paths(pg)
        seen: dict[str, bool] = {}

        def check(name: str, *args: Any, want: float | None = 3.0, idle: bool = True) -> None:
            if idle:
                wait_idle(pg)
            thin, w = went_thin(pg, paths, *args)
            w.wait()
            seen[name] = thin
            if want is not None:
                t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
                assert float(t.detach().flatten()[0]) == want, name

        one = torch.full((8,), rank + 1.0)
        check("first (op, dtype)", [one], blocking())
        check("common", [torch.full((8,), rank + 1.0)], blocking())
        check("2-d", [torch.full((2, 4), rank + 1.0)], blocking())
        grad = torch.full((8,), rank + 1.0, requires_grad=True)
        wait_idle(pg)
        thin, w = went_thin(pg, paths, [grad], blocking())
        w.wait()
        seen["requires_grad"] = thin
        assert float(grad.detach()[0]) == 3.0
        check(
            "per-call timeout",
            [torch.full((8,), rank + 1.0)],
            blocking(timeout=timedelta(seconds=9)),
        )
        async_opts = blocking()
        async_opts.asyncOp = True
        check("async", [torch.full((8,), rank + 1.0)], async_opts)
        check("short form", torch.full((8,), rank + 1.0), R.SUM)
        check("tuple", (torch.full((8,), rank + 1.0),), blocking())
        check("two tensors", [torch.full((8,), rank + 1.0), torch.ones(2)], blocking())
        check("non-contiguous", [torch.full((8, 2), rank + 1.0).t()], blocking())
        check("parameter", [torch.nn.Parameter(torch.full((8,), rank + 1.0))], blocking())
        premul = dist._make_nccl_premul_sum(2.0)
        check("premul_sum", [torch.full((8,), rank + 1.0)], blocking(premul), want=6.0)
        check("no options", [torch.full((8,), rank + 1.0)])  # async: opts None
        if rank == 0:  # one profiler in the process at a time: rank 0's
            with torch.profiler.profile() as prof:
                check("profiler", [torch.full((8,), rank + 1.0)], blocking())
            assert any(e.name == "entrenar:all_reduce" for e in prof.events())
        else:
            check("profiler", [torch.full((8,), rank + 1.0)], blocking())
        pg.checker = _NoopChecker()  # any checker sends it the long way
        check("checker", [torch.full((8,), rank + 1.0)], blocking())
        pg.checker = None
        check("common again", [torch.full((8,), rank + 1.0)], blocking())
        # busy: rank 0's async call waits for rank 1, which comes late, so
        # rank 0's next call must queue behind it. Late by rank 0's seq (both
        # calls issued), not by a sleep a loaded machine could outlast.
        slow = torch.full((1 << 16,), rank + 1.0)
        if rank == 1:
            issued = pg._runtime.seq + 2  # rank 0's async call and its next
            deadline = time.monotonic() + 30
            while groups[0]._runtime.seq < issued and time.monotonic() < deadline:
                time.sleep(0.001)
        first = pg.allreduce([slow], async_opts)
        check("busy group", [torch.full((8,), rank + 1.0)], blocking(), idle=False)
        first.wait()
        assert float(slow[0]) == 3.0
        return seen

    thin = {"common", "2-d", "requires_grad", "per-call timeout", "common again"}
    groups = make_groups(2)
    try:
        seen = run_ranks(2, fn, groups=groups, timeout_s=70)
    finally:
        for g in groups:
            g.shutdown()
    assert {k for k, v in seen[0].items() if v} == thin
    # Rank 1: its async call may be done before its next one; the profiler's
    # switch is the process's, so rank 0's profiler may have sent it the long way.
    assert {k for k, v in seen[1].items() if v} - {"busy group", "profiler"} == thin


class _NoopChecker:
    """A contract checker that measures nothing (``Runtime.run`` calls it around the job)."""

    def before(self, *args: Any) -> None:
        return None

    def after(self, *args: Any) -> None:
        raise AssertionError("after() without a measurement")


@pytest.mark.timeout(60)
def test_the_flight_recorder_sees_every_call() -> None:
    """With the flight recorder on, every call is recorded: the long path."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[int, int]:
        paths = Paths(pg)
        for _ in range(3):
            dist.all_reduce(torch.ones(8), group=pg)
        assert pg._runtime.recorder is not None
        return paths.long, pg._runtime.seq

    for long, seq in run_ranks(2, fn, options=Options(fr_buffer_size=16), timeout_s=40):
        assert long == 3 and seq == 3


# ---------------------------------------------------------------------- bad calls, failures


BAD = {
    "meta device": lambda: ([torch.empty(4, device="meta")], blocking()),
    "complex dtype": lambda: ([torch.ones(4, dtype=torch.complex64)], blocking()),
    "op for dtype": lambda: ([torch.ones(4)], blocking(R.BAND)),
    "expanded output": lambda: ([torch.ones(1).expand(4)], blocking()),
    "no tensors": lambda: ([], blocking()),
    "not a tensor": lambda: ([3.0], blocking()),
}


def _errors(pg: EntrenarProcessGroup) -> dict[str, tuple[type, str]]:
    out = {}
    for name, make in BAD.items():
        for _ in range(2):  # twice: a first try must not teach the thin path anything
            with pytest.raises((TypeError, ValueError)) as info:
                pg.allreduce(*make())
        out[name] = (type(info.value), str(info.value))
    return out


@pytest.mark.timeout(60)
def test_bad_calls_raise_the_long_paths_errors_and_send_nothing() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[Any, Any]:
        dist.all_reduce(torch.ones(4), group=pg)  # SUM on float32 learnt
        thin = _errors(pg)
        seq = pg._runtime.seq
        pg._thin_saved = pg._thin  # type: ignore[attr-defined]
        pg._thin = NoThin()  # type: ignore[assignment]
        long = _errors(pg)
        pg._thin = pg._thin_saved  # type: ignore[attr-defined]
        assert pg._runtime.seq == seq  # nothing issued
        t = torch.ones(4)
        dist.all_reduce(t, group=pg)  # still usable, in step with the peer
        assert t.tolist() == [2.0] * 4
        return thin, long

    for thin, long in run_ranks(2, fn, timeout_s=40):
        assert thin == long
        for name, (_, message) in thin.items():
            assert "allreduce" in message and "rank" in message, name


@pytest.mark.timeout(60)
def test_destroyed_and_aborted_groups_refuse_alike() -> None:
    groups = make_groups(2)
    try:
        msgs: dict[str, list[tuple[type, str]]] = {"closed": [], "aborted": []}
        run_ranks(2, lambda r, pg: dist.all_reduce(torch.ones(4), group=pg), groups=groups)
        groups[0].shutdown()
        groups[1].abort()
        for pg, kind in ((groups[0], "closed"), (groups[1], "aborted")):
            for thin_on in (True, False):
                if not thin_on:
                    pg._thin = NoThin()  # type: ignore[assignment]
                with pytest.raises(EntrenarError) as info:
                    pg.allreduce([torch.ones(4)], blocking()).wait()
                msgs[kind].append((type(info.value), str(info.value)))
        assert msgs["closed"][0] == msgs["closed"][1]
        assert msgs["closed"][0][0] is GroupDestroyedError
        assert msgs["aborted"][0] == msgs["aborted"][1]
    finally:
        for pg in groups:
            pg.shutdown()


@contextlib.contextmanager
def _warm_pair(transport: str) -> Iterator[EntrenarProcessGroup]:
    """Rank 0 of two groups that have made one allreduce together (its route
    is learnt); both groups aborted and shut down at the end."""
    groups = make_groups(2, Options(transport=transport))
    try:
        run_ranks(2, lambda r, g: dist.all_reduce(torch.ones(4), group=g), groups=groups)
        yield groups[0]
    finally:
        for g in groups:
            g.abort()
            g.shutdown()


def _unanswered(pg: EntrenarProcessGroup, opts: Any) -> tuple[Any, float, int]:
    """Rank 0's thin allreduce that rank 1 never joins: its Work (failed, in the
    caller's thread: no long path taken), how long the call took, the seq before it."""
    paths = Paths(pg)
    seq = pg._runtime.seq
    start = time.monotonic()
    work = pg.allreduce([torch.ones(4)], opts)
    took = time.monotonic() - start
    assert paths.long == 0 and type(work) is EntrenarWork  # thin; it failed
    return work, took, seq


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_stall_times_out_on_the_thin_path_and_breaks_the_group(transport: str) -> None:
    """The group's timeout (set_timeout, read per call) bounds a thin call
    whose peer never comes; the error is in the Work, the group is broken,
    and the next call is refused with the same class naming the first."""
    with _warm_pair(transport) as pg:
        pg.set_timeout(timedelta(seconds=0.4))
        work, took, seq = _unanswered(pg, blocking())
        assert work.is_completed()
        with pytest.raises(PeerConnectionError, match=f"allreduce#{seq + 1}") as info:
            work.wait()
        assert 0.3 < took < 5.0, took
        assert pg.errored() is not None
        assert pg.stats()["allreduce_calls"] == 1  # the failed call is not counted
        with pytest.raises(PeerConnectionError, match=f"allreduce#{seq + 1}"):
            pg.allreduce([torch.ones(4)], blocking())
        assert type(info.value) is type(pg.errored())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_per_call_timeout_bounds_a_thin_call(transport: str) -> None:
    """A call's own timeout (torch's option), not the group's, bounds a thin
    call whose peer never comes: the two-rank shm sum reads it only when its
    wait comes to sleep (``thin._PairSum``), the other routes at the call."""
    with _warm_pair(transport) as pg:
        pg.set_timeout(timedelta(seconds=60))
        work, took, seq = _unanswered(pg, blocking(timeout=timedelta(seconds=0.4)))
        with pytest.raises(PeerConnectionError, match=f"allreduce#{seq + 1}"):
            work.wait()
        assert 0.3 < took < 5.0, took


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_call_queued_behind_a_callers_own_job_runs_when_it_is_done(transport: str) -> None:
    """A thread runs its own blocking call (it holds the engine's token, its
    peer not there yet); another thread's call on the same group is queued
    behind it. When the first is done, its release (``Engine._release``, no
    mutex where nothing is queued) must wake the comm thread for the queued
    call: both complete, in issue order, with the right sums."""
    groups = make_groups(2, Options(transport=transport))
    try:
        pg0, pg1 = groups
        engine = pg0._runtime.engine
        first, second = torch.ones(1024), torch.full((1024,), 2.0)
        own = threading.Thread(target=lambda: pg0.allreduce([first], blocking()).wait())
        own.start()
        deadline = time.monotonic() + 10
        while engine._owner is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine._owner == own.ident  # the caller's own job holds the token
        queued = pg0.allreduce([second])  # async: behind the token
        assert not queued.is_completed()
        pg1.allreduce([torch.ones(1024)], blocking()).wait()  # the peer comes
        pg1.allreduce([torch.full((1024,), 3.0)], blocking()).wait()
        own.join(10)
        waited = threading.Thread(target=queued.wait, daemon=True)
        waited.start()
        waited.join(10)
        assert not own.is_alive() and not waited.is_alive(), "the queued call never ran"
        assert torch.equal(first, torch.full((1024,), 2.0))
        assert torch.equal(second, torch.full((1024,), 5.0))
    finally:
        for g in groups:
            g.abort()
            g.shutdown()


@pytest.mark.timeout(60)
def test_a_mismatch_on_the_thin_path_is_caught_on_both_ranks() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> Any:
        dist.all_reduce(torch.ones(256), group=pg)  # learnt, plans cached
        paths = Paths(pg)
        try:
            dist.all_reduce(torch.ones(256 * (rank + 1)), group=pg)
        except Exception as e:  # judged below
            return paths.long, e
        return paths.long, None

    for transport in ("shm", "tcp"):
        for long, error in run_ranks(2, fn, options=Options(transport=transport)):
            assert long == 0 and isinstance(error, CollectiveMismatchError), (transport, error)
            # whoever saw it first, the message names the two calls (test_mismatch.py)
            assert "called" in str(error) or "garbage" in str(error), error


@pytest.mark.timeout(60)
def test_ctrl_c_on_the_thin_path_propagates_and_breaks_the_group() -> None:
    """As on the long path (test_execution.py): KeyboardInterrupt reaches the
    caller as itself, the group is broken, and the peer raises, not hangs."""

    both_done = threading.Barrier(2, timeout=20)

    def fn(rank: int, pg: EntrenarProcessGroup) -> str:
        dist.all_reduce(torch.ones(4), group=pg)  # learnt: the next call goes thin
        # Rank 1 out of that call first: its end-of-call abort check would
        # otherwise see rank 0's abort and fail the warm-up call instead.
        both_done.wait()
        if rank == 0:
            paths = Paths(pg)

            def interrupted(plan: Any, what: str, pace: Any) -> None:
                raise KeyboardInterrupt

            pg.mesh.run = interrupted  # type: ignore[method-assign]
            with pytest.raises(KeyboardInterrupt):
                pg.allreduce([torch.ones(4)], blocking())
            assert paths.long == 0
            with pytest.raises(EntrenarError, match="cannot be used any more"):
                pg.allreduce([torch.ones(4)], blocking())
            return "interrupted"
        with pytest.raises(EntrenarError) as info:
            pg.allreduce([torch.ones(4)], blocking()).wait()
        return str(info.value)

    res = run_ranks(2, fn, options=Options(transport="tcp"), timeout_s=40)  # plans: mesh.run
    assert res[0] == "interrupted"
    assert "rank 0" in res[1], res[1]


@pytest.mark.timeout(30)
def test_a_one_rank_group_answers_alike() -> None:
    """World 1: the policy sends nothing (no algorithm); AVG leaves the value."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[Any]:
        got = []
        for thin_on in (True, False):
            if not thin_on:
                pg._thin = NoThin()  # type: ignore[assignment]
            for op in (R.SUM, R.AVG, R.SUM, R.AVG):
                t = torch.arange(5, dtype=torch.float32) / 3
                w = pg.allreduce([t], blocking(op))
                got.append((type(w) is DoneWork, t.tolist(), pg._runtime.seq))
        return got

    (got,) = run_ranks(1, fn, timeout_s=20)
    thin, long = got[:4], got[4:]
    assert [g[0] for g in thin] == [False, False, True, True]  # each op learnt once
    assert not any(g[0] for g in long)
    assert [g[1] for g in thin] == [g[1] for g in long]
    assert [g[2] for g in thin] == [1, 2, 3, 4] and [g[2] for g in long] == [5, 6, 7, 8]

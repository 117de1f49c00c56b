"""Where a collective runs, and that it does not matter to the result.

A blocking call (torch's ``async_op=False``) on CPU tensors runs in the
caller's thread when its group has nothing queued or running; everything else
goes through the group's comm thread. Both must give the same results, in
issue order, whatever mix of the two each rank happens to use. Also covered:
the cached plans and byte views of small messages (a buffer reused, freed and
reallocated at the same address, or reinterpreted as another dtype), and a
Ctrl-C inside a collective run in the caller's thread.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks

from entrenar_pg import CollectiveMismatchError, EntrenarError, EntrenarProcessGroup, Options

pytestmark = pytest.mark.timeout(120)

ALGOS = ["direct", "star", "ring", "auto"]


def _opts(
    *, blocking: bool, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.asyncOp = not blocking
    return opts


def test_blocking_call_completes_in_the_callers_thread() -> None:
    """Blocking: done when the call returns, run by the calling thread. Async:
    returns at once (the peer is still asleep) and runs on the comm thread."""

    looked = threading.Event()  # rank 0 looked at its async call's Work

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[bool, bool, bool, bool]:
        ran_in: list[threading.Thread] = []
        real_run = pg.mesh.run

        def spy(plan, what, pace):  # type: ignore[no-untyped-def]
            ran_in.append(threading.current_thread())
            return real_run(plan, what, pace)

        pg.mesh.run = spy  # type: ignore[method-assign]
        if rank == 1:
            time.sleep(0.3)
        w = pg.allreduce([torch.ones(8)], _opts(blocking=True))
        blocking_done = w.is_completed()
        blocking_here = ran_in[-1] is threading.current_thread()
        if rank == 1:
            # Joins rank 0's async call only once rank 0 has looked at it (an
            # event, not a sleep: a loaded machine may hold rank 0's thread
            # between its call and the look).
            assert looked.wait(30)
        w = pg.allreduce([torch.ones(8)], _opts(blocking=False))
        async_pending = not w.is_completed()
        if rank == 0:
            looked.set()
        w.wait()
        async_elsewhere = ran_in[-1] is not threading.current_thread()
        return blocking_done, blocking_here, async_pending, async_elsewhere

    # TCP: the spy sits on the plans' entry point (``mesh.run``), which the
    # shm-native allreduce of an all-local group does not use.
    res = run_ranks(2, fn, options=Options(transport="tcp"))
    assert all(r[0] and r[1] for r in res), res  # blocking: done on return, in the caller
    assert res[0][2], res  # rank 0's async call returned before rank 1 joined it
    assert all(r[3] for r in res), res  # async: on the comm thread


@pytest.mark.parametrize("algo", ALGOS)
def test_any_mix_of_blocking_and_async_calls_agrees(algo: str) -> None:
    """Each rank picks async or blocking per call at random (its own choice):
    every result is right and comes back in issue order. A blocking call
    issued while async ones are queued must wait its turn, not jump ahead."""
    world, calls = 3, 60

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[list[float]]:
        rng = random.Random(1000 + rank)
        pending: list[tuple[object, torch.Tensor]] = []
        out: list[list[float]] = []
        for i in range(calls):
            # every rank needs the same size for call i: derive it from i alone
            numel = [1, 7, 1000, 70_000][i % 4]
            t = torch.full((numel,), float(rank + 1) * (i + 1))
            blocking = rng.random() < 0.5
            w = pg.allreduce([t], _opts(blocking=blocking))
            pending.append((w, t))
            if blocking or rng.random() < 0.3:
                for pw, pt in pending:
                    pw.wait()  # type: ignore[attr-defined]
                    out.append([float(pt[0]), float(pt[-1])])
                pending.clear()
        for pw, pt in pending:
            pw.wait()  # type: ignore[attr-defined]
            out.append([float(pt[0]), float(pt[-1])])
        return out

    res = run_ranks(world, fn, options=Options(algorithm=algo))
    total = sum(range(1, world + 1))
    expected = [[float(total * (i + 1))] * 2 for i in range(calls)]
    for r in range(world):
        assert res[r] == expected, f"rank {r}"


def test_reused_freed_and_reinterpreted_buffers() -> None:
    """Small-message plans and byte views are cached by buffer address: a
    buffer refilled, freed and reallocated at the same address, or the same
    memory seen as another dtype, must still reduce what it holds now."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[float]:
        got = []
        for i in range(6):
            t = torch.full((1024,), float(rank + i))  # usually lands where the last one was
            pg.allreduce([t], _opts(blocking=i % 2 == 0)).wait()
            got.append(float(t[0]))
            del t
        base = torch.zeros(1024, dtype=torch.float32)
        base.fill_(float(rank + 1))
        pg.allreduce([base], _opts(blocking=True)).wait()
        got.append(float(base[0]))
        as_int = base.view(torch.int32)  # same address and byte length, other dtype
        as_int.fill_(rank + 1)
        pg.allreduce([as_int], _opts(blocking=True)).wait()
        got.append(float(as_int[0]))
        half = base[:512]  # same address, other length
        half.fill_(float(10 * (rank + 1)))
        pg.allreduce([half], _opts(blocking=True)).wait()
        got.append(float(half[0]))
        return got

    res = run_ranks(2, fn)
    expected = [float(2 * i + 1) for i in range(6)] + [3.0, 3.0, 30.0]
    assert res == [expected, expected]


def test_mismatch_is_caught_on_a_cached_plan() -> None:
    """The header is restamped on a cached plan: a different op on the same
    buffer (a warm cache) is still a collective mismatch on both ranks."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[str, int]:
        t = torch.ones(256)
        for _ in range(3):
            pg.allreduce([t], _opts(blocking=True)).wait()  # warm the plan cache
        op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
        with pytest.raises(CollectiveMismatchError) as info:
            pg.allreduce([t], _opts(blocking=True, op=op)).wait()
        return str(info.value), pg._runtime.seq

    results = run_ranks(2, fn, timeout_s=30)
    for m, seq in results:
        assert "reduce_op=0" in m and "reduce_op=4" in m, m  # SUM, MAX
        # Both sides' descriptions carry this call's sequence number (a reused
        # plan is restamped with it), not the one the plan was built for.
        assert m.count(f"allreduce#{seq}(") == 2, m


def test_direct_sums_in_rank_order_on_every_rank() -> None:
    """The direct allreduce accumulates ((c0 + c1) + c2) whichever rank runs it
    (in a scratch part until its own input is read, then in place): every rank
    gets the bits of that one order, on a fresh and on a cached plan."""
    world = 3
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    expected = (inputs[0] + inputs[1]) + inputs[2]

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[torch.Tensor]:
        out = []
        t = torch.empty(1000)
        for _ in range(2):  # the second call reuses the cached plan
            t.copy_(inputs[rank])
            pg.allreduce([t], _opts(blocking=True)).wait()
            out.append(t.clone())
        return out

    for rank, outs in enumerate(run_ranks(world, fn, options=Options(algorithm="direct"))):
        for got in outs:
            assert torch.equal(got, expected), f"rank {rank}"


def test_spin_is_set_by_who_runs_the_job() -> None:
    """A job in the caller's thread busy-polls for ``caller_spin_us``; one on
    the comm thread for ``spin_us`` (two options: the caller waits anyway,
    while the comm thread may share its core with a caller that computes)."""
    seen: dict[str, float] = {}

    def fn(rank: int, pg: EntrenarProcessGroup) -> None:
        real = pg.mesh.run

        def spy(plan, what, pace):  # type: ignore[no-untyped-def]
            where = "comm" if threading.current_thread().name.startswith("entrenar-") else "caller"
            if rank == 0:
                seen[where] = pace.spin_s
            real(plan, what, pace)

        pg.mesh.run = spy  # type: ignore[method-assign]
        t = torch.ones(64)
        pg.allreduce([t], _opts(blocking=True)).wait()
        pg.allreduce([t], _opts(blocking=False)).wait()  # type: ignore[attr-defined]

    opts = Options(caller_spin_us=123, spin_us=7, transport="tcp")  # the spy is on plans
    run_ranks(2, fn, options=opts, timeout_s=30)
    assert seen == {"caller": pytest.approx(123e-6), "comm": pytest.approx(7e-6)}, seen


def test_comm_thread_spin_takes_new_jobs_and_ends_on_shutdown() -> None:
    """The comm thread busy-polls for its next job (``spin_us``): a job issued
    while it spins runs, and destroying the group ends the spin at once
    rather than when it runs out (5 s here)."""
    groups = make_groups(2, Options(spin_us=5_000_000))

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[float]:
        outs = []
        for i in range(3):
            t = torch.full((16,), float(rank + i))
            pg.allreduce([t], _opts(blocking=False)).wait()  # type: ignore[attr-defined]
            outs.append(float(t[0]))
            time.sleep(0.02)  # the comm thread is spinning for the next job now
        return outs

    try:
        assert run_ranks(2, fn, groups=groups, timeout_s=30) == [[1.0, 3.0, 5.0]] * 2
    finally:
        start = time.perf_counter()
        for g in groups:
            g.shutdown()
        elapsed = time.perf_counter() - start
    assert elapsed < 2.5, f"shutdown waited {elapsed:.2f} s for the spin to run out"


def test_ctrl_c_in_a_callers_thread_collective_breaks_the_group_everywhere() -> None:
    """KeyboardInterrupt inside a collective run in the caller's thread reaches
    the caller as KeyboardInterrupt (not swallowed into the Work); the group is
    broken, and the peer raises instead of hanging."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> str:
        if rank == 0:

            def interrupted(plan, what, pace):  # type: ignore[no-untyped-def]
                raise KeyboardInterrupt

            pg.mesh.run = interrupted  # type: ignore[method-assign]
            with pytest.raises(KeyboardInterrupt):
                pg.allreduce([torch.ones(4)], _opts(blocking=True))
            with pytest.raises(EntrenarError, match="cannot be used any more"):
                pg.allreduce([torch.ones(4)], _opts(blocking=True))
            return "interrupted"
        with pytest.raises(EntrenarError) as info:
            pg.allreduce([torch.ones(4)], _opts(blocking=True)).wait()
        return str(info.value)

    res = run_ranks(2, fn, options=Options(transport="tcp"), timeout_s=60)  # plans: mesh.run
    assert res[0] == "interrupted"
    assert "rank 0" in res[1], res[1]


def test_comm_thread_waits_for_a_callers_thread_job() -> None:
    """While a blocking call runs in its caller's thread, an async call issued
    by another thread is queued behind it, not run at once on the comm thread
    (two jobs on the same sockets at once would interleave their bytes)."""

    issued = threading.Event()  # rank 0's second call is issued

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[float]:
        first = torch.full((50_000,), float(rank + 1))
        second = torch.full((50_000,), float(10 * (rank + 1)))
        if rank == 1:
            # Rank 0's first call waits for us in its caller's thread until its
            # second is issued (events, not sleeps: under load a sleep could
            # let the second be issued before the first, or after it ended).
            assert issued.wait(30)
            pg.allreduce([first], _opts(blocking=True)).wait()
            pg.allreduce([second], _opts(blocking=True)).wait()
            return [float(first[0]), float(second[0])]
        works: list[object] = []
        seq = pg._runtime.seq

        def issue_second() -> None:
            # While the first call is in progress: it has its seq (and, under
            # the same lock, the token), and it waits for rank 1.
            deadline = time.monotonic() + 30
            while pg._runtime.seq == seq and time.monotonic() < deadline:
                time.sleep(0.001)
            works.append(pg.allreduce([second], _opts(blocking=False)))
            issued.set()

        helper = threading.Thread(target=issue_second)
        helper.start()
        pg.allreduce([first], _opts(blocking=True)).wait()
        helper.join(10)
        assert works, "the helper thread did not issue its call"
        works[0].wait()  # type: ignore[attr-defined]
        return [float(first[0]), float(second[0])]

    assert run_ranks(2, fn) == [[3.0, 30.0], [3.0, 30.0]]

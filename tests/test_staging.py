"""Staging bookkeeping, tested on CPU.

The CUDA path of ``Staging`` is exercised here with an instrumented fake of its
stream operations (``FakeOps``: an event, a stream context, wait, record_stream,
synchronize, a future) and ordinary host memory, which checks the order of
operations, the pinned-buffer reuse and the future/Work wiring without a GPU.
What only a GPU can show (that the real CUDA streams are ordered) is in
tests/gpu/test_cuda.py.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks
from torch.overrides import TorchFunctionMode

from entrenar_pg import EntrenarProcessGroup
from entrenar_pg.runtime.staging import PinnedPool, Staging

CPU = torch.device("cpu")

# --------------------------------------------------------------------- helpers


class CopyLog(TorchFunctionMode):
    """Records every ``Tensor.copy_`` as ("copy", non_blocking) into a shared log."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            self.log.append(("copy", bool(blocking)))
        return func(*args, **kwargs)


class FakeOps:
    """StreamOps on CPU: logs every call; tracks the thread's current fake stream."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self._local = threading.local()
        self.futures: list[torch.futures.Future[Any]] = []
        self.lock = threading.Lock()

    def _add(self, *entry: Any) -> None:
        with self.lock:
            self.log.append(entry)

    def current(self) -> Any:
        return getattr(self._local, "stream", None)

    def caller_event(self, device: torch.device) -> Any:
        event = ("event", threading.get_ident())
        self._add("record_event", device, threading.get_ident())
        return event

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        prev = self.current()
        self._local.stream = stream
        self._add("enter", stream)
        try:
            yield
        finally:
            self._add("exit", stream)
            self._local.stream = prev

    def wait_event(self, stream: Any, event: Any) -> None:
        assert self.current() == stream, "wait_event outside the stream context"
        self._add("wait_event", stream, event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self._add("record_stream", tensor.data_ptr(), stream)

    def synchronize(self, stream: Any) -> None:
        self._add("synchronize", stream)

    def new_future(self, device: torch.device) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        self.futures.append(fut)
        return fut

    def kinds(self) -> list[str]:
        return [e[0] for e in self.log]


def non_contiguous(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.arange(2 * n, dtype=dtype).view(n, 2).t()  # (2, n), strided
    assert not t.is_contiguous()
    return t


# ------------------------------------------------------------------ PinnedPool


@pytest.mark.timeout(30)
def test_pool_reuses_buffers_per_device_and_slot() -> None:
    pool = PinnedPool(pin=False)
    a = pool.get(0, 0, 100, torch.float32)
    assert a.dtype == torch.float32 and a.numel() == 100 and a.is_contiguous()
    assert pool.allocations == 1
    again = pool.get(0, 0, 100, torch.float32)
    smaller = pool.get(0, 0, 10, torch.float64)
    assert again.data_ptr() == a.data_ptr() == smaller.data_ptr()
    assert smaller.dtype == torch.float64 and smaller.numel() == 10
    assert pool.allocations == 1, "same slot, no growth: must reuse"
    other_slot = pool.get(0, 1, 100, torch.float32)
    other_device = pool.get(1, 0, 100, torch.float32)
    ptrs = {a.data_ptr(), other_slot.data_ptr(), other_device.data_ptr()}
    assert len(ptrs) == 3, "slots and devices must not share buffers"
    assert pool.allocations == 3
    grown = pool.get(0, 0, 1000, torch.float32)
    assert grown.numel() == 1000 and pool.allocations == 4
    assert pool.get(0, 0, 500, torch.float32).data_ptr() == grown.data_ptr()
    assert pool.allocations == 4
    assert pool.nbytes >= 4000 + 400 + 400


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.int64,
        torch.uint8,
        torch.bool,
    ],
)
def test_pool_views_every_dtype(dtype: torch.dtype) -> None:
    pool = PinnedPool(pin=False)
    for numel in (0, 1, 7, 64):
        buf = pool.get(0, 0, numel, dtype)
        assert buf.dtype == dtype and buf.numel() == numel
        buf.fill_(1)
        assert bool((buf == 1).all())


@pytest.mark.timeout(30)
def test_pool_pin_default_and_refusal_without_cuda() -> None:
    assert PinnedPool().pin == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            PinnedPool(pin=True)


# ------------------------------------------------------------- CPU staging


@pytest.mark.timeout(30)
def test_cpu_contiguous_is_used_in_place() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    s = Staging(CPU)
    assert not s.uses_streams and s.completion_context() is None
    (item,) = s.add([t], read=True, write=True)
    log: list[tuple[Any, ...]] = []
    with CopyLog(log):
        s.load()
        assert item.host is not None
        assert item.host.data_ptr() == t.data_ptr() and item.host.shape == (12,)
        item.host.mul_(2)
        s.store()
    assert log == [], "contiguous CPU tensors must not be copied"
    assert torch.equal(t, 2 * torch.arange(12, dtype=torch.float32).view(3, 4))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("read,write", [(True, True), (True, False), (False, True)])
def test_cpu_non_contiguous_copies_in_and_out_per_flags(read: bool, write: bool) -> None:
    t = non_contiguous(5)
    original = t.clone()
    s = Staging(CPU)
    (item,) = s.add([t], read=read, write=write)
    log: list[tuple[Any, ...]] = []
    with CopyLog(log):
        s.load()
    assert item.host is not None and item.host.is_contiguous()
    assert item.host.data_ptr() != t.data_ptr()
    assert len(log) == int(read), f"copy in only when read: {log}"
    if read:
        assert torch.equal(item.host, original.reshape(-1))
    item.host.copy_(torch.arange(10, dtype=torch.float32) + 100)
    log.clear()
    with CopyLog(log):
        s.store()
    assert len(log) == int(write), f"copy out only when written: {log}"
    if write:
        assert torch.equal(t, (torch.arange(10, dtype=torch.float32) + 100).view(2, 5))
    else:
        assert torch.equal(t, original)


@pytest.mark.timeout(30)
def test_cpu_empty_and_zero_dim_tensors() -> None:
    e = torch.empty(0)
    z = torch.tensor(3.0)
    s = Staging(CPU)
    ie, iz = s.add([e, z], read=True, write=True)
    s.load()
    assert ie.host is not None and ie.host.numel() == 0
    assert iz.host is not None and iz.host.shape == (1,)
    iz.host.add_(1)
    s.store()
    assert z.item() == 4.0


# ------------------------------------------------ stream path (CUDA bookkeeping)


def stream_staging(ops: FakeOps, pool: PinnedPool) -> Staging:
    return Staging(CPU, pool, "S", ops)


@pytest.mark.timeout(30)
def test_stream_path_needs_a_stream() -> None:
    with pytest.raises(ValueError, match="needs a comm stream"):
        Staging(CPU, PinnedPool(pin=False), None, FakeOps())
    with pytest.raises(ValueError, match="needs a comm stream"):
        Staging(CPU, None, None, FakeOps())


@pytest.mark.timeout(30)
def test_stream_path_with_buffers_of_its_own() -> None:
    """pool=None (p2p): a fresh buffer per item; a read synchronizes, a write-only load does not."""
    ops = FakeOps()
    src = torch.arange(6, dtype=torch.float32)
    s = Staging(CPU, None, "P", ops)
    (read,) = s.add([src], read=True, write=False)
    s.load()
    assert read.host is not None and read.host.data_ptr() != src.data_ptr()
    assert torch.equal(read.host, src)
    assert ops.kinds()[-2:] == ["synchronize", "exit"], "a read must be on the host before use"
    ops.log.clear()
    dst = non_contiguous(3)
    s = Staging(CPU, None, "P", ops)
    (written,) = s.add([dst], read=False, write=True)
    s.load()
    assert ops.kinds() == ["record_event", "enter", "wait_event", "exit"], ops.log
    assert written.host is not None and written.host.data_ptr() != dst.data_ptr()
    other = Staging(CPU, None, "P", ops)
    (again,) = other.add([torch.zeros(6)], read=False, write=True)
    other.load()
    assert again.host is not None and again.host.data_ptr() != written.host.data_ptr()
    written.host.copy_(torch.arange(6, dtype=torch.float32))
    ops.log.clear()
    s.store()
    assert ops.kinds() == ["enter", "record_stream", "exit"]
    assert torch.equal(dst, torch.arange(6, dtype=torch.float32).view(2, 3))


@pytest.mark.timeout(30)
def test_stream_path_order_of_operations() -> None:
    ops, pool = FakeOps(), PinnedPool(pin=False)
    src = torch.arange(8, dtype=torch.float32)  # read only
    dst = torch.zeros(8)  # written only
    both = non_contiguous(4)  # read and written, strided
    both_before = both.clone()
    s = stream_staging(ops, pool)
    # The caller's event is recorded when the collective is issued, in the caller's thread.
    assert ops.log == [("record_event", CPU, threading.get_ident())]
    assert s.uses_streams and not s.is_cuda
    i_src = s.add([src], read=True, write=False)[0]
    i_dst = s.add([dst], read=False, write=True)[0]
    i_both = s.add([both], read=True, write=True)[0]

    with CopyLog(ops.log):
        s.load()
    kinds = ops.kinds()
    assert kinds[1:3] == ["enter", "wait_event"], kinds
    assert ops.log[2] == ("wait_event", "S", ("event", threading.get_ident()))
    copies = [e for e in ops.log if e[0] == "copy"]
    # src and both are read; dst is not. The strided one is packed first (reshape
    # does not go through copy_), then copied device -> host without blocking.
    assert copies == [("copy", True), ("copy", True)], ops.log
    assert kinds[-2:] == ["synchronize", "exit"], "load must sync the stream before returning"
    assert kinds.index("wait_event") < kinds.index("copy") < kinds.index("synchronize")
    for it in (i_src, i_dst, i_both):
        assert it.host is not None and it.host.is_contiguous()
        assert it.host.data_ptr() != it.user.data_ptr(), "device path always stages"
    assert i_src.host is not None and torch.equal(i_src.host, src)
    assert i_both.host is not None and torch.equal(i_both.host, both_before.reshape(-1))
    assert "record_stream" not in kinds, "reads are synchronized: no record_stream needed"

    assert i_dst.host is not None and i_both.host is not None and i_src.host is not None
    i_dst.host.fill_(7)
    i_both.host.neg_()
    i_src.host.fill_(-1)  # a read-only item is never copied back
    ops.log.clear()
    with CopyLog(ops.log):
        s.store()
    kinds = ops.kinds()
    assert kinds[0] == "enter" and kinds[-1] == "exit"
    assert "synchronize" not in kinds, "store must not block the comm thread on the copies"
    recorded = [e[1] for e in ops.log if e[0] == "record_stream"]
    assert recorded == [dst.data_ptr(), both.data_ptr()], "record_stream on written tensors"
    assert [e for e in ops.log if e[0] == "copy"] == [("copy", True), ("copy", True)]
    assert torch.equal(dst, torch.full((8,), 7.0))
    assert torch.equal(both, -both_before)
    assert torch.equal(src, torch.arange(8, dtype=torch.float32))

    ctx = s.completion_context()
    assert ctx is not None
    ops.log.clear()
    with ctx():
        assert ops.current() == "S", "the future must complete with the comm stream current"
    assert ops.kinds() == ["enter", "exit"]
    fut = s.new_future()
    assert ops.futures == [fut]


@pytest.mark.timeout(30)
def test_stream_path_reuses_pool_buffers_across_calls() -> None:
    ops, pool = FakeOps(), PinnedPool(pin=False)
    ptrs = []
    for step in range(5):
        t = torch.full((1000,), float(step))
        s = stream_staging(ops, pool)
        (it,) = s.add([t], read=True, write=True)
        s.load()
        assert it.host is not None and torch.equal(it.host, t)
        ptrs.append(it.host.data_ptr())
        it.host.add_(1)
        s.store()
        assert torch.equal(t, torch.full((1000,), step + 1.0))
    assert len(set(ptrs)) == 1 and pool.allocations == 1
    # A bigger call grows the slot once; smaller ones reuse it.
    s = stream_staging(ops, pool)
    s.add([torch.zeros(5000)], read=True, write=True)
    s.load()
    s = stream_staging(ops, pool)
    s.add([torch.zeros(10)], read=True, write=True)
    s.load()
    assert pool.allocations == 2


@pytest.mark.timeout(30)
def test_stream_path_empty_tensor_issues_no_copies() -> None:
    ops, pool = FakeOps(), PinnedPool(pin=False)
    s = stream_staging(ops, pool)
    (it,) = s.add([torch.empty(0)], read=True, write=True)
    with CopyLog(ops.log):
        s.load()
        s.store()
    assert "copy" not in ops.kinds() and "record_stream" not in ops.kinds()
    assert it.host is not None and it.host.numel() == 0


# ------------------------------------------- future / Work wiring through the group


def patch_stream_staging(groups: list[EntrenarProcessGroup]) -> list[tuple[FakeOps, PinnedPool]]:
    """Make each group stage its CPU tensors through the stream path with FakeOps."""
    fakes = []
    for g in groups:
        ops, pool = FakeOps(), PinnedPool(pin=False)
        fakes.append((ops, pool))

        def staging(device: torch.device, ops: FakeOps = ops, pool: PinnedPool = pool) -> Staging:
            return Staging(device, pool, "S", ops)

        g._runtime.staging = staging  # type: ignore[method-assign]
    return fakes


@pytest.mark.timeout(60)
def test_group_completes_future_on_comm_stream_and_reuses_buffers() -> None:

    world = 2
    groups = make_groups(world)
    try:
        fakes = patch_stream_staging(groups)

        def fn(rank: int, g: EntrenarProcessGroup) -> Any:
            ops, pool = fakes[rank]
            seen: list[Any] = []
            results = []
            for step in range(4):
                t = non_contiguous(50) + rank + step
                expected = sum(non_contiguous(50) + r + step for r in range(world))
                work = g.allreduce([t])
                fut = work.get_future()
                # Runs inside set_result, in the completing thread.
                fut.add_done_callback(lambda _f: seen.append(ops.current()))
                work.wait()
                results.append(torch.equal(t, expected))
            out = [torch.zeros(3) for _ in range(world)]
            g.allgather([out], [torch.full((3,), float(rank))]).wait()
            assert all(torch.equal(o, torch.full((3,), float(r))) for r, o in enumerate(out))
            return results, seen, pool.allocations, len(ops.futures)

        for results, seen, allocations, nfutures in run_ranks(world, fn, groups=groups):
            assert results == [True] * 4
            # The callback may run in the waiting thread if it was added after
            # completion; whenever it ran in the comm thread, S was current.
            assert all(s in ("S", None) for s in seen) and len(seen) == 4
            # slot 0 (allreduce, then the allgather input: reused), slots 1..world (outputs)
            assert allocations == 1 + world, "buffers must be reused across calls"
            assert nfutures == 5, "every collective's future must come from the staging"
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.timeout(60)
def test_group_future_completed_inside_stream_context() -> None:
    """Deterministic version of the above: the callback is attached before the job runs."""

    groups = make_groups(1)
    try:
        ((ops, _pool),) = patch_stream_staging(groups)
        g = groups[0]
        gate = threading.Event()
        # Block the comm thread with a job queued ahead, so the next one is pending.
        blocker = torch.futures.Future()  # type: ignore[var-annotated]
        from entrenar_pg.runtime.engine import Job

        g._runtime.engine.submit(Job(10_000, "blocker", 0, lambda: gate.wait(10), blocker))
        t = torch.ones(4)
        work = g.allreduce([t])
        seen: list[Any] = []
        ran = threading.Event()

        def record(_f: Any) -> None:
            seen.append((ops.current(), threading.current_thread().name))
            ran.set()

        # get_future() is a chained future: its callbacks run after wait() returns
        work.get_future().add_done_callback(record)
        gate.set()
        work.wait()
        assert ran.wait(10), "the future's callback never ran"
        assert len(seen) == 1
        stream, thread = seen[0]
        assert thread.startswith("entrenar-"), thread
        assert stream == "S", "set_result must run with the comm stream current"
    finally:
        for g in groups:
            g.shutdown()


# -------------------------------------------------- p2p through the stream path


class ThreadOps(FakeOps):
    """FakeOps that also logs which thread each record_stream ran in."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        assert self.current() == stream, "record_stream outside the stream context"
        self._add("record_stream", tensor.data_ptr(), stream, threading.current_thread().name)


def p2p_stream_staging(ops: FakeOps, device: torch.device) -> Staging:
    return Staging(device, None, "P", ops)


@pytest.mark.timeout(60)
def test_p2p_stages_through_the_stream_path() -> None:
    """A send's host copy waits on the caller's event and is synchronized
    before its bytes are queued; a recv's copy back runs in the p2p thread on
    the p2p stream, and its future completes with that stream current."""
    groups = make_groups(2)
    try:
        fakes = [ThreadOps() for _ in groups]
        for g, ops in zip(groups, fakes, strict=True):
            g._runtime.p2p.staging = partial(p2p_stream_staging, ops)
        sent = non_contiguous(6)  # strided on both sides: packed, then unpacked
        got = torch.zeros(2, 12)[:, ::2]  # (2, 6), strided
        assert not got.is_contiguous() and got.shape == sent.shape

        def fn(rank: int, g: EntrenarProcessGroup) -> Any:
            ops = fakes[rank]
            me = threading.get_ident()
            if rank == 1:
                work = g.recv([got], 0, 5)
                (fut,) = ops.futures
                seen: list[Any] = []
                called = threading.Event()

                def record(_f: Any) -> None:
                    seen.append((ops.current(), threading.current_thread().name))
                    called.set()

                fut.add_done_callback(record)
                posted = list(ops.log)
                g.allreduce([torch.ones(1)]).wait()  # now rank 0 sends
                work.wait()
                # A future wakes its waiters before it runs its callbacks.
                assert called.wait(30), "the recv future's callback never ran"
                return posted, seen
            g.allreduce([torch.ones(1)]).wait()
            copies: list[tuple[Any, ...]] = []
            with CopyLog(copies):
                work = g.send([sent], 1, 5)
            assert ops.log[0] == ("record_event", CPU, me)
            work.wait()
            return copies, list(ops.log)

        (copies, send_log), (posted, seen) = run_ranks(2, fn, groups=groups)
        kinds = [e[0] for e in send_log]
        assert kinds[:3] == ["record_event", "enter", "wait_event"], send_log
        assert kinds.index("synchronize") < kinds.index("exit"), "host copy done before queueing"
        assert ("copy", True) in copies, "device -> host copy is asynchronous on the stream"
        assert "record_stream" not in kinds
        assert len(fakes[0].futures) == 1, "the send's future comes from the staging"

        # Posting the recv: the stream waits on the caller's event, nobody blocks.
        assert [e[0] for e in posted] == ["record_event", "enter", "wait_event", "exit"], posted
        log1 = fakes[1].log[len(posted) :]
        (rs,) = [e for e in log1 if e[0] == "record_stream"]
        assert rs[1] == got.data_ptr() and rs[2] == "P"
        assert rs[3].startswith("entrenar-p2p-r1"), "the copy back runs in the p2p thread"
        assert seen == [("P", rs[3])], "set_result must run with the p2p stream current"
        assert torch.equal(got, sent)
    finally:
        for g in groups:
            g.shutdown()


# ------------------------------------------------------------- mixed devices


class FakeDeviceTensor(torch.Tensor):
    """A CPU tensor that reports another device (to test validation without a GPU)."""

    @property  # type: ignore[override]
    def device(self) -> torch.device:  # type: ignore[override]
        return self.__dict__.get("_fake_device", torch.device("cuda", 0))


def on(device: str, n: int = 4) -> torch.Tensor:
    t = torch.zeros(n).as_subclass(FakeDeviceTensor)
    t.__dict__["_fake_device"] = torch.device(device)
    return t


@pytest.mark.timeout(60)
def test_mixed_devices_are_a_value_error_before_anything_is_sent() -> None:
    def fn(rank: int, g: EntrenarProcessGroup) -> int:
        cpu = torch.zeros(4)
        calls = [
            ("allreduce", lambda: g.allreduce([cpu, on("cuda:0")])),
            ("allreduce cuda:0+cuda:1", lambda: g.allreduce([on("cuda:0"), on("cuda:1")])),
            ("allreduce_coalesced", lambda: g.allreduce_coalesced([on("cuda:0"), cpu])),
            ("broadcast", lambda: g.broadcast([on("cuda:0"), cpu], dist.BroadcastOptions())),
            ("allgather", lambda: g.allgather([[cpu, cpu]], [on("cuda:0")])),
            ("allgather out", lambda: g.allgather([[on("cuda:1"), cpu]], [cpu])),
        ]
        # Whichever of these entrenar implements (collectives added later are covered too).
        # send/recv take exactly one tensor, so a call cannot mix devices.
        c4, c8 = torch.zeros(4), torch.zeros(8)

        def as_root(opts: Any) -> Any:
            opts.rootRank = rank
            return opts

        more = {
            "all_gather_single": lambda: g.all_gather_single(c8, on("cuda:0")),
            "reduce": lambda: g.reduce([c4, on("cuda:0")]),
            # rooted: each rank calls as the root (the only side that has several tensors)
            "gather": lambda: g.gather([[c4, c4]], [on("cuda:0")], as_root(dist.GatherOptions())),
            "scatter": lambda: g.scatter(
                [on("cuda:0")], [[c4, c4]], as_root(dist.ScatterOptions())
            ),
            "alltoall_base": lambda: g.alltoall_base(c8, on("cuda:0", 8), [], []),
            "all_to_all_single": lambda: g.all_to_all_single(c8, on("cuda:0", 8), [], []),
            "alltoall": lambda: g.alltoall([c4, c4], [on("cuda:0"), c4]),
            "reduce_scatter": lambda: g.reduce_scatter([on("cuda:0")], [[c4, c4]]),
            "reduce_scatter_single": lambda: g.reduce_scatter_single(c4, on("cuda:0", 8)),
            "reduce_scatter_tensor_coalesced": lambda: g.reduce_scatter_tensor_coalesced(
                [c4], [on("cuda:0", 8)]
            ),
            "allgather_coalesced": lambda: g.allgather_coalesced([[c4, c4]], [on("cuda:0")]),
            "allgather_into_tensor_coalesced": lambda: g.allgather_into_tensor_coalesced(
                [c8], [on("cuda:0")]
            ),
        }
        ours = [c for c in type(g).__mro__ if c.__module__.startswith("entrenar_pg")]
        for name, call in more.items():
            if any(name in vars(c) for c in ours):
                calls.append((name, call))
        for name, call in calls:
            with pytest.raises(ValueError, match="different devices"):
                call()
                pytest.fail(f"{name}: tensors on different devices were accepted")
        with pytest.raises(ValueError, match="not supported"):
            g.allreduce([torch.zeros(2, device="meta")])
        # Nothing was sent: the group still works and every rank is in step.
        t = torch.full((4,), float(rank))
        g.allreduce([t]).wait()
        assert torch.equal(t, torch.full((4,), float(sum(range(g.size())))))
        return len(calls)

    counts = run_ranks(2, fn)
    assert counts[0] == counts[1] >= 6

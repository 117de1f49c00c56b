"""Core backend, unit level: N ranks as threads, over each transport (loopback TCP, and the
same-host shared-memory rings that ``auto`` picks for them).

Covers the allreduce algorithms across world sizes and sizes, every reduce op
and dtype against a reference computed in one process, broadcast/allgather/
barrier, argument validation, mismatch detection and timeouts.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks

from entrenar_pg import (
    CollectiveMismatchError,
    EntrenarProcessGroup,
    Options,
    PeerConnectionError,
)
from entrenar_pg.config import ENV_ALGORITHM, ENV_SEGMENT_BYTES
from entrenar_pg.wire import Algo, Header, OpCode

pytestmark = pytest.mark.timeout(120)

ALGOS = ["ring", "star", "direct"]
# gloo's style: every sweep runs over (transport, world size, size, algorithm).
TRANSPORTS = ["tcp", "shm"]


def allreduce(pg: EntrenarProcessGroup, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    """As ``dist.all_reduce(t, op)`` calls it: blocking (runs in this thread when the
    group is idle); test_execution.py covers async and blocking side by side."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.asyncOp = False
    pg.allreduce([t], opts).wait()


# ---------------------------------------------------------------- config and wire


def test_options_from_env_and_validation() -> None:
    o = Options.from_env({ENV_ALGORITHM: "Ring", ENV_SEGMENT_BYTES: "4096"})
    assert (o.algorithm, o.segment_bytes) == ("ring", 4096)
    with pytest.raises(ValueError, match="ENTRENAR_ALGO"):
        Options.from_env({ENV_ALGORITHM: "tree"})
    with pytest.raises(ValueError, match="ENTRENAR_SEGMENT_BYTES"):
        Options.from_env({ENV_SEGMENT_BYTES: "lots"})
    with pytest.raises(ValueError, match="ENTRENAR_DETERMINISTIC"):
        Options.from_env({"ENTRENAR_DETERMINISTIC": "maybe"})
    o = Options.from_env(
        {"ENTRENAR_CALLER_SPIN_US": "0", "ENTRENAR_SPIN_US": "20", "ENTRENAR_IDLE_SPIN_US": "7"}
    )
    assert (o.caller_spin_us, o.spin_us, o.idle_spin_us) == (0, 20, 7)
    with pytest.raises(ValueError, match="caller_spin_us"):
        Options(caller_spin_us=-1)
    with pytest.raises(ValueError, match="idle_spin_us"):
        Options(idle_spin_us=-1)
    with pytest.raises(TypeError):
        Options("ring")  # type: ignore[misc]  # keyword-only


def test_header_round_trip_and_garbage() -> None:
    h = Header(7, OpCode.ALLREDUCE, Algo.RING, torch.bfloat16, 4, 123456789, -1)
    assert Header.unpack(h.pack()) == h
    assert len(h.pack()) == 32
    with pytest.raises(ValueError, match="not an entrenar frame"):
        Header.unpack(b"\0" * 32)


# ---------------------------------------------------------------- allreduce sweep


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("world", range(1, 9))
def test_allreduce_sizes(world: int, algo: str, transport: str) -> None:
    """Sizes 0, 1, 7 (non-divisible) and many segments (64-byte segments)."""
    sizes = [0, 1, 7, 1000]

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[torch.Tensor]:
        outs = []
        for n in sizes:
            t = torch.arange(n, dtype=torch.float64) + 1000.0 * rank
            allreduce(pg, t)
            outs.append(t)
        return outs

    options = Options(algorithm=algo, segment_bytes=64, transport=transport)
    results = run_ranks(world, fn, options=options)
    for i, n in enumerate(sizes):
        expected = torch.arange(n, dtype=torch.float64) * world + 1000.0 * sum(range(world))
        for rank in range(world):
            assert torch.equal(results[rank][i], expected), (world, algo, n, rank)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("world", [2, 3])
def test_allreduce_64mib(world: int, algo: str) -> None:
    numel = (64 << 20) // 4

    def fn(rank: int, pg: EntrenarProcessGroup) -> bool:
        t = torch.full((numel,), float(rank + 1))
        t[-1] = rank
        allreduce(pg, t)
        expected = world * (world + 1) / 2
        return bool((t[:-1] == expected).all()) and t[-1].item() == sum(range(world))

    assert all(run_ranks(world, fn, options=Options(algorithm=algo), timeout_s=100))


# ---------------------------------------------------------------- ops x dtypes

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
OPS = {
    "SUM": dist.ReduceOp.SUM,
    "AVG": dist.ReduceOp.AVG,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "BAND": dist.ReduceOp.BAND,
    "BOR": dist.ReduceOp.BOR,
    "BXOR": dist.ReduceOp.BXOR,
    "PREMUL_SUM": dist._make_nccl_premul_sum(0.5),
}
VALID = {
    "SUM": FLOATS + INTS + [torch.bool],
    "PRODUCT": FLOATS + INTS + [torch.bool],
    "MIN": FLOATS + INTS + [torch.bool],
    "MAX": FLOATS + INTS + [torch.bool],
    "AVG": FLOATS + INTS,  # integers: NCCL's truncating division (test_int_avg.py)
    "PREMUL_SUM": FLOATS,
    "BAND": INTS + [torch.bool],
    "BOR": INTS + [torch.bool],
    "BXOR": INTS + [torch.bool],
}


def _input(rank: int, dtype: torch.dtype, n: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + rank)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) + 0.5).to(dtype)
    return torch.randint(1, 5, (n,), generator=g).to(dtype)


def _reference(name: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    acc = inputs[0].clone()
    if name == "PREMUL_SUM":
        acc = acc * 0.5
    for x in inputs[1:]:
        if name in ("SUM", "AVG"):
            acc = acc + x
        elif name == "PREMUL_SUM":
            acc = acc + x * 0.5
        elif name == "PRODUCT":
            acc = acc * x
        elif name == "MIN":
            acc = torch.minimum(acc, x)
        elif name == "MAX":
            acc = torch.maximum(acc, x)
        elif name == "BAND":
            acc = acc & x
        elif name == "BOR":
            acc = acc | x
        elif name == "BXOR":
            acc = acc ^ x
    if name == "AVG":
        # (positive inputs here: truncation and floor agree; test_int_avg.py has the signs)
        trunc = None if acc.is_floating_point() else "trunc"
        acc = torch.div(acc, len(inputs), rounding_mode=trunc)
    return acc


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("algo", ALGOS)
def test_every_op_and_dtype_against_reference(algo: str, transport: str) -> None:
    world = 3
    cases = [(name, dt) for name, dts in VALID.items() for dt in dts]

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[torch.Tensor]:
        outs = []
        for name, dt in cases:
            t = _input(rank, dt)
            allreduce(pg, t, OPS[name])
            outs.append(t)
        return outs

    options = Options(algorithm=algo, segment_bytes=16, transport=transport)
    results = run_ranks(world, fn, options=options)
    for i, (name, dt) in enumerate(cases):
        ref = _reference(name, [_input(r, dt) for r in range(world)])
        for rank in range(world):
            got = results[rank][i]
            assert got.dtype == dt
            if dt.is_floating_point:
                tol = 1e-2 if dt in (torch.float16, torch.bfloat16) else 1e-6
                torch.testing.assert_close(got.double(), ref.double(), rtol=tol, atol=tol)
            else:
                assert torch.equal(got, ref), (name, dt, rank)
        # every rank holds the same bits
        assert all(torch.equal(results[0][i], results[r][i]) for r in range(world))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("factor", [0.5, torch.tensor(0.5)])
def test_premul_sum_on_a_torch_without_reduce_op_factor(monkeypatch, factor) -> None:
    # torch before 2.12 (2.11 is what CUDA images ship) has no ReduceOp.factor:
    # the factor lives only in the op's pickle state. There every PREMUL_SUM
    # once failed with "PREMUL_SUM without a factor".
    monkeypatch.delattr(dist.ReduceOp, "factor", raising=False)  # absent on torch 2.11
    op = dist._make_nccl_premul_sum(factor)

    def fn(rank: int, pg: EntrenarProcessGroup) -> torch.Tensor:
        t = _input(rank, torch.float32)
        allreduce(pg, t, op)
        return t

    results = run_ranks(2, fn)
    ref = _reference("PREMUL_SUM", [_input(r, torch.float32) for r in range(2)])
    for got in results:
        torch.testing.assert_close(got, ref)


# ---------------------------------------------------------------- other collectives


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_broadcast_allgather_barrier_coalesced(world: int, transport: str) -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> None:
        for root in range(world):
            for n in (0, 5, 300_000):  # 300k floats > star_max_bytes: chained broadcast
                t = torch.full((n,), float(rank))
                opts = dist.BroadcastOptions()
                opts.rootRank = root
                pg.broadcast([t], opts).wait()
                assert bool((t == root).all()), (rank, root, n)
        outs = [torch.empty(4, dtype=torch.int32) for _ in range(world)]
        pg.allgather([outs], [torch.full((4,), rank, dtype=torch.int32)]).wait()
        assert [int(o[0]) for o in outs] == list(range(world))
        flat = torch.empty(3 * world)
        pg._allgather_base(flat, torch.full((3,), float(rank))).wait()
        assert flat.tolist() == [float(r) for r in range(world) for _ in range(3)]
        a, b = torch.ones(3) * rank, torch.ones(5, 2) * rank
        pg.allreduce_coalesced([a, b]).wait()
        assert bool((a == sum(range(world))).all()) and bool((b == sum(range(world))).all())
        pg.barrier().wait()

    run_ranks(world, fn, options=Options(segment_bytes=4096, transport=transport))


def test_barrier_really_waits() -> None:
    """No rank leaves the barrier before the last one arrives."""
    arrive: dict[int, float] = {}
    leave: dict[int, float] = {}

    def fn(rank: int, pg: EntrenarProcessGroup) -> None:
        time.sleep(0.3 * rank)
        arrive[rank] = time.monotonic()
        pg.barrier().wait()
        leave[rank] = time.monotonic()

    run_ranks(3, fn)
    assert min(leave.values()) >= max(arrive.values())


def test_async_work_overlaps_and_completes_in_order() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> list[float]:
        ts = [torch.full((10_000,), float(i + rank)) for i in range(20)]
        works = [pg.allreduce([t]) for t in ts]  # all in flight at once
        for w in works:
            assert w.wait() is True
            assert w.is_completed() and w.is_success()
            assert w.get_future().value() is not None
        return [float(t[0]) for t in ts]

    res = run_ranks(2, fn)
    assert res[0] == res[1] == [float(2 * i + 1) for i in range(20)]


# ---------------------------------------------------------------- errors


def test_bad_arguments_raise_before_sending_and_group_survives() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> float:
        with pytest.raises(ValueError, match=rf"rank {rank}: allreduce.*BXOR.*float32"):
            allreduce(pg, torch.ones(3), dist.ReduceOp.BXOR)
        with pytest.raises(ValueError, match="AVG.*bool"):
            allreduce(pg, torch.ones(3, dtype=torch.bool), dist.ReduceOp.AVG)
        with pytest.raises(ValueError, match="different dtypes"):
            pg.allreduce_coalesced([torch.ones(2), torch.ones(2, dtype=torch.float64)])
        with pytest.raises(ValueError, match="complex64 is not supported"):
            pg.allreduce([torch.ones(2, dtype=torch.complex64)])
        with pytest.raises(ValueError, match="only dense tensors.*sparse_csr"):
            pg.allreduce([torch.ones(2, 2).to_sparse_csr()])  # sparse COO works (test_sparse.py)
        with pytest.raises(ValueError, match="root rank 7"):
            opts = dist.BroadcastOptions()
            opts.rootRank = 7
            pg.broadcast([torch.ones(2)], opts)
        with pytest.raises(ValueError, match="output list has 1 tensors"):
            pg.allgather([[torch.ones(2)]], [torch.ones(2)])
        with pytest.raises(
            TypeError, match=rf"rank {rank}: allreduce: .*\(list\[float\]\) fit none"
        ):
            pg.allreduce([3.0])
        t = torch.ones(4)
        allreduce(pg, t)  # nothing was sent above: the ranks are still in step
        return float(t[0])

    assert run_ranks(2, fn) == [2.0, 2.0]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("algo", ALGOS)
def test_mismatched_collectives_raise_on_both(algo: str, transport: str) -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> str:
        with pytest.raises(CollectiveMismatchError) as info:
            if rank == 0:
                allreduce(pg, torch.ones(10))
            else:
                pg.broadcast([torch.ones(10)], None).wait()
        # later calls say the group is broken, with the same class
        with pytest.raises(CollectiveMismatchError, match="cannot be used any more"):
            allreduce(pg, torch.ones(1))
        return str(info.value)

    msgs = run_ranks(2, fn, options=Options(algorithm=algo, transport=transport), timeout_s=30)
    for m in msgs:
        assert "allreduce#1" in m and "broadcast#1" in m, m


def test_size_mismatch_is_detected() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> None:
        with pytest.raises(CollectiveMismatchError, match=r"mismatch.*numel=1[012].*numel=1[012]"):
            allreduce(pg, torch.ones(10 + rank))

    run_ranks(3, fn, timeout_s=30)


def test_stalled_peer_times_out_on_every_rank() -> None:
    """Rank 2 joins only once ranks 0 and 1 have given up (or 20 s have
    passed): they raise at the 2 s no-progress timeout, while rank 2 is still
    held. Held by events, not a fixed sleep, so a loaded machine that makes
    the timeout and its wait-for walk late cannot turn the outcome."""
    groups = make_groups(3, Options(), timeout_s=2.0)
    gave_up = [threading.Event(), threading.Event()]
    started = time.monotonic()

    def fn(rank: int, pg: EntrenarProcessGroup) -> float | bool:
        if rank == 2:
            held = all(e.wait(20.0) for e in gave_up)  # never joins the collective in time
            with pytest.raises(PeerConnectionError):
                allreduce(pg, torch.ones(8))
            return held
        try:
            with pytest.raises(PeerConnectionError, match="no progress|rank 2|failed"):
                allreduce(pg, torch.ones(8))
        finally:
            gave_up[rank].set()
        return time.monotonic() - started

    try:
        *elapsed, held = run_ranks(3, fn, groups=groups, timeout_s=60)
    finally:
        for g in groups:
            g.shutdown()
    # Both gave up before rank 2 came (within the timeout, not after it), and
    # neither before the timeout had run out.
    assert held is True, elapsed
    assert min(elapsed) >= 2.0, elapsed


def test_missing_rank_fails_group_creation_within_timeout() -> None:
    store = dist.HashStore()
    start = time.monotonic()
    with pytest.raises(PeerConnectionError, match="rank 1: timed out"):
        EntrenarProcessGroup(store, 1, 2, timeout=timedelta(seconds=1.5), options=Options())
    assert time.monotonic() - start < 4


def test_intruder_connection_is_refused() -> None:
    """A connection that cannot answer the challenge never becomes a peer."""
    import socket

    store = dist.HashStore()
    results: dict[int, object] = {}

    import threading

    def make(rank: int) -> None:
        results[rank] = EntrenarProcessGroup(
            dist.PrefixStore("x", store), rank, 2, timeout=timedelta(seconds=10), options=Options()
        )

    t0 = threading.Thread(target=make, args=(0,), daemon=True)
    t0.start()
    prefixed = dist.PrefixStore("x", store)
    prefixed.wait(["entrenar/a0/addr/0"], timedelta(seconds=10))
    host, port = prefixed.get("entrenar/a0/addr/0").decode().rsplit(":", 1)
    intruder = socket.create_connection((host, int(port)), timeout=15)
    # Rank 0 challenges once every rank has published its address (its
    # acceptor starts after that one store round trip): start rank 1 too.
    t1 = threading.Thread(target=make, args=(1,), daemon=True)
    t1.start()
    intruder.recv(16)  # the challenge
    # A well-formed hello (rank 1 of 2, data channel) with a MAC it cannot know.
    hello = b"ENTR" + b"".join(v.to_bytes(4, "little") for v in (1, 2, 0))
    intruder.sendall(hello + b"x" * 32)
    assert intruder.recv(32) == b""  # refused and closed
    intruder.close()
    t0.join(15)
    t1.join(15)
    groups = [results[0], results[1]]
    try:

        def fn(rank: int, pg: EntrenarProcessGroup) -> float:
            t = torch.ones(3)
            allreduce(pg, t)
            return float(t[0])

        assert run_ranks(2, fn, groups=groups) == [2.0, 2.0]  # type: ignore[arg-type]
    finally:
        for g in groups:
            g.shutdown()  # type: ignore[attr-defined]


def test_busy_poll_option_gives_the_same_results() -> None:
    """Busy-polling before sleeping in poll() (``caller_spin_us`` for these
    blocking calls, ``spin_us`` on the comm thread): with a peer that is late
    by more than the spin, both the spin and the sleep after it run."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[float]:
        out = []
        for i in range(3):
            if rank == 1:
                time.sleep(0.05)  # longer than the 1 ms spin
            t = torch.full((70_000,), float(rank + 1 + i))
            allreduce(pg, t)
            out.append(float(t[-1]))
        return out

    res = run_ranks(2, fn, options=Options(spin_us=1000, caller_spin_us=1000))
    assert res == [[3.0, 5.0, 7.0]] * 2

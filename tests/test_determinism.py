"""Deterministic mode (ENTRENAR_DETERMINISTIC=1): one canonical summation order, identical bits.

N ranks run as threads over real loopback TCP (conftest.run_ranks). Every
comparison is bitwise (``torch.equal`` on the raw bits), against the reference
tree sum computed in one process (``entrenar_pg.tree_sum``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks

from entrenar_pg import EntrenarProcessGroup, Options, tree_sum
from entrenar_pg import collectives as alg
from entrenar_pg.reduce_ops import Kind, Reduction
from entrenar_pg.wire import OpCode

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def inputs(world: int, numel: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Per-rank inputs with a wide dynamic range, so the summation order shows in the bits."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 3)).to(dtype)
        for _ in range(world)
    ]


def avg_op() -> dist.AllreduceOptions:
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.AVG
    return o


def det(**kw: object) -> Options:
    return Options(deterministic=True, **kw)  # type: ignore[arg-type]


# A few thousand elements, not divisible by any world size > 1, several segments.
NUMEL = 3001
SEGMENT = 1024


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_repeated_allreduce_identical_bits(world: int, dtype: torch.dtype) -> None:
    """100 allreduces of the same inputs: identical bits every time, equal to tree_sum."""
    repeats = 100
    xs = inputs(world, NUMEL, dtype, seed=world)
    ref = tree_sum(xs)

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[torch.Tensor]:
        outs = []
        for _ in range(repeats):
            t = xs[rank].clone()
            pg.allreduce([t]).wait()
            outs.append(t)
        return outs

    results = run_ranks(world, fn, options=det(algorithm="ring", segment_bytes=SEGMENT))
    for rank, outs in enumerate(results):
        assert len(outs) == repeats
        for i, out in enumerate(outs):
            assert same_bits(out, ref), f"rank {rank}, repeat {i}: differs from the tree sum"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [3, 4, 6])
def test_all_algorithms_identical(world: int) -> None:
    """The same inputs through ring, star, direct and auto (all its paths): the same bits."""
    sizes = [1, 7, 200, 5000]  # auto: direct up to 64 B, star up to 1 KiB, then ring
    xs = {n: inputs(world, n, torch.float32, seed=n) for n in sizes}
    results: dict[str, list[list[torch.Tensor]]] = {}
    for algo in ("ring", "star", "direct", "auto"):

        def fn(rank: int, pg: EntrenarProcessGroup) -> list[torch.Tensor]:
            outs = []
            for n in sizes:
                t = xs[n][rank].clone()
                pg.allreduce([t]).wait()
                a = xs[n][rank].clone()
                pg.allreduce([a], avg_op()).wait()
                outs += [t, a]
            return outs

        opts = det(algorithm=algo, segment_bytes=256, star_max_bytes=1024, direct_max_bytes=64)
        results[algo] = run_ranks(world, fn, options=opts)
    for i, n in enumerate(sizes):
        ref = tree_sum(xs[n])
        ref_avg = ref / world
        for algo, per_rank in results.items():
            for rank, outs in enumerate(per_rank):
                assert same_bits(outs[2 * i], ref), f"{algo}, rank {rank}, numel {n}: sum"
                assert same_bits(outs[2 * i + 1], ref_avg), f"{algo}, rank {rank}, numel {n}: avg"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 5])
def test_independent_of_segments_and_bucketing(world: int) -> None:
    """Whole vs in pieces vs coalesced, across segment sizes: bit for bit the same."""
    numel = 10_007
    xs = inputs(world, numel, torch.float32, seed=7)
    cuts = [0, 1, 1000, 1001, 4096, 9000, numel]  # uneven pieces, one of one element
    ref = tree_sum(xs)
    for segment in (64, 4000, 1 << 20):
        for algo in ("ring", "star"):

            def fn(rank: int, pg: EntrenarProcessGroup) -> list[torch.Tensor]:
                whole = xs[rank].clone()
                pg.allreduce([whole]).wait()
                pieces = [xs[rank][a:b].clone() for a, b in zip(cuts, cuts[1:], strict=False)]
                for p in pieces:
                    pg.allreduce([p]).wait()
                coalesced = [xs[rank][a:b].clone() for a, b in zip(cuts, cuts[1:], strict=False)]
                pg.allreduce_coalesced(coalesced).wait()
                return [whole, torch.cat(pieces), torch.cat(coalesced)]

            opts = det(algorithm=algo, segment_bytes=segment)
            for rank, outs in enumerate(run_ranks(world, fn, options=opts)):
                for name, out in zip(("whole", "pieces", "coalesced"), outs, strict=True):
                    assert same_bits(out, ref), f"{algo}, segment {segment}, rank {rank}: {name}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slow_rank", [0, 2])
def test_a_slow_rank_keeps_the_bits(slow_rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank combines slowly: its partners' data for a level runs ahead of
    its combines at the level below.

    With many segments per chunk (the halving, halving.py) a segment whose
    data arrived before the level below was combined must wait for it; one
    combined out of order, or read before it was combined, makes the bits
    differ from the tree sum.
    """
    import threading
    import time

    from entrenar_pg.collectives import halving

    world, numel = 4, 40_000
    xs = inputs(world, numel, torch.float32, seed=11)
    original = halving.combine_into
    calls = [0]

    def slow(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, kind: Kind) -> None:
        if threading.current_thread().name.startswith(f"entrenar-r{slow_rank}-"):
            calls[0] += 1
            time.sleep(0.0005 * (calls[0] % 3))
        original(dst, a, b, kind)

    monkeypatch.setattr(halving, "combine_into", slow)

    def fn(rank: int, pg: EntrenarProcessGroup) -> torch.Tensor:
        t = xs[rank].clone()
        pg.allreduce([t]).wait()
        return t

    outs = run_ranks(world, fn, options=det(algorithm="ring", segment_bytes=256))
    assert calls[0] > 100, "the slow rank was not slowed"
    ref = tree_sum(xs)
    for rank, out in enumerate(outs):
        assert same_bits(out, ref), f"rank {rank}: combined out of order"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("kind", [Kind.SUM, Kind.AVG, Kind.MAX])
def test_reduce_scatter_tree(world: int, kind: Kind) -> None:
    """``reduce_scatter_tree`` with uneven chunks: chunks[r] is the tree reduction of chunk r."""
    lengths = [(3 * i + 5) * 97 for i in range(world)]  # unequal chunk sizes, many segments
    total = sum(lengths)
    xs = inputs(world, total, torch.float32, seed=world + 10)
    red = Reduction(kind)

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(t, lengths))

    def fn(rank: int, pg: EntrenarProcessGroup) -> torch.Tensor:
        buf = xs[rank].clone()
        choice = alg.choose(OpCode.REDUCE_SCATTER, 0, world, pg.options)
        call = alg.Call(pg.mesh, 10**6, choice, alg.ScratchPool(), 0.0, 30.0)  # the group is idle
        alg.reduce_scatter_tree(call, split(buf), red)
        return split(buf)[rank].clone()

    outs = run_ranks(world, fn, options=det(segment_bytes=512))
    for rank, out in enumerate(outs):
        parts = [split(x)[rank] for x in xs]
        if kind is Kind.MAX:
            ref = torch.stack(parts).amax(0)
        else:
            ref = tree_sum(parts)
            if kind is Kind.AVG:
                ref = ref / world
        assert same_bits(out, ref), f"rank {rank}: chunk differs from its tree reduction"


@pytest.mark.timeout(60)
def test_integer_and_empty() -> None:
    """Integer sums are exact; empty tensors and one-element tensors go through."""
    world = 4
    ints = [torch.arange(1000, dtype=torch.int64) * (r + 1) for r in range(world)]

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[torch.Tensor]:
        a = ints[rank].clone()
        e = torch.empty(0)
        one = torch.full((1,), float(rank))
        for t in (a, e, one):
            pg.allreduce([t]).wait()
        return [a, e, one]

    for a, e, one in run_ranks(world, fn, options=det(algorithm="ring")):
        assert torch.equal(a, sum(ints))
        assert e.numel() == 0
        assert one.item() == 6.0


@pytest.mark.timeout(60)
def test_default_ring_order_differs() -> None:
    """Guard that the tests above can fail: the plain ring does not sum in tree order.

    With three ranks and wide-range inputs the ring's order ((x1 + x2) + x0 for
    some chunks) gives different bits from the tree ((x0 + x1) + x2) somewhere.
    """
    world = 3
    xs = inputs(world, 30_000, torch.float32, seed=3)
    ref = tree_sum(xs)

    def fn(rank: int, pg: EntrenarProcessGroup) -> torch.Tensor:
        t = xs[rank].clone()
        pg.allreduce([t]).wait()
        return t

    outs = run_ranks(world, fn, options=Options(algorithm="ring"))
    assert not same_bits(outs[0], ref)
    torch.testing.assert_close(outs[0], ref, rtol=1e-4, atol=1e-3)


@pytest.mark.timeout(60)
def test_groups_reused_many_shapes() -> None:
    """One set of groups, many sizes and both dtypes in a row: scratch reuse keeps bits right."""
    world = 4
    opts = det(algorithm="auto", direct_max_bytes=256, star_max_bytes=2048, segment_bytes=512)
    groups = make_groups(world, opts)
    try:
        cases = [
            (n, dt) for n in (5000, 3, 700, 12345, 1) for dt in (torch.float32, torch.bfloat16)
        ]
        xs = [inputs(world, n, dt, seed=n) for n, dt in cases]

        def fn(rank: int, pg: EntrenarProcessGroup) -> list[torch.Tensor]:
            outs = []
            for case in xs:
                t = case[rank].clone()
                pg.allreduce([t]).wait()
                outs.append(t)
            return outs

        for _rank, outs in enumerate(run_ranks(world, fn, groups=groups)):
            for case, out in zip(xs, outs, strict=True):
                assert same_bits(out, tree_sum(case))
    finally:
        for g in groups:
            g.shutdown()

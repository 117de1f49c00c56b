"""Recursive doubling in the canonical tree's shape (collectives/doubling.py), issue 26 item 4.

The flat rows' small allreduce from ``FLAT_DOUBLING_MIN_WORLD`` ranks: every
rank ends with the canonical tree's bits at any N, holds ceil(log2 N)
partners (plus its ring neighbours) instead of the star root's N - 1, and a
rank that fails is still named by every other.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import allreduce_errors, make_groups, run_ranks
from test_connections import emulated_hosts
from test_failures import run_blame

from entrenar_pg import EntrenarProcessGroup, Options, PeerConnectionError
from entrenar_pg.collectives import policy
from entrenar_pg.collectives.doubling import partners, rounds
from entrenar_pg.reduce_ops import tree_sum
from entrenar_pg.wire import Algo, OpCode

R = torch.distributed.ReduceOp


def tree_expr(names: list[str]) -> str:
    """The canonical tree over ``names`` as text: ``((x0+x1)+x2)`` for three."""
    if len(names) == 1:
        return names[0]
    m = (len(names) + 1) // 2
    return f"({tree_expr(names[:m])}+{tree_expr(names[m:])})"


def simulate(world: int) -> tuple[list[str], int]:
    """Run every rank's ``rounds`` on expressions, messages in any order they
    can go; each rank's final expression, and the messages sent."""
    steps = [rounds(world, r) for r in range(world)]
    value = [f"x{r}" for r in range(world)]
    at = [0] * world  # each rank's next round
    mail: dict[tuple[int, int], str] = {}
    sent = 0

    def post(r: int) -> None:
        nonlocal sent
        if at[r] < len(steps[r]):
            for p in steps[r][at[r]].sends:
                assert (r, p) not in mail, f"N={world}: rank {r} sends {p} twice"
                mail[(r, p)] = value[r]
                sent += 1

    for r in range(world):
        post(r)
    progress = True
    while progress:
        progress = False
        for r in range(world):
            if at[r] == len(steps[r]):
                continue
            step = steps[r][at[r]]
            got = mail.pop((step.source, r), None)
            if got is None:
                continue
            value[r] = f"({value[r]}+{got})" if step.left else f"({got}+{value[r]})"
            at[r] += 1
            post(r)
            progress = True
    assert all(a == len(s) for a, s in zip(at, steps, strict=True)), f"N={world}: stuck"
    assert not mail, f"N={world}: messages never received: {sorted(mail)}"
    return value, sent


@pytest.mark.parametrize("world", range(1, 70))
def test_every_rank_ends_with_the_canonical_tree(world: int) -> None:
    """At every N every rank computes the canonical tree's expression (the same
    operands in the same order: its bits), in at most ceil(log2 N) rounds,
    with at most 2 ceil(log2 N) partners; N a power of two: the classic pairs
    (i XOR 2^k), one message per rank per round."""
    want = tree_expr([f"x{r}" for r in range(world)])
    got, sent = simulate(world)
    assert got == [want] * world
    depth = math.ceil(math.log2(world)) if world > 1 else 0
    for r in range(world):
        assert len(rounds(world, r)) <= depth
        assert len(partners(world, r)) <= 2 * depth
    if world & (world - 1) == 0:
        assert sent == world * depth
        for r in range(world):
            assert [s.source for s in rounds(world, r)] == [r ^ (1 << k) for k in range(depth)]


def test_the_flat_rows_pick_doubling_from_the_threshold() -> None:
    """Flat (no shared memory between all, not host-aware), small: the star
    below ``FLAT_DOUBLING_MIN_WORLD`` ranks, doubling from it (deterministic
    too: it sums in tree order); the ring above ``star_max_bytes``."""
    n, o = policy.FLAT_DOUBLING_MIN_WORLD, Options()
    small, large = o.star_max_bytes, o.star_max_bytes + 4
    a = OpCode.ALLREDUCE
    assert policy.choose(a, small, n - 1, o).algo is Algo.STAR
    assert policy.choose(a, small, n, o).algo is Algo.DOUBLING
    assert policy.choose(a, 4096, 1024, o).algo is Algo.DOUBLING
    det = policy.choose(a, small, n, Options(deterministic=True))
    assert det.algo is Algo.DOUBLING and det.tree
    assert policy.choose(a, large, n, o).algo is Algo.RING
    assert policy.choose(a, small, n, o, local=True).algo is Algo.SHM


def _inputs(world: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(world)
    return [torch.randn(numel, generator=g) for _ in range(world)]


@pytest.mark.timeout(240)
def test_bits_are_the_canonical_trees_at_several_n() -> None:
    """N = 3, 5, 8, 13, 16, 33 thread ranks, each its own emulated host (TCP):
    doubling (forced below the policy's threshold, its pick at 33), SUM and
    AVG of floats, deterministic and not: every rank's result has the bits of
    ``tree_sum`` of the inputs (AVG: divided by N after); integers exact;
    an empty tensor completes."""
    numel = 1000
    for world in (3, 5, 8, 13, 16, 33):
        data = _inputs(world, numel)
        ref = tree_sum(data)
        algorithm = "auto" if world >= policy.FLAT_DOUBLING_MIN_WORLD else "doubling"
        for det in (False, True):
            opts = [
                Options(transport="tcp", algorithm=algorithm, deterministic=det, host_id=f"h{r}")
                for r in range(world)
            ]
            gs = make_groups(world, opts)
            try:
                algos = {
                    policy.choose(
                        OpCode.ALLREDUCE, numel * 4, world, g._runtime.options, False, None
                    ).algo
                    for g in gs
                }
                assert algos == {Algo.DOUBLING}, (world, algos)

                def fn(
                    rank: int, pg: EntrenarProcessGroup, data: list[torch.Tensor] = data
                ) -> list[torch.Tensor]:
                    s, a = data[rank].clone(), data[rank].clone()
                    pg.allreduce([s]).wait()
                    pg.allreduce([a], R.AVG).wait()
                    i = torch.full((7,), rank + 1, dtype=torch.int64)
                    pg.allreduce([i]).wait()
                    pg.allreduce([torch.empty(0)]).wait()
                    return [s, a, i]

                for r, (s, a, i) in enumerate(run_ranks(world, fn, groups=gs)):
                    assert torch.equal(s, ref), (world, det, r)
                    assert torch.equal(a, ref / world), (world, det, r)
                    assert torch.equal(i, torch.full((7,), world * (world + 1) // 2)), r
            finally:
                for g in gs:
                    g.shutdown()


@pytest.mark.timeout(120)
def test_no_rank_connects_to_every_rank_at_a_flat_n() -> None:
    """32 thread ranks (``FLAT_DOUBLING_MIN_WORLD``), each its own emulated
    host (the flat rows), 4 KiB allreduces with the policy's choice: every
    rank holds data sockets only to its doubling partners (5 at N = 32) and
    ring neighbours, none more than 2 log2 N + 2; rank 0 holds 6. (Before:
    the star, rank 0 connected to all 31 others.)"""
    world = 32
    assert policy.FLAT_DOUBLING_MIN_WORLD <= world
    gs = make_groups(world, emulated_hosts(world, 1, "auto"))
    try:

        def fn(rank: int, pg: EntrenarProcessGroup) -> float:
            t = torch.full((1024,), float(rank + 1))
            for _ in range(2):
                t.fill_(float(rank + 1))
                pg.allreduce([t]).wait()
            return t[0].item()

        assert run_ranks(world, fn, groups=gs) == [world * (world + 1) / 2] * world
        for r, g in enumerate(gs):
            ring = {(r - 1) % world, (r + 1) % world}
            assert g._runtime.mesh.data_peers == partners(world, r) | ring, r
            assert len(g._runtime.mesh.data_peers) <= 2 * 5 + 2, r
        assert len(gs[0]._runtime.mesh.data_peers) == 6
    finally:
        for g in gs:
            g.shutdown()


@pytest.mark.timeout(60)
def test_a_rank_that_never_joins_or_left_is_named_by_every_rank() -> None:
    """8 thread ranks, each its own emulated host, doubling: rank 5 never calls
    the first allreduce; every other rank names it (PeerConnectionError,
    culprit 5), whether it waits on rank 5 itself (ranks 1, 4, 7: rank 5's
    partners; 4 and 6: its ring neighbours) or on a partner that does."""
    world = 8
    gs = make_groups(world, emulated_hosts(world, 1, "doubling"), timeout_s=2.0)
    try:
        others = [r for r in range(world) if r != 5]
        errors = allreduce_errors(gs, others, numel=64)
        assert sorted(errors) == others
        for r, e in errors.items():
            assert isinstance(e, PeerConnectionError), (r, e)
            assert e.culprit == 5, (r, e)
    finally:
        for g in gs:
            g.abort()


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("mode", "victim"), [("stall", 3), ("kill", 6)])
def test_a_stalled_or_dead_rank_is_named_by_every_rank_under_doubling(
    mode: str, victim: int
) -> None:
    """8 rank processes over TCP, doubling forced: the victim SIGSTOPs or
    SIGKILLs itself in a loop of allreduces; every survivor names it, most
    with no link of any kind to it."""
    results = run_blame(mode, victim, world=8, timeout_s=4.0, transport="tcp", algorithm="doubling")
    assert sorted(results) == [r for r in range(8) if r != victim]
    for rank, (cls, culprit, message) in results.items():
        assert cls == "PeerConnectionError", (rank, message)
        assert culprit == str(victim), f"rank {rank} blamed {culprit}: {message}"

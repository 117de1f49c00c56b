"""Confirmations that scale (issue 26, item 4): the deterministic allreduce and
the rooted collectives without a socket to every peer.

The deterministic reduce-scatter is recursive halving in the canonical tree's
shape (collectives/halving.py: ceil(log2 N) partners; the direct exchange it
replaces sent a chunk to every peer); reduce, gather, scatter and the direct
broadcast confirm headers through the root's verdict and the ring neighbours
(``Plan.confirm_at_root``; before, a header frame with every peer). These tests
check the halving's levels, its bits at uneven N, which peers a rank holds data
sockets to at N = 16 (each rank its own emulated host: no data socket at
set-up), and that a disagreement or a missing rank still reaches every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
from conftest import each_rank, make_groups, run_ranks

from entrenar_pg import CollectiveMismatchError, EntrenarProcessGroup, Options, PeerConnectionError
from entrenar_pg.collectives import choose
from entrenar_pg.collectives.dissemination import rounds_of
from entrenar_pg.collectives.halving import levels, partners
from entrenar_pg.reduce_ops import tree_sum
from entrenar_pg.wire import Algo, OpCode

WORLD = 16
# Deterministic; the allreduce on the ring rows (TREE_RING at any size);
# reduce-scatter + move to the root above 128 KiB, the star below; broadcasts
# above 64 KiB direct from the root; several segments per chunk.
OPTS = Options(
    transport="tcp",
    deterministic=True,
    algorithm="ring",
    star_max_bytes=128 << 10,
    segment_bytes=4 << 10,
)


def own_hosts(world: int, opts: Options = OPTS) -> list[Options]:
    """``opts`` per rank, each rank its own emulated host (no data socket at set-up)."""
    return [replace(opts, host_id=f"h{r}") for r in range(world)]


def test_the_halving_levels_partition_and_pair_up() -> None:
    """At every N up to 40 and a few larger: a rank sends every chunk but its
    own exactly once, each send is the receiver's level from this rank (the
    chunks it keeps there), the top level keeps the rank's own chunk, and no
    rank has more than 2 ceil(log2 N) partners (ceil(log2 N), r XOR 2^k, for a
    power of two)."""
    for n in [*range(2, 41), 100, 255, 256]:
        steps = {r: levels(n, r) for r in range(n)}
        heard = {(r, lv.source): lv.keeps for r in range(n) for lv in steps[r]}
        for r in range(n):
            assert steps[r][-1].keeps == (r,), (n, r)
            out = sorted(c for lv in steps[r] for _, cs in lv.sends for c in cs)
            assert out == [c for c in range(n) if c != r], (n, r)
            for lv in steps[r]:
                for p, cs in lv.sends:
                    assert heard.get((p, r)) == cs, (n, r, p)
            assert len(partners(n, r)) <= 2 * rounds_of(n), (n, r)
            if n & (n - 1) == 0:
                assert partners(n, r) == {r ^ (1 << k) for k in range(rounds_of(n))}, (n, r)


@dataclass(frozen=True)
class Sums:
    """A deterministic allreduce and reduce-scatter of rank r's ``xs[r]`` (the
    reduce-scatter's pieces cut at ``bounds``); each rank's two results."""

    xs: list[torch.Tensor]
    bounds: list[tuple[int, int]]

    def run(self, rank: int, pg: EntrenarProcessGroup) -> list[torch.Tensor]:
        t = self.xs[rank].clone()
        pg.allreduce([t]).wait()
        a, b = self.bounds[rank]
        out = torch.empty(b - a)
        ins = [self.xs[rank][lo:hi].clone() for lo, hi in self.bounds]
        pg.reduce_scatter([out], [ins], dist.ReduceScatterOptions()).wait()
        return [t, out]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [3, 6, 13])
def test_the_halving_gives_the_canonical_trees_bits(world: int) -> None:
    """Deterministic allreduce (TREE_RING) and reduce-scatter at uneven N, in
    many segments, with empty chunks too (numel < N): the bits of
    ``tree_sum``, on every rank."""
    gen = torch.Generator().manual_seed(world)
    groups = make_groups(world, replace(OPTS, segment_bytes=64))
    try:
        for numel in (world - 1, 1000):
            xs = [torch.randn(numel, generator=gen) * 10.0 ** (r % 5) for r in range(world)]
            want = tree_sum(xs)
            bounds = [(p * numel // world, (p + 1) * numel // world) for p in range(world)]
            got = run_ranks(world, Sums(xs, bounds).run, groups=groups)
            for r, (t, out) in enumerate(got):
                assert torch.equal(t, want), (world, numel, r)
                a, b = bounds[r]
                assert torch.equal(out, want[a:b]), (world, numel, r)
    finally:
        for g in groups:
            g.shutdown()


@dataclass(frozen=True)
class Rooted:
    """Every op this file's options send over a plan that used to confirm with
    every peer, each checked; ``root`` for the rooted ones."""

    root: int

    def allreduce(self, rank: int, pg: EntrenarProcessGroup) -> None:
        t = torch.full((16 << 10,), float(rank + 1))  # 64 KiB: TREE_RING
        pg.allreduce([t]).wait()
        assert torch.equal(t, torch.full_like(t, WORLD * (WORLD + 1) / 2)), rank

    def rooted(self, rank: int, pg: EntrenarProcessGroup) -> None:
        total = WORLD * (WORLD + 1) / 2
        for numel in (1 << 10, 64 << 10):  # 4 KiB: the star; 256 KiB: halving + move
            t = torch.full((numel,), float(rank + 1))
            opts = dist.ReduceOptions()
            opts.rootRank = self.root
            pg.reduce([t], opts).wait()
            assert rank != self.root or torch.equal(t, torch.full_like(t, total)), rank
        mine = torch.full((256,), float(rank))
        outs = [[torch.empty(256) for _ in range(WORLD)]] if rank == self.root else []
        gopts = dist.GatherOptions()
        gopts.rootRank = self.root
        pg.gather(outs, [mine], gopts).wait()
        if rank == self.root:
            assert all(torch.equal(o, torch.full((256,), float(p))) for p, o in enumerate(outs[0]))
        got = torch.empty(256)
        ins = [[torch.full((256,), float(p)) for p in range(WORLD)]] if rank == self.root else []
        sopts = dist.ScatterOptions()
        sopts.rootRank = self.root
        pg.scatter([got], ins, sopts).wait()
        assert torch.equal(got, torch.full((256,), float(rank))), rank
        b = torch.full((24 << 10,), float(rank))  # 96 KiB: direct from the root
        bopts = dist.BroadcastOptions()
        bopts.rootRank = self.root
        pg.broadcast([b], bopts).wait()
        assert torch.equal(b, torch.full_like(b, float(self.root))), rank


@pytest.mark.timeout(120)
def test_a_deterministic_allreduce_holds_log_n_sockets_at_sixteen() -> None:
    """16 thread ranks, each its own emulated host, deterministic: after a
    64 KiB allreduce (TREE_RING) every rank holds data sockets only to its
    halving partners (4) and ring neighbours: 6 at most. (Before: the direct
    exchange gave every rank a socket to all 15.)"""
    assert choose(OpCode.ALLREDUCE, 64 << 10, WORLD, OPTS).algo is Algo.TREE_RING
    groups = make_groups(WORLD, own_hosts(WORLD))
    try:
        run_ranks(WORLD, Rooted(0).allreduce, groups=groups)
        for r, g in enumerate(groups):
            ring = {(r - 1) % WORLD, (r + 1) % WORLD}
            assert g._runtime.mesh.data_peers == partners(WORLD, r) | ring, r
            assert len(g._runtime.mesh.data_peers) <= rounds_of(WORLD) + 2, r
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.timeout(120)
def test_rooted_ops_hold_the_root_and_log_n_sockets_at_sixteen() -> None:
    """16 thread ranks, each its own emulated host, deterministic: after
    reduces (the star, and the halving + the move to the root), a gather, a
    scatter and a direct broadcast to or from rank 5, a rank other than the
    root holds data sockets only to the root, its ring neighbours and its
    halving partners: 7 at most; the root holds all 15. (Before: the header
    confirmations and the direct exchange gave every rank a socket to all
    15.)"""
    root = 5
    assert choose(OpCode.REDUCE, 256 << 10, WORLD, OPTS).algo is Algo.DIRECT
    assert choose(OpCode.REDUCE, 4 << 10, WORLD, OPTS).algo is Algo.STAR
    assert choose(OpCode.BROADCAST, 96 << 10, WORLD, OPTS).algo is Algo.DIRECT
    # topology="flat": the one-host rule's DIRECT broadcast (one rank per host
    # otherwise takes the dissemination tree at this size: test_hosts)
    groups = make_groups(WORLD, own_hosts(WORLD, replace(OPTS, topology="flat")))
    try:
        run_ranks(WORLD, Rooted(root).rooted, groups=groups)
        for r, g in enumerate(groups):
            if r == root:
                assert g._runtime.mesh.data_peers == set(range(WORLD)) - {r}
                continue
            ring = {(r - 1) % WORLD, (r + 1) % WORLD}
            assert g._runtime.mesh.data_peers == partners(WORLD, r) | ring | {root}, r
            assert len(g._runtime.mesh.data_peers) <= rounds_of(WORLD) + 3, r
    finally:
        for g in groups:
            g.shutdown()


@dataclass(frozen=True)
class Odd:
    """One collective on every rank of ``world``; rank ``odd`` passes another
    size, root (3, the others 0) or dtype (``kind``)."""

    collective: str
    odd: int
    numel: int
    kind: str = "size"
    world: int = WORLD

    def run(self, rank: int, pg: EntrenarProcessGroup) -> None:
        odd = rank == self.odd
        numel = self.numel + (1 if odd and self.kind == "size" else 0)
        root = 3 if odd and self.kind == "root" else 0
        dtype = torch.float64 if odd and self.kind == "dtype" else torch.float32
        t = torch.ones(numel, dtype=dtype)
        many = [[torch.ones_like(t) for _ in range(self.world)]] if rank == root else []
        if self.collective == "allreduce":
            pg.allreduce([t]).wait()
        elif self.collective == "reduce":
            opts = dist.ReduceOptions()
            opts.rootRank = root
            pg.reduce([t], opts).wait()
        elif self.collective == "gather":
            gopts = dist.GatherOptions()
            gopts.rootRank = root
            pg.gather(many, [t], gopts).wait()
        elif self.collective == "scatter":
            sopts = dist.ScatterOptions()
            sopts.rootRank = root
            pg.scatter([t], many, sopts).wait()
        else:
            bopts = dist.BroadcastOptions()
            bopts.rootRank = root
            pg.broadcast([t], bopts).wait()


def raised_everywhere(case: Odd) -> dict[int, str]:
    """Run ``case`` on fresh groups of ranks on hosts of their own; the ranks
    that did not raise CollectiveMismatchError, with what they did."""
    groups = make_groups(case.world, own_hosts(case.world), timeout_s=15.0)
    try:
        got = each_rank(groups, range(case.world), case.run, timeout_s=60.0)
        return {r: repr(e) for r, e in got.items() if not isinstance(e, CollectiveMismatchError)}
    finally:
        for g in groups:
            g.abort()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "case",
    [
        Odd("allreduce", 11, 16 << 10),  # TREE_RING, one rank a size larger
        Odd("reduce", 6, 64 << 10, "root"),  # halving + move, one rank another root
        Odd("reduce", 13, 1 << 10, "root"),  # the star
        Odd("gather", 9, 256, "root"),
    ],
    ids=lambda c: f"{c.collective}-{c.numel}-{c.kind}",
)
def test_a_disagreement_raises_on_every_one_of_sixteen(case: Odd) -> None:
    """16 ranks, each its own emulated host: one rank (no ring neighbour of
    the root, no partner of most ranks) disagrees; every rank raises
    CollectiveMismatchError in the call, none returns or times out."""
    assert not raised_everywhere(case)


ROOTED_CASES = [
    Odd(collective, odd, numel, kind, world=4)
    for collective, numel in (("reduce", 1 << 10), ("gather", 256), ("scatter", 256))
    for kind, odd in (("root", 2), ("size", 1), ("dtype", 0))
] + [Odd("broadcast", odd, 24 << 10, kind, world=4) for kind, odd in (("size", 2), ("root", 1))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ROOTED_CASES, ids=lambda c: f"{c.collective}-{c.kind}-{c.odd}")
def test_rooted_disagreements_across_hosts_raise_everywhere(case: Odd) -> None:
    """The rooted plans' confirmation across hosts (the root's verdict and the
    neighbours' plan first; tests/test_mismatch.py runs one host, where every
    peer confirms): 4 ranks, each its own host, one disagreeing about the
    root, the size or the dtype (the broadcast at 96 KiB: direct from the
    root); every rank raises CollectiveMismatchError."""
    assert not raised_everywhere(case)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collective", ["allreduce", "gather"])
def test_a_rank_that_never_joins_is_named_by_every_rank(collective: str) -> None:
    """8 ranks, each its own emulated host, deterministic: rank 5 never calls a
    64 KiB allreduce (TREE_RING) or a gather to rank 0; every other rank names
    it (PeerConnectionError, culprit 5), most with no link to it."""
    world, victim = 8, 5
    groups = make_groups(world, own_hosts(world), timeout_s=2.0)

    def call(rank: int, pg: EntrenarProcessGroup) -> None:
        t = torch.ones(16 << 10)
        if collective == "allreduce":
            pg.allreduce([t]).wait()
        else:
            outs = [[torch.empty_like(t) for _ in range(world)]] if rank == 0 else []
            pg.gather(outs, [t], dist.GatherOptions()).wait()

    try:
        others = [r for r in range(world) if r != victim]
        got = each_rank(groups, others, call)
        for r in others:
            assert isinstance(got[r], PeerConnectionError), (r, got[r])
            assert got[r].culprit == victim, (r, got[r])
    finally:
        for g in groups:
            g.abort()

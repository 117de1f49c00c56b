"""The dissemination barrier and the small broadcast on its rounds (issue 26 item 2).

Thread ranks over real loopback TCP: results at several world sizes (powers
of two and not, one rank), that no rank leaves a barrier before the last one
arrived, which peers a rank talks to (2 ceil(log2 N) at most: the star's root
talked to all N - 1), the headers on the wire, and that a rank that never
arrives is named by every other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from conftest import each_rank, make_groups, run_ranks
from test_connections import emulated_hosts

from entrenar_pg import EntrenarProcessGroup, Options, PeerConnectionError
from entrenar_pg.collectives import choose
from entrenar_pg.collectives.dissemination import carries_data, partners, rounds_of, step
from entrenar_pg.wire import HEADER_BYTES, Algo, Header, OpCode

WORLDS = [1, 2, 3, 5, 8]


@dataclass(frozen=True)
class BroadcastFrom:
    """A broadcast of ``numel`` ``dtype`` elements from ``root`` (rank r starts
    with arange x (r + 1)), then a barrier; each rank returns its tensor."""

    root: int
    numel: int
    dtype: torch.dtype

    def run(self, rank: int, pg: EntrenarProcessGroup) -> torch.Tensor:
        t = (torch.arange(self.numel) * (rank + 1)).to(self.dtype)
        opts = dist.BroadcastOptions()
        opts.rootRank = self.root
        pg.broadcast([t], opts).wait()
        pg.barrier().wait()
        return t


def test_rounds_and_partners_cover_every_rank() -> None:
    """Every rank reaches every other within the rounds (forwarded), and the
    broadcast's data links form a tree from the root: each rank but the root
    receives the data exactly once."""
    for world in range(1, 18):
        for rank in range(world):
            reached = {rank}
            for k in range(rounds_of(world)):
                reached |= {(p + step(k, world)) % world for p in reached}
            assert reached == set(range(world)), (world, rank)
        got = [0] * world
        for v in range(world):
            for k in range(rounds_of(world)):
                if carries_data(v, k, world):
                    got[v + step(k, world)] += 1
        assert got == [0] + [1] * (world - 1), world
    assert [rounds_of(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    assert partners(0, 5) == [(4, 1), (2, 3), (1, 4)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", WORLDS)
def test_barrier_and_small_broadcasts_at_any_world(world: int) -> None:
    """Broadcasts from every root (several sizes and dtypes, on the
    dissemination rounds up to the policy's threshold, beyond it the direct
    and chain plans) equal the root's tensor on every rank."""
    groups = make_groups(world, Options(transport="tcp"))
    try:
        for root in range(world):
            for numel, dtype in ((1, torch.float32), (1000, torch.int64), (4096, torch.float32)):
                got = run_ranks(world, BroadcastFrom(root, numel, dtype).run, groups=groups)
                want = (torch.arange(numel) * (root + 1)).to(dtype)
                for r, t in enumerate(got):
                    assert torch.equal(t, want), (world, root, numel, r)
        empty = run_ranks(world, BroadcastFrom(world - 1, 0, torch.float32).run, groups=groups)
        assert all(t.numel() == 0 for t in empty)
    finally:
        for g in groups:
            g.shutdown()


@dataclass
class LateArrival:
    """One barrier in which rank ``late`` arrives 0.3 s after the others: when
    it arrived, and when each rank left."""

    late: int
    left: list[float]
    arrived: float = 0.0

    def run(self, rank: int, pg: EntrenarProcessGroup) -> None:
        if rank == self.late:
            time.sleep(0.3)
            self.arrived = time.monotonic()
        pg.barrier().wait()
        self.left[rank] = time.monotonic()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [3, 5])
def test_no_rank_leaves_the_barrier_before_the_last_arrives(world: int) -> None:
    """The last rank to arrive sleeps first; every rank leaves after it arrived
    (several barriers in a row, a different late rank each)."""
    groups = make_groups(world, Options(transport="tcp"))
    try:
        for late in range(world):
            times = LateArrival(late, [0.0] * world)
            run_ranks(world, times.run, groups=groups)
            assert all(t >= times.arrived for t in times.left), (late, times)
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.timeout(120)
def test_a_rank_talks_only_to_its_rounds_partners() -> None:
    """8 thread ranks, each its own emulated host (no data socket at set-up):
    after a barrier and a 4 KiB broadcast every rank holds data sockets only
    to r +- 1, 2, 4 (the star barrier's root connected to all 7, the direct
    broadcast's header confirmation every rank to every rank)."""
    world = 8
    groups = make_groups(world, emulated_hosts(world, 1, "auto"))
    try:
        run_ranks(world, BroadcastFrom(0, 1024, torch.float32).run, groups=groups)
        for r, g in enumerate(groups):
            want = {p for pair in partners(r, world) for p in pair}
            assert g._runtime.mesh.data_peers == want, r
            assert len(want) <= 2 * rounds_of(world)
    finally:
        for g in groups:
            g.shutdown()


def test_the_policy_picks_dissemination() -> None:
    o = Options()
    assert choose(OpCode.BARRIER, 0, 2, o).algo is Algo.DISSEMINATION
    assert choose(OpCode.BARRIER, 0, 1000, o).algo is Algo.DISSEMINATION
    assert choose(OpCode.BROADCAST, 4096, 8, o).algo is Algo.DISSEMINATION
    assert choose(OpCode.BROADCAST, 4096, 2, o).algo is Algo.DIRECT


@pytest.mark.timeout(60)
def test_the_barrier_headers_on_the_wire() -> None:
    """Rank 1 of 3 takes the first bytes rank 0 sends it in a barrier: a
    header for BARRIER / DISSEMINATION, then the 1-byte token (rank 0's round 1
    goes to rank 1)."""
    from entrenar_pg.transport import mesh as mesh_mod

    seen: list[bytes] = []
    real = mesh_mod.Mesh.run

    def spy(self, plan, what, call):  # the plan's first send to rank 1, as packed
        if self.rank == 0 and 1 in plan.sends:
            seen.append(b"".join(bytes(s.view) for s in plan.sends[1]))
        return real(self, plan, what, call)

    mesh_mod.Mesh.run = spy  # type: ignore[method-assign]
    try:
        run_ranks(3, lambda r, pg: pg.barrier().wait(), options=Options(transport="tcp"))
    finally:
        mesh_mod.Mesh.run = real  # type: ignore[method-assign]
    assert len(seen) == 1 and len(seen[0]) == HEADER_BYTES + 1, seen
    header = Header.unpack(seen[0][:HEADER_BYTES])
    assert header.op is OpCode.BARRIER and header.algo is Algo.DISSEMINATION, header


@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_is_named_by_every_rank() -> None:
    """8 thread ranks, each its own emulated host: rank 5 never calls the
    barrier. Every other rank waits on it directly or through a chain of
    rounds; each names rank 5 within the timeout (the wait-for walk)."""
    world, victim = 8, 5
    groups = make_groups(world, emulated_hosts(world, 1, "auto"), timeout_s=2.0)
    try:
        others = [r for r in range(world) if r != victim]
        got = each_rank(groups, others, lambda r, pg: pg.barrier().wait())
        for r, e in got.items():
            assert isinstance(e, PeerConnectionError), (r, e)
            assert e.culprit == victim, (r, e)
            assert f"rank {victim}" in str(e), (r, e)
    finally:
        for g in groups:
            g.abort()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [3, 5, 8])
def test_the_chain_broadcast_confirms_through_the_rounds(world: int) -> None:
    """A broadcast above ``star_max_bytes`` goes down the chain (several
    segments) and confirms its header through the rounds' tokens: every rank
    holds the root's data, and, each rank its own emulated host (no data
    socket at set-up), talks only to its chain neighbours and its rounds'
    partners (before: a header frame with every peer, a socket to each)."""
    opts = [
        Options(transport="tcp", star_max_bytes=1024, segment_bytes=4096, host_id=f"h{r}")
        for r in range(world)
    ]
    assert choose(OpCode.BROADCAST, 4096 * 4, world, opts[0]).algo is Algo.CHAIN
    groups = make_groups(world, opts)
    try:
        for root in (0, world - 1):
            got = run_ranks(world, BroadcastFrom(root, 4096, torch.float32).run, groups=groups)
            want = torch.arange(4096, dtype=torch.float32) * (root + 1)
            assert all(torch.equal(t, want) for t in got), root
        for r, g in enumerate(groups):
            chain = {(r - 1) % world, (r + 1) % world}
            rounds = {p for pair in partners(r, world) for p in pair}
            assert g._runtime.mesh.data_peers == chain | rounds, r
    finally:
        for g in groups:
            g.shutdown()

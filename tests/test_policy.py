"""The algorithm policy (entrenar_pg/collectives/policy.py) against the documented rules.

``ROWS`` is the policy table of docs/architecture.md written out as cases,
with small thresholds (direct_max_bytes 1 KiB, star_max_bytes 2 KiB) so that
every side of every threshold is a few floats: for each (collective, payload
bytes, world size, ``Options.algorithm``, ``deterministic``) the algorithm
the policy must pick and the algorithm bytes the collective's headers carry
on the wire.

Two checks of the same rows:
- ``test_headers_on_the_wire_follow_the_rules``: real 2- and 3-rank groups
  run each collective; every header a rank packs is recorded (``Header.pack_into``)
  and its algorithm and flags compared with the row. This is the behaviour
  itself, independent of how the code decides (it passes on the tree
  before the policy module existed too);
- ``test_choose_follows_the_rules``: ``policy.choose`` returns the row's
  algorithm, order, flags and segment, and one rank does nothing.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import pytest
import torch
from conftest import make_groups, run_ranks

from entrenar_pg import EntrenarProcessGroup, Options
from entrenar_pg.wire import Algo, Flags, Header, OpCode

c10d = torch._C._distributed_c10d

DIRECT_MAX = 1024
STAR_MAX = 2048
SEGMENT = 512


class Row(NamedTuple):
    op: OpCode
    nbytes: int  # the payload of the call on every rank (float32: a multiple of 4)
    world: int
    algorithm: str
    deterministic: bool
    picks: Algo  # what policy.choose must return
    wire: frozenset[Algo]  # the algorithms this rank's headers carry
    local: bool  # every rank on one host (transport shm), else tcp


def row(op: OpCode, nbytes: int, world: int, picks: Algo, *wire: Algo, **kw: Any) -> Row:
    return Row(
        op,
        nbytes,
        world,
        kw.get("algorithm", "auto"),
        kw.get("det", False),
        picks,
        frozenset(wire or (picks,)),
        kw.get("local", False),
    )


A = OpCode.ALLREDUCE
ROWS = [
    # allreduce, auto: two ranks direct up to direct_max_bytes, ring above
    row(A, DIRECT_MAX, 2, Algo.DIRECT),
    row(A, DIRECT_MAX + 4, 2, Algo.RING),
    row(A, DIRECT_MAX, 2, Algo.DIRECT, det=True),  # direct sums in tree order
    row(A, DIRECT_MAX + 4, 2, Algo.TREE_RING, det=True),  # the ring becomes the tree ring
    # more ranks: star up to star_max_bytes, ring above
    row(A, STAR_MAX, 3, Algo.STAR),
    row(A, STAR_MAX + 4, 3, Algo.RING),
    row(A, STAR_MAX, 3, Algo.STAR, det=True),
    row(A, STAR_MAX + 4, 3, Algo.TREE_RING, det=True),
    row(A, DIRECT_MAX + 4, 3, Algo.STAR),  # direct_max_bytes is for two ranks only...
    # every rank on one host (shared memory between all): the shm-native
    # allreduce at any size and world, in tree order when deterministic
    row(A, 8, 2, Algo.SHM, local=True),
    row(A, 8 * STAR_MAX, 2, Algo.SHM, local=True),
    row(A, DIRECT_MAX, 3, Algo.SHM, local=True),
    row(A, DIRECT_MAX, 3, Algo.SHM, det=True, local=True),
    row(A, STAR_MAX + 4, 3, Algo.SHM, local=True),
    row(A, 8 * STAR_MAX, 3, Algo.SHM, det=True, local=True),
    row(A, 8, 3, Algo.RING, algorithm="ring", local=True),  # an explicit one still wins
    row(A, 8, 2, Algo.DIRECT, algorithm="direct", local=True),
    # an explicit algorithm, whatever the size
    row(A, 8 * STAR_MAX, 3, Algo.DIRECT, algorithm="direct"),
    row(A, 8 * STAR_MAX, 2, Algo.STAR, algorithm="star"),
    row(A, 8, 3, Algo.RING, algorithm="ring"),
    row(A, 8, 3, Algo.TREE_RING, algorithm="ring", det=True),
    row(A, 8, 2, Algo.DIRECT, algorithm="direct", det=True),
    # broadcast: direct from the root with two ranks; with more along the
    # dissemination rounds up to star_max_bytes (and 64 KiB); else a chain
    row(OpCode.BROADCAST, 8 * STAR_MAX, 2, Algo.DIRECT),
    row(OpCode.BROADCAST, 8, 2, Algo.DIRECT),
    row(OpCode.BROADCAST, STAR_MAX, 3, Algo.DISSEMINATION),
    row(OpCode.BROADCAST, 4, 3, Algo.DISSEMINATION, det=True),
    row(OpCode.BROADCAST, STAR_MAX + 4, 3, Algo.CHAIN),
    row(OpCode.BROADCAST, STAR_MAX + 4, 3, Algo.CHAIN, det=True),
    row(OpCode.BROADCAST, STAR_MAX + 4, 3, Algo.CHAIN, algorithm="direct"),  # allreduce only
    # reduce: star with two ranks or up to star_max_bytes; else reduce-scatter + a direct move
    row(OpCode.REDUCE, 8 * STAR_MAX, 2, Algo.STAR),
    row(OpCode.REDUCE, STAR_MAX, 3, Algo.STAR),
    row(OpCode.REDUCE, STAR_MAX + 4, 3, Algo.RING, Algo.RING, Algo.DIRECT),
    row(OpCode.REDUCE, STAR_MAX + 4, 3, Algo.DIRECT, Algo.DIRECT, det=True),
    # reduce-scatter: ring; the tree exchange (DIRECT) when deterministic
    row(OpCode.REDUCE_SCATTER, 6 * STAR_MAX, 3, Algo.RING),
    row(OpCode.REDUCE_SCATTER, 16, 2, Algo.RING),
    row(OpCode.REDUCE_SCATTER, 24, 3, Algo.DIRECT, det=True),
    row(OpCode.ALLGATHER, 8 * STAR_MAX, 3, Algo.RING),
    row(OpCode.ALLGATHER, 16, 2, Algo.RING, det=True),
    row(OpCode.BARRIER, 0, 3, Algo.DISSEMINATION),
    row(OpCode.BARRIER, 0, 2, Algo.DISSEMINATION, det=True),
    row(OpCode.GATHER, 8 * STAR_MAX, 3, Algo.DIRECT),
    row(OpCode.SCATTER, 8 * STAR_MAX, 3, Algo.DIRECT, det=True),
    row(OpCode.ALLTOALL, 48, 3, Algo.DIRECT),
    row(OpCode.ALLTOALL, 48, 2, Algo.DIRECT, det=True),
]


def options(r: Row) -> Options:
    return Options(
        algorithm=r.algorithm,
        deterministic=r.deterministic,
        direct_max_bytes=DIRECT_MAX,
        star_max_bytes=STAR_MAX,
        segment_bytes=SEGMENT,
        transport="shm" if r.local else "tcp",
    )


def _opts(cls: Any, root: int = 0) -> Any:
    o = cls()
    o.rootRank = root
    return o


def issue(r: Row, rank: int, pg: EntrenarProcessGroup) -> None:
    """Run the row's collective once on this rank (payload ``r.nbytes``)."""
    n, world = r.nbytes // 4, r.world
    t = torch.full((n,), float(rank + 1))
    op = r.op
    if op is OpCode.ALLREDUCE:
        pg.allreduce([t]).wait()
    elif op is OpCode.BROADCAST:
        pg.broadcast([t], _opts(c10d.BroadcastOptions)).wait()
    elif op is OpCode.REDUCE:
        pg.reduce([t], _opts(c10d.ReduceOptions)).wait()
    elif op is OpCode.REDUCE_SCATTER:
        pg._reduce_scatter_base(torch.empty(n // world), t).wait()
    elif op is OpCode.ALLGATHER:
        pg._allgather_base(torch.empty(n * world), t).wait()
    elif op is OpCode.BARRIER:
        pg.barrier().wait()
    elif op is OpCode.GATHER:
        outs = [[torch.empty(n) for _ in range(world)]] if rank == 0 else []
        pg.gather(outs, [t], _opts(c10d.GatherOptions)).wait()
    elif op is OpCode.SCATTER:
        ins = [[torch.ones(n) for _ in range(world)]] if rank == 0 else []
        pg.scatter([t], ins, _opts(c10d.ScatterOptions)).wait()
    else:
        pg.alltoall_base(torch.empty(n), t, [], [], c10d.AllToAllOptions()).wait()


@pytest.mark.timeout(120)
def test_headers_on_the_wire_follow_the_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    packed: dict[int, list[Header]] = {}  # thread id -> the headers it packed
    original = Header.pack_into

    def spy(self: Header, *args: Any) -> Any:
        packed.setdefault(threading.get_ident(), []).append(self)
        return original(self, *args)

    monkeypatch.setattr(Header, "pack_into", spy)
    by_group: dict[tuple[int, str, bool, bool], list[Row]] = {}
    for r in ROWS:
        by_group.setdefault((r.world, r.algorithm, r.deterministic, r.local), []).append(r)
    failures = []
    for (world, *_), rows in by_group.items():
        groups = make_groups(world, options(rows[0]))
        try:
            for r in rows:
                packed.clear()

                def fn(rank: int, pg: EntrenarProcessGroup, r: Row = r) -> None:
                    issue(r, rank, pg)

                run_ranks(world, fn, groups=groups, timeout_s=30)
                headers = [h for hs in packed.values() for h in hs if h.op is r.op]
                assert headers, f"{r}: no header of {r.op.name} was packed"
                algos = frozenset(h.algo for h in headers)
                flags = {h.flags for h in headers}
                want_flags = Flags.DETERMINISTIC if r.deterministic else Flags.NONE
                if algos != r.wire or flags != {want_flags}:
                    failures.append(f"{r}: headers say {sorted(algos)}, flags {flags}")
        finally:
            for g in groups:
                g.shutdown()
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "r",
    ROWS,
    ids=lambda r: (
        f"{r.op.name}-{r.nbytes}B-N{r.world}-{r.algorithm}-det{int(r.deterministic)}"
        + ("-local" if r.local else "")
    ),
)
def test_choose_follows_the_rules(r: Row) -> None:
    from entrenar_pg.collectives.policy import choose

    choice = choose(r.op, r.nbytes, r.world, options(r), r.local)
    assert choice.algo is r.picks, choice
    assert choice.tree is r.deterministic
    assert choice.flags == (Flags.DETERMINISTIC if r.deterministic else Flags.NONE)
    assert choice.segment_bytes == SEGMENT
    assert choice.segment_elems(torch.float64) == SEGMENT // 8
    assert choice.segment_elems(torch.float32) == SEGMENT // 4


@pytest.mark.parametrize("op", list(OpCode))
def test_one_rank_runs_no_algorithm(op: OpCode) -> None:
    from entrenar_pg.collectives.policy import choose

    assert choose(op, 1 << 30, 1, Options()).algo is Algo.NONE


def test_a_segment_is_at_least_one_element() -> None:
    from entrenar_pg.collectives.policy import choose

    choice = choose(OpCode.ALLREDUCE, 64, 2, Options(segment_bytes=3))
    assert choice.segment_elems(torch.float64) == 1
    assert choice.segment_elems(torch.uint8) == 3

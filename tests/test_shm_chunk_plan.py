"""The large shm allreduce's chunk size per call: rank 0's choice, and every rank running it."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from conftest import make_groups, run_ranks
from torch.distributed import distributed_c10d as c10d

from entrenar_pg import Options
from entrenar_pg.collectives import shm_allreduce
from entrenar_pg.transport.shm import slots
from entrenar_pg.transport.shm.chunk_plan import EXPLORE_EVERY, ChunkChoice, ChunkPlan


def test_choice_tries_both_then_keeps_the_faster_and_explores_the_other() -> None:
    choice = ChunkChoice()
    assert choice.next_big() is False  # nothing measured: small chunks first
    choice.record(False, 1 << 20, 2.0)
    assert choice.next_big() is True  # then the size not measured yet
    choice.record(True, 1 << 20, 1.0)
    picks = [choice.next_big() for _ in range(2 * EXPLORE_EVERY)]
    assert picks.count(False) == 2, picks  # big is faster: small once in EXPLORE_EVERY
    assert all(p == ((i + 3) % EXPLORE_EVERY != 0) for i, p in enumerate(picks)), picks


def test_choice_follows_a_change_of_state_at_once_and_per_size_class() -> None:
    choice = ChunkChoice()
    choice.record(False, 1 << 24, 1.0)
    choice.record(True, 1 << 24, 2.0)
    choice._calls = 1  # not an exploring call next
    assert choice.next_big() is False
    for _ in range(3):  # small chunks got slower (the state changed): big's estimate wins
        choice.record(False, 1 << 24, 8.0)
    assert choice.next_big() is True
    # another size class has estimates of its own: nothing measured there yet
    choice.record(False, 1 << 20, 1.0)
    assert choice.next_big() is True  # its big size not measured yet
    choice.record(True, 1 << 20, 3.0)
    choice._calls = 1
    assert choice.next_big() is False


class _Scripted(ChunkChoice):
    """Rank 0's choice from a fixed random script (records ignored)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def next_big(self) -> bool:
        return self._rng.random() < 0.5


@pytest.mark.parametrize("seed", range(5))
def test_every_rank_reads_the_size_rank_0_chose_even_a_call_behind(seed: int) -> None:
    """Rank 0 may begin call c + 1 (writing its choice for c + 2) before a
    slower rank begins call c + 1; the two words keep c + 1's choice."""
    words = memoryview(bytearray(4096)).cast("q")
    rank0 = ChunkPlan(words, 40, _Scripted(seed))
    others = [ChunkPlan(words, 40, None) for _ in range(2)]
    rng = random.Random(seed + 100)
    got0: list[bool] = []
    got: list[list[bool]] = [[], []]
    for call in range(200):
        got0.append(rank0.begin())
        # The others begin this call in any order, and rank 0 can only be
        # one call ahead: it cannot finish this call before they began it.
        for i in rng.sample(range(2), 2):
            got[i].append(others[i].begin())
        assert got[0][call] == got[1][call] == got0[call], call
    assert got0[0] is False  # the first call: nothing written yet
    assert 40 < sum(got0) < 160  # both sizes ran


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_chunked_calls_run_rank_0s_sizes_on_every_rank_with_the_same_bits(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thread ranks over real slot areas; rank 0's choice scripted at random,
    chunks made tiny (small 64 bytes, big 448) so each size cuts a message
    differently: every call runs one size on every rank, both sizes run,
    and the sums are the rank-order sums."""
    monkeypatch.setattr(shm_allreduce, "SMALL_MAX_BYTES", 0)
    monkeypatch.setattr(shm_allreduce, "PAIR_SMALL_MAX_BYTES", 0)
    monkeypatch.setattr(shm_allreduce, "PAIR_SUM_SMALL_MAX_BYTES", 0)
    monkeypatch.setattr(shm_allreduce, "CHUNK_BYTES", 64)
    monkeypatch.setattr(shm_allreduce, "BIG_CHUNK_BYTES", 448)
    monkeypatch.setattr(slots, "ChunkChoice", lambda: _Scripted(world))
    begun: dict[int, list[bool]] = {}
    real_begin = ChunkPlan.begin

    def begin(self: ChunkPlan) -> bool:
        big = real_begin(self)
        begun.setdefault(id(self), []).append(big)
        return big

    monkeypatch.setattr(ChunkPlan, "begin", begin)
    sizes = [1001, 97, 448 // 4 * 3 + 1, 2000]

    def data(rank: int, n: int, call: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * rank + call)
        return torch.randn(n, generator=g) * 3

    def fn(rank: int, pg: Any) -> list[torch.Tensor]:
        out = []
        for call in range(40):
            t = data(rank, sizes[call % len(sizes)], call)
            opts = c10d.AllreduceOptions()
            opts.reduceOp = c10d.ReduceOp.SUM
            pg.allreduce([t], opts).wait()
            out.append(t)
        return out

    groups = make_groups(world, Options(transport="shm"))
    try:
        assert all(g._runtime.mesh.slots is not None for g in groups)
        got = run_ranks(world, fn, groups=groups, timeout_s=100)
    finally:
        for g in groups:
            g.shutdown()
    runs = list(begun.values())
    assert len(runs) == world and all(len(r) == 40 for r in runs), [len(r) for r in runs]
    assert all(r == runs[0] for r in runs), runs  # one size per call on every rank
    assert 5 < sum(runs[0]) < 35, runs[0]  # both sizes ran
    for call in range(40):
        n = sizes[call % len(sizes)]
        want = data(0, n, call)
        for q in range(1, world):
            want = want + data(q, n, call)  # rank order, as the path promises
        for rank in range(world):
            assert torch.equal(got[rank][call], want), (call, rank)

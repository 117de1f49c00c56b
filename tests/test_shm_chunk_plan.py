"""Where the large shm allreduce puts its chunks: at two ranks, rank 0's choice per call,
run by every rank; at three or more, always at the start of 4 MiB slots (the previous path)."""

from __future__ import annotations

import mmap
import random
from typing import Any

import pytest
import torch
from conftest import make_groups, run_ranks
from torch.distributed import distributed_c10d as c10d

from entrenar_pg import Options
from entrenar_pg.collectives import shm_allreduce
from entrenar_pg.transport.shm import slots
from entrenar_pg.transport.shm.chunk_plan import (
    CONFIRM_AFTER,
    EXPLORE_EVERY,
    EXPLORE_MAX,
    ChunkChoice,
    ChunkPlan,
)


def test_choice_tries_both_keeps_the_faster_and_explores_less_while_it_holds() -> None:
    choice = ChunkChoice()
    assert choice.next_rotates() is False  # nothing measured: in place first
    choice.record(False, 1 << 20, 50.0)  # a first call (page faults): not counted
    assert choice.next_rotates() is False
    choice.record(False, 1 << 20, 2.0)
    assert choice.next_rotates() is True  # then the placement not measured yet
    choice.record(True, 1 << 20, 50.0)
    assert choice.next_rotates() is True
    choice.record(True, 1 << 20, 1.0)
    picks = [choice.next_rotates() for _ in range(400)]
    # rotating is faster (a change of choice): in place tried again 2 calls
    # later, then after gaps of 4, 8, ... up to 128
    assert [i for i, p in enumerate(picks) if not p] == [1, 5, 13, 29, 61, 125, 253, 381], picks
    assert (CONFIRM_AFTER, EXPLORE_EVERY, EXPLORE_MAX) == (2, 16, 128)
    for _ in range(3):  # rotating got slower (the state changed): in place wins at once
        choice.record(True, 1 << 20, 9.0)
    picks = [choice.next_rotates() for _ in range(40)]
    assert [i for i, p in enumerate(picks) if p] == [1, 5, 13, 29], picks  # checked soon again


def test_a_burst_that_flips_the_choice_is_undone_within_a_few_calls() -> None:
    """In place costs 1.0 a byte, rotating 1.5 (the near state); four calls
    disturbed by other work (10x) flip the choice to rotating. Once the
    burst is over the choice is back in place after at most CONFIRM_AFTER
    rotating calls and one exploration (was: until the next exploration, 16
    calls)."""
    choice = ChunkChoice()
    cost = {False: 1.0, True: 1.5}
    for _ in range(300):  # steady: in place chosen
        rotate = choice.next_rotates()
        choice.record(rotate, 1 << 26, cost[rotate])
    flipped = False
    for _ in range(4):  # the burst
        rotate = choice.next_rotates()
        choice.record(rotate, 1 << 26, 10 * cost[rotate])
        flipped = flipped or choice.next_rotates()
    assert flipped, "the burst did not flip the choice: nothing to undo"
    after = []
    for _ in range(40):
        rotate = choice.next_rotates()
        after.append(rotate)
        choice.record(rotate, 1 << 26, cost[rotate])
    # the flipped choice's calls, then one confirming exploration of rotating
    assert sum(after[:8]) <= CONFIRM_AFTER + 1, after
    assert sum(after[8:]) <= 3, after  # then only explorations (gaps 4, 8, 16, ...)


def test_choice_follows_a_change_of_state_at_once_and_per_size_class() -> None:
    choice = ChunkChoice()
    for rotate, first, then in ((False, 9.0, 1.0), (True, 9.0, 2.0)):
        choice.record(rotate, 1 << 24, first)  # (not counted)
        choice.record(rotate, 1 << 24, then)
    assert choice.next_rotates() is False
    for _ in range(3):  # in place got slower (the state changed): rotating's estimate wins
        choice.record(False, 1 << 24, 8.0)
    assert choice.next_rotates() is True
    choice.record(False, 1 << 24, 0.5)  # one cheaper explored call: in place's cost now
    assert choice.next_rotates() is False
    # another size class has estimates of its own: nothing measured there yet
    choice.record(False, 1 << 20, 9.0)
    choice.record(False, 1 << 20, 1.0)
    assert choice.next_rotates() is True  # its rotating not measured yet
    choice.record(True, 1 << 20, 9.0)
    choice.record(True, 1 << 20, 3.0)
    picks = [choice.next_rotates() for _ in range(8)]  # in place, but for explorations
    assert sum(picks) <= 2 and not any(picks[1:4]), picks


class _Scripted(ChunkChoice):
    """Rank 0's choice from a fixed random script (records ignored)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def next_rotates(self) -> bool:
        return self._rng.random() < 0.5


@pytest.mark.parametrize("seed", range(5))
def test_every_rank_reads_what_rank_0_chose_even_a_call_behind(seed: int) -> None:
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
    assert 40 < sum(got0) < 160  # both placements ran


_SIZES = [1001, 97, 16 * 3 + 1, 2000]  # float32 elements: 16 a chunk at 64-byte chunks
_CALLS = 40


def _data(rank: int, n: int, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + call)
    return torch.randn(n, generator=g) * 3


def _sums(rank: int, pg: Any) -> list[torch.Tensor]:
    """``_CALLS`` blocking SUM allreduces of ``_SIZES`` in turn (each rank's own data)."""
    out = []
    for call in range(_CALLS):
        t = _data(rank, _SIZES[call % len(_SIZES)], call)
        opts = c10d.AllreduceOptions()
        opts.reduceOp = c10d.ReduceOp.SUM
        pg.allreduce([t], opts).wait()
        out.append(t)
    return out


def _assert_rank_order_sums(world: int, got: list[list[torch.Tensor]]) -> None:
    """Every rank's results are the rank-order sums, bit for bit (the path's promise)."""
    for call in range(_CALLS):
        n = _SIZES[call % len(_SIZES)]
        want = _data(0, n, call)
        for q in range(1, world):
            want = want + _data(q, n, call)
        for rank in range(world):
            assert torch.equal(got[rank][call], want), (call, rank)


def _tiny_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call takes the chunked path, in 64-byte chunks (a message spans many)."""
    monkeypatch.setattr(shm_allreduce, "SMALL_MAX_BYTES", 0)
    monkeypatch.setattr(shm_allreduce, "PAIR_SMALL_MAX_BYTES", 0)
    monkeypatch.setattr(shm_allreduce, "PAIR_SUM_SMALL_MAX_BYTES", 0)
    monkeypatch.setattr(shm_allreduce, "CHUNK_BYTES", 64)


@pytest.mark.timeout(120)
def test_two_ranks_run_rank_0s_placement_on_both_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two thread ranks over real 16 MiB slot areas; rank 0's choice scripted
    at random, chunks made tiny (64 bytes) so a message rotates over every
    place: every call runs one placement on both ranks, both placements run,
    the sums are the rank-order sums, and the rotating calls wrote beyond the
    first place."""
    _tiny_chunks(monkeypatch)
    monkeypatch.setattr(slots, "ChunkChoice", lambda: _Scripted(2))
    begun: dict[int, list[bool]] = {}
    real_begin = ChunkPlan.begin

    def begin(self: ChunkPlan) -> bool:
        rotate = real_begin(self)
        begun.setdefault(id(self), []).append(rotate)
        return rotate

    monkeypatch.setattr(ChunkPlan, "begin", begin)
    groups = make_groups(2, Options(transport="shm"))
    try:
        areas = [g._runtime.mesh.slots for g in groups]
        assert all(a is not None and a.chunk_plan is not None for a in areas)
        assert all(a.slot_bytes == slots.PAIR_SLOT_DATA_BYTES == 16 << 20 for a in areas)
        got = run_ranks(2, _sums, groups=groups, timeout_s=100)
        # the fourth place (bytes 192-255 of a slot) is written only by rotating calls
        fourth = [bytes(areas[0].data_bytes(q, p, 256)[192:]) for q in (0, 1) for p in (0, 1)]
        assert any(any(b) for b in fourth), "no rotating call reached the fourth place"
        for rank, g in enumerate(groups):  # its own slice out first, the peer's after the wait
            for shape in _shapes(g):
                assert {place for _, place in shape.cuts} == set(range(shm_allreduce.ROTATE))
                for cut in shape.cuts.values():
                    assert cut.out_early == [rank] and cut.out_late == [1 - rank], rank
    finally:
        for g in groups:
            g.shutdown()
    runs = list(begun.values())
    assert len(runs) == 2 and all(len(r) == _CALLS for r in runs), [len(r) for r in runs]
    assert runs[0] == runs[1], runs  # one placement per call on both ranks
    assert 5 < sum(runs[0]) < 35, runs[0]  # both placements ran
    _assert_rank_order_sums(2, got)


def _shapes(group: Any) -> list[Any]:
    """The shm allreduce shapes a group cached (``shm_allreduce._shape``)."""
    plans = group._runtime.scratch._plans
    return [shape for key, shape in plans.items() if key[0] == "shm"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [3, 4])
def test_three_or_more_ranks_keep_the_previous_chunk_path(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At N >= 3 nothing of the two-rank placement runs: no plan, 4 MiB slots
    (the previous release's 8 MiB + 3 pages per rank), every chunk at the
    slots' start (with 64-byte chunks, bytes 64-255 of every slot are never
    written), every rank's reduced slice copied out after the last wait in
    rank order, and the sums the rank-order sums."""
    _tiny_chunks(monkeypatch)

    def begin(self: ChunkPlan) -> bool:
        raise AssertionError("a chunk plan ran at three or more ranks")

    monkeypatch.setattr(ChunkPlan, "begin", begin)
    groups = make_groups(world, Options(transport="shm"))
    try:
        areas = [g._runtime.mesh.slots for g in groups]
        assert all(a is not None and a.chunk_plan is None for a in areas)
        page = mmap.PAGESIZE
        previous_area = page + 2 * ((4 << 20) + page)  # 4 MiB slots, a header page each
        assert slots.area_bytes(world) == previous_area
        assert all(a.slot_bytes == 4 << 20 for a in areas)
        assert all(len(view) == previous_area for a in areas for view in a._areas)
        got = run_ranks(world, _sums, groups=groups, timeout_s=100)
        beyond = [bytes(areas[0].data_bytes(q, p, 256)[64:]) for q in range(world) for p in (0, 1)]
        assert not any(any(b) for b in beyond), "a chunk went beyond the slots' start"
        for rank, g in enumerate(groups):
            shapes = _shapes(g)
            assert shapes, "no chunked shape cached"
            for shape in shapes:
                assert {place for _, place in shape.cuts} == {0}
                for cut in shape.cuts.values():
                    assert cut.out_early == [] and cut.out_late == list(range(world)), rank
    finally:
        for g in groups:
            g.shutdown()
    _assert_rank_order_sums(world, got)

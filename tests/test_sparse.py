"""Allreduce of sparse COO tensors (entrenar_pg/sparse.py).

Ranks are threads, each with its own group over real loopback TCP; gloo's
groups (``ProcessGroupGloo``, also one per thread) run the same inputs side
by side. Results are compared bit for bit: the default mode sums in gloo's
order (left to right over ranks), the deterministic mode in the canonical
tree, checked against a reference tree written here. DDP with a sparse
embedding runs under torchrun on both backends (tests/scripts/ddp_sparse.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import GLOO_EXIT_ABORT, REPO, run_ranks, torchrun

from entrenar_pg import CollectiveMismatchError, Options

SUM = dist.ReduceOp.SUM
Make = Callable[[int, int, torch.dtype], torch.Tensor]


def gloo_groups(world: int, timeout_s: float = 20.0) -> list[Any]:
    store = dist.HashStore()
    groups: list[Any] = [None] * world

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(
            dist.PrefixStore("gloo", store), rank, world, timedelta(seconds=timeout_s)
        )

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    assert all(g is not None for g in groups), "gloo group creation hung"
    return groups


def allreduce(pg: Any, t: torch.Tensor, op: Any = SUM) -> torch.Tensor:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    pg.allreduce([t], opts).wait()
    return t


def run(world: int, make: Make, dtype: torch.dtype, **kw: Any) -> list[torch.Tensor]:
    """Every rank allreduces ``make(rank, world, dtype)``; the tensors afterwards, by rank."""
    return run_ranks(world, lambda r, pg: allreduce(pg, make(r, world, dtype)), **kw)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: -0.0 and 0.0 differ, as they must here."""
    return t.contiguous().view(-1).view(torch.uint8)


def assert_same_sparse(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.layout is torch.sparse_coo and got.is_coalesced(), what
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert got.sparse_dim() == want.sparse_dim() and got.dense_dim() == want.dense_dim(), what
    assert got._indices().dtype == torch.int64, what
    assert torch.equal(got._indices(), want._indices()), f"{what}: indices differ"
    assert torch.equal(bits(got._values()), bits(want._values())), f"{what}: values differ"


def _gen(rank: int, world: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(7919 * rank + 101 * world + salt)


def _values(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def overlapping(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """Random indices from a small range: shared between ranks, duplicated within one."""
    g = _gen(rank, world, 1)
    idx = torch.randint(0, 12, (1, 9), generator=g)
    return torch.sparse_coo_tensor(idx, _values(g, (9,), dtype), (12,))


def disjoint(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r owns indices 3r..3r+2 (given in reverse order); a -0.0 that must stay -0.0."""
    g = _gen(rank, world, 2)
    idx = torch.arange(3 * rank + 2, 3 * rank - 1, -1).view(1, 3)
    vals = _values(g, (3,), dtype)
    if dtype.is_floating_point:
        vals[1] = -0.0
    return torch.sparse_coo_tensor(idx, vals, (3 * world,))


def duplicates(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """Uncoalesced: index 3 three times, 1 twice."""
    g = _gen(rank, world, 3)
    idx = torch.tensor([[3, 1, 3, 3, 0, 1]])
    return torch.sparse_coo_tensor(idx, _values(g, (6,), dtype), (5,))


def empty(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.sparse_coo_tensor(
        torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, 4).to(dtype), (3, 5, 4)
    )


def empty_on_even_ranks(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    if rank % 2 == 0:
        return empty(rank, world, dtype)
    g = _gen(rank, world, 4)
    idx = torch.stack(
        [torch.randint(0, 3, (4,), generator=g), torch.randint(0, 5, (4,), generator=g)]
    )
    return torch.sparse_coo_tensor(idx, _values(g, (4, 4), dtype), (3, 5, 4))


def hybrid(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """sparse_dim 2, a dense dim of 3 (an embedding-like row per index)."""
    g = _gen(rank, world, 5)
    idx = torch.stack(
        [torch.randint(0, 4, (7,), generator=g), torch.randint(0, 3, (7,), generator=g)]
    )
    return torch.sparse_coo_tensor(idx, _values(g, (7, 3), dtype), (4, 3, 3))


def hybrid_two_dense_dims(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    g = _gen(rank, world, 6)
    idx = torch.randint(0, 6, (1, 4), generator=g)
    return torch.sparse_coo_tensor(idx, _values(g, (4, 2, 5), dtype), (6, 2, 5))


CASES: dict[str, Make] = {
    f.__name__: f
    for f in (
        overlapping,
        disjoint,
        duplicates,
        empty,
        empty_on_even_ranks,
        hybrid,
        hybrid_two_dense_dims,
    )
}


# ----------------------------------------------------------------------------- against gloo


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sparse_allreduce_matches_gloo_bit_for_bit(world: int) -> None:
    gloo = gloo_groups(world)
    for dtype in (torch.float32, torch.float64, torch.int64):
        for name, make in CASES.items():
            want = run(world, make, dtype, groups=gloo)
            got = run(world, make, dtype)
            for r in range(world):
                assert_same_sparse(got[r], want[r], f"{name} {dtype} N={world} rank {r}")
            if world > 1 and name == "overlapping":  # the data really overlaps
                assert got[0]._nnz() < sum(make(r, world, dtype)._nnz() for r in range(world))


# ----------------------------------------------------------------------------- determinism


def reference_tree(contribs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The canonical tree over ranks (split at (k+1)//2); an absent rank is skipped."""
    if len(contribs) == 1:
        return contribs[0]
    m = (len(contribs) + 1) // 2
    left, right = reference_tree(contribs[:m]), reference_tree(contribs[m:])
    if left is None or right is None:
        return left if right is None else right
    return left + right


def expected_tree_sum(inputs: list[torch.Tensor]) -> dict[tuple[int, ...], torch.Tensor]:
    per_rank = []
    for t in inputs:
        c = t.coalesce()
        per_rank.append(
            {tuple(c._indices()[:, i].tolist()): c._values()[i] for i in range(c._nnz())}
        )
    keys = sorted(set().union(*per_rank))
    out = {}
    for k in keys:
        total = reference_tree([rank.get(k) for rank in per_rank])
        assert total is not None
        out[k] = total
    return out


def as_dict(t: torch.Tensor) -> dict[tuple[int, ...], torch.Tensor]:
    return {tuple(t._indices()[:, i].tolist()): t._values()[i] for i in range(t._nnz())}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_deterministic_mode_sums_every_index_in_the_tree_order(world: int) -> None:
    det = Options(deterministic=True)
    for name in ("overlapping", "disjoint", "duplicates", "hybrid", "empty_on_even_ranks"):
        make = CASES[name]
        inputs = [make(r, world, torch.float32) for r in range(world)]
        want = expected_tree_sum(inputs)
        got = run(world, make, torch.float32, options=det)
        for r in range(world):
            assert got[r].is_coalesced(), name
            keys = [tuple(c) for c in got[r]._indices().t().tolist()]
            assert keys == sorted(want), f"{name}: indices"
            for k, v in as_dict(got[r]).items():
                assert torch.equal(bits(v), bits(want[k])), f"{name} N={world} rank {r} index {k}"


@pytest.mark.timeout(60)
def test_tree_order_and_gloos_rank_order_give_different_bits_where_they_should() -> None:
    """One index, four ranks, values where the order shows in float32:
    tree (1e8 + 1) + (-1e8 + 1) = 0; left to right ((1e8 + 1) - 1e8) + 1 = 1."""
    vals = [1e8, 1.0, -1e8, 1.0]

    def make(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.sparse_coo_tensor(
            torch.tensor([[2]]), torch.tensor([vals[rank]], dtype=dtype), (4,)
        )

    det = run(4, make, torch.float32, options=Options(deterministic=True))
    default = run(4, make, torch.float32)
    gloo = run(4, make, torch.float32, groups=gloo_groups(4))
    for r in range(4):
        assert det[r]._values().tolist() == [0.0]
        assert default[r]._values().tolist() == [1.0] == gloo[r]._values().tolist()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [3, 4])
def test_deterministic_bits_repeat_across_runs_and_algorithm_options(world: int) -> None:
    runs = []
    for algorithm in ("auto", "ring", "star", "direct", "auto"):
        options = Options(deterministic=True, algorithm=algorithm, segment_bytes=64)
        runs.append(run(world, hybrid, torch.float32, options=options))
    first = runs[0][0]
    assert first._nnz() > 0
    for results in runs:
        for t in results:
            assert_same_sparse(t, first, "deterministic run")


# ----------------------------------------------------------------------------- mismatches


def _sparse_1d(size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, dtype=dtype), (size,))


def _sparse_hybrid(row: int) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2, row), (4, row))


MISMATCHES: dict[str, tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], str]] = {
    # name: (what the odd rank passes, what the others pass, what the message names)
    "dense_vs_sparse": (lambda: torch.ones(10), lambda: _sparse_1d(10), "allreduce#1"),
    "dtype": (lambda: _sparse_1d(10, torch.float64), lambda: _sparse_1d(10), "float64"),
    "dense_shape": (lambda: _sparse_hybrid(4), lambda: _sparse_hybrid(3), "4 elements per index"),
    "sparse_dim": (
        lambda: torch.ones(4, 3).to_sparse(2),
        lambda: torch.ones(4, 3).to_sparse(1),
        "sparse_dim 2",
    ),
    "sparse_shape": (lambda: _sparse_1d(11), lambda: _sparse_1d(10), "shape (11,)"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatched_inputs_raise_on_every_rank_in_the_call(case: str, world: int) -> None:
    odd_tensor, usual_tensor, named = MISMATCHES[case]
    odd = world - 1

    def fn(rank: int, pg: Any) -> tuple[type, str, float]:
        t = odd_tensor() if rank == odd else usual_tensor()
        start = time.monotonic()
        try:
            allreduce(pg, t)
        except Exception as e:
            return type(e), str(e), time.monotonic() - start
        return type(None), "no error", time.monotonic() - start

    results = run_ranks(world, fn, options=Options(), timeout_s=60)
    for rank, (cls, msg, seconds) in enumerate(results):
        assert cls is CollectiveMismatchError, f"rank {rank}: {cls.__name__}: {msg}"
        assert msg.startswith(f"rank {rank}: "), msg
        assert seconds < 15, f"rank {rank} took {seconds:.1f}s (the group timeout is 20s)"
    if case != "dense_vs_sparse":  # every rank sees every rank's record: one message
        for _, msg, _ in results:
            assert f"rank {odd}: " in msg and named in msg, msg
            assert "sparse_allreduce#1" in msg, msg
    else:  # the transport's header check names both calls where it fires
        assert any(named in msg and "sparse_allreduce#1" in msg for _, msg, _ in results)


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.timeout(60)
def test_bad_sparse_calls_raise_in_the_caller_and_leave_the_group_usable() -> None:
    t = _sparse_1d(10)

    def fn(rank: int, pg: Any) -> torch.Tensor:
        if rank == 0:  # rank 1 sends nothing: rank 0's calls must not send either
            for op in (dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
                with pytest.raises(ValueError, match=r"rank 0: allreduce: .*only .*ReduceOp\.SUM"):
                    allreduce(pg, t.clone(), op)
            premul = dist._make_nccl_premul_sum(2.0)
            with pytest.raises(ValueError, match=r"rank 0: allreduce: .*ReduceOp\.SUM"):
                allreduce(pg, t.clone(), premul)
            with pytest.raises(ValueError, match=r"rank 0: allreduce: .*exactly one tensor"):
                pg.allreduce([t.clone(), t.clone()], dist.AllreduceOptions())
            with pytest.raises(TypeError, match=r"rank 0: allreduce: expected a list of tensors"):
                pg.allreduce(t.clone(), dist.AllreduceOptions())  # a bare sparse tensor
            with pytest.raises(TypeError, match=r"rank 0: allreduce: expected a list"):
                pg.allreduce(torch.ones(3), dist.AllreduceOptions())  # the dense path's check
            meta = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (3,), device="meta")
            with pytest.raises(ValueError, match=r"rank 0: allreduce: .*not supported \(CPU only"):
                allreduce(pg, meta)
            with pytest.raises(ValueError, match=r"rank 0: allreduce_coalesced: only dense"):
                pg.allreduce_coalesced([t.clone()], dist.AllreduceCoalescedOptions())
        return allreduce(pg, t.clone())

    for out in run_ranks(2, fn, timeout_s=30):
        assert out._indices().tolist() == [[0, 2]] and out._values().tolist() == [2.0, 2.0]


@pytest.mark.timeout(60)
def test_public_api_async_work_and_stats() -> None:
    """``dist.all_reduce`` on a sparse tensor through a registered entrenar group."""

    def fn(rank: int, pg: Any) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, float]]:
        t = torch.sparse_coo_tensor(torch.tensor([[rank, 3]]), torch.ones(2), (4,))
        work = pg.allreduce([t], dist.AllreduceOptions())
        assert work.wait()
        return t, work.result(), pg.stats()

    for t, result, stats in run_ranks(2, fn, timeout_s=30):
        assert result[0] is t
        assert t._indices().tolist() == [[0, 1, 3]] and t._values().tolist() == [1.0, 1.0, 2.0]
        assert stats["sparse_allreduce_calls"] == 1 and stats["sparse_allreduce_bytes"] > 0


# ----------------------------------------------------------------------------- DDP


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_with_a_sparse_embedding_trains_to_gloos_weights(tmp_path: Path) -> None:
    script = REPO / "tests" / "scripts" / "ddp_sparse.py"
    # One job: entrenar is the default group, gloo a group of the same ranks.
    job = (script, 2, "--backends", "entrenar", "gloo", "--out", str(tmp_path))
    proc = torchrun(*job, timeout_s=180)
    if proc.returncode != 0 and GLOO_EXIT_ABORT in proc.stderr:
        # The reference, not the subject: gloo now and then aborts in its own
        # teardown after the script finished (seen under the parallel suite's
        # load); one rerun of the job, which must then pass.
        proc = torchrun(*job, timeout_s=180)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    states = {
        b: [torch.load(tmp_path / b / f"rank{r}.pt") for r in range(2)]
        for b in ("entrenar", "gloo")
    }
    ours, theirs = states["entrenar"], states["gloo"]
    assert ours[0]["stats"].get("sparse_allreduce_calls", 0) >= ours[0]["steps"] > 0
    assert ours[0]["grad_was_sparse"] and theirs[0]["grad_was_sparse"]
    for r in range(2):
        for k, v in ours[0]["model"].items():
            assert torch.equal(bits(v), bits(ours[r]["model"][k])), f"rank {r} differs in {k}"
            assert torch.equal(bits(v), bits(theirs[r]["model"][k])), f"{k} differs from gloo"
        assert_same_sparse(ours[r]["public"], theirs[r]["public"], f"dist.all_reduce rank {r}")
    initial = ours[0]["initial"]
    assert not torch.equal(initial, ours[0]["model"]["emb.weight"])  # it trained

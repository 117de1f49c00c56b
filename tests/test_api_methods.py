"""The ProcessGroup method surface, called directly (threads over loopback TCP).

torch 2.13's Python API calls the new names (``all_to_all_single``,
``reduce_scatter_single``, ``*_single_coalesced``); torch 2.11 calls the old
ones (``alltoall_base``, ``_reduce_scatter_base``, ``*_tensor_coalesced``).
Every one is implemented here in Python (none falls through to torch's C++
base class, which would fail), takes ``opts=None``, and gives the right
result; bad arguments fail in the caller; disagreeing ranks get a
CollectiveMismatchError instead of a hang; deterministic mode gives the
canonical tree order bit for bit in reduce and reduce-scatter too.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks

from entrenar_pg import CollectiveMismatchError, EntrenarProcessGroup, Options, tree_sum
from entrenar_pg.overloads import SPECS

# Every collective / p2p name torch 2.11 or 2.13 calls on a ProcessGroup.
TORCH_METHODS = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "reduce",
    "allgather",
    "allgather_coalesced",
    "_allgather_base",  # 2.11 all_gather_into_tensor
    "all_gather_single",  # 2.13
    "allgather_into_tensor_coalesced",  # 2.11 coalescing manager, functional collectives
    "all_gather_single_coalesced",  # 2.13 coalescing manager
    "gather",
    "scatter",
    "reduce_scatter",
    "_reduce_scatter_base",  # 2.11 reduce_scatter_tensor
    "reduce_scatter_single",  # 2.13
    "reduce_scatter_tensor_coalesced",  # 2.11
    "reduce_scatter_single_coalesced",  # 2.13
    "alltoall",
    "alltoall_base",  # 2.11 all_to_all_single
    "all_to_all_single",  # 2.13
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "recv_anysource",
    "shutdown",
    "abort",
)


def test_every_torch_method_is_implemented_in_python_with_optional_opts() -> None:
    for name in TORCH_METHODS:
        owner = next(c for c in EntrenarProcessGroup.__mro__ if name in c.__dict__)
        assert owner.__module__.startswith("entrenar_pg"), f"{name} falls through to {owner}"
        params = inspect.signature(getattr(EntrenarProcessGroup, name)).parameters
        if "opts" in params:
            assert params["opts"].default is None, name
        if name in SPECS:  # torch's forms (overloads.py): the options form's opts defaults to None
            last = SPECS[name].forms[0][-1]
            assert last.name == "opts" and last.default is None, name
    # every method taking torch's options goes through overloads.normalize
    for name in TORCH_METHODS:
        doc = str(getattr(dist.ProcessGroup, name, None).__doc__)
        if "Options" in doc and name not in ("send", "recv", "recv_anysource"):
            assert name in SPECS, name
    # and nothing torch's ProcessGroup offers as a collective is left to C++
    ours = set(EntrenarProcessGroup.__dict__)
    torch_side = {n for n in dir(dist.ProcessGroup) if not n.startswith("__")}
    collective_like = {
        n
        for n in torch_side
        if any(k in n for k in ("all", "reduce", "gather", "scatter", "send", "recv", "barrier"))
    }
    assert collective_like <= ours, sorted(collective_like - ours)


def _ranks(world: int, fn, options: Options | None = None):  # type: ignore[no-untyped-def]
    return run_ranks(world, fn, options=options)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 3])
def test_old_and_new_names_without_opts(world: int) -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> None:
        n = pg.size()
        x = torch.arange(4.0) + 10 * rank
        every = torch.cat([torch.arange(4.0) + 10 * r for r in range(n)])
        for name in ("_allgather_base", "all_gather_single"):
            out = torch.empty(4 * n)
            getattr(pg, name)(out, x).wait()
            assert torch.equal(out, every), name
        for name in ("allgather_into_tensor_coalesced", "all_gather_single_coalesced"):
            outs = [torch.empty(4 * n), torch.empty(2 * n)]
            getattr(pg, name)(outs, [x, x[:2] * 2]).wait()
            assert torch.equal(outs[0], every), name
            assert torch.equal(outs[1], every.reshape(n, 4)[:, :2].reshape(-1) * 2), name
        big = torch.arange(3.0 * n) * (rank + 1)
        tri = n * (n + 1) // 2
        want = torch.arange(3.0 * n)[3 * rank : 3 * rank + 3] * tri
        for name in ("_reduce_scatter_base", "reduce_scatter_single"):
            out = torch.empty(3)
            getattr(pg, name)(out, big).wait()
            assert torch.equal(out, want), name
        for name in ("reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced"):
            outs = [torch.empty(3), torch.empty(0)]
            getattr(pg, name)(outs, [big, torch.empty(0)]).wait()
            assert torch.equal(outs[0], want), name
        src = torch.arange(2.0 * n) + 100 * rank
        want_a2a = torch.tensor([100.0 * p + o for p in range(n) for o in (2 * rank, 2 * rank + 1)])
        for name in ("alltoall_base", "all_to_all_single"):
            out = torch.empty(2 * n)
            getattr(pg, name)(out, src, [], []).wait()
            assert torch.equal(out, want_a2a), name
        inplace = src.clone()
        pg.all_to_all_single(inplace, inplace, [], []).wait()
        assert torch.equal(inplace, want_a2a)
        pg.reduce([y := torch.ones(2)]).wait()
        assert torch.equal(y, torch.full((2,), float(n) if rank == 0 else 1.0))
        pg.monitored_barrier()

    _ranks(world, fn)


@pytest.mark.timeout(60)
def test_bad_arguments_fail_in_the_caller_naming_the_rank() -> None:
    (pg,) = make_groups(1)
    try:
        with pytest.raises(ValueError, match="rank 0: all_to_all_single: the input split sizes"):
            pg.all_to_all_single(torch.empty(4), torch.empty(4), [4], [3])
        with pytest.raises(ValueError, match="rank 0: reduce_scatter_single: input has 5"):
            pg.reduce_scatter_single(torch.empty(4), torch.empty(5))
        with pytest.raises(ValueError, match="rank 0: gather: the root needs"):
            pg.gather([], [torch.ones(1)])
        opts = dist.ReduceOptions()
        opts.rootRank = 2
        with pytest.raises(ValueError, match="root rank 2 outside"):
            pg.reduce([torch.ones(1)], opts)
        with pytest.raises(ValueError, match="reduce op BAND is not defined"):
            o = dist.ReduceScatterOptions()
            o.reduceOp = dist.ReduceOp.BAND
            pg.reduce_scatter_single(torch.empty(1), torch.empty(1), o)
    finally:
        pg.shutdown()


@pytest.mark.timeout(60)
def test_disagreeing_split_sizes_are_a_mismatch_not_a_hang() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> None:
        # rank 0 sends 1 element to rank 1; rank 1 expects 2 from rank 0
        out_splits = [1, 1] if rank == 0 else [2, 1]
        inp = torch.ones(2)
        out = torch.empty(sum(out_splits))
        # Both ends compare the link's sizes both ways, so both raise in the
        # call itself (rank 0, whose own receive is fine, included).
        other = 1 - rank
        with pytest.raises(
            CollectiveMismatchError, match=rf"rank {other} called alltoall#1\(.*numel={2 - rank}"
        ):
            pg.all_to_all_single(out, inp, out_splits, [1, 1]).wait()

    run_ranks(2, fn)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel", [37, 50_000])  # star / reduce-scatter + gather paths
def test_deterministic_reduce_and_reduce_scatter_use_the_tree_order(numel: int) -> None:
    world = 4
    inputs = [
        torch.randn(numel * world, generator=torch.Generator().manual_seed(r)) for r in range(world)
    ]
    opts = Options(deterministic=True, star_max_bytes=64 << 10, segment_bytes=8192)

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        red = inputs[rank].clone()
        ro = dist.ReduceOptions()
        ro.rootRank = 2
        pg.reduce([red], ro).wait()
        out = torch.empty(numel)
        pg.reduce_scatter_single(out, inputs[rank]).wait()
        return red, out

    want = tree_sum(inputs)
    results = _ranks(world, fn, opts)
    assert torch.equal(results[2][0], want)  # the root; bitwise
    for rank, (red, out) in enumerate(results):
        assert torch.equal(out, want[rank * numel : (rank + 1) * numel])
        if rank != 2:
            assert torch.equal(red, inputs[rank])  # non-root inputs untouched

"""Outputs whose elements share memory are refused before anything is sent.

An ``expand()``ed (stride-0) output, or any internally overlapping tensor a
collective writes, cannot hold the result: torch refuses the final copy, and
before the check it did so after the bytes had moved, so the job failed and
broke the group. Every collective (and a p2p recv) now raises ValueError
naming the rank and the call in the caller's thread, sends nothing, and the
group stays usable. Non-contiguous outputs that do not overlap still work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import run_ranks

from entrenar_pg import EntrenarProcessGroup

c10d = torch._C._distributed_c10d
N = 4


def shared(n: int = N) -> torch.Tensor:
    """n elements, one memory location."""
    return torch.zeros(1).expand(n)


def ok(n: int = N) -> torch.Tensor:
    return torch.zeros(n)


def _opts(cls: type, **fields: Any) -> Any:
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


# (call name in the message, the ranks that write and so must refuse, the call).
# Ranks whose part of a rooted call only reads issue nothing (they would wait).
Case = tuple[str, tuple[int, ...], Callable[[int, Any], Any]]
CASES: list[Case] = [
    ("allreduce", (0, 1), lambda r, pg: pg.allreduce([shared()])),
    ("allreduce", (0, 1), lambda r, pg: pg.allreduce(shared())),
    (
        "allreduce",
        (0, 1),
        lambda r, pg: pg.allreduce([torch.empty_strided((2, 2), (1, 1))]),  # offsets 0,1,1,2
    ),
    ("allreduce_coalesced", (0, 1), lambda r, pg: pg.allreduce_coalesced([ok(), shared()])),
    ("broadcast", (0,), lambda r, pg: pg.broadcast(shared(), 1)),
    ("reduce", (0,), lambda r, pg: pg.reduce(shared(), 0)),
    ("allgather", (0, 1), lambda r, pg: pg.allgather([[ok(), shared()]], [ok()])),
    ("all_gather_single", (0, 1), lambda r, pg: pg.all_gather_single(shared(2 * N), ok())),
    ("_allgather_base", (0, 1), lambda r, pg: pg._allgather_base(shared(2 * N), ok())),
    (
        "allgather_coalesced",
        (0, 1),
        lambda r, pg: pg.allgather_coalesced([[ok(), ok()], [ok(), shared()]], [ok(), ok()]),
    ),
    (
        "allgather_into_tensor_coalesced",
        (0, 1),
        lambda r, pg: pg.allgather_into_tensor_coalesced([shared(2 * N)], [ok()]),
    ),
    (
        "gather",
        (1,),
        lambda r, pg: pg.gather([[ok(), shared()]], [ok()], _opts(c10d.GatherOptions, rootRank=1)),
    ),
    ("scatter", (0, 1), lambda r, pg: pg.scatter(shared(), [ok(), ok()] if r == 0 else [], 0)),
    ("reduce_scatter", (0, 1), lambda r, pg: pg.reduce_scatter(shared(), [ok(), ok()])),
    (
        "reduce_scatter_single",
        (0, 1),
        lambda r, pg: pg.reduce_scatter_single(shared(), ok(2 * N)),
    ),
    (
        "reduce_scatter_tensor_coalesced",
        (0, 1),
        lambda r, pg: pg.reduce_scatter_tensor_coalesced([ok(), shared()], [ok(2 * N)] * 2),
    ),
    ("all_to_all_single", (0, 1), lambda r, pg: pg.all_to_all_single(shared(), ok(), [], [])),
    ("alltoall", (0, 1), lambda r, pg: pg.alltoall([ok(), shared()], [ok(), ok()])),
    ("recv", (0,), lambda r, pg: pg.recv([shared()], 1, 0)),
]


@pytest.mark.timeout(60)
def test_overlapping_outputs_are_refused_before_sending_and_the_group_survives() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> list[float]:
        for name, writers, call in CASES:
            if rank not in writers:
                continue
            with pytest.raises(ValueError, match=rf"^rank {rank}: {name}: an output tensor"):
                call(rank, pg)
        assert pg.errored() is None
        # nothing was sent above: the ranks are still in step, on every path
        t = torch.full((3,), float(rank + 1))
        pg.allreduce([t]).wait()
        outs = [ok(), ok()]
        pg.allgather(outs, torch.full((N,), float(rank))).wait()
        return [*t.tolist(), *outs[1].tolist()]

    assert run_ranks(2, fn, timeout_s=40) == [[3.0] * 3 + [1.0] * N] * 2


@pytest.mark.timeout(60)
def test_non_contiguous_outputs_that_do_not_overlap_still_work() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> list[torch.Tensor]:
        base = torch.zeros(4, 6)
        strided = base[:, ::2]  # a step: non-contiguous, no overlap
        strided.fill_(rank + 1.0)
        pg.allreduce([strided]).wait()
        woven = torch.empty_strided((3, 2), (2, 3))  # interleaved strides, offsets 0..5 once each
        woven.copy_(torch.arange(6.0).view(3, 2) * (rank + 1))
        pg.allreduce([woven]).wait()
        outs = [torch.zeros(3, 2).t(), torch.zeros(3, 2).t()]  # transposed outputs
        pg.allgather(outs, torch.full((2, 3), float(rank))).wait()
        return [base, woven, *outs]

    for base, woven, out0, out1 in run_ranks(2, fn, timeout_s=40):
        assert torch.equal(base[:, ::2], torch.full((4, 3), 3.0))
        assert torch.equal(base[:, 1::2], torch.zeros(4, 3))  # untouched between the steps
        assert torch.equal(woven, torch.arange(6.0).view(3, 2) * 3)
        assert torch.equal(out0, torch.zeros(2, 3)) and torch.equal(out1, torch.ones(2, 3))

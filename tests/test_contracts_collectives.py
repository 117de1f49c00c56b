"""The checker on every collective (docs/contracts.md): each form, clean and corrupted.

Every collective and call form runs under the checker on three rank threads:
clean, nothing is raised and every call is counted under its contract; with
one rank's output corrupted at call k (the job wrapped as a faulty algorithm
would leave it), every rank raises ``ContractViolation`` at call k naming the
contract, the collective, its sequence number and the corrupted rank. Then
the batched mode: after a step, a corruption is judged within ``flush_every``
calls (or at a barrier), still naming its call; ``take_verdicts`` counts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks
from test_contracts import corrupt

from entrenar_pg import ContractViolation, EntrenarProcessGroup, Options
from entrenar_pg.call import requests as rq

N = 3
M = 1000  # elements per rank's piece
CHECK = Options(check=True, star_max_bytes=4096, segment_bytes=4096)


def x(rank: int, call: int, numel: int = M) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * call + rank))


def z(numel: int = M) -> torch.Tensor:
    return torch.zeros(numel)


class Case(NamedTuple):
    name: str  # the collective as a message names it
    kind: type  # the request kind whose job the fault wraps
    contract: str
    victim: int  # a rank holding an output
    run: Callable[[int, EntrenarProcessGroup, int], Any]  # (rank, group, call) -> Work


def _gather(r: int, pg: EntrenarProcessGroup, i: int) -> Any:
    return pg.gather([z() for _ in range(N)] if r == 1 else [], x(r, i), 1)


def _scatter(r: int, pg: EntrenarProcessGroup, i: int) -> Any:
    return pg.scatter(z(), [x(p, i) for p in range(N)] if r == 0 else [], 0)


CASES = [
    Case("allreduce", rq.Allreduce, "C-RING-001", 1, lambda r, pg, i: pg.allreduce([x(r, i)])),
    Case(
        "allreduce",
        rq.Allreduce,
        "C-RING-001",
        2,
        lambda r, pg, i: pg.allreduce_coalesced([x(r, i, 7), x(r, i + 50, 5000)]),
    ),
    Case(
        "reduce_scatter",
        rq.ReduceScatter,
        "C-RS-001",
        1,
        lambda r, pg, i: pg.reduce_scatter(z(), [x(r, i + p) for p in range(N)]),
    ),
    Case(
        "reduce_scatter",
        rq.ReduceScatter,
        "C-RS-001",
        2,
        lambda r, pg, i: pg._reduce_scatter_base(z(), x(r, i, N * M)),
    ),
    Case(
        "reduce_scatter",
        rq.ReduceScatter,
        "C-RS-001",
        0,
        lambda r, pg, i: pg.reduce_scatter_tensor_coalesced(
            [z(), z(10)], [x(r, i, N * M), x(r, i + 9, N * 10)]
        ),
    ),
    Case("reduce", rq.Reduce, "C-RED-001", 1, lambda r, pg, i: pg.reduce(x(r, i), 1)),
    Case(
        "allgather",
        rq.Allgather,
        "C-AG-001",
        2,
        lambda r, pg, i: pg.allgather([z() for _ in range(N)], x(r, i)),
    ),
    Case(
        "allgather",
        rq.Allgather,
        "C-AG-001",
        1,
        lambda r, pg, i: pg._allgather_base(z(N * M), x(r, i)),
    ),
    Case(
        "allgather",
        rq.AllgatherPacked,
        "C-AG-001",
        0,
        lambda r, pg, i: pg.allgather_coalesced(
            [[z(), z(3)] for _ in range(N)], [x(r, i), x(r, i + 7, 3)]
        ),
    ),
    Case(
        "allgather",
        rq.AllgatherPacked,
        "C-AG-001",
        1,
        lambda r, pg, i: pg.allgather_into_tensor_coalesced(
            [z(N * M), z(N * 4)], [x(r, i), x(r, i, 4)]
        ),
    ),
    Case("broadcast", rq.Broadcast, "C-BC-001", 2, lambda r, pg, i: pg.broadcast(x(r, i), 0)),
    Case("gather", rq.Rooted, "C-GA-001", 1, _gather),
    Case("scatter", rq.Rooted, "C-SC-001", 2, _scatter),
    Case(
        "alltoall",
        rq.Alltoall,
        "C-A2A-001",
        1,
        lambda r, pg, i: pg.alltoall([z() for _ in range(N)], [x(r, i + p) for p in range(N)]),
    ),
    Case(
        "alltoall",
        rq.Alltoall,
        "C-A2A-001",
        0,
        lambda r, pg, i: pg.alltoall_base(z(N * M), x(r, i, N * M), [], []),
    ),
]
IDS = [f"{c.name}-{c.kind.__name__}-{i}" for i, c in enumerate(CASES)]


@pytest.mark.timeout(60)
def test_every_collective_clean() -> None:
    """Every form twice, with a non-linear op and integers too: no violation; all counted."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> dict[str, int]:
        for i, case in enumerate(CASES):
            for j in range(2):
                case.run(rank, pg, 10 * i + j).wait()
        ints = torch.arange(N * M, dtype=torch.int32) * (rank + 1)
        pg._reduce_scatter_base(torch.zeros(M, dtype=torch.int32), ints).wait()
        maxed = z()
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        pg._reduce_scatter_base(maxed, x(rank, 99, N * M), opts).wait()
        pg.barrier().wait()
        assert pg.checker is not None
        return pg.checker.take_verdicts()

    expected: dict[str, int] = {}
    for case in CASES:
        expected[case.contract] = expected.get(case.contract, 0) + 2
    expected["C-RS-001"] += 2
    expected["F-DP-003"] = (
        2 * sum(c.contract in ("C-RING-001", "C-RS-001", "C-RED-001") for c in CASES) + 1
    )
    for got in run_ranks(N, fn, options=CHECK, timeout_s=50):
        assert got == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_corrupted_output_caught_at_k(monkeypatch: pytest.MonkeyPatch, case: Case) -> None:
    k = 2
    # A gross error (+1000 on one element) for the reductions, whose checksums
    # bound float error; one flipped bit for the copies, whose hashes are exact.
    how = (
        "copy-bit"
        if case.contract in ("C-AG-001", "C-BC-001", "C-GA-001", "C-SC-001", "C-A2A-001")
        else "gross"
    )
    corrupt(monkeypatch, case.kind, k, {case.victim}, how)

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[int, str]:
        for i in range(1, k + 2):
            try:
                case.run(rank, pg, i).wait()
            except ContractViolation as e:
                return i, str(e)
        return -1, "no violation"

    for rank, (at, msg) in enumerate(run_ranks(N, fn, options=CHECK, timeout_s=50)):
        assert at == k, f"rank {rank}: caught at call {at}: {msg}"
        assert f"{case.contract} violated at {case.name} #{k} " in msg, msg
        assert f"[offending rank(s): [{case.victim}]]" in msg, msg


# ---------------------------------------------------------------------- batches


def _steps_then_calls(
    rank: int, pg: EntrenarProcessGroup, calls: int, barrier_at: int | None
) -> tuple[int, str, list[dict[str, int]]]:
    """One step (the batched mode starts), then allreduces; returns where it raised."""
    assert pg.checker is not None
    verdicts = []
    pg.allreduce([x(rank, 0)]).wait()
    pg.checker.check_parameters([torch.ones(3)])  # the step: judges the allreduce above
    verdicts.append(pg.checker.take_verdicts())
    for i in range(1, calls + 1):
        try:
            pg.allreduce([x(rank, i)]).wait()
            if barrier_at == i:
                pg.barrier().wait()
        except ContractViolation as e:
            return i, str(e), verdicts
    return -1, "no violation", verdicts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("barrier_at", [None, 4])
def test_batched_verdict_within_flush_every(
    monkeypatch: pytest.MonkeyPatch, barrier_at: int | None
) -> None:
    """After a step, call 3's corruption is judged at the flush_every-th call or at a barrier."""
    flush_every = 6
    corrupt(monkeypatch, rq.Allreduce, 1 + 3, {1}, "gross")  # the 3rd allreduce after the step
    opts = Options(check=True)

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[int, str, list[dict[str, int]]]:
        assert pg.checker is not None
        pg.checker.flush_every = flush_every
        return _steps_then_calls(rank, pg, 10, barrier_at)

    for at, msg, verdicts in run_ranks(N, fn, options=opts, timeout_s=50):
        assert verdicts == [{"C-RING-001": 1, "F-DP-003": 1, "C-DDP-001": 1}]
        assert at == (barrier_at or flush_every), msg
        assert re.search(
            r"C-RING-001 violated at allreduce #5 \(bucket 3 of optimizer step 2;", msg
        ), msg


@pytest.mark.timeout(60)
def test_take_verdicts_counts_each_step() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> list[dict[str, int]]:
        assert pg.checker is not None
        out = []
        for step in range(3):
            for i in range(step + 1):
                pg.allreduce([x(rank, i)]).wait()
                pg.broadcast(x(rank, i), 0).wait()
            pg.checker.check_parameters([torch.ones(3)])
            out.append(pg.checker.take_verdicts())
        out.append(pg.checker.take_verdicts())  # nothing since
        return out

    for got in run_ranks(2, fn, options=CHECK, timeout_s=50):
        assert got == [
            {"C-RING-001": s, "F-DP-003": s, "C-BC-001": s, "C-DDP-001": 1} for s in (1, 2, 3)
        ] + [{}]

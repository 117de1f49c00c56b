"""ReduceOp.AVG on integer tensors, with NCCL's semantics, on every path that reduces.

NCCL's ncclAvg on integers sums in the dtype (wrapping like every integer
sum) and divides by the number of ranks with C integer division, i.e.
truncated toward zero (FuncSumPostDiv: the quotient of |x| with the sign put
back). Lightning sends AVG on int64 to every backend but gloo (its
``cumulated_batch_size`` sync), so a drop-in backend must accept it.

The expected values are computed here with Python integers, independently of
torch's kernels: the wrapped sum, then ``sign(s) * (|s| // n)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

from entrenar_pg import EntrenarProcessGroup, Options

WORLD = 3  # sums not divisible by 3: the truncation shows
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


def _bits(dtype: torch.dtype) -> tuple[int, bool]:
    return torch.iinfo(dtype).bits, dtype != torch.uint8


def _wrap(v: int, dtype: torch.dtype) -> int:
    bits, signed = _bits(dtype)
    v %= 1 << bits
    return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v


def _inputs(rank: int, dtype: torch.dtype, numel: int) -> list[int]:
    """Values with negative sums, remainders of 1 and 2, and sums that wrap."""
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(7 * rank + numel)
    vals = torch.randint(info.min // 2, info.max // 2 + 1, (numel,), generator=g).tolist()
    special = [info.max, info.min, -1 if info.min < 0 else 1, 1, 2 - rank]
    for i, v in enumerate(special[: min(len(special), numel)]):
        vals[i] = max(info.min, min(info.max, v))
    return vals


def _nccl_avg(per_rank: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    out = []
    for column in zip(*per_rank, strict=True):
        s = _wrap(sum(column), dtype)
        q = abs(s) // len(column)
        out.append(q if s >= 0 else -q)
    return torch.tensor(out, dtype=dtype)


def _opts(cls: type, **fields: object) -> object:
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


CONFIGS = {
    "direct": Options(algorithm="direct", segment_bytes=16),
    "star": Options(algorithm="star", segment_bytes=16),
    "ring": Options(algorithm="ring", segment_bytes=16, star_max_bytes=64),
    "deterministic-ring": Options(
        algorithm="ring", deterministic=True, segment_bytes=16, star_max_bytes=64
    ),
    "deterministic-star": Options(algorithm="star", deterministic=True, segment_bytes=16),
    "checked": Options(check=True, segment_bytes=16),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_integer_avg_truncates_toward_zero_like_nccl(config: str) -> None:
    numels = [0, 1, 5, 61]  # 61 x 8 bytes > star_max_bytes: reduce takes its ring path too
    avg = dist.ReduceOp.AVG

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[tuple[str, torch.Tensor]]:
        got = []
        for dtype in INTS:
            for n in numels:
                t = torch.tensor(_inputs(rank, dtype, n), dtype=dtype)
                pg.allreduce([t], _opts(dist.AllreduceOptions, reduceOp=avg)).wait()
                got.append(("allreduce", t))
                t = torch.tensor(_inputs(rank, dtype, n), dtype=dtype)
                pg.reduce([t], _opts(dist.ReduceOptions, reduceOp=avg, rootRank=1)).wait()
                got.append(("reduce", t))
                full = torch.tensor(_inputs(rank, dtype, n * WORLD), dtype=dtype)
                out = torch.empty(n, dtype=dtype)
                opts = _opts(dist.ReduceScatterOptions, reduceOp=avg)
                pg.reduce_scatter_single(out, full, opts).wait()
                got.append(("reduce_scatter", out))
        return got

    results = run_ranks(WORLD, fn, options=CONFIGS[config], timeout_s=100)
    i = 0
    for dtype in INTS:
        for n in numels:
            want = _nccl_avg([_inputs(r, dtype, n) for r in range(WORLD)], dtype)
            full = [_inputs(r, dtype, n * WORLD) for r in range(WORLD)]
            for rank in range(WORLD):
                what, got = results[rank][i]
                assert got.dtype == dtype and torch.equal(got, want), (what, dtype, n, rank)
                if rank == 1:  # reduce's root
                    what, got = results[rank][i + 1]
                    assert torch.equal(got, want), (what, dtype, n)
                what, got = results[rank][i + 2]
                mine = _nccl_avg([f[rank * n : (rank + 1) * n] for f in full], dtype)
                assert torch.equal(got, mine), (what, dtype, n, rank)
            i += 3


def test_avg_stays_undefined_for_bool() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> None:
        opts = _opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.AVG)
        with pytest.raises(ValueError, match=rf"rank {rank}: allreduce: .*AVG.*torch.bool"):
            pg.allreduce([torch.ones(3, dtype=torch.bool)], opts)
        t = torch.full((3,), 5, dtype=torch.int64)  # the group is still usable
        pg.allreduce([t], opts).wait()
        assert t.tolist() == [5, 5, 5]

    run_ranks(2, fn, timeout_s=30)

"""Reduce ops: which op goes with which dtype, the in-place kernels, and the canonical order.

Kernels run on CPU tensors (the comm thread only sees host memory) and always
write into their first argument, so a reduction never allocates.

The canonical order (deterministic mode) is a balanced pairwise tree over the
ranks' contributions, split at ``m = (k + 1) // 2``::

    tree([x0])       = x0
    tree(xs)         = tree(xs[:m]) + tree(xs[m:])
    tree([x0..x3])   = (x0 + x1) + (x2 + x3)

It depends only on the number of contributions, so any algorithm that applies
it elementwise gives the same bits; and for powers of two, a tree over M
micro-batches equals a tree over N ranks of trees over M/N micro-batches each,
which is what makes the trainer's results world-size invariant.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class Kind(enum.IntEnum):
    """Reduce op codes; equal to torch's ``ReduceOp.RedOpType`` values."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8


FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
SUPPORTED_DTYPES = FLOAT_DTYPES | INT_DTYPES | {torch.bool}

_ALLOWED: dict[Kind, frozenset[torch.dtype]] = {
    Kind.SUM: SUPPORTED_DTYPES,
    Kind.PRODUCT: SUPPORTED_DTYPES,
    Kind.MIN: SUPPORTED_DTYPES,
    Kind.MAX: SUPPORTED_DTYPES,
    # Integer AVG as NCCL defines it (ncclAvg on integers: the sum in the
    # dtype, then C integer division by the world size, i.e. truncated toward
    # zero). Lightning and others send AVG on int64 to every backend but gloo.
    Kind.AVG: FLOAT_DTYPES | INT_DTYPES,
    Kind.PREMUL_SUM: FLOAT_DTYPES,
    Kind.BAND: INT_DTYPES | {torch.bool},
    Kind.BOR: INT_DTYPES | {torch.bool},
    Kind.BXOR: INT_DTYPES | {torch.bool},
}


class Reduction(NamedTuple):
    """A validated reduce op. ``factor`` is PREMUL_SUM's multiplier."""

    kind: Kind
    factor: float = 1.0

    @property
    def combine_kind(self) -> Kind:
        """The pairwise kernel: AVG and PREMUL_SUM combine by summing."""
        return Kind.SUM if self.kind in (Kind.AVG, Kind.PREMUL_SUM) else self.kind


def resolve(op: object, dtype: torch.dtype, *, where: str | Callable[[], str]) -> Reduction:
    """Validate ``op`` for ``dtype``; ValueError naming ``where`` (rank and call) if not.

    ``where`` may be a function giving that label, so a call whose op is
    already known valid never builds it.
    """
    # Every call resolves its op: remember the plain ops (all but PREMUL_SUM,
    # whose factor varies) per dtype, once they were found valid.
    inner = getattr(op, "op", op)
    key = (inner, dtype) if isinstance(inner, dist.ReduceOp.RedOpType) else None
    if key is not None:
        hit = _RESOLVED.get(key)
        if hit is not None:
            return hit
    red = _resolve(op, dtype, where if isinstance(where, str) else where())
    if key is not None and red.kind is not Kind.PREMUL_SUM:
        _RESOLVED[key] = red
    return red


_RESOLVED: dict[tuple[Any, torch.dtype], Reduction] = {}


def _resolve(op: object, dtype: torch.dtype, where: str) -> Reduction:
    factor = 1.0
    if isinstance(op, dist.ReduceOp.RedOpType):
        kind = Kind(op.value)
    elif isinstance(op, dist.ReduceOp):
        inner = getattr(op, "op", None)
        if inner is None:  # ReduceOp.SUM etc. compare equal to their RedOpType
            found = next((k for k in Kind if op == dist.ReduceOp.RedOpType(int(k))), None)
            if found is None:
                raise ValueError(f"{where}: unknown reduce op {op!r}")
            kind = found
        else:
            kind = Kind(inner.value)
        if kind is Kind.PREMUL_SUM:
            raw = _premul_factor(op)
            if isinstance(raw, torch.Tensor):
                if raw.numel() != 1:
                    raise ValueError(f"{where}: PREMUL_SUM factor must be a scalar")
                raw = raw.item()
            if raw is None:
                raise ValueError(f"{where}: PREMUL_SUM without a factor")
            factor = float(raw)
    else:
        raise ValueError(f"{where}: reduce op must be a torch.distributed.ReduceOp, got {op!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{where}: dtype {dtype} is not supported by entrenar")
    if dtype not in _ALLOWED[kind]:
        raise ValueError(f"{where}: reduce op {kind.name} is not defined for dtype {dtype}")
    return Reduction(kind, factor)


def _premul_factor(op: dist.ReduceOp) -> float | torch.Tensor | None:
    """PREMUL_SUM's factor (a number or a one-element tensor; None if unset).
    torch 2.12 on has it as ``op.factor``; before (2.11 is what CUDA images
    ship) only pickling's ``(op, factor)`` state holds it."""
    try:
        return op.factor
    except AttributeError:
        state: tuple[Any, float | torch.Tensor | None] = op.__getstate__()  # type: ignore[assignment]
        return state[1]


_KERNELS: dict[Kind, Callable[..., torch.Tensor]] = {
    Kind.SUM: torch.add,
    Kind.PRODUCT: torch.mul,
    Kind.MIN: torch.minimum,
    Kind.MAX: torch.maximum,
    Kind.BAND: torch.bitwise_and,
    Kind.BOR: torch.bitwise_or,
    Kind.BXOR: torch.bitwise_xor,
}


def combine_into(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, kind: Kind) -> None:
    """``dst = a <op> b`` elementwise (``kind`` is a combine kind).

    ``dst`` may be ``a`` or ``b`` itself (elementwise kernels allow exact aliasing).
    """
    kernel = _KERNELS.get(kind)
    assert kernel is not None, f"not a combine kind: {kind}"
    kernel(a, b, out=dst)


def combine_(dst: torch.Tensor, src: torch.Tensor, kind: Kind) -> None:
    """``dst = dst <op> src`` elementwise, in place (``kind`` is a combine kind)."""
    combine_into(dst, dst, src, kind)


def prepare_(t: torch.Tensor, red: Reduction) -> None:
    """What each rank applies to its own input before combining (PREMUL_SUM's scale)."""
    if red.kind is Kind.PREMUL_SUM and red.factor != 1.0:
        t.mul_(red.factor)


def finish_(t: torch.Tensor, red: Reduction, world: int) -> None:
    """What is applied once to the combined result (AVG's division).

    Integers divide as NCCL's ncclAvg does: the sum (wrapped in the dtype,
    like every integer sum here) divided by the world size, truncated toward
    zero (C's ``/``), exactly, with no detour through floating point.
    """
    if red.kind is Kind.AVG and world > 1:
        if t.is_floating_point():
            t.div_(world)
        else:
            t.div_(world, rounding_mode="trunc")


def tree_reduce_(parts: Sequence[torch.Tensor], kind: Kind) -> torch.Tensor:
    """Combine ``parts`` in the canonical pairwise-tree order, in place.

    The result lands in ``parts[0]``; the other parts are used as scratch.
    """
    n = len(parts)
    if n == 1:
        return parts[0]
    m = (n + 1) // 2
    left = tree_reduce_(parts[:m], kind)
    right = tree_reduce_(parts[m:], kind)
    combine_(left, right, kind)
    return left


def tree_has_blocks(n: int, size: int) -> bool:
    """Whether the canonical tree over ``n`` contributions has every run of
    ``size`` consecutive ones (0..size-1, size..2 size-1, ...) as a subtree.

    Then reducing each run in tree order, and the runs' results in tree
    order, is the canonical order itself (the host-aware allreduce, hosts of
    ``size`` consecutive ranks, collectives/hierarchical.py): true for
    powers of two, and e.g. 2 runs of 3; false for 3 runs of 2 (the root
    splits 6 at 3, inside the second run).
    """
    if size < 1 or n % size:
        return False

    def aligned(start: int, count: int) -> bool:
        if count <= size:
            # Inside one run: fine if it lies within a single run.
            return start // size == (start + count - 1) // size
        if start % size or count % size:
            return False  # a subtree larger than a run must be whole runs
        m = (count + 1) // 2
        return aligned(start, m) and aligned(start + m, count - m)

    return aligned(0, n)


def tree_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum ``tensors`` in the canonical tree order (the inputs are left untouched)."""
    if not tensors:
        raise ValueError("tree_sum needs at least one tensor")
    return tree_reduce_([t.clone() for t in tensors], Kind.SUM)

"""Allreduce of sparse COO tensors (``torch.sparse_coo``), SUM only, as gloo defines it.

What gloo does (torch 2.13, checked side by side in tests/test_sparse.py):
each rank coalesces its input (duplicate indices summed by torch), every
rank's indices and values are gathered, and the ranks' tensors are summed
left to right in rank order, ``((x0 + x1) + x2) + ...``, each index over the
ranks that have it. The result is copied into the input tensor
in place: coalesced, indices ``int64`` in lexicographic (row-major) order,
values of the input's dtype and dense shape. Any op but SUM raises.
NCCL has no sparse allreduce at all (pytorch/pytorch#22400); DDP with
``nn.Embedding(sparse=True)`` allreduces each sparse gradient through it.

How, on every rank (one job, so issue order and the error model are the
group's usual ones):

1. Coalesce the local input (duplicates within a rank summed by torch, as gloo).
2. Exchange a fixed 48-byte record with every peer: dtype code, ndim,
   sparse_dim, dense_dim, elements per dense row, nnz. Every rank now holds
   every rank's record, so they all see the same disagreement, if any, and
   raise the same ``CollectiveMismatchError`` naming each rank's tensor.
3. Exchange the payloads: this rank's ``[sizes | indices | values | pad to 8
   bytes]``, whose length every rank computes from step 2's records (so
   variable nnz needs no further round). A rank whose sizes disagree is named
   the same way. A rank calling a dense allreduce meanwhile opens its links
   with another opcode: the transport's header check raises
   ``CollectiveMismatchError`` on both sides, and the abort reaches the rest.
4. Sum locally, from the gathered data only, so arrival order plays no part:
   - default: left to right in rank order, as gloo (the same bits as gloo);
   - in tree order (the policy's ``Choice.tree``): for each index, the values of
     the ranks that have it are summed in the canonical tree over ranks of
     ``reduce_ops`` (split at ``(k + 1) // 2``); a rank without the index is
     skipped, not added as zero, so a lone ``-0.0`` stays ``-0.0``. The result
     depends only on the inputs and the world size, never on the algorithm
     options, since the exchanges only move bytes.

Bytes on the wire, per rank r, with ``b_p = 8 * ndim + nnz_p * (8 *
sparse_dim + row_bytes)`` rounded up to 8: it sends ``(N - 1) * (48 + b_r)``
and receives ``sum over p != r of (48 + b_p)``, plus a 32-byte header per
link direction and exchange (and, with N > 2, a 32-byte acknowledgement).
Both exchanges are ``collectives.alltoall`` with this rank's piece to every
peer (1 hop each, 2 with N > 2 for the acknowledgement; nothing relayed).
A ring all-gather would move the same total (each rank's payload
still crosses N - 1 links) in N - 1 hops; it balances the load only when one
rank's nnz dwarfs the others', which DDP's sparse gradients (one batch per
rank) do not do. A reduce-scatter is not possible: which indices the result
has is known only once every rank's indices are in, so the data must be
gathered, as gloo does. Gathering beats densifying when the summed nnz rows
are fewer than about twice the dense tensor's rows (a dense allreduce moves
about ``2 (N - 1) / N`` of the dense bytes).

Limits: CPU tensors only (``ValueError`` for CUDA: no GPU was available to
test the staging); one tensor per call (``dist.all_reduce`` and DDP pass one);
the contract checker does not check sparse allreduces (it checks dense
buffers; C-DDP-001 still covers the embedding's weights).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .collectives import Call, alltoall
from .errors import CollectiveMismatchError
from .reduce_ops import SUPPORTED_DTYPES, Kind, Reduction
from .wire import CODE_DTYPE, DTYPE_CODE, OpCode

CALL = "allreduce"
_INT64_MAX = (1 << 63) - 1
# The two rounds can never be taken one for the other: their headers differ
# in dtype (int64 records, uint8 payloads).


_SPARSE_COO = torch.sparse_coo


def is_sparse_call(tensors: Any) -> bool:
    """True when an allreduce's first tensor is sparse COO.

    Every dense allreduce runs this first, so it is one attribute test (about
    0.3 us here); anything malformed is left to the dense path's checks.
    """
    try:
        return tensors[0].layout is _SPARSE_COO
    except (TypeError, IndexError, KeyError, AttributeError):
        return False


def the_tensor(where: str, tensors: Any) -> torch.Tensor:
    """The one sparse tensor of a ``[sparse]`` allreduce; raises before anything is sent."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{where}: expected a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != 1:
        raise ValueError(
            f"{where}: a sparse allreduce takes exactly one tensor, got {len(tensors)} "
            "(gloo's multi-tensor form is deprecated by torch)"
        )
    t = tensors[0]
    if not t.is_cpu:
        raise ValueError(
            f"{where}: sparse tensors on {t.device} are not supported (CPU only; "
            "move the tensor to the CPU, or densify it)"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{where}: dtype {t.dtype} is not supported by entrenar")
    return t


def payload_nbytes(where: str, t: torch.Tensor, red: Reduction) -> int:
    """Check the op and the index range; the bytes this rank contributes."""
    if red.kind is not Kind.SUM:
        raise ValueError(
            f"{where}: sparse tensors can only be allreduced with ReduceOp.SUM, got "
            f"{red.kind.name} (as gloo; densify the tensor for other ops)"
        )
    if math.prod(t.shape[: t.sparse_dim()]) > _INT64_MAX:
        raise ValueError(f"{where}: the sparse dimensions {tuple(t.shape)} overflow int64 indices")
    return int(t._indices().numel() * 8 + t._values().numel() * t.element_size())


class Record(NamedTuple):
    """What rank p tells every rank about its tensor in the first exchange."""

    dtype_code: int
    ndim: int
    sparse_dim: int
    dense_dim: int
    row_numel: int  # elements per dense row (one index's values)
    nnz: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Record:
        row = math.prod(t.shape[t.sparse_dim() :])
        return cls(DTYPE_CODE[t.dtype], t.dim(), t.sparse_dim(), t.dense_dim(), row, t._nnz())

    @property
    def layout(self) -> tuple[int, ...]:
        """Every field but nnz: what all ranks must agree on."""
        return tuple(self[:-1])

    @property
    def dtype(self) -> torch.dtype:
        return CODE_DTYPE[self.dtype_code]

    def payload_bytes(self) -> int:
        """``sizes | indices | values``, padded to 8 bytes so every part is aligned."""
        n = 8 * self.ndim + 8 * self.sparse_dim * self.nnz
        n += self.nnz * self.row_numel * self.dtype.itemsize
        return -(-n // 8) * 8

    def describe(self) -> str:
        return (
            f"{str(self.dtype).removeprefix('torch.')}, sparse_dim {self.sparse_dim}, "
            f"dense_dim {self.dense_dim}, {self.row_numel} "
            f"element{'s' if self.row_numel != 1 else ''} per index"
        )


class Part(NamedTuple):
    """One rank's coalesced contribution, as gathered."""

    shape: tuple[int, ...]
    indices: torch.Tensor  # (sparse_dim, nnz) int64, sorted, no duplicates
    values: torch.Tensor  # (nnz, *dense shape)


def allreduce(call: Call, tensor: torch.Tensor) -> None:
    """The job: the exchanges and the local sum, then the result into ``tensor``.

    The summation order is the policy's (``call.choice.tree``).
    """
    local = tensor.detach().coalesce()
    if call.world == 1:
        result = local
    else:
        records = _exchange_records(call, Record.of(local))
        parts = _exchange_payloads(call, local, records)
        result = _sum(parts, parts[0].shape, tree=call.choice.tree)
    with torch.no_grad():
        tensor.copy_(result)


def _exchange_records(call: Call, mine: Record) -> list[Record]:
    n, r = call.world, call.rank
    fields = len(mine)
    table = call.scratch.get("sparse_records", n * fields, torch.int64).view(n, fields)
    table[r] = torch.tensor(mine, dtype=torch.int64)
    # Every rank's record to every rank: an all-to-all whose pieces out are all ours.
    alltoall(call, [table[r]] * n, [table[p] for p in range(n)], OpCode.SPARSE_ALLREDUCE)
    records = [Record(*row) for row in table.tolist()]
    if any(rec.layout != mine.layout for rec in records):
        raise CollectiveMismatchError(
            _disagreement(
                call, "ranks passed sparse tensors that disagree", records, Record.describe
            )
        )
    return records


def _exchange_payloads(call: Call, local: torch.Tensor, records: list[Record]) -> list[Part]:
    n, r = call.world, call.rank
    sizes = [rec.payload_bytes() for rec in records]
    flat = call.scratch.get("sparse_payload", sum(sizes), torch.uint8)
    chunks, at = [], 0
    for size in sizes:
        chunks.append(flat[at : at + size])
        at += size
    _pack(chunks[r], local, records[r])
    alltoall(call, [chunks[r]] * n, chunks, OpCode.SPARSE_ALLREDUCE)
    parts = [_unpack(chunk, rec) for chunk, rec in zip(chunks, records, strict=True)]
    if any(part.shape != parts[r].shape for part in parts):
        raise CollectiveMismatchError(
            _disagreement(
                call, "ranks passed sparse tensors of different shapes", parts, _describe_shape
            )
        )
    return parts


def _sections(chunk: torch.Tensor, rec: Record) -> tuple[torch.Tensor, ...]:
    """``chunk``'s sizes, indices, values and padding, as typed views (all 8-aligned)."""
    a = 8 * rec.ndim
    b = a + 8 * rec.sparse_dim * rec.nnz
    c = b + rec.nnz * rec.row_numel * rec.dtype.itemsize
    return (
        chunk[:a].view(torch.int64),
        chunk[a:b].view(torch.int64).view(rec.sparse_dim, rec.nnz),
        chunk[b:c].view(rec.dtype),
        chunk[c:],
    )


def _pack(chunk: torch.Tensor, local: torch.Tensor, rec: Record) -> None:
    sizes, indices, values, pad = _sections(chunk, rec)
    sizes.copy_(torch.tensor(local.shape, dtype=torch.int64))
    indices.copy_(local._indices())
    values.view(local._values().shape).copy_(local._values())
    pad.zero_()  # no stale scratch bytes on the wire


def _unpack(chunk: torch.Tensor, rec: Record) -> Part:
    sizes, indices, values, _ = _sections(chunk, rec)
    shape = tuple(sizes.tolist())
    return Part(shape, indices, values.view(rec.nnz, *shape[rec.sparse_dim :]))


def _describe_shape(part: Part) -> str:
    return f"shape {part.shape}"


def _disagreement(
    call: Call, what: str, per_rank: Sequence[Any], describe: Callable[[Any], str]
) -> str:
    """``rank R: sparse_allreduce#S: <what>: ranks 0, 2: <a>; rank 1: <b>`` (same on every rank)."""
    groups: dict[str, list[int]] = {}
    for p, item in enumerate(per_rank):
        groups.setdefault(describe(item), []).append(p)
    listed = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
        for text, ranks in groups.items()
    )
    return f"rank {call.rank}: {call.what(OpCode.SPARSE_ALLREDUCE)}: {what}: {listed}"


class _Partial(NamedTuple):
    """A sum over some ranks: ``values[i]`` belongs to union slot ``slots[i]`` (sorted)."""

    slots: torch.Tensor
    values: torch.Tensor


def _sum(parts: Sequence[Part], shape: tuple[int, ...], *, tree: bool) -> torch.Tensor:
    """Per index, the sum of the values of the ranks that have it, as a coalesced tensor.

    ``tree``: in the canonical tree over ranks; else left to right in rank
    order, as gloo.
    """
    sparse_dim = parts[0].indices.size(0)
    indices = torch.cat([p.indices for p in parts], dim=1)
    keys = _linear_keys(indices, shape[:sparse_dim])
    union, slot_of = torch.unique(keys, sorted=True, return_inverse=True)
    leaves, at = [], 0
    for p in parts:
        nnz = p.values.size(0)
        leaves.append(_Partial(slot_of[at : at + nnz], p.values))
        at += nnz
    total = _tree(leaves) if tree else _rank_order(leaves, union.numel())
    out_indices = indices.new_empty((sparse_dim, union.numel()))
    out_indices[:, slot_of] = indices  # every copy of an index writes the same column
    return torch.sparse_coo_tensor(
        out_indices, total.values, shape, is_coalesced=True, check_invariants=False
    )


def _rank_order(leaves: Sequence[_Partial], slots: int) -> _Partial:
    """gloo's fold, bit for bit: ``((x0 + x1) + x2) + ...`` per index.

    gloo's sparse ``+=`` (torch's ``add_out_sparse_contiguous``) accumulates
    into zero-filled values, ``(0 + a) + b``, whenever both sides have
    entries, and copies the other side when one is empty. So with two or more
    non-empty ranks every index gets ``0 + x_first + x_next + ...`` (this is
    ``a + b`` except that a ``-0.0`` comes out ``+0.0``), which is exactly
    what adding each rank's values in turn into a zero-filled buffer computes;
    a single non-empty rank's values come out unchanged.
    """
    present = [leaf for leaf in leaves if leaf.slots.numel()]
    if len(present) <= 1:
        return present[0] if present else leaves[0]
    values = present[0].values
    total = values.new_zeros((slots, *values.shape[1:]))
    for leaf in present:
        total.index_add_(0, leaf.slots, leaf.values)  # slots are unique within a rank
    return _Partial(torch.arange(slots), total)


def _tree(leaves: Sequence[_Partial]) -> _Partial:
    """``reduce_ops``' canonical order: tree(xs) = tree(xs[:m]) + tree(xs[m:]), m = (k+1)//2."""
    if len(leaves) == 1:
        return leaves[0]
    m = (len(leaves) + 1) // 2
    return _merge(_tree(leaves[:m]), _tree(leaves[m:]))


def _merge(a: _Partial, b: _Partial) -> _Partial:
    """``a + b`` over the union of their slots; a slot only one side has is copied, not added."""
    slots = torch.unique(torch.cat([a.slots, b.slots]), sorted=True)
    at_a = torch.searchsorted(slots, a.slots)
    at_b = torch.searchsorted(slots, b.slots)
    values = a.values.new_empty((slots.numel(), *a.values.shape[1:]))
    values.index_copy_(0, at_a, a.values)
    in_a = torch.zeros(slots.numel(), dtype=torch.bool)
    in_a[at_a] = True
    shared = in_a[at_b]
    only_b = ~shared
    values.index_copy_(0, at_b[only_b], b.values[only_b])
    values.index_add_(0, at_b[shared], b.values[shared])  # one add per slot: a + b
    return _Partial(slots, values)


def _linear_keys(indices: torch.Tensor, sparse_sizes: Sequence[int]) -> torch.Tensor:
    """Row-major position of each index column: sorting keys sorts indices lexicographically."""
    keys = torch.zeros(indices.size(1), dtype=torch.int64)
    for d, size in enumerate(sparse_sizes):
        keys.mul_(size).add_(indices[d])
    return keys

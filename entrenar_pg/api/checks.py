"""Argument checks of torch's calls, and the request each call becomes.

Every collective method of the process group normalizes its call form
(overloads.py), then calls one builder here, which checks the arguments in
the caller's thread (a ``ValueError`` / ``TypeError`` naming the rank and the
call, raised before anything is queued or sent; the group stays usable) and
returns a request (``call/requests.py``): data only, read by the runtime
(``runtime/runtime.py``) and by the request kind's job (``runtime/jobs.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import sparse
from ..call.requests import (
    Allgather,
    AllgatherPacked,
    Allreduce,
    Alltoall,
    Barrier,
    Broadcast,
    Reduce,
    ReduceScatter,
    Rooted,
    SparseAllreduce,
)
from ..overlap import overlaps_itself
from ..p2p import ANY_SOURCE
from ..reduce_ops import SUPPORTED_DTYPES, Reduction, resolve
from ..runtime.state import GroupState, Phase
from ..wire import OpCode

_CPU = torch.device("cpu")


# ---------------------------------------------------------------------- the checks


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _rows(t: torch.Tensor) -> int:
    return t.size(0) if t.dim() else 1


class Checks:
    """The argument checks every builder shares, for one rank of one group."""

    def __init__(self, rank: int, size: int, state: GroupState) -> None:
        self.rank = rank
        self.size = size
        self.state = state

    def where(self, call: str) -> str:
        return f"rank {self.rank}: {call}"

    def tensors(
        self,
        call: str,
        tensors: Sequence[Any],
        *,
        same_dtype: bool = True,
        written: Sequence[torch.Tensor] = (),
    ) -> torch.device:
        """Check a call's tensors; returns their common device. Raises before anything is sent.

        A destroyed or broken group refuses first. ``written``: those of
        ``tensors`` the call writes; none may have elements sharing memory
        (an expand()ed output), which could not take the result. Written for
        the hot path (every collective runs it): cheap checks first, the
        message built only when raising.
        """
        state = self.state
        if state.error is not None or state.phase is Phase.CLOSED:
            state.check(call)
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(
                f"{self.where(call)}: expected a list of tensors, got {type(tensors).__name__}"
            )
        device: torch.device | None = None
        dtype: torch.dtype | None = None
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.where(call)}: expected tensors, got {type(t).__name__}")
            if t.layout is not torch.strided:
                raise ValueError(
                    f"{self.where(call)}: only dense tensors are supported, got {t.layout}"
                )
            if not (t.is_cpu or t.is_cuda):
                raise ValueError(
                    f"{self.where(call)}: device {t.device} is not supported (cpu, cuda)"
                )
            if t.dtype not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"{self.where(call)}: dtype {t.dtype} is not supported by entrenar"
                )
            if device is None:
                device, dtype = t.device, t.dtype
            elif t.device != device:
                raise ValueError(
                    f"{self.where(call)}: tensors on different devices ({device} and {t.device})"
                )
            elif same_dtype and t.dtype != dtype:
                raise ValueError(
                    f"{self.where(call)}: tensors of different dtypes ({dtype} and {t.dtype})"
                )
        for t in written:
            if not t.is_contiguous() and overlaps_itself(t):
                raise ValueError(
                    f"{self.where(call)}: an output tensor (shape {tuple(t.shape)}, strides "
                    f"{t.stride()}) has elements that share memory (an expand()ed tensor?), "
                    "so it cannot hold the result; pass one with memory of its own "
                    "(.contiguous() or .clone())"
                )
        return device if device is not None else _CPU

    def reduction(self, call: str, opts: Any, dtype: torch.dtype) -> Reduction:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return resolve(op, dtype, where=lambda: self.where(call))

    def check_root(self, call: str, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"{self.where(call)}: root rank {root} outside [0, {self.size})")

    def root(self, call: str, opts: Any) -> int:
        root = int(opts.rootRank) if opts is not None else 0
        self.check_root(call, root)
        return root

    def one(self, call: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            n = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise ValueError(f"{self.where(call)}: expected exactly one tensor, got {n}")
        return tensors[0]

    def root_list(
        self,
        call: str,
        lists: list[list[torch.Tensor]],
        single: torch.Tensor,
        root: int,
        role: str,
        other: str,
    ) -> list[torch.Tensor]:
        """The root's per-rank tensor list of gather (outputs) or scatter (inputs),
        checked against this rank's single tensor; empty on the other ranks."""
        where = self.where(call)
        if self.rank != root:
            if lists and any(len(lst) for lst in lists):
                raise ValueError(f"{where}: only the root (rank {root}) takes {role} tensors")
            return []
        if len(lists) != 1 or len(lists[0]) != self.size:
            raise ValueError(f"{where}: the root needs one {role} list of {self.size} tensors")
        for t in lists[0]:  # one size for all: the header carries it (as gloo requires)
            if t.numel() != single.numel():
                raise ValueError(
                    f"{where}: {role} tensor of {t.numel()} elements for an "
                    f"{other} of {single.numel()}"
                )
        return list(lists[0])

    def split_bounds(
        self, call: str, what: str, t: torch.Tensor, splits: Sequence[int]
    ) -> list[tuple[int, int]]:
        """Element ranges of ``t``'s pieces along dim 0 (equal pieces if ``splits`` is empty)."""
        where = self.where(call)
        rows = _rows(t)
        per_row = t.numel() // rows if rows else 0
        if not splits:
            if rows % self.size:
                raise ValueError(
                    f"{where}: {what} has {rows} rows, not divisible by the world size "
                    f"{self.size}; pass split sizes"
                )
            splits = [rows // self.size] * self.size
        splits = [int(s) for s in splits]
        if len(splits) != self.size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(
                f"{where}: {what} split sizes {splits} must be {self.size} non-negative "
                f"numbers summing to its {rows} rows"
            )
        bounds, at = [], 0
        for s in splits:
            bounds.append((at * per_row, (at + s) * per_row))
            at += s
        return bounds


# ---------------------------------------------------------------------- the builders


def allreduce(c: Checks, call: str, tensors: list[torch.Tensor], opts: Any) -> Allreduce:
    """``allreduce`` / ``allreduce_coalesced`` of dense tensors."""
    device = c.tensors(call, tensors, written=tensors)
    if not tensors:
        raise ValueError(f"{c.where(call)}: no tensors given")
    red = c.reduction(call, opts, tensors[0].dtype)
    nbytes = 0
    for t in tensors:
        nbytes += t.numel() * t.element_size()
    io = ((tensors, True, True),)
    # The common blocking call takes runtime/thin.py and builds no request;
    # this long path's one __init__ call is not on it.
    return Allreduce(OpCode.ALLREDUCE, device, nbytes, list(tensors), io, red)


def sparse_allreduce(c: Checks, tensors: list[torch.Tensor], opts: Any) -> SparseAllreduce:
    """``allreduce([sparse COO])``: checked here (entrenar_pg.sparse), one job."""
    where = c.where("allreduce")
    c.tensors("allreduce", [])  # a destroyed or broken group refuses first
    t = sparse.the_tensor(where, tensors)
    nbytes = sparse.payload_nbytes(where, t, c.reduction("allreduce", opts, t.dtype))
    return SparseAllreduce(OpCode.SPARSE_ALLREDUCE, t.device, nbytes, [t], (), t)


def broadcast(c: Checks, tensors: list[torch.Tensor], opts: Any) -> Broadcast:
    root = opts.rootRank if opts is not None else 0
    is_root = c.rank == root
    device = c.tensors("broadcast", tensors, same_dtype=False, written=() if is_root else tensors)
    c.check_root("broadcast", root)
    io = ((tensors, is_root, not is_root),)
    return Broadcast(OpCode.BROADCAST, device, _nbytes(tensors), list(tensors), io, root)


def allgather(
    c: Checks, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]
) -> Allgather:
    """The list form: one input, one list of N outputs."""
    where = c.where("allgather")
    if len(input_tensors) != 1 or len(output_tensors) != 1:
        raise ValueError(f"{where}: expected one input tensor and one output list")
    inp, outs = input_tensors[0], output_tensors[0]
    device = c.tensors("allgather", [inp, *outs], written=outs)
    if len(outs) != c.size:
        raise ValueError(f"{where}: output list has {len(outs)} tensors, world size is {c.size}")
    for o in outs:
        if o.numel() != inp.numel():
            raise ValueError(
                f"{where}: output tensor of {o.numel()} elements for an input of {inp.numel()}"
            )
    io = (([inp], True, False), (outs, False, True))
    nbytes = inp.numel() * inp.element_size() * c.size
    return Allgather(OpCode.ALLGATHER, device, nbytes, output_tensors, io, None)


def allgather_into(c: Checks, call: str, output: torch.Tensor, inp: torch.Tensor) -> Allgather:
    """``_allgather_base`` / ``all_gather_single``: N inputs' worth in one output."""
    device = c.tensors(call, [output, inp], written=[output])
    if output.numel() != inp.numel() * c.size:
        raise ValueError(
            f"{c.where(call)}: output has {output.numel()} elements, expected "
            f"{c.size} x {inp.numel()}"
        )
    io = (([inp], True, False), ([output], False, True))
    nbytes = output.numel() * output.element_size()
    return Allgather(OpCode.ALLGATHER, device, nbytes, [output], io, inp.numel())


def allgather_coalesced(
    c: Checks, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor]
) -> AllgatherPacked:
    call = "allgather_coalesced"
    where = c.where(call)
    flat_outs = [t for lst in output_lists for t in lst]
    device = c.tensors(call, [*input_list, *flat_outs], written=flat_outs)
    if not input_list:
        raise ValueError(f"{where}: no input tensors")
    if len(output_lists) != c.size or any(
        len(lst) != len(input_list)
        or any(o.numel() != i.numel() for o, i in zip(lst, input_list, strict=True))
        for lst in output_lists
    ):
        raise ValueError(f"{where}: expected {c.size} output lists shaped like the input list")
    io = ((input_list, True, False), *((lst, False, True) for lst in output_lists))
    return AllgatherPacked(OpCode.ALLGATHER, device, _nbytes(flat_outs), output_lists, io, None)


def allgather_tensors(
    c: Checks, call: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor]
) -> AllgatherPacked:
    """Each ``outputs[i]`` (N x ``inputs[i]``) gets every rank's ``inputs[i]``, one pass."""
    where = c.where(call)
    device = c.tensors(call, [*outputs, *inputs], written=outputs)
    if not inputs or len(outputs) != len(inputs):
        raise ValueError(f"{where}: expected as many outputs as inputs (at least one)")
    for o, i in zip(outputs, inputs, strict=True):
        if o.numel() != i.numel() * c.size:
            raise ValueError(
                f"{where}: output has {o.numel()} elements, expected {c.size} x {i.numel()}"
            )
    io = ((inputs, True, False), (outputs, False, True))
    sizes = [i.numel() for i in inputs]
    return AllgatherPacked(OpCode.ALLGATHER, device, _nbytes(outputs), list(outputs), io, sizes)


def barrier(c: Checks) -> Barrier:
    c.tensors("barrier", [])
    return Barrier(OpCode.BARRIER, _CPU, 0, [], ())


def reduce(c: Checks, tensors: list[torch.Tensor], opts: Any) -> Reduce:
    call = "reduce"
    root = c.root(call, opts)
    is_root = c.rank == root
    device = c.tensors(call, tensors, written=tensors if is_root else ())
    t = c.one(call, tensors)
    red = c.reduction(call, opts, t.dtype)
    io = (([t], True, is_root),)
    return Reduce(OpCode.REDUCE, device, _nbytes([t]), [t], io, red, root)


def gather(
    c: Checks,
    output_tensors: list[list[torch.Tensor]],
    input_tensors: list[torch.Tensor],
    opts: Any,
) -> Rooted:
    call = "gather"
    inp = c.one(call, input_tensors)
    root = c.root(call, opts)
    outs = c.root_list(call, output_tensors, inp, root, "output", "input")
    device = c.tensors(call, [inp, *outs], written=outs)
    io = (([inp], True, False), (outs, False, True))
    nbytes = _nbytes(outs) if c.rank == root else _nbytes([inp])
    return Rooted(OpCode.GATHER, device, nbytes, output_tensors, io, root)


def scatter(
    c: Checks,
    output_tensors: list[torch.Tensor],
    input_tensors: list[list[torch.Tensor]],
    opts: Any,
) -> Rooted:
    call = "scatter"
    out = c.one(call, output_tensors)
    root = c.root(call, opts)
    ins = c.root_list(call, input_tensors, out, root, "input", "output")
    device = c.tensors(call, [out, *ins], written=[out])
    io = ((ins, True, False), ([out], False, True))
    nbytes = _nbytes(ins) if c.rank == root else _nbytes([out])
    return Rooted(OpCode.SCATTER, device, nbytes, [out], io, root)


def alltoall_single(
    c: Checks,
    call: str,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
) -> Alltoall:
    device = c.tensors(call, [output, input], written=[output])
    out_bounds = c.split_bounds(call, "the output", output, output_split_sizes)
    in_bounds = c.split_bounds(call, "the input", input, input_split_sizes)
    r = c.rank
    if out_bounds[r][1] - out_bounds[r][0] != in_bounds[r][1] - in_bounds[r][0]:
        raise ValueError(
            f"{c.where(call)}: this rank keeps {in_bounds[r][1] - in_bounds[r][0]} "
            f"elements of its input but has room for {out_bounds[r][1] - out_bounds[r][0]}"
        )
    io = (([input], True, False), ([output], False, True))
    bounds = (in_bounds, out_bounds)
    return Alltoall(OpCode.ALLTOALL, device, _nbytes([input]), [output], io, bounds)


def alltoall(
    c: Checks, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor]
) -> Alltoall:
    call = "alltoall"
    where = c.where(call)
    device = c.tensors(call, [*output_tensors, *input_tensors], written=output_tensors)
    if len(output_tensors) != c.size or len(input_tensors) != c.size:
        raise ValueError(
            f"{where}: expected {c.size} input and output tensors, got "
            f"{len(input_tensors)} and {len(output_tensors)}"
        )
    r = c.rank
    if output_tensors[r].numel() != input_tensors[r].numel():
        raise ValueError(
            f"{where}: this rank's own piece has {input_tensors[r].numel()} elements, "
            f"its output slot {output_tensors[r].numel()}"
        )
    io = ((input_tensors, True, False), (output_tensors, False, True))
    nbytes = _nbytes(input_tensors)
    return Alltoall(OpCode.ALLTOALL, device, nbytes, output_tensors, io, None)


def reduce_scatter(
    c: Checks,
    output_tensors: list[torch.Tensor],
    input_tensors: list[list[torch.Tensor]],
    opts: Any,
) -> ReduceScatter:
    """The list form: one output, one list of N input pieces."""
    call = "reduce_scatter"
    where = c.where(call)
    out = c.one(call, output_tensors)
    if len(input_tensors) != 1 or len(input_tensors[0]) != c.size:
        raise ValueError(f"{where}: expected one input list of {c.size} tensors")
    ins = list(input_tensors[0])
    device = c.tensors(call, [out, *ins], written=[out])
    if ins[c.rank].numel() != out.numel():
        raise ValueError(
            f"{where}: output of {out.numel()} elements for this rank's input piece of "
            f"{ins[c.rank].numel()}"
        )
    red = c.reduction(call, opts, out.dtype)
    io = ((ins, True, False), ([out], False, True))
    return ReduceScatter(OpCode.REDUCE_SCATTER, device, _nbytes(ins), [out], io, red, None)


def reduce_scatter_tensors(
    c: Checks, call: str, outputs: Any, inputs: Any, opts: Any
) -> ReduceScatter:
    """Reduce-scatter each ``inputs[i]`` (N x ``outputs[i]``) into ``outputs[i]``; one pass."""
    if isinstance(outputs, torch.Tensor):  # the single-tensor forms
        outputs, inputs = [outputs], [inputs]
    where = c.where(call)
    device = c.tensors(call, [*outputs, *inputs], written=outputs)
    if not outputs or len(outputs) != len(inputs):
        raise ValueError(f"{where}: expected as many outputs as inputs (at least one)")
    for o, i in zip(outputs, inputs, strict=True):
        if i.numel() != o.numel() * c.size:
            raise ValueError(
                f"{where}: input has {i.numel()} elements, expected {c.size} x {o.numel()}"
            )
    red = c.reduction(call, opts, outputs[0].dtype)
    io = ((inputs, True, False), (outputs, False, True))
    sizes = [o.numel() for o in outputs]
    nbytes = _nbytes(inputs)
    return ReduceScatter(OpCode.REDUCE_SCATTER, device, nbytes, list(outputs), io, red, sizes)


def p2p(
    c: Checks, call: str, tensors: list[torch.Tensor], peer: int, tag: int, *, writes: bool
) -> torch.Tensor:
    """A send's or recv's one tensor, checked (p2p runs outside the FIFO: no request)."""
    t = c.one(call, tensors)
    c.tensors(call, [t], same_dtype=False, written=[t] if writes else ())
    if peer != ANY_SOURCE and not 0 <= peer < c.size:
        raise ValueError(f"{c.where(call)}: peer rank {peer} outside [0, {c.size})")
    if not isinstance(tag, int):
        raise TypeError(f"{c.where(call)}: tag must be an int, got {type(tag).__name__}")
    return t

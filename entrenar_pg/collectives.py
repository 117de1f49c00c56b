"""The rest of torch's ProcessGroup surface, as thin wrappers over the adapter's core path.

``EntrenarProcessGroup`` (backend.py) owns the core: ``_validate`` (arguments,
in the caller's thread), ``_staging`` (device staging), ``_launch`` (the job on
the comm thread and its Work). Each method here is the same three steps:
validate, ``staging.add`` what is read and written, and a small body that calls
one algorithm from ``entrenar_pg.algorithms``. The reduce-scatter and
all-gather families each end in one packed helper (``_reduce_scatter_packed``,
``_allgather_packed``), so the list, tensor and coalesced forms share one path.

Method names cover torch 2.11 and 2.13 alike (2.13 renamed several:
``all_to_all_single`` / ``alltoall_base``, ``reduce_scatter_single`` /
``_reduce_scatter_base``, ``*_single_coalesced`` / ``*_tensor_coalesced``).

Point-to-point (``send`` / ``recv`` / ``recv_anysource``) does not use the comm
thread: see ``entrenar_pg.p2p``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import algorithms as alg
from .overloads import normalize
from .p2p import ANY_SOURCE, P2PChannel, P2PWork
from .reduce_ops import Reduction, finish_, prepare_, resolve
from .wire import OpCode

if TYPE_CHECKING:
    from .config import Options
    from .staging import Staged, Staging

    Body = Any


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _rows(t: torch.Tensor) -> int:
    return t.size(0) if t.dim() else 1


class CollectivesMixin:
    """reduce, gather, scatter, all-to-all, reduce-scatter, coalesced forms, p2p, barriers."""

    if TYPE_CHECKING:
        _rank: int
        _size: int
        options: Options
        _p2p: P2PChannel

        def _where(self, call: str) -> str: ...
        def _validate(
            self,
            call: str,
            tensors: Sequence[Any],
            *,
            same_dtype: bool = True,
            written: Sequence[torch.Tensor] = (),
        ) -> torch.device: ...
        def _staging(self, device: torch.device) -> Staging: ...
        def _launch(
            self,
            kind: OpCode,
            staging: Staging,
            nbytes: int,
            body: Body,
            result: Any,
            *,
            opts: Any = None,
        ) -> Any: ...
        @staticmethod
        def _host(items: Sequence[Staged]) -> list[torch.Tensor]: ...
        def _check_root(self, call: str, root: int) -> None: ...
        def barrier(self, *args: Any, **kwargs: Any) -> Any: ...

    # ------------------------------------------------------------ torch integration
    #
    # A Python backend must subclass ProcessGroup (torch exposes no constructor
    # for a Python ``Backend``), so it registers no per-device backend and
    # torch's ``pg._get_backend(device)`` would raise. torch's Python side asks
    # it only for capabilities (init_process_group(device_id=...), new_group,
    # FSDP2's allocator, destroy): this group answers for every device itself.

    supports_splitting = False  # no communicator splitting: new_group builds fresh meshes
    supports_coalescing = False  # batch_isend_irecv issues each op (p2p never blocks)
    supports_shrinking = False
    supports_time_estimate = False

    def _get_backend(self, device: Any) -> Any:
        return self

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    @property
    def bound_device_id(self) -> Any:
        """Always None: nothing is eagerly bound, so torch never tries to split this group.

        ``init_process_group(device_id=...)`` sets it; the device is kept in
        ``requested_device_id`` (staging follows each tensor's own device).
        """
        return None

    @bound_device_id.setter
    def bound_device_id(self, device: Any) -> None:
        self.requested_device_id = device

    # ------------------------------------------------------------ helpers

    def _reduction(self, call: str, opts: Any, dtype: torch.dtype) -> Reduction:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return resolve(op, dtype, where=lambda: self._where(call))

    def _root(self, call: str, opts: Any) -> int:
        root = int(opts.rootRank) if opts is not None else 0
        self._check_root(call, root)
        return root

    def _one(self, call: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            n = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise ValueError(f"{self._where(call)}: expected exactly one tensor, got {n}")
        return tensors[0]

    def _reduce_scatter_chunks(
        self, call: alg.Call, chunks: Sequence[torch.Tensor], red: Reduction, op: OpCode
    ) -> None:
        """Reduce-scatter N flat chunks in place: afterwards ``chunks[rank]`` is reduced.

        The header's ``aux`` is a digest of the chunk sizes: ranks that agree on
        the total but split it differently would otherwise pass the check.
        """
        if call.world == 1:
            finish_(chunks[0], red, 1)
            return
        aux = alg.sizes_digest([c.numel() for c in chunks])
        if call.options.deterministic:
            alg.reduce_scatter_tree(call, chunks, red, op, aux=aux)
        else:
            alg.reduce_scatter_ring(call, chunks, red, op, aux=aux)

    def _reduce_scatter_packed(
        self,
        call: alg.Call,
        pieces: Sequence[Sequence[torch.Tensor]],
        outs: Sequence[torch.Tensor],
        red: Reduction,
    ) -> None:
        """The one reduce-scatter every form ends in.

        ``pieces[p]`` are this rank's contributions to rank p (flat host
        tensors, same sizes on every rank); chunk p is their concatenation in
        a scratch buffer (the inputs are never written), the chunks are
        reduce-scattered (ring; the direct-exchange tree when deterministic)
        and this rank's reduced chunk is unpacked into ``outs``.
        """
        dtype = outs[0].dtype
        sizes = [sum(t.numel() for t in ps) for ps in pieces]
        flat = call.scratch.get("rs_packed", sum(sizes), dtype)
        chunks, at = [], 0
        for ps, size in zip(pieces, sizes, strict=True):
            chunk = flat[at : at + size]
            if size:
                torch.cat([t.view(-1) for t in ps], out=chunk)
            chunks.append(chunk)
            at += size
        prepare_(flat, red)
        self._reduce_scatter_chunks(call, chunks, red, OpCode.REDUCE_SCATTER)
        mine, at = chunks[call.rank], 0
        for o in outs:
            o.copy_(mine[at : at + o.numel()])
            at += o.numel()

    def _allgather_packed(
        self,
        call: alg.Call,
        pieces: Sequence[torch.Tensor],
        dests: Sequence[Sequence[torch.Tensor]],
    ) -> None:
        """The one all-gather the coalesced forms end in.

        This rank's ``pieces`` are concatenated into its chunk of a scratch
        buffer, the chunks are all-gathered round the ring, and rank p's
        piece j is unpacked into ``dests[p][j]``.
        """
        n = call.world
        size = sum(t.numel() for t in pieces)
        flat = call.scratch.get("ag_packed", size * n, pieces[0].dtype)
        chunks = [flat[p * size : (p + 1) * size] for p in range(n)]
        if size:
            torch.cat([t.view(-1) for t in pieces], out=chunks[call.rank])
        if n > 1:
            alg.allgather_ring(call, chunks)
        for p in range(n):
            at = 0
            for d in dests[p]:
                d.copy_(chunks[p][at : at + d.numel()])
                at += d.numel()

    # ------------------------------------------------------------ reduce

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        """``(tensors, opts=None)`` or ``(tensor, root, op=SUM, timeout=None)``."""
        name = "reduce"
        (tensors,), opts = normalize(name, args, kwargs, self._rank)
        root = self._root(name, opts)
        is_root = self._rank == root
        device = self._validate(name, tensors, written=tensors if is_root else ())
        t = self._one(name, tensors)
        red = self._reduction(name, opts, t.dtype)
        staging = self._staging(device)
        item = staging.add([t], read=True, write=is_root)

        def body(call: alg.Call) -> None:
            buf = self._host(item)[0]
            if not is_root:  # the algorithm works in place: keep the user's input
                copy = call.scratch.get("reduce_in", buf.numel(), buf.dtype)
                copy.copy_(buf)
                buf = copy
            prepare_(buf, red)
            alg.reduce(call, buf, red, root)

        return self._launch(OpCode.REDUCE, staging, _nbytes([t]), body, [t], opts=opts)

    # ------------------------------------------------------------ gather / scatter

    def _root_list(
        self,
        name: str,
        lists: list[list[torch.Tensor]],
        single: torch.Tensor,
        root: int,
        role: str,
        other: str,
    ) -> list[torch.Tensor]:
        """The root's per-rank tensor list of gather (outputs) or scatter (inputs),
        checked against this rank's single tensor; empty on the other ranks."""
        where = self._where(name)
        if self._rank != root:
            if lists and any(len(lst) for lst in lists):
                raise ValueError(f"{where}: only the root (rank {root}) takes {role} tensors")
            return []
        if len(lists) != 1 or len(lists[0]) != self._size:
            raise ValueError(f"{where}: the root needs one {role} list of {self._size} tensors")
        for t in lists[0]:  # one size for all: the header carries it (as gloo requires)
            if t.numel() != single.numel():
                raise ValueError(
                    f"{where}: {role} tensor of {t.numel()} elements for an "
                    f"{other} of {single.numel()}"
                )
        return list(lists[0])

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_tensors, input_tensors, opts=None)`` or
        ``(output_tensors, input_tensor, root, timeout=None)``."""
        name = "gather"
        (output_tensors, input_tensors), opts = normalize(name, args, kwargs, self._rank)
        inp = self._one(name, input_tensors)
        root = self._root(name, opts)
        is_root = self._rank == root
        outs = self._root_list(name, output_tensors, inp, root, "output", "input")
        device = self._validate(name, [inp, *outs], written=outs)
        staging = self._staging(device)
        src = staging.add([inp], read=True, write=False)
        dst = staging.add(outs, read=False, write=True)

        def body(call: alg.Call) -> None:
            alg.gather(call, self._host(src)[0], self._host(dst) if is_root else None, root)

        nbytes = _nbytes(outs) if is_root else _nbytes([inp])
        return self._launch(OpCode.GATHER, staging, nbytes, body, output_tensors, opts=opts)

    def scatter(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_tensors, input_tensors, opts=None)`` or
        ``(output_tensor, input_tensors, root, timeout=None)``."""
        name = "scatter"
        (output_tensors, input_tensors), opts = normalize(name, args, kwargs, self._rank)
        out = self._one(name, output_tensors)
        root = self._root(name, opts)
        is_root = self._rank == root
        ins = self._root_list(name, input_tensors, out, root, "input", "output")
        device = self._validate(name, [out, *ins], written=[out])
        staging = self._staging(device)
        src = staging.add(ins, read=True, write=False)
        dst = staging.add([out], read=False, write=True)

        def body(call: alg.Call) -> None:
            alg.scatter(call, self._host(src) if is_root else None, self._host(dst)[0], root)

        nbytes = _nbytes(ins) if is_root else _nbytes([out])
        return self._launch(OpCode.SCATTER, staging, nbytes, body, [out], opts=opts)

    # ------------------------------------------------------------ all-to-all

    def alltoall_base(self, *args: Any, **kwargs: Any) -> Any:
        """``(output, input, output_split_sizes, input_split_sizes, opts=None | timeout=None)``."""
        return self._alltoall_single("alltoall_base", args, kwargs)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Any:
        """``(output, input, output_split_sizes, input_split_sizes, opts=None | timeout=None)``."""
        return self._alltoall_single("all_to_all_single", args, kwargs)

    def _split_bounds(
        self, call: str, what: str, t: torch.Tensor, splits: Sequence[int]
    ) -> list[tuple[int, int]]:
        """Element ranges of ``t``'s pieces along dim 0 (equal pieces if ``splits`` is empty)."""
        where = self._where(call)
        rows = _rows(t)
        per_row = t.numel() // rows if rows else 0
        if not splits:
            if rows % self._size:
                raise ValueError(
                    f"{where}: {what} has {rows} rows, not divisible by the world size "
                    f"{self._size}; pass split sizes"
                )
            splits = [rows // self._size] * self._size
        splits = [int(s) for s in splits]
        if len(splits) != self._size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(
                f"{where}: {what} split sizes {splits} must be {self._size} non-negative "
                f"numbers summing to its {rows} rows"
            )
        bounds, at = [], 0
        for s in splits:
            bounds.append((at * per_row, (at + s) * per_row))
            at += s
        return bounds

    def _alltoall_single(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        (output, input, output_split_sizes, input_split_sizes), opts = normalize(
            name, args, kwargs, self._rank
        )
        device = self._validate(name, [output, input], written=[output])
        out_bounds = self._split_bounds(name, "the output", output, output_split_sizes)
        in_bounds = self._split_bounds(name, "the input", input, input_split_sizes)
        r = self._rank
        if out_bounds[r][1] - out_bounds[r][0] != in_bounds[r][1] - in_bounds[r][0]:
            raise ValueError(
                f"{self._where(name)}: this rank keeps {in_bounds[r][1] - in_bounds[r][0]} "
                f"elements of its input but has room for {out_bounds[r][1] - out_bounds[r][0]}"
            )
        staging = self._staging(device)
        src = staging.add([input], read=True, write=False)
        dst = staging.add([output], read=False, write=True)

        def body(call: alg.Call) -> None:
            inp, out = self._host(src)[0], self._host(dst)[0]
            if inp.numel() and inp.data_ptr() == out.data_ptr():  # in place: keep the input
                copy = call.scratch.get("alltoall_in", inp.numel(), inp.dtype)
                copy.copy_(inp)
                inp = copy
            alg.alltoall(call, [inp[a:b] for a, b in in_bounds], [out[a:b] for a, b in out_bounds])

        return self._launch(OpCode.ALLTOALL, staging, _nbytes([input]), body, [output], opts=opts)

    def alltoall(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_tensors, input_tensors, opts=None)``."""
        name = "alltoall"
        (output_tensors, input_tensors), opts = normalize(name, args, kwargs, self._rank)
        where = self._where(name)
        device = self._validate(name, [*output_tensors, *input_tensors], written=output_tensors)
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise ValueError(
                f"{where}: expected {self._size} input and output tensors, got "
                f"{len(input_tensors)} and {len(output_tensors)}"
            )
        r = self._rank
        if output_tensors[r].numel() != input_tensors[r].numel():
            raise ValueError(
                f"{where}: this rank's own piece has {input_tensors[r].numel()} elements, "
                f"its output slot {output_tensors[r].numel()}"
            )
        staging = self._staging(device)
        src = staging.add(input_tensors, read=True, write=False)
        dst = staging.add(output_tensors, read=False, write=True)

        def body(call: alg.Call) -> None:
            alg.alltoall(call, self._host(src), self._host(dst))

        nbytes = _nbytes(input_tensors)
        return self._launch(OpCode.ALLTOALL, staging, nbytes, body, output_tensors, opts=opts)

    # ------------------------------------------------------------ reduce-scatter

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_tensors, input_tensors, opts=None)`` or
        ``(output, input, op=SUM, timeout=None)``."""
        name = "reduce_scatter"
        (output_tensors, input_tensors), opts = normalize(name, args, kwargs, self._rank)
        where = self._where(name)
        out = self._one(name, output_tensors)
        if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
            raise ValueError(f"{where}: expected one input list of {self._size} tensors")
        ins = list(input_tensors[0])
        device = self._validate(name, [out, *ins], written=[out])
        if ins[self._rank].numel() != out.numel():
            raise ValueError(
                f"{where}: output of {out.numel()} elements for this rank's input piece of "
                f"{ins[self._rank].numel()}"
            )
        red = self._reduction(name, opts, out.dtype)
        staging = self._staging(device)
        src = staging.add(ins, read=True, write=False)
        dst = staging.add([out], read=False, write=True)

        def body(call: alg.Call) -> None:
            self._reduce_scatter_packed(call, [[h] for h in self._host(src)], self._host(dst), red)

        return self._launch(OpCode.REDUCE_SCATTER, staging, _nbytes(ins), body, [out], opts=opts)

    def _reduce_scatter_base(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputTensor, inputTensor, opts=None)``."""
        return self._reduce_scatter_tensors("_reduce_scatter_base", args, kwargs)

    def reduce_scatter_single(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputTensor, inputTensor, opts=None)``."""
        return self._reduce_scatter_tensors("reduce_scatter_single", args, kwargs)

    def reduce_scatter_tensor_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputs, inputs, opts=None)``."""
        return self._reduce_scatter_tensors("reduce_scatter_tensor_coalesced", args, kwargs)

    def reduce_scatter_single_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputs, inputs, opts=None)``."""
        return self._reduce_scatter_tensors("reduce_scatter_single_coalesced", args, kwargs)

    def _reduce_scatter_tensors(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        """Reduce-scatter each ``inputs[i]`` (N x ``outputs[i]``) into ``outputs[i]``; one pass."""
        (outputs, inputs), opts = normalize(name, args, kwargs, self._rank)
        if isinstance(outputs, torch.Tensor):  # the single-tensor forms
            outputs, inputs = [outputs], [inputs]
        where = self._where(name)
        device = self._validate(name, [*outputs, *inputs], written=outputs)
        if not outputs or len(outputs) != len(inputs):
            raise ValueError(f"{where}: expected as many outputs as inputs (at least one)")
        for o, i in zip(outputs, inputs, strict=True):
            if i.numel() != o.numel() * self._size:
                raise ValueError(
                    f"{where}: input has {i.numel()} elements, expected {self._size} x {o.numel()}"
                )
        red = self._reduction(name, opts, outputs[0].dtype)
        staging = self._staging(device)
        src = staging.add(inputs, read=True, write=False)
        dst = staging.add(outputs, read=False, write=True)
        n = self._size

        def body(call: alg.Call) -> None:
            hosts = self._host(src)
            sizes = [o.numel() for o in outputs]
            pieces = [
                [h[p * m : (p + 1) * m] for h, m in zip(hosts, sizes, strict=True)]
                for p in range(n)
            ]
            self._reduce_scatter_packed(call, pieces, self._host(dst), red)

        return self._launch(
            OpCode.REDUCE_SCATTER, staging, _nbytes(inputs), body, list(outputs), opts=opts
        )

    # ------------------------------------------------------------ all-gather, coalesced

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_lists, input_list, opts=None)``."""
        name = "allgather_coalesced"
        (output_lists, input_list), opts = normalize(name, args, kwargs, self._rank)
        where = self._where(name)
        flat_outs = [t for lst in output_lists for t in lst]
        device = self._validate(name, [*input_list, *flat_outs], written=flat_outs)
        if not input_list:
            raise ValueError(f"{where}: no input tensors")
        if len(output_lists) != self._size or any(
            len(lst) != len(input_list)
            or any(o.numel() != i.numel() for o, i in zip(lst, input_list, strict=True))
            for lst in output_lists
        ):
            raise ValueError(
                f"{where}: expected {self._size} output lists shaped like the input list"
            )
        staging = self._staging(device)
        src = staging.add(input_list, read=True, write=False)
        dst = [staging.add(lst, read=False, write=True) for lst in output_lists]

        def body(call: alg.Call) -> None:
            self._allgather_packed(call, self._host(src), [self._host(d) for d in dst])

        return self._launch(
            OpCode.ALLGATHER, staging, _nbytes(flat_outs), body, output_lists, opts=opts
        )

    def allgather_into_tensor_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputs, inputs, opts=None)``."""
        return self._allgather_tensors("allgather_into_tensor_coalesced", args, kwargs)

    def all_gather_single_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputs, inputs, opts=None)``."""
        return self._allgather_tensors("all_gather_single_coalesced", args, kwargs)

    def _allgather_tensors(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Each ``outputs[i]`` (N x ``inputs[i]``) gets every rank's ``inputs[i]``, one pass."""
        (outputs, inputs), opts = normalize(name, args, kwargs, self._rank)
        where = self._where(name)
        device = self._validate(name, [*outputs, *inputs], written=outputs)
        if not inputs or len(outputs) != len(inputs):
            raise ValueError(f"{where}: expected as many outputs as inputs (at least one)")
        for o, i in zip(outputs, inputs, strict=True):
            if o.numel() != i.numel() * self._size:
                raise ValueError(
                    f"{where}: output has {o.numel()} elements, expected {self._size} x {i.numel()}"
                )
        staging = self._staging(device)
        src = staging.add(inputs, read=True, write=False)
        dst = staging.add(outputs, read=False, write=True)
        n = self._size

        def body(call: alg.Call) -> None:
            sizes = [i.numel() for i in inputs]
            outs = self._host(dst)
            dests = [
                [o[p * m : (p + 1) * m] for o, m in zip(outs, sizes, strict=True)] for p in range(n)
            ]
            self._allgather_packed(call, self._host(src), dests)

        return self._launch(
            OpCode.ALLGATHER, staging, _nbytes(outputs), body, list(outputs), opts=opts
        )

    # ------------------------------------------------------------ barrier

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier that raises if it is not passed within ``timeout`` (default: the group's)."""
        if timeout is None:
            timeout = timedelta(seconds=self._p2p.timeout_s)
        elif not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        self.barrier().wait(timeout)

    # ------------------------------------------------------------ point-to-point

    def _p2p_check(
        self, call: str, tensors: list[torch.Tensor], peer: int, tag: int, *, writes: bool
    ) -> torch.Tensor:
        t = self._one(call, tensors)
        self._validate(call, [t], same_dtype=False, written=[t] if writes else ())
        if peer != ANY_SOURCE and not 0 <= peer < self._size:
            raise ValueError(f"{self._where(call)}: peer rank {peer} outside [0, {self._size})")
        if not isinstance(tag, int):
            raise TypeError(f"{self._where(call)}: tag must be an int, got {type(tag).__name__}")
        return t

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> P2PWork:  # noqa: N803
        t = self._p2p_check("send", tensors, dstRank, tag, writes=False)
        return self._p2p.send(t, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> P2PWork:  # noqa: N803
        t = self._p2p_check("recv", tensors, srcRank, tag, writes=True)
        return self._p2p.recv(t, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> P2PWork:
        t = self._p2p_check("recv_anysource", tensors, ANY_SOURCE, tag, writes=True)
        return self._p2p.recv(t, ANY_SOURCE, tag)

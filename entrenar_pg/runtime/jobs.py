"""The job of each request kind: what runs, in the token-holding thread, on staged host tensors.

Each job is a plain function ``job(ctx, req, hosts)``: ``ctx`` is the call's
``JobContext`` (``runtime/context.py``), ``hosts[i]`` the flat host tensors
of ``req.io[i]`` (``runtime/staging.py`` made them and copies results back
afterwards). A job asks its context for a ``Call`` (``ctx.call(op,
nbytes)``), which carries the policy's ``Choice`` (collectives/policy.py)
for that op and size, and runs the algorithm it names. ``JOBS`` maps each
request class to its job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import collectives as alg
from .. import sparse
from ..call import requests as rq
from ..reduce_ops import Reduction, finish_, prepare_
from ..wire import Algo, OpCode
from .context import JobContext

Hosts = list[list[torch.Tensor]]

_ALLREDUCE: dict[Algo, Callable[[alg.Call, torch.Tensor, Reduction], None]] = {
    Algo.DIRECT: alg.allreduce_direct,  # rank order, or tree order (choice.tree)
    Algo.STAR: alg.allreduce_star,  # the same, at the root
    Algo.RING: alg.allreduce_ring,
    Algo.TREE_RING: alg.allreduce_tree_ring,
    Algo.SHM: alg.allreduce_shm,  # ranks all on one host: through the slot areas
    Algo.HOST_SLICES: alg.allreduce_host_slices,  # several hosts: collectives/hierarchical.py
    Algo.HOST_LEADERS: alg.allreduce_host_leaders,
    Algo.DOUBLING: alg.allreduce_doubling,  # flat, many ranks: log2 N partners each
}
_REDUCE_SCATTER = {
    Algo.RING: alg.reduce_scatter_ring,
    Algo.DIRECT: alg.reduce_scatter_tree,
    Algo.HOST_SLICES: alg.reduce_scatter_hosts,  # several hosts: collectives/hierarchical.py
}
_ALLGATHER = {Algo.RING: alg.allgather_ring, Algo.HOST_SLICES: alg.allgather_hosts}


# ---------------------------------------------------------------------- layouts
# Where each rank's piece lies in a request's staged tensors: shared by the
# jobs and by the contract checker's views of the same call (checker/kinds.py).


def reduce_scatter_pieces(
    req: rq.ReduceScatter, inputs: Sequence[torch.Tensor], world: int
) -> list[list[torch.Tensor]]:
    """``pieces[p]``: this rank's contributions to rank p's output, in output order."""
    if req.sizes is None:
        return [[h] for h in inputs]
    return [
        [h[p * m : (p + 1) * m] for h, m in zip(inputs, req.sizes, strict=True)]
        for p in range(world)
    ]


def allgather_chunks(
    req: rq.Allgather, dst: Sequence[torch.Tensor], world: int
) -> Sequence[torch.Tensor]:
    """The output chunk of each rank (a list of N tensors, or N slices of one)."""
    if req.split is None:
        return dst
    n, flat = req.split, dst[0]
    return [flat[i * n : (i + 1) * n] for i in range(world)]


def allgather_dests(
    req: rq.AllgatherPacked, hosts: Hosts, world: int
) -> Sequence[Sequence[torch.Tensor]]:
    """``dests[p]``: where rank p's pieces go on this rank, in piece order."""
    if req.sizes is None:
        return hosts[1:]
    sizes, outs = req.sizes, hosts[1]
    return [
        [o[p * m : (p + 1) * m] for o, m in zip(outs, sizes, strict=True)] for p in range(world)
    ]


def alltoall_pieces(
    req: rq.Alltoall, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]
) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    """(the piece for each rank, the piece from each rank)."""
    if req.bounds is None:
        return ins, outs
    (inp,), (out,) = ins, outs
    in_bounds, out_bounds = req.bounds
    return [inp[a:b] for a, b in in_bounds], [out[a:b] for a, b in out_bounds]


# ---------------------------------------------------------------------- reductions


def allreduce_flat(ctx: JobContext, flat: torch.Tensor, red: Reduction, nbytes: int) -> None:
    """The one allreduce of a flat host tensor (of ``nbytes``) every allreduce request ends in."""
    call = ctx.call(OpCode.ALLREDUCE, nbytes)
    prepare_(flat, red)
    if call.choice.algo is not Algo.NONE:
        _ALLREDUCE[call.choice.algo](call, flat, red)


def allreduce(ctx: JobContext, req: rq.Allreduce, hosts: Hosts) -> None:
    (tensors,) = hosts
    if len(tensors) == 1:
        allreduce_flat(ctx, tensors[0], req.red, req.nbytes)
        return
    total = sum(h.numel() for h in tensors)
    flat = ctx.scratch.get("coalesced", total, tensors[0].dtype)
    torch.cat(tensors, out=flat)
    allreduce_flat(ctx, flat, req.red, req.nbytes)  # the same bytes, packed
    offset = 0
    for h in tensors:
        h.copy_(flat[offset : offset + h.numel()])
        offset += h.numel()


def sparse_allreduce(ctx: JobContext, req: rq.SparseAllreduce, hosts: Hosts) -> None:
    sparse.allreduce(ctx.call(req.op, req.nbytes), req.tensor)


def reduce(ctx: JobContext, req: rq.Reduce, hosts: Hosts) -> None:
    buf = hosts[0][0]
    call = ctx.call(OpCode.REDUCE, buf.numel() * buf.element_size())
    if call.rank != req.root:  # the algorithm works in place: keep the user's input
        copy = call.scratch.get("reduce_in", buf.numel(), buf.dtype)
        copy.copy_(buf)
        buf = copy
    prepare_(buf, req.red)
    alg.reduce(call, buf, req.red, req.root)


def reduce_scatter(ctx: JobContext, req: rq.ReduceScatter, hosts: Hosts) -> None:
    """The one reduce-scatter every form ends in.

    ``pieces[p]`` are this rank's contributions to rank p (flat host
    tensors, same sizes on every rank); chunk p is their concatenation in
    a scratch buffer (the inputs are never written), the chunks are
    reduce-scattered (the policy's algorithm) and this rank's reduced chunk
    is unpacked into the outputs.
    """
    inputs, outs = hosts
    pieces = reduce_scatter_pieces(req, inputs, ctx.world)
    red = req.red
    chunk_sizes = [sum(t.numel() for t in ps) for ps in pieces]
    flat = ctx.scratch.get("rs_packed", sum(chunk_sizes), outs[0].dtype)
    chunks, at = [], 0
    for ps, size in zip(pieces, chunk_sizes, strict=True):
        chunk = flat[at : at + size]
        if size:
            torch.cat([t.view(-1) for t in ps], out=chunk)
        chunks.append(chunk)
        at += size
    prepare_(flat, red)
    call = ctx.call(OpCode.REDUCE_SCATTER, flat.numel() * flat.element_size())
    if call.choice.algo is Algo.NONE:
        finish_(chunks[0], red, 1)
    else:
        # The header's aux is a digest of the chunk sizes: ranks that agree on
        # the total but split it differently would otherwise pass the check.
        aux = alg.sizes_digest(chunk_sizes)
        _REDUCE_SCATTER[call.choice.algo](call, chunks, red, OpCode.REDUCE_SCATTER, aux=aux)
    mine, at = chunks[call.rank], 0
    for o in outs:
        o.copy_(mine[at : at + o.numel()])
        at += o.numel()


# ---------------------------------------------------------------------- data movement


def broadcast(ctx: JobContext, req: rq.Broadcast, hosts: Hosts) -> None:
    for h in hosts[0]:  # one broadcast per tensor, each sized by the policy on its own
        call = ctx.call(OpCode.BROADCAST, h.numel() * h.element_size())
        if call.choice.algo is not Algo.NONE:
            alg.broadcast(call, h, req.root)


def allgather(ctx: JobContext, req: rq.Allgather, hosts: Hosts) -> None:
    (src,), dst = hosts
    chunks = allgather_chunks(req, dst, ctx.world)
    call = ctx.call(OpCode.ALLGATHER, src.numel() * src.element_size() * len(chunks))
    chunks[call.rank].copy_(src)
    if call.choice.algo is not Algo.NONE:
        _ALLGATHER[call.choice.algo](call, chunks)


def allgather_packed(ctx: JobContext, req: rq.AllgatherPacked, hosts: Hosts) -> None:
    """The one all-gather the coalesced forms end in.

    This rank's pieces are concatenated into its chunk of a scratch buffer,
    the chunks are all-gathered round the ring, and rank p's piece j is
    unpacked into its destination ``dests[p][j]``.
    """
    pieces = hosts[0]
    n = ctx.world
    dests = allgather_dests(req, hosts, n)
    size = sum(t.numel() for t in pieces)
    flat = ctx.scratch.get("ag_packed", size * n, pieces[0].dtype)
    chunks = [flat[p * size : (p + 1) * size] for p in range(n)]
    call = ctx.call(OpCode.ALLGATHER, flat.numel() * flat.element_size())
    if size:
        torch.cat([t.view(-1) for t in pieces], out=chunks[call.rank])
    if call.choice.algo is not Algo.NONE:
        _ALLGATHER[call.choice.algo](call, chunks)
    for p in range(n):
        at = 0
        for d in dests[p]:
            d.copy_(chunks[p][at : at + d.numel()])
            at += d.numel()


def rooted(ctx: JobContext, req: rq.Rooted, hosts: Hosts) -> None:
    """Gather (every rank's input to the root's outputs) or scatter (the reverse)."""
    call = ctx.call(req.op, req.nbytes)
    is_root = call.rank == req.root
    if req.op is OpCode.GATHER:
        (inp,), outs = hosts
        alg.gather(call, inp, outs if is_root else None, req.root)
    else:
        ins, (out,) = hosts
        alg.scatter(call, ins if is_root else None, out, req.root)


def alltoall(ctx: JobContext, req: rq.Alltoall, hosts: Hosts) -> None:
    call = ctx.call(OpCode.ALLTOALL, req.nbytes)
    if req.bounds is None:
        alg.alltoall(call, *alltoall_pieces(req, hosts[0], hosts[1]))
        return
    (inp,), (out,) = hosts
    if inp.numel() and inp.data_ptr() == out.data_ptr():  # in place: keep the input
        copy = call.scratch.get("alltoall_in", inp.numel(), inp.dtype)
        copy.copy_(inp)
        inp = copy
    alg.alltoall(call, *alltoall_pieces(req, [inp], [out]))


def barrier(ctx: JobContext, req: rq.Barrier, hosts: Hosts) -> None:
    call = ctx.call(OpCode.BARRIER, 0)
    if call.choice.algo is not Algo.NONE:
        alg.barrier(call)


def custom(ctx: JobContext, req: rq.Custom, hosts: Hosts) -> None:
    req.run(ctx.call(req.op, req.nbytes))


JOBS: dict[type, Callable[[JobContext, Any, Hosts], None]] = {
    rq.Allreduce: allreduce,
    rq.SparseAllreduce: sparse_allreduce,
    rq.Reduce: reduce,
    rq.ReduceScatter: reduce_scatter,
    rq.Broadcast: broadcast,
    rq.Allgather: allgather,
    rq.AllgatherPacked: allgather_packed,
    rq.Rooted: rooted,
    rq.Alltoall: alltoall,
    rq.Barrier: barrier,
    rq.Custom: custom,
}

"""Rooted collectives: reduce to a root, gather to a root, scatter from a root."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..reduce_ops import Reduction, finish_
from ..transport import Plan
from ..wire import Algo, OpCode
from .alltoall import exchange
from .common import Call, bytes_of, chunk_bounds
from .deterministic import reduce_scatter_tree
from .ring import reduce_scatter_ring
from .star import gather_reduce


def reduce(call: Call, buf: torch.Tensor, red: Reduction, root: int) -> None:
    """Reduce every rank's flat CPU tensor ``buf`` into the root's ``buf``.

    ``prepare_`` (PREMUL_SUM's scale) is the caller's. Non-root ``buf`` is
    used as scratch (the adapter hands in a copy, so user inputs survive).
    Up to ``star_max_bytes``, or with two ranks: ``reduce_star``. Larger: a
    reduce-scatter (ring; the direct-exchange tree when deterministic) and
    then every rank sends its reduced chunk to the root: every rank sends and
    receives about (N-1)/N x nbytes in the reduce-scatter, the root receives
    another (N-1)/N x nbytes: about 2 x nbytes at the root instead of the
    star's (N-1) x nbytes. Latency: N-1 ring hops (1 when deterministic) + 1.
    """
    n, r = call.world, call.rank
    if n == 1:
        finish_(buf, red, 1)
        return
    nbytes = buf.numel() * buf.element_size()
    if n <= 2 or nbytes <= call.options.star_max_bytes:
        reduce_star(call, buf, red, root)
        return
    chunks = [buf[a:b] for a, b in chunk_bounds(buf.numel(), n)]
    if call.options.deterministic:
        reduce_scatter_tree(call, chunks, red, OpCode.REDUCE)
    else:
        reduce_scatter_ring(call, chunks, red, OpCode.REDUCE)
    if r == root:
        exchange(
            call, OpCode.REDUCE, buf.dtype, {}, {p: chunks[p] for p in range(n) if p != r}, aux=root
        )
    else:
        exchange(call, OpCode.REDUCE, buf.dtype, {root: chunks[r]}, {}, aux=root)


def reduce_star(call: Call, buf: torch.Tensor, red: Reduction, root: int) -> None:
    """Every rank sends ``buf`` to the root, which combines segment by segment as they arrive.

    The root's side is the star's ``gather_reduce``: segment k is combined
    once every rank's segment k is in, in rank order (the canonical tree
    order when deterministic). Bytes: a leaf sends nbytes; the root receives
    (N-1) x nbytes. Latency: 1 hop. Scratch at the root: (N-1) x nbytes.
    """
    header = call.header(
        OpCode.REDUCE, Algo.STAR, buf.dtype, reduce_op=int(red.kind), numel=buf.numel(), aux=root
    )
    plan = Plan(call.rank)
    if call.rank != root:
        plan.open(root, header, recv=False)
        plan.send(root, bytes_of(buf))
    else:
        gather_reduce(call, plan, buf, red, root, header, replies=False)
    call.mesh.run(plan, call.what(OpCode.REDUCE))


def gather(call: Call, inp: torch.Tensor, outs: Sequence[torch.Tensor] | None, root: int) -> None:
    """Every rank's flat ``inp`` lands in the root's ``outs[rank]``; direct to the root.

    Steps: one; every non-root rank sends its input to the root, which
    receives from all of them at once. Bytes: a leaf sends its input; the
    root receives (N-1) inputs. Latency: 1 hop.
    """
    r = call.rank
    if r == root:
        assert outs is not None
        if outs[r].numel():
            outs[r].copy_(inp)
        peers = {p: outs[p] for p in range(call.world) if p != r}
        exchange(call, OpCode.GATHER, inp.dtype, {}, peers, aux=root)
    else:
        exchange(call, OpCode.GATHER, inp.dtype, {root: inp}, {}, aux=root)


def scatter(call: Call, ins: Sequence[torch.Tensor] | None, out: torch.Tensor, root: int) -> None:
    """The root's ``ins[p]`` lands in rank p's flat ``out``; direct from the root.

    Steps: one; the root sends every piece at once. Bytes: the root sends
    (N-1) pieces; a leaf receives its piece. Latency: 1 hop.
    """
    r = call.rank
    if r == root:
        assert ins is not None
        if out.numel():
            out.copy_(ins[r])
        peers = {p: ins[p] for p in range(call.world) if p != r}
        exchange(call, OpCode.SCATTER, out.dtype, peers, {}, aux=root)
    else:
        exchange(call, OpCode.SCATTER, out.dtype, {}, {root: out}, aux=root)

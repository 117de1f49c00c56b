"""Star (coordinator) allreduce: rank 0 gathers, reduces, broadcasts. Fewest hops."""

from __future__ import annotations

from functools import partial

import torch

from ..reduce_ops import Reduction, combine_, finish_, tree_reduce_
from ..transport import Plan
from ..wire import Algo, Header, OpCode
from .common import Call, bytes_of, is_set, segments

ROOT = 0


def gather_reduce(
    call: Call,
    plan: Plan,
    buf: torch.Tensor,
    red: Reduction,
    root: int,
    header: Header,
    *,
    replies: bool,
) -> tuple[list[tuple[int, int]], list[bool]]:
    """Add the root's side of a star to ``plan``: receive every rank's ``buf``
    and combine segment k into the root's ``buf`` as soon as every rank's
    segment k is in, in rank order (the canonical tree order when
    ``call.choice.tree``), so combining overlaps receiving. Returns the segments
    (element bounds) and their "reduced" flags, which a send can wait on.
    ``replies``: the root also opens a frame back to every rank (the star
    allreduce sends the result; reduce does not). Scratch: (N-1) x nbytes.
    """
    n = call.world
    numel, size = buf.numel(), buf.element_size()
    leaves = [p for p in range(n) if p != root]
    scratch = call.scratch.get("star", numel * len(leaves), buf.dtype)
    parts = {p: scratch[i * numel : (i + 1) * numel] for i, p in enumerate(leaves)}
    segs = segments(0, numel, call.segment_elems(buf.dtype))
    arrivals = [0] * len(segs)
    reduced = [False] * len(segs)
    kind = red.combine_kind
    tree = call.choice.tree

    def arrived(k: int) -> None:
        arrivals[k] += 1
        if arrivals[k] < len(leaves):
            return
        a, b = segs[k]
        mine = buf[a:b]
        if tree:
            ordered = [mine if p == root else parts[p][a:b] for p in range(n)]
            result = tree_reduce_(ordered, kind)
            if result is not mine:
                mine.copy_(result)
        else:
            for p in leaves:
                combine_(mine, parts[p][a:b], kind)
        finish_(mine, red, n)
        reduced[k] = True

    for p in leaves:
        plan.open(p, header, send=replies)
        view = bytes_of(parts[p])
        for k, (a, b) in enumerate(segs):
            plan.recv(p, view[a * size : b * size], partial(arrived, k), chain=True)
    if not segs:  # nothing to reduce: the headers alone carry the call
        finish_(buf, red, n)
    return segs, reduced


def allreduce_star(
    call: Call, buf: torch.Tensor, red: Reduction, op: OpCode = OpCode.ALLREDUCE
) -> None:
    """Star allreduce of the flat CPU tensor ``buf``, in place.

    Steps: every other rank sends its input to rank 0 and receives the result
    into place; rank 0 combines segment k as soon as every rank's segment k
    has arrived (``gather_reduce``) and sends it straight back, so large
    messages pipeline. Bytes on the wire: a leaf sends and receives nbytes;
    rank 0 sends and receives (N-1) x nbytes. Latency: 2 hops.
    """
    n, r = call.world, call.rank
    plan = Plan(r)
    header = call.header(op, Algo.STAR, buf.dtype, reduce_op=int(red.kind), numel=buf.numel())
    raw = bytes_of(buf)
    if r != ROOT:
        plan.open(ROOT, header)
        plan.send(ROOT, raw)
        plan.recv(ROOT, raw)
    else:
        segs, reduced = gather_reduce(call, plan, buf, red, ROOT, header, replies=True)
        size = buf.element_size()
        for p in range(1, n):
            for k, (a, b) in enumerate(segs):
                plan.send(p, raw[a * size : b * size], is_set(reduced, k))
    if buf.numel():
        # A leaf's answer leaves the root only once every leaf's data (after
        # its header) has arrived there, so a leaf that completes has seen
        # every rank's call agree. The neighbour headers make a rank running
        # another plan for this call (a ring) meet this one.
        plan.confirm_neighbours(n, header)
    else:
        # No data: the answer is the header alone, which proves nothing
        # about the other leaves; every rank confirms with every other.
        plan.confirm_peers(n, header)
    call.mesh.run(plan, call.what(op), call)

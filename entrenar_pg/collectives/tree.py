"""Deterministic reductions: every element is combined in the canonical tree order.

The canonical order (``reduce_ops.tree_reduce_``) is a balanced pairwise tree
over the ranks' contributions, ``((x0 + x1) + (x2 + x3))`` for four ranks; it
depends only on the world size. A ring reduce-scatter cannot follow it (rank r
adds the contributions in the order they travel round the ring, which differs
from chunk to chunk), so the deterministic reduce-scatter is a *direct
exchange*: every rank sends chunk p straight to rank p and receives its own
chunk from every peer, then combines the N contributions of each segment in
tree order as soon as that segment has arrived from everyone. The bytes on the
wire are the ring's; only the hop pattern differs. The allreduce follows it
with a ring all-gather in the same plan, so a reduced segment starts round
the ring while later segments are still being exchanged.

Because every rank reduces the elements it owns in the same tree, and the
star algorithm's coordinator uses the same tree, ring, star and auto give the
same bits; chunk and segment boundaries only decide *who* reduces an element
and *when*, never in which order, so the result is also independent of
``segment_bytes`` and of how a tensor is split into buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from ..reduce_ops import Kind, Reduction, combine_into, finish_, tree_reduce_
from ..transport import Plan
from ..wire import Algo, Header, OpCode
from .common import Call, bytes_of, chunk_bounds, is_set, segments, setter
from .dissemination import confirm_in_rounds
from .halving import halve

CREDIT = 4  # segments a rank sends ahead of its own reduction (receive scratch: 2x this)


def tree_reduce_into(dst: torch.Tensor, parts: Sequence[torch.Tensor], kind: Kind) -> None:
    """``tree_reduce_(parts)``, bit for bit, with the result written into ``dst``.

    The two halves reduce in place as usual; the root combine writes ``dst``
    directly (``dst`` may be one of the parts), which saves ``tree_reduce_``'s
    final copy when the owner's chunk is not the first contribution.
    """
    if len(parts) == 1:
        if parts[0] is not dst:
            dst.copy_(parts[0])
        return
    m = (len(parts) + 1) // 2
    combine_into(dst, tree_reduce_(parts[:m], kind), tree_reduce_(parts[m:], kind), kind)


def exchange(
    call: Call, plan: Plan, chunks: Sequence[torch.Tensor], red: Reduction, header: Header
) -> list[bool]:
    """Add the direct-exchange reduce-scatter to ``plan``; opens every link.

    Returns the per-segment "reduced" flags of ``chunks[rank]`` (set by the
    receive callbacks as the plan runs), for a later phase to wait on.
    """
    n, r = call.world, call.rank
    own = chunks[r]
    dtype, size, numel = own.dtype, own.element_size(), own.numel()
    for chunk in chunks:
        if chunk.dtype != dtype:
            raise ValueError(f"rank {r}: reduce-scatter chunks of different dtypes")
    peers = [p for p in range(n) if p != r]
    seg_elems = call.segment_elems(dtype)
    segs = segments(0, numel, seg_elems)
    # Receive scratch: a ring of slots per peer, segment k in slot k mod slots.
    # One peer: segment k is reduced in the callback of its own receive, so one
    # slot is enough. More: flow control (below) bounds how far ahead any peer
    # can be, to 2 x CREDIT segments, provided every chunk has about as many
    # segments (the credit travels with the data); else every peer's whole
    # chunk is received first.
    counts = [len(segments(0, c.numel(), seg_elems)) for c in chunks]
    flow = len(peers) > 1 and max(counts) - min(counts) <= 1
    if len(peers) == 1:
        slots = min(1, len(segs))
    else:
        slots = min(2 * CREDIT, len(segs)) if flow else len(segs)
    cap = min(seg_elems, numel)
    scratch = call.scratch.get("tree", len(peers) * slots * cap, dtype)
    parts = {p: scratch[i * slots * cap : (i + 1) * slots * cap] for i, p in enumerate(peers)}
    slot = [((k % slots) * cap, (k % slots) * cap + b - a) for k, (a, b) in enumerate(segs)]
    arrivals = [0] * len(segs)
    reduced = [False] * len(segs)
    kind = red.combine_kind

    def arrived(k: int) -> None:
        arrivals[k] += 1
        if arrivals[k] < len(peers):
            return
        a, b = segs[k]
        c, d = slot[k]
        mine = own[a:b]
        tree_reduce_into(mine, [mine if p == r else parts[p][c:d] for p in range(n)], kind)
        finish_(mine, red, n)
        reduced[k] = True

    for p in peers:
        plan.open(p, header)
        out = chunks[p]
        out_raw = bytes_of(out)
        for i, (a, b) in enumerate(segments(0, out.numel(), seg_elems)):
            # Flow control: segment i goes out once this rank has reduced its own
            # segment i - CREDIT. A peer sending us segment j has thereby reduced
            # its j - CREDIT, so it had our j - CREDIT, which we sent after
            # reducing our j - 2 x CREDIT: slot j mod (2 x CREDIT) is free again.
            # (Indices clamp to the last segment; chunks that differ by at most
            # one segment keep this true.) Reducing segment k needs only
            # segments < k of anyone: no deadlock.
            gated = flow and i >= CREDIT and segs
            ready = is_set(reduced, min(i - CREDIT, len(segs) - 1)) if gated else None
            plan.send(p, out_raw[a * size : b * size], ready)
        into = bytes_of(parts[p])
        for k, (c, d) in enumerate(slot):
            plan.recv(p, into[c * size : d * size], partial(arrived, k))
    if not segs:
        finish_(own, red, n)
    return reduced


def reduce_scatter_tree(
    call: Call,
    chunks: Sequence[torch.Tensor],
    red: Reduction,
    op: OpCode = OpCode.REDUCE_SCATTER,
    *,
    aux: int = 0,
) -> None:
    """Deterministic reduce-scatter, in place: afterwards ``chunks[r]`` holds the reduced chunk r.

    ``chunks`` are N contiguous 1-D CPU tensors of one dtype (sizes may
    differ); ``prepare_`` (PREMUL_SUM's scale) is the caller's, AVG's division
    is done here, after the sum.

    Recursive halving in the canonical tree's shape (halving.py): ceil(log2 N)
    levels, one partner each, segment k of a chunk combined in the canonical
    tree order level by level as it arrives. Bytes on the wire per rank: the
    other chunks out, once each; for equal chunks (N-1)/N x total out, the
    ring's. Latency: ceil(log2 N) hops. ``aux`` goes into the header
    (reduce's root). Headers: see ``confirm_tree``.
    """
    n = call.world
    if len(chunks) != n:
        raise ValueError(f"rank {call.rank}: reduce-scatter needs {n} chunks, got {len(chunks)}")
    if n == 1:
        finish_(chunks[0], red, 1)
        return
    numel = sum(c.numel() for c in chunks)
    plan = call.plan()
    header = call.header(
        op, Algo.DIRECT, chunks[0].dtype, reduce_op=int(red.kind), numel=numel, aux=aux
    )
    halve(call, plan, chunks, red, header)
    confirm_tree(call, plan, header, chunks)
    call.mesh.run(plan, call.what(op), call)


def confirm_tree(call: Call, plan: Plan, header: Header, chunks: Sequence[torch.Tensor]) -> None:
    """The header rule for a plan built on ``halve`` (call it after every ``open``).

    Every chunk's sum gathers every rank's contribution along a tree of links,
    each receiver checking its sender's header before it combines and sends
    the chunk on; so a rank that receives its reduced chunk (and, in the
    allreduce, every other) has seen every rank's call agree, if every chunk
    has data. The ring neighbours' headers make a rank running another plan
    for this call meet this one. With an empty chunk some rank's result passes
    through no one: then the headers go along the dissemination rounds
    (``confirm_in_rounds``: 2 ceil(log2 N) more peers at most, not N - 1).
    """
    if any(c.numel() == 0 for c in chunks):
        confirm_in_rounds(call, plan, header)
    else:
        plan.confirm_neighbours(call.world, header)


def allreduce_tree_ring(
    call: Call, buf: torch.Tensor, red: Reduction, op: OpCode = OpCode.ALLREDUCE
) -> None:
    """Deterministic allreduce of the flat CPU tensor ``buf``, in place.

    Steps: the halving reduce-scatter of ``reduce_scatter_tree`` (``buf`` cut
    by ``chunk_bounds``; rank r owns chunk r and reduces it in tree order),
    then N-1 ring all-gather steps (at step s rank r forwards chunk r-s to
    r+1 and receives chunk r-s-1 from r-1), both in one plan: segment k of
    chunk r goes round the ring as soon as it is reduced. Bytes on the wire
    per rank: 2(N-1)/N x nbytes sent (the ring allreduce's). Latency:
    ceil(log2 N) + (N-1) hops. Peers: the halving's (ceil(log2 N) for a power
    of two, at most 2 ceil(log2 N)) and the ring neighbours (the direct
    exchange before it talked to all N - 1).
    """
    n, r = call.world, call.rank
    if n == 1:
        finish_(buf, red, 1)
        return
    header = call.header(op, Algo.TREE_RING, buf.dtype, reduce_op=int(red.kind), numel=buf.numel())
    chunks = [buf[a:b] for a, b in chunk_bounds(buf.numel(), n)]
    plan = call.plan()
    reduced = halve(call, plan, chunks, red, header)
    # Ring all-gather after the halving's pieces (on a link they share). A
    # received segment lands in its final place; chunk c's segment k can only
    # arrive after its owner had this rank's share of it, so overwriting it
    # never races the halving's send of the same bytes.
    right, left = (r + 1) % n, (r - 1) % n
    if call.group_rank(right) not in plan.sends:
        plan.open(right, header, recv=False)
    if call.group_rank(left) not in plan.recvs:
        plan.open(left, header, send=False)
    seg_elems = call.segment_elems(buf.dtype)
    size = buf.element_size()
    views = [bytes_of(c) for c in chunks]
    got: list[list[bool]] = []
    for s in range(n - 1):
        c = (r - s - 1) % n
        flags = [False] * len(segments(0, chunks[c].numel(), seg_elems))
        for k, (a, b) in enumerate(segments(0, chunks[c].numel(), seg_elems)):
            plan.recv(left, views[c][a * size : b * size], setter(flags, k))
        got.append(flags)
    for s in range(n - 1):
        c = (r - s) % n
        gate = reduced if s == 0 else got[s - 1]
        for k, (a, b) in enumerate(segments(0, chunks[c].numel(), seg_elems)):
            plan.send(right, views[c][a * size : b * size], is_set(gate, k))
    confirm_tree(call, plan, header, chunks)
    call.mesh.run(plan, call.what(op), call)

"""Rooted collectives: reduce to a root, gather to a root, scatter from a root.

In each, some rank only sends or only receives, so data alone does not show
every rank every other rank's call: each plan also confirms its header
(``run_rooted``: on one host with every peer; across hosts through the
root, which checks every rank's header and answers each with a verdict, and
the ring neighbours, so that a rank other than the root needs no socket but
to the root and its neighbours), and a rank that disagrees (root, size,
dtype, op) makes every rank raise in the call. The root travels in every
header (``aux``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..reduce_ops import Reduction, finish_
from ..transport import Plan
from ..wire import Algo, Header, OpCode
from .common import Call, bytes_of, chunk_bounds
from .ring import reduce_scatter_ring
from .star import gather_reduce
from .tree import reduce_scatter_tree


def reduce(call: Call, buf: torch.Tensor, red: Reduction, root: int) -> None:
    """Reduce every rank's flat CPU tensor ``buf`` into the root's ``buf``.

    ``prepare_`` (PREMUL_SUM's scale) is the caller's. Non-root ``buf`` is
    used as scratch (the adapter hands in a copy, so user inputs survive).
    ``call.choice.algo`` (collectives.policy) ``STAR`` (two ranks, or up to
    ``star_max_bytes``): ``reduce_star``. Else a reduce-scatter, ``RING`` or
    ``DIRECT`` (the halving in tree order, deterministic: halving.py), and
    then every rank sends its reduced chunk to the root: every rank sends and
    receives about (N-1)/N x nbytes in the reduce-scatter, the root receives
    another (N-1)/N x nbytes: about 2 x nbytes at the root instead of the
    star's (N-1) x nbytes. Latency: N-1 ring hops (ceil(log2 N) when deterministic) + 1.
    The reduce-scatter's header carries the root, and completing it means
    every rank's header agreed (its data passes through every rank), so the
    final move to the root needs no confirmation of its own.
    """
    n, r = call.world, call.rank
    if n == 1:
        finish_(buf, red, 1)
        return
    if call.choice.algo is Algo.STAR:
        reduce_star(call, buf, red, root)
        return
    chunks = [buf[a:b] for a, b in chunk_bounds(buf.numel(), n)]
    if call.choice.algo is Algo.DIRECT:  # the halving (deterministic)
        reduce_scatter_tree(call, chunks, red, OpCode.REDUCE, aux=root)
    else:
        reduce_scatter_ring(call, chunks, red, OpCode.REDUCE, aux=root)
    header = call.header(OpCode.REDUCE, Algo.DIRECT, buf.dtype, numel=buf.numel(), aux=root)
    plan = _rooted(call, header, root, chunks, chunks[r], to_root=True)
    call.mesh.run(plan, call.what(OpCode.REDUCE), call)


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
    run_rooted(call, plan, root, header, OpCode.REDUCE)


def gather(call: Call, inp: torch.Tensor, outs: Sequence[torch.Tensor] | None, root: int) -> None:
    """Every rank's flat ``inp`` lands in the root's ``outs[rank]``; direct to the root.

    Every piece has ``inp``'s size (the adapter checks the root's list).
    Steps: one; every non-root rank sends its input to the root, which
    receives from all of them at once. Bytes: a leaf sends its input; the
    root receives (N-1) inputs; plus the header confirmations (``run_rooted``). Latency: 1 hop.
    """
    r = call.rank
    if r == root:
        assert outs is not None
        if outs[r].numel():
            outs[r].copy_(inp)
    header = call.header(OpCode.GATHER, Algo.DIRECT, inp.dtype, numel=inp.numel(), aux=root)
    plan = _rooted(call, header, root, outs or [], inp, to_root=True)
    run_rooted(call, plan, root, header, OpCode.GATHER)


def scatter(call: Call, ins: Sequence[torch.Tensor] | None, out: torch.Tensor, root: int) -> None:
    """The root's ``ins[p]`` lands in rank p's flat ``out``; direct from the root.

    Every piece has ``out``'s size (the adapter checks the root's list).
    Steps: one; the root sends every piece at once. Bytes: the root sends
    (N-1) pieces; a leaf receives its piece; plus the header confirmations.
    Latency: 1 hop.
    """
    r = call.rank
    if r == root:
        assert ins is not None
        if out.numel():
            out.copy_(ins[r])
    header = call.header(OpCode.SCATTER, Algo.DIRECT, out.dtype, numel=out.numel(), aux=root)
    plan = _rooted(call, header, root, ins or [], out, to_root=False)
    run_rooted(call, plan, root, header, OpCode.SCATTER)


def run_rooted(call: Call, plan: Plan, root: int, header: Header, op: OpCode) -> None:
    """Run a rooted plan with the header rule (call it after every ``open``).

    On one host (every data socket made at set-up): a header frame with every
    peer (``Plan.confirm_peers``), which costs no socket there and no round
    trip. Where some rank of the call is on another host, data sockets are
    made on first use, so a frame with every peer would connect every rank to
    every other: there every rank's header is checked at the root, whose
    verdict each rank waits for (``Plan.confirm_at_root``: one more hop), and
    a rank other than the root talks to the root and its two ring neighbours
    only. The neighbours' headers, which make a rank running another plan for
    this call (another root, another collective) meet this one, go in a plan
    of their own, first: a plan waits for its links before it runs, the lower
    rank connecting, so a rank that names another root would wait for that
    rank to connect, which it never does; ring neighbours are linked by every
    plan, so a disagreement surfaces there, and the rooted plan runs only
    where neighbours agree (one more hop).
    """
    n = call.world
    if n > 1 and linked_at_set_up(call):
        plan.confirm_peers(n, header)
    elif n > 1:
        first = call.plan()
        first.confirm_neighbours(n, header)
        call.mesh.run(first, call.what(op), call)
        plan.confirm_at_root(root, n, header)
    call.mesh.run(plan, call.what(op), call)


def linked_at_set_up(call: Call) -> bool:
    """Whether every rank of the call shares this rank's host (the data sockets
    between them are made at set-up); the same answer on every rank of it."""
    host_of = call.mesh.topology.host_of
    here = host_of[call.mesh.rank]
    return all(host_of[call.group_rank(i)] == here for i in range(call.world))


def _rooted(
    call: Call,
    header: Header,
    root: int,
    pieces: Sequence[torch.Tensor],
    mine: torch.Tensor,
    *,
    to_root: bool,
) -> Plan:
    """The plan of a direct move between the root and every other rank, each link
    opened with ``header``: to the root (rank p's ``mine`` lands in the root's
    ``pieces[p]``) or from it (the root's ``pieces[p]`` lands in rank p's ``mine``)."""
    r = call.rank
    plan = Plan(r)
    if r == root:
        for p in range(call.world):
            if p == r:
                continue
            plan.open(p, header, send=not to_root, recv=to_root)
            if to_root:
                plan.recv(p, bytes_of(pieces[p]))
            else:
                plan.send(p, bytes_of(pieces[p]))
    else:
        plan.open(root, header, send=to_root, recv=not to_root)
        if to_root:
            plan.send(root, bytes_of(mine))
        else:
            plan.recv(root, bytes_of(mine))
    return plan

"""Broadcast: along the dissemination rounds' binomial tree for small messages
(collectives/dissemination.py), direct from the root for mid-sized ones, a
pipelined chain for large ones: in rank order on one host, through one head
per host on several (``HOST_CHAIN``)."""

from __future__ import annotations

import torch

from ..wire import Algo, OpCode
from .common import Call, bytes_of, is_set, segments, setter
from .dissemination import confirm_in_rounds, disseminate
from .rooted import run_rooted

_CHAINS = (Algo.CHAIN, Algo.HOST_CHAIN)  # the pipelined plans (``chain_links`` places a rank)


def broadcast(call: Call, buf: torch.Tensor, root: int, op: OpCode = OpCode.BROADCAST) -> None:
    """Copy the root's flat CPU tensor ``buf`` into every rank's ``buf``.

    ``call.choice.algo`` (collectives.policy): ``DISSEMINATION`` (small
    messages, more than two ranks): the binomial tree on the dissemination
    barrier's links, ceil(log2 N) hops, headers checked along the rounds
    (``disseminate``). ``DIRECT`` (two ranks, or up to ``star_max_bytes``):
    the root sends to every rank directly; 1 hop, the
    root sends (N-1) x nbytes. ``CHAIN`` (larger messages): a chain in rank
    order from the root, each rank forwarding segment k as soon as it has it;
    every rank sends and receives nbytes once, and the time is about
    nbytes/bandwidth + (N-2) segments instead of (N-1) x nbytes/bandwidth.
    ``HOST_CHAIN`` (larger messages on several hosts): the same pipeline on a
    tree (``chain_links``): one head per host in a chain across the hosts,
    each head forwarding every segment to the next host first and then to its
    own host's ranks. A host link carries nbytes once per direction whatever
    the ranks' placement (the rank-order chain: once per host boundary when
    each host's ranks are consecutive, up to L times with ranks interleaved),
    and the first segment makes H-1 cross-host hops and one local hop, not
    N-1 hops.

    With ``DIRECT`` or ``CHAIN`` no rank hears from every other, and the root
    hears from none: with ``DIRECT`` every rank also confirms its header as
    the rooted ops do (``run_rooted``: on one host with every peer; across
    hosts through the root's verdict and the ring neighbours); the chain
    confirms through the dissemination rounds' tokens after its data
    (``confirm_in_rounds``: 2 ceil(log2 N) peers more at most, not N - 1),
    so a rank that disagrees (root, size, dtype, algorithm) makes every rank
    raise in this call, the root included.
    """
    if call.choice.algo is Algo.DISSEMINATION:
        disseminate(call, op, buf, root)
        return
    n, r = call.world, call.rank
    algo = call.choice.algo if call.choice.algo in _CHAINS else Algo.DIRECT
    header = call.header(op, algo, buf.dtype, numel=buf.numel(), aux=root)
    raw = bytes_of(buf)
    plan = call.plan()
    if algo is Algo.DIRECT:
        if r == root:
            for p in range(n):
                if p != root:
                    plan.open(p, header, recv=False)
                    plan.send(p, raw)
        else:
            plan.open(root, header, send=False)
            plan.recv(root, raw)
    else:
        parent, children = chain_links(call, root, algo)
        size = buf.element_size()
        segs = segments(0, buf.numel(), call.segment_elems(buf.dtype))
        pieces = [raw[a * size : b * size] for a, b in segs]
        have = [parent is None] * len(pieces)
        if parent is not None:
            plan.open(parent, header, send=False)
            for k, piece in enumerate(pieces):
                plan.recv(parent, piece, setter(have, k), chain=True)
        for child in children:
            plan.open(child, header, recv=False)
            for k, piece in enumerate(pieces):
                plan.send(child, piece, is_set(have, k))
    if algo is Algo.DIRECT:
        run_rooted(call, plan, root, header, op)
        return
    confirm_in_rounds(call, plan, header)
    call.mesh.run(plan, call.what(op), call)


def chain_links(call: Call, root: int, algo: Algo) -> tuple[int | None, list[int]]:
    """This rank's place in a chain broadcast from ``root``: the rank it receives
    from (None: the root) and the ranks it forwards to, in the order it feeds them.

    ``CHAIN``: rank order from the root, one next rank each. ``HOST_CHAIN``
    (the whole group, its ``Mesh.topology``): the hosts in order from the
    root's; each host's *head* is the root on the root's host and the lowest
    rank on every other. A head receives from the previous host's head and
    forwards to the next host's head first (the cross-host link is the slow
    one, and every later host waits on it), then to the other ranks of its
    host; those receive from their head and forward nothing.
    """
    n, r = call.world, call.rank
    if algo is Algo.CHAIN:
        pos = (r - root) % n
        return (None if pos == 0 else (r - 1) % n), ([] if pos == n - 1 else [(r + 1) % n])
    assert call.team is None, "the hosts' chain runs on the whole group"
    topology = call.mesh.topology
    hosts, first = topology.hosts, topology.host_of[root]
    order = [hosts[(first + j) % len(hosts)] for j in range(len(hosts))]
    heads = [root] + [members[0] for members in order[1:]]
    j = (topology.host_of[r] - first) % len(hosts)
    if r != heads[j]:
        return heads[j], []
    nxt = [heads[j + 1]] if j + 1 < len(heads) else []
    return (None if j == 0 else heads[j - 1]), nxt + [p for p in order[j] if p != r]

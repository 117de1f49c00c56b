"""Broadcast: along the dissemination rounds' binomial tree for small messages
(collectives/dissemination.py), direct from the root for mid-sized ones, a
pipelined chain for large ones."""

from __future__ import annotations

import torch

from ..wire import Algo, OpCode
from .common import Call, bytes_of, is_set, segments, setter
from .dissemination import confirm_in_rounds, disseminate
from .rooted import run_rooted


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
    algo = Algo.CHAIN if call.choice.algo is Algo.CHAIN else Algo.DIRECT
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
        pos = (r - root) % n
        prev, nxt = (r - 1) % n, (r + 1) % n
        size = buf.element_size()
        segs = segments(0, buf.numel(), call.segment_elems(buf.dtype))
        have = [pos == 0] * len(segs)
        if pos > 0:
            plan.open(prev, header, send=False)
            for k, (a, b) in enumerate(segs):
                plan.recv(prev, raw[a * size : b * size], setter(have, k), chain=True)
        if pos < n - 1:
            plan.open(nxt, header, recv=False)
            for k, (a, b) in enumerate(segs):
                plan.send(nxt, raw[a * size : b * size], is_set(have, k))
    if algo is Algo.DIRECT:
        run_rooted(call, plan, root, header, op)
        return
    confirm_in_rounds(call, plan, header)
    call.mesh.run(plan, call.what(op), call)

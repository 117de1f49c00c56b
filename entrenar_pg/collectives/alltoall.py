"""All-to-all: every piece goes straight from the rank that has it to the rank that wants it.

Nothing is forwarded, and every link of a rank is driven at once by one
transport ``Plan`` (the progress loop sends what each kernel buffer takes
while it receives on all the others, so no size and no order deadlocks).

Split sizes are checked on both ends of every link: the link's header says
how many elements go each way (``numel`` from the lower rank to the higher,
``aux`` back), both ends send the same one and compare, so a disagreement in
either direction is a CollectiveMismatchError on both ranks, never a
desynchronised byte stream. With three or more ranks the two that disagree
are not the only ones who must know (the others would complete): every link
ends with an acknowledgement (``Plan.acknowledge``) that a rank sends only
once all of its own links agreed, which costs one more hop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..transport import Plan
from ..wire import Algo, OpCode
from .common import Call, bytes_of


def alltoall(
    call: Call,
    sends: Sequence[torch.Tensor],
    recvs: Sequence[torch.Tensor],
    op: OpCode = OpCode.ALLTOALL,
) -> None:
    """All-to-all: ``sends[p]`` goes to rank p, rank p's piece for this rank lands in ``recvs[p]``.

    ``sends`` and ``recvs`` are N flat contiguous CPU tensors of one dtype;
    sizes may differ per peer (``all_to_all_single`` with split sizes), and
    ``recvs[r]`` must have ``sends[r]``'s size (the local piece is a copy).

    Steps: one. Rank r sends piece p to every rank p != r and receives piece
    r from every peer, all 2(N-1) link directions at once; with N > 2 each
    link then carries an acknowledgement each way (see the module doc).
    Bytes on the wire per rank: sum of the pieces it sends out, sum of the
    pieces it receives in, plus 32 (64 with N > 2) per link direction;
    nothing is relayed. Latency: 1 hop (2 with N > 2).
    """
    n, r = call.world, call.rank
    if len(sends) != n or len(recvs) != n:
        raise ValueError(f"rank {r}: all-to-all needs {n} pieces each way")
    if recvs[r].numel():
        recvs[r].copy_(sends[r])
    if n == 1:
        return
    dtype = sends[r].dtype
    plan = Plan(r)
    headers = {}
    for p in range(n):
        if p == r:
            continue
        out, back = sends[p].numel(), recvs[p].numel()
        up, down = (out, back) if r < p else (back, out)
        headers[p] = header = call.header(op, Algo.DIRECT, dtype, numel=up, aux=down)
        plan.open(p, header)
        plan.send(p, bytes_of(sends[p]))
        plan.recv(p, bytes_of(recvs[p]), chain=True)  # its own buffer: one syscall with the next
    if n > 2:
        for p, header in headers.items():
            plan.acknowledge(p, header)
    call.mesh.run(plan, call.what(op), call)

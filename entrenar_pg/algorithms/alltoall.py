"""Direct exchanges: all-to-all, and the one-to-many / many-to-one moves of gather and scatter.

Nothing is forwarded: every piece goes straight from the rank that has it to
the rank that wants it, and every link of a rank is driven at once by one
transport ``Plan`` (the progress loop sends what each kernel buffer takes
while it receives on all the others, so no size and no order deadlocks).

Each direction of a link opens with its own header, whose ``numel`` is the
piece's element count as the *sender* sees it; the receiver expects the count
it has room for. Uneven splits are therefore checked: a rank whose split
sizes disagree with its peer's gets a CollectiveMismatchError naming both
ranks and both counts, never a desynchronised byte stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..transport import Plan
from ..wire import Algo, OpCode
from .common import Call, bytes_of


def exchange(
    call: Call,
    op: OpCode,
    dtype: torch.dtype,
    sends: Mapping[int, torch.Tensor],
    recvs: Mapping[int, torch.Tensor],
    *,
    aux: int = 0,
) -> None:
    """Send ``sends[p]`` to every rank p and receive rank p's piece into ``recvs[p]``, all at once.

    Tensors are flat contiguous CPU tensors of ``dtype``; keys never include
    this rank. ``aux`` (the root, for gather/scatter) is part of both headers.
    """
    r = call.rank
    plan = Plan(r)
    for p in sorted(set(sends) | set(recvs)):
        assert p != r, "internal: a rank does not exchange with itself"
        if p in sends:
            t = sends[p]
            plan.open(p, call.header(op, Algo.DIRECT, dtype, numel=t.numel(), aux=aux), recv=False)
            plan.send(p, bytes_of(t))
        if p in recvs:
            t = recvs[p]
            plan.open(p, call.header(op, Algo.DIRECT, dtype, numel=t.numel(), aux=aux), send=False)
            plan.recv(p, bytes_of(t))
    if plan.sends or plan.recvs:
        call.mesh.run(plan, call.what(op))


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
    r from every peer, all 2(N-1) link directions at once.
    Bytes on the wire per rank: sum of the pieces it sends out, sum of the
    pieces it receives in; nothing is relayed. Latency: 1 hop.
    """
    n, r = call.world, call.rank
    if len(sends) != n or len(recvs) != n:
        raise ValueError(f"rank {r}: all-to-all needs {n} pieces each way")
    if recvs[r].numel():
        recvs[r].copy_(sends[r])
    dtype = sends[r].dtype
    peers = [p for p in range(n) if p != r]
    exchange(call, op, dtype, {p: sends[p] for p in peers}, {p: recvs[p] for p in peers})

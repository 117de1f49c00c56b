"""Direct allreduce: everyone sends to everyone, everyone reduces. One hop."""

from __future__ import annotations

import torch

from ..reduce_ops import Reduction, combine_into, finish_, tree_reduce_
from ..wire import Algo, OpCode
from .common import PLAN_CACHE_MAX_BYTES, Call, bytes_of


def allreduce_direct(
    call: Call, buf: torch.Tensor, red: Reduction, op: OpCode = OpCode.ALLREDUCE
) -> None:
    """Direct allreduce of the flat CPU tensor ``buf``, in place.

    Steps: every rank sends its input to every other rank and receives
    theirs, all links at once; then each rank combines the N contributions
    itself, in rank order (in the canonical tree order when ``call.choice.tree``).
    Every rank applies the same operations to the same operands in the same
    order, so all ranks hold the same bits.
    Bytes on the wire per rank: (N-1) x nbytes sent and received.
    Latency: 1 hop (star needs 2, ring 2(N-1)): the choice for small messages.
    """
    n, r = call.world, call.rank
    numel = buf.numel()
    # Small messages are dominated by building the plan: keep it per buffer
    # address and shape (DDP's buckets and a training loop's tensors reuse
    # theirs) and per everything its header says (the flags depend on the
    # group's options only), so a reuse only has to restamp the sequence number.
    key = (op, buf.data_ptr(), numel, buf.dtype, n, red.kind, call.team)
    cacheable = numel * buf.element_size() <= PLAN_CACHE_MAX_BYTES
    cached = call.scratch.plan(key) if cacheable else None
    if cached is not None:
        plan, parts = cached
        plan.restamp(call.seq)
    else:
        header = call.header(op, Algo.DIRECT, buf.dtype, reduce_op=int(red.kind), numel=numel)
        plan = call.plan()
        scratch = call.scratch.get("direct", numel * (n - 1), buf.dtype)
        raw = bytes_of(buf)
        parts = []
        for p in range(n):
            if p == r:
                continue
            part = scratch[len(parts) * numel : (len(parts) + 1) * numel]
            parts.append(part)
            plan.open(p, header)
            plan.send(p, raw)
            plan.recv(p, bytes_of(part))
        if cacheable:
            call.scratch.keep_plan(key, (plan, parts))
    call.mesh.run(plan, call.what(op), call)
    contributions = parts[:r] + [buf] + parts[r:]
    if call.choice.tree:
        result = tree_reduce_(contributions, red.combine_kind)
        if result is not buf:
            buf.copy_(result)
    else:
        # Left to right, in rank order: ((c0 op c1) op c2) ... The running
        # result lives in a scratch part until our own input (c_r) has been
        # read, and in ``buf`` from then on, so no final copy is needed.
        kind = red.combine_kind
        acc = contributions[0]
        for k in range(1, n):
            dst = buf if k >= r else acc
            combine_into(dst, acc, contributions[k], kind)
            acc = dst
    finish_(buf, red, n)

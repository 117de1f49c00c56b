"""Ring algorithms: allreduce, all-gather and reduce-scatter share one pass.

The data is cut into N chunks (chunk bounds depend only on numel and N). In a
ring pass rank r sends to r+1 and receives from r-1. Each chunk moves in
segments of ``segment_bytes``: a received segment is reduced (or stored) and
becomes sendable at once, so receiving, reducing and sending overlap and the
link never idles waiting for a whole chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..reduce_ops import Kind, Reduction, combine_, finish_
from ..transport import Plan
from ..wire import Algo, Header, OpCode
from .common import Call, bytes_of, chunk_bounds, is_set, segments, setter
from .dissemination import confirm_in_rounds


@dataclass(slots=True)
class RingPass:
    """What ``ring_pass`` added to a plan and a cached plan must keep: its
    receives' flags, set in order as each completes (``finished``; a rerun
    clears them), and the scratch its reducing receives land in (the plan's
    views of it own nothing: whoever keeps the plan keeps this)."""

    arrived: list[bool]
    scratch: torch.Tensor

    def rearm(self) -> None:
        """No receive done (before a cached plan's next run)."""
        self.arrived[:] = [False] * len(self.arrived)


def ring_pass(
    call: Call,
    plan: Plan,
    chunks: Sequence[torch.Tensor],
    *,
    reduce_steps: int,
    gather_steps: int,
    shift: int = 0,
    kind: Kind = Kind.SUM,
    on_reduced: Callable[[torch.Tensor], None] | None = None,
    scratch_name: str = "ring",
    after: Callable[[], bool] | None = None,
) -> RingPass:
    """Add one ring pass over ``chunks`` (N contiguous 1-D tensors) to ``plan``.

    Step s (0-based) sends chunk ``(r - s + shift) mod N`` to the right and
    receives chunk ``(r - s - 1 + shift) mod N`` from the left. The first
    ``reduce_steps`` steps combine what arrives into the local chunk (through
    a one-segment scratch buffer); the next ``gather_steps`` store it in place.
    ``on_reduced`` runs on each segment of the chunk finished by the last
    reduce step. Segment k of step s is sent once segment k of step s-1 has
    arrived, which is exactly the segment it forwards. Passes that reduce at
    the same time in one plan (on other links) need scratch of their own
    (``scratch_name``).

    ``after``: the pass neither sends nor takes in anything before it is
    true (another pass of the plan, on other links, still writes its
    chunks). Returns the pass (``RingPass``: ``finished`` makes a later
    pass's ``after`` of it).
    """
    n, r = call.world, call.rank
    right, left = (r + 1) % n, (r - 1) % n
    steps = reduce_steps + gather_steps
    seg_elems = call.segment_elems(chunks[0].dtype)
    views = [bytes_of(c) for c in chunks]
    size = chunks[0].element_size()
    scratch = call.scratch.get(scratch_name, seg_elems, chunks[0].dtype)
    scratch_bytes = bytes_of(scratch)
    arrived: list[bool] = []
    gate = after  # the pass's first receive waits on it, and the rest behind it
    first_recv: list[int] = []  # index into `arrived` of each step's first segment
    for s in range(steps):
        c = (r - s - 1 + shift) % n
        first_recv.append(len(arrived))
        for a, b in segments(0, chunks[c].numel(), seg_elems):
            idx = len(arrived)
            arrived.append(False)
            if s < reduce_steps:
                done = _reduce_into(
                    chunks[c][a:b],
                    scratch[: b - a],
                    kind,
                    on_reduced if s == reduce_steps - 1 else None,
                    arrived,
                    idx,
                )
                plan.recv(left, scratch_bytes[: (b - a) * size], done, ready=gate)
            else:
                view = views[c][a * size : b * size]
                plan.recv(left, view, setter(arrived, idx), chain=True, ready=gate)
            gate = None
    for s in range(steps):
        c = (r - s + shift) % n
        for k, (a, b) in enumerate(segments(0, chunks[c].numel(), seg_elems)):
            ready = after if s == 0 else is_set(arrived, first_recv[s - 1] + k)
            plan.send(right, views[c][a * size : b * size], ready)
    return RingPass(arrived, scratch)


def finished(done: RingPass, after: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """True once the ring pass ``done`` is over on this rank (its last receive done;
    they complete in order); a pass that receives nothing is over once its own
    ``after`` is."""
    flags = done.arrived
    return is_set(flags, len(flags) - 1) if flags else after


def _reduce_into(
    dst: torch.Tensor,
    src: torch.Tensor,
    kind: Kind,
    then: Callable[[torch.Tensor], None] | None,
    flags: list[bool],
    idx: int,
) -> Callable[[], None]:
    def done() -> None:
        combine_(dst, src, kind)
        if then is not None:
            then(dst)
        flags[idx] = True

    return done


def open_ring(call: Call, plan: Plan, header: Header, chunks: Sequence[torch.Tensor]) -> None:
    """Open the frame to the right and from the left (one link each way).

    A rank checks only its left neighbour's header, which is enough when
    every chunk has data: then the last segment a rank receives was
    forwarded, hop by hop, by every other rank, each only after it had checked
    its own left neighbour's header (a rank that raises starves the rest, who
    then get its abort). With an empty chunk some rank may receive nothing
    that passed through the others, so then the headers also go along the
    dissemination rounds (``confirm_in_rounds``: 2 ceil(log2 N) more peers at
    most, where a header frame with every peer needed a socket to each).
    """
    n, r = call.world, call.rank
    right, left = (r + 1) % n, (r - 1) % n
    plan.open(right, header, send=True, recv=left == right)
    if left != right:
        plan.open(left, header, send=False, recv=True)
    if any(c.numel() == 0 for c in chunks):
        confirm_in_rounds(call, plan, header)


def allreduce_ring(call: Call, buf: torch.Tensor, red: Reduction) -> None:
    """Ring allreduce of the flat CPU tensor ``buf``, in place.

    Steps: N-1 reduce-scatter steps (rank r ends owning the reduced chunk
    r+1), then N-1 all-gather steps that circulate the reduced chunks.
    Bytes on the wire per rank: 2(N-1)/N x nbytes sent, the same received;
    the bandwidth optimum. Latency: 2(N-1) hops.
    """
    n = call.world
    plan = call.plan()
    header = call.header(
        OpCode.ALLREDUCE, Algo.RING, buf.dtype, reduce_op=int(red.kind), numel=buf.numel()
    )
    chunks = [buf[a:b] for a, b in chunk_bounds(buf.numel(), n)]
    open_ring(call, plan, header, chunks)
    ring_pass(
        call,
        plan,
        chunks,
        reduce_steps=n - 1,
        gather_steps=n - 1,
        kind=red.combine_kind,
        on_reduced=lambda seg: finish_(seg, red, n),
    )
    call.mesh.run(plan, call.what(OpCode.ALLREDUCE), call)


def allgather_ring(
    call: Call, chunks: Sequence[torch.Tensor], op: OpCode = OpCode.ALLGATHER
) -> None:
    """Ring all-gather: ``chunks[r]`` holds this rank's input; fills the others in place.

    Steps: N-1; at step s rank r forwards chunk (r-s) and receives chunk
    (r-s-1). Bytes on the wire per rank: (N-1) x chunk bytes each way.
    """
    plan = call.plan()
    numel = sum(c.numel() for c in chunks)
    open_ring(call, plan, call.header(op, Algo.RING, chunks[0].dtype, numel=numel), chunks)
    ring_pass(call, plan, chunks, reduce_steps=0, gather_steps=call.world - 1)
    call.mesh.run(plan, call.what(op), call)


def reduce_scatter_ring(
    call: Call,
    chunks: Sequence[torch.Tensor],
    red: Reduction,
    op: OpCode = OpCode.REDUCE_SCATTER,
    *,
    aux: int = 0,
) -> None:
    """Ring reduce-scatter, in place: afterwards ``chunks[r]`` holds the reduced chunk r.

    Steps: N-1; at step s rank r sends chunk (r-s-1) and combines chunk
    (r-s-2) from the left. Bytes on the wire per rank: (N-1) x chunk bytes each way.
    ``aux`` goes into the header (reduce's root).
    """
    n = call.world
    plan = call.plan()
    numel = sum(c.numel() for c in chunks)
    header = call.header(
        op, Algo.RING, chunks[0].dtype, reduce_op=int(red.kind), numel=numel, aux=aux
    )
    open_ring(call, plan, header, chunks)
    ring_pass(
        call,
        plan,
        chunks,
        reduce_steps=n - 1,
        gather_steps=0,
        shift=-1,
        kind=red.combine_kind,
        on_reduced=lambda seg: finish_(seg, red, n),
    )
    call.mesh.run(plan, call.what(op), call)

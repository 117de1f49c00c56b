"""The shm-native allreduce: ranks all on one host reduce straight from each other's slots.

No plan and no byte ring: each rank's input goes once into its own slot
area (``transport/shm/slots.py``), which every peer has mapped, and the
reduction reads the peers' slots in place.

- Small (<= ``SMALL_MAX_BYTES``), one phase: each rank writes its 32-byte
  wire header and its input into its slot, publishes, waits for every peer,
  compares every peer's header byte for byte with its own (so a mismatch
  raises ``CollectiveMismatchError`` on every rank, in the call), then
  combines all N slots into its output, in rank order left to right (the
  canonical tree order when ``call.choice.tree``): the operations and
  operands of ``direct.py``, so the bits equal TCP's.
- Large, in chunks of a slot, two phases each (DeepSpeed's >= 1 MiB path):
  copy the chunk in (all but the slice this rank reduces: it reads that
  from its input); each rank combines its 1/N slice of the chunk across
  all slots (same order) into its other slot; then every rank copies all N
  reduced slices out. The first chunk's headers are compared as above.

PREMUL_SUM's scale was applied to the input before (``reduce_ops.prepare_``,
by the job), AVG's division is applied once to the result here
(``finish_``), as every algorithm does. Per call on the small path: two
copies of the message per rank (in, and the reduction's output), no
allocation (views cached per dtype and size, the header packed once per
shape and restamped), no syscall when the peers are already there.
"""

from __future__ import annotations

import torch

from ..errors import CollectiveMismatchError
from ..reduce_ops import Kind, Reduction, combine_, combine_into, finish_
from ..transport.shm.slots import SLOT_DATA_BYTES, ForeignTraffic, SlotArea
from ..wire import HEADER_BYTES, Algo, Header, OpCode, stamp_seq
from .common import Call, ScratchPool, bytes_of, chunk_bounds

# Up to this size every rank reduces the whole message (one phase); above,
# each rank reduces a slice (N-fold less reduction work, one more phase per
# chunk). DeepSpeed's crossover, which matches ours on 2 cores.
SMALL_MAX_BYTES = 1 << 20


def allreduce_shm(
    call: Call, buf: torch.Tensor, red: Reduction, op: OpCode = OpCode.ALLREDUCE
) -> None:
    """Allreduce of the flat CPU tensor ``buf``, in place, through the slot areas."""
    area = call.mesh.slots
    assert area is not None, "internal: the policy chose SHM without slot areas"
    numel = buf.numel()
    packed = _packed_header(call, op, buf.dtype, red, numel)
    if numel * buf.element_size() <= SMALL_MAX_BYTES:
        _small(call, area, buf, red.combine_kind, packed, op)
    else:
        _chunked(call, area, buf, red.combine_kind, packed, op)
    finish_(buf, red, call.world)


def _packed_header(
    call: Call, op: OpCode, dtype: torch.dtype, red: Reduction, numel: int
) -> bytearray:
    """This call's header, packed once per shape and restamped with the sequence number."""
    key = ("shm_header", op, dtype, int(red.kind), numel, call.choice.flags)
    packed = call.scratch.plan(key)
    if packed is None:
        packed = bytearray(HEADER_BYTES)
        call.header(op, Algo.SHM, dtype, reduce_op=int(red.kind), numel=numel).pack_into(packed)
        call.scratch.keep_plan(key, packed)
    stamp_seq(packed, call.seq)
    return packed


def _small(
    call: Call, area: SlotArea, buf: torch.Tensor, kind: Kind, packed: bytearray, op: OpCode
) -> None:
    n = call.world
    phase = area.phase + 1
    parity = phase & 1
    views = area.views(buf.dtype, buf.numel())
    area.write_data(phase, bytes_of(buf))
    area.write_header(phase, packed)
    area.publish(phase)
    if not area.ready(phase):
        _wait(area, phase, call, op, packed)
    _check_headers(area, call, phase, packed)
    area.check_peers(call.mesh.progress, call.what(op))
    parts = [views[q][parity] for q in range(n)]
    _combine(buf, parts, kind, call.choice.tree, call.scratch)


def _chunked(
    call: Call, area: SlotArea, buf: torch.Tensor, kind: Kind, packed: bytearray, op: OpCode
) -> None:
    n, r = call.world, call.rank
    what = call.what(op)
    progress = call.mesh.progress
    step = SLOT_DATA_BYTES // buf.element_size()
    numel = buf.numel()
    for start in range(0, numel, step):
        m = min(step, numel - start)
        views = area.views(buf.dtype, m)
        bounds = chunk_bounds(m, n)
        chunk = buf[start : start + m]
        # Phase A: the chunk into this rank's slot, but for the slice this
        # rank reduces itself (read from ``buf`` directly: 1/N less copying).
        phase = area.phase + 1
        pa = phase & 1
        lo, hi = bounds[r]
        if lo:
            views[r][pa][:lo].copy_(chunk[:lo])
        if hi < m:
            views[r][pa][hi:].copy_(chunk[hi:])
        area.write_header(phase, packed)
        area.publish(phase)
        _wait(area, phase, call, op, packed)
        if start == 0:
            _check_headers(area, call, phase, packed)
        area.check_peers(progress, what)
        # Phase B: this rank's slice, reduced across every slot, into its other slot.
        pb = pa ^ 1
        parts = [views[q][pa][lo:hi] if q != r else chunk[lo:hi] for q in range(n)]
        _combine(views[r][pb][lo:hi], parts, kind, call.choice.tree, call.scratch)
        area.publish(phase + 1)
        _wait(area, phase + 1, call, op, packed)
        for q, (a, b) in enumerate(bounds):  # every rank's reduced slice out
            if b > a:
                chunk[a:b].copy_(views[q][pb][a:b])


def _wait(area: SlotArea, phase: int, call: Call, op: OpCode, packed: bytearray) -> None:
    """``area.wait``; a peer found running another collective (its plan's
    header in its ring to us) is a mismatch naming both calls."""
    try:
        area.wait(phase, call.mesh.progress, call.what(op), call)
    except ForeignTraffic as e:
        error = _mismatch(call.rank, e.peer, packed, e.raw) or CollectiveMismatchError(
            f"rank {call.rank}: {call.what(op)}: rank {e.peer} runs another collective"
        )
        raise error from None


def _check_headers(area: SlotArea, call: Call, phase: int, packed: bytearray) -> None:
    """Every peer's header of ``phase`` equals ours, byte for byte; else the
    mismatch, naming both calls (every rank compares every header, so every
    rank raises in the call)."""
    for q in range(call.world):
        if q == call.rank:
            continue
        raw = area.header_of(q, phase, HEADER_BYTES)
        if raw != packed:
            error = _mismatch(call.rank, q, packed, bytes(raw))
            if error is not None:
                raise error


def _mismatch(
    rank: int, peer: int, packed: bytearray, raw: bytes
) -> CollectiveMismatchError | None:
    """The error for ``peer``'s header ``raw`` against ours (None: equal after all)."""
    mine = Header.unpack(packed)
    try:
        theirs = Header.unpack(raw)
    except ValueError as e:
        return CollectiveMismatchError(
            f"rank {rank}: garbage from rank {peer} where the header of "
            f"{mine.describe()} was due ({e}); the ranks are out of step"
        )
    if theirs == mine:
        return None
    return CollectiveMismatchError(
        f"rank {rank}: collective mismatch with rank {peer}: this rank called "
        f"{mine.describe()}, rank {peer} called {theirs.describe()}"
    )


def _combine(
    dst: torch.Tensor, parts: list[torch.Tensor], kind: Kind, tree: bool, scratch: ScratchPool
) -> None:
    """``dst`` = the combination of ``parts`` (never written: peers read them):
    left to right in rank order, or in the canonical tree order."""
    if tree:
        _tree_into(dst, parts, kind, scratch, 0)
        return
    combine_into(dst, parts[0], parts[1], kind)
    for p in parts[2:]:
        combine_(dst, p, kind)


def _tree_into(
    dst: torch.Tensor, parts: list[torch.Tensor], kind: Kind, scratch: ScratchPool, depth: int
) -> None:
    """``reduce_ops.tree_reduce_``'s order (split at ``(k + 1) // 2``, left op
    right) without writing ``parts``: right halves go through scratch, one
    buffer per depth."""
    k = len(parts)
    if k == 1:
        dst.copy_(parts[0])
        return
    if k == 2:
        combine_into(dst, parts[0], parts[1], kind)
        return
    m = (k + 1) // 2
    _tree_into(dst, parts[:m], kind, scratch, depth + 1)
    right = scratch.get(_TREE_SCRATCH[depth], dst.numel(), dst.dtype)
    _tree_into(right, parts[m:], kind, scratch, depth + 1)
    combine_(dst, right, kind)


_TREE_SCRATCH = [f"shm_tree{d}" for d in range(64)]

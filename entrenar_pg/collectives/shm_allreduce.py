"""The shm-native allreduce: ranks all on one host reduce straight from each other's slots.

No plan and no byte ring: each rank's input goes once into its own slot
area (``transport/shm/slots.py``), which every peer has mapped, and the
reduction reads the peers' slots in place. Every step is one *phase* of the
slot protocol: write this rank's slot of phase q, publish q, wait until
every peer published q, read the peers' slots of phase q (reads of phase q
end before this rank publishes q + 1, so double-buffered slots suffice).
A wait spins for a multiple of this rank's own work in the phase before it
sleeps (``_spin_for``).

- Small (<= ``small_max_bytes(N)``: 256 KiB for two ranks, 2 MiB for two
  ranks summing with numpy, else 1 MiB), one
  phase: each rank writes its 32-byte wire header and its input into its
  slot, publishes, waits for every peer, compares every peer's header byte
  for byte with its own (so a mismatch raises ``CollectiveMismatchError``
  on every rank, in the call), then combines all N slots into its output,
  in rank order left to right (the canonical tree order when
  ``call.choice.tree``): the operations and operands of ``direct.py``, so
  the bits equal TCP's.
- Large, in chunks of 4 MiB, two phases each, the chunks one after
  another as in DeepSpeed's >= 1 MiB slice algorithm: copy the chunk in
  (all but the slice this rank reduces: it reads that from its input);
  each rank combines its 1/N slice of the chunk across all slots (same
  order) into its other slot; then every rank copies all N reduced slices
  out. Three or more ranks put every chunk at the start of their 4 MiB
  slots and copy the slices out in rank order once all are reduced. Two
  ranks (16 MiB slots) put each chunk at the start of the slots or rotate
  the chunks over the slots' four quarters, rank 0's choice per call from
  the calls' own times, the same on both (``transport/shm/chunk_plan.py``:
  which is faster depends on the machine's state; docs/benchmarks.md), and
  copy their own slice out while the peer finishes its. (With both for
  every world, N=4 read 1.11-1.28x the previous release in 4 of 8 cells:
  only two ranks have them.) The first chunk's headers are compared as
  above. Pipelining the chunks (chunk t's copy-in, chunk
  t - 1's reduction and copy-out in one phase: K + 1 phases for K
  chunks) was measured 10-25% slower here at 4-64 MiB (the reduction then
  reads a chunk copied in a phase earlier, after another chunk went
  through the caches), so the chunks stay in sequence.
  Two ranks slice above 256 KiB, or above 2 MiB when they sum with numpy
  (the reduction halves, but the ranks meet twice; measured in the comments
  of ``PAIR_SMALL_MAX_BYTES`` and ``PAIR_SUM_SMALL_MAX_BYTES``); more ranks on this 2-core machine
  gain nothing from it below 1 MiB.
- Two ranks summing (SUM, AVG, PREMUL_SUM) a dtype numpy adds alike
  (``_NUMPY_SUM``), small or one chunk: the same phases with no torch op.
  The copies are memcpys between memoryviews and the sum is ``np.add`` on
  views made once per shape (``_Pair``, ``_PairCut``); the one phase adds
  the peer's slot into the caller's buffer in place, in rank order (each
  rank still reads the peer's slot of phase q before it publishes q + 1,
  so the double buffering above covers it). From 32 KiB a call's data goes
  to the next of up to 16 places in the slots (``_pair_places``: place i in
  slot i & 1, so consecutive phases still use both slots), not to the
  slot's start: a copy into lines the peer read two calls ago must take
  them back from its core first (0.60-0.82x the time at 32-256 KiB). The caller's buffer
  is viewed through its address (remembered per shape), which is right for
  whatever contiguous tensor of the shape's size lies there. At 4 KiB a
  torch op costs ~0.7-0.9 us of dispatch and these ~0.1-0.3 us; at 1 MiB the
  sliced one-chunk call also drops a ``split`` and runs ~25% less CPU.
  Like gloo's, these writes leave the tensor's autograd version counter as
  it was (torch's ``out=`` ops bump it).

PREMUL_SUM's scale was applied to the input before (``reduce_ops.prepare_``,
by the job), AVG's division is applied once to the result here
(``finish_``), as every algorithm does. Per call on the small path: two
copies of the message per rank (in, and the reduction's output), no
allocation (a ``_Shape`` per dtype, op and size: the slot views and the
header, packed once and restamped), a handful of Python calls, no syscall
when the peers are already there.
"""

from __future__ import annotations

import ctypes
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from ..errors import CollectiveMismatchError
from ..reduce_ops import Kind, Reduction, combine_, combine_into, finish_
from ..transport.shm.slots import PAIR_SLOT_DATA_BYTES, SLOT_DATA_BYTES, ForeignTraffic, SlotArea
from ..wire import HEADER_BYTES, Algo, Header, OpCode, stamp_seq
from .common import Call, ScratchPool, chunk_bounds

if TYPE_CHECKING:
    from ..transport.loop import Pace

# Up to this size every rank reduces the whole message in one phase; above,
# each rank reduces a slice of each chunk (N-fold less reduction work, one
# more phase). Measured (benchmarks/shm_ab.py, docs/benchmarks.md): two ranks
# gain from the slices from 512 KiB on (0.88x at 512 KiB, 0.78x at 1 MiB, and
# 1.04x at 256 KiB); with more ranks than this machine's two cores the second
# phase costs more than the slices save up to 1 MiB, so they keep 1 MiB.
SMALL_MAX_BYTES = 1 << 20
PAIR_SMALL_MAX_BYTES = 1 << 18  # the same, for two ranks
# The same for two ranks summing with numpy (``_Pair``: the one phase adds the
# peer's slot into the caller's buffer in place, their sliced phase B is one
# np.add, no torch op). One phase against sliced, quiet 2-core VM (twenty-third
# session, 2026-11-27, docs/benchmarks.md "Two ranks sum in one phase up to
# 2 MiB"): ``benchmarks/shm_ab.py`` (both in one job) 0.74x at 192 KiB, 0.70x
# at 256 KiB, 0.58-0.60x at 384-512 KiB, 0.55-0.57x at 1 MiB, 0.67-0.70x at
# 1.5-2 MiB, 0.97x at 3 MiB, 1.43x at 4 MiB (0.90-0.94x at 64-128 KiB, where
# both ran the same code: the harness's own lean); ``bench --baseline-tree``
# (``dist.all_reduce``, the two trees' jobs taking turns) 0.68x at 256 KiB,
# 0.62x at 512 KiB and 1 MiB, 0.73x at 2 MiB, 0.99x at 3 MiB. The sliced path
# halves the reduction but meets twice; the add in place streams two arrays,
# not three, and the caller's buffer is warm. (Before the add in place the
# sliced path measured 0.83x of a three-array one phase at 256 KiB; under
# other jobs' heavy memory load it was 1.15-1.24x faster at 64-256 KiB.)
PAIR_SUM_SMALL_MAX_BYTES = 2 << 20
# Where two ranks summing with numpy put a call's data: not the same two
# places (the parities) every call, but a rotation over up to
# ``PAIR_PLACES_MAX`` places, as many as fit in ``PAIR_PLACES_BYTES``
# (``_pair_places``). A rank's copy into a place the peer read two calls ago
# must first take those cache lines back from the peer's core; a place last
# used 16 calls ago has left both cores' private caches. A two-process numpy
# model of the one phase (twenty-third session, docs/benchmarks.md "Two
# ranks' sums rotate over the slots"; in the library 0.60-0.82x the time at
# 32-256 KiB), time by places 2 / 4 / 8 / 16: 64 KiB
# 10-14 / 10-14 / 9.7 / 6.1 us, 128 KiB 21-27 / 17 / 10 / 9-10, 256 KiB
# 28-33 / 19-20 / 14-18 / 15, 512 KiB 30-36 / 28-36 / 37 / 36, 1 MiB 55-57
# / 58-61 / 80 / 130-140 (beyond the caches the rotation only adds misses).
# Below 32 KiB the model gained nothing (16 KiB 3.4-3.6 us at 2 or 16
# places; a two-job A/B read 4 KiB 1.14x rotating, and 1.03x later with the
# same code on both sides): the two places there.
PAIR_PLACES_MAX = 16
PAIR_PLACES_BYTES = 2 << 20
PAIR_PLACES_MIN_BYTES = 32 << 10
# A large message's chunk (``chunk_elems``): a slot of three or more ranks.
# Two ranks' chunks go to the start of the slots, or rotate over ``ROTATE``
# such places in them; rank 0 picks per call from the calls' times
# (``transport/shm/chunk_plan.py``; docs/benchmarks.md, "the two states").
# Larger chunks for two ranks (8 MiB over the slots' halves, or the whole
# 16 MiB slot as DeepSpeed's 32 MiB chunks take a 16 MiB message at once)
# measured 1.15-1.65x this size's time in the near state at 16 and 64 MiB,
# and 0.97x at 16 MiB (1.15x at 64) in the far state (eighteenth session,
# docs/benchmarks.md): 4 MiB kept.
CHUNK_BYTES = 4 << 20
ROTATE = 4
assert CHUNK_BYTES <= SLOT_DATA_BYTES, "a chunk fits in a slot"
assert ROTATE * CHUNK_BYTES <= PAIR_SLOT_DATA_BYTES, "two ranks' rotating chunks fit in a slot"
# A wait spins (``sched_yield``: whoever else needs the core gets it) up to
# this many times this rank's own work in the phase, within the cap, before
# it sleeps (``_spin_for``).
_SPIN_PER_WORK = 8.0
_SPIN_MAX_S = 0.002


@dataclass(slots=True)
class _Shape:
    """What every call of one shape (op, dtype, reduction, size, flags) reuses."""

    packed: bytearray  # this shape's wire header; each call restamps the sequence number
    kind: Kind  # the pairwise combine
    small: bool  # one phase (else chunks)
    slot_views: list[list[torch.Tensor]]  # [parity][rank]: the slot's first elements (small)
    chunk: int  # elements per chunk (large)
    # (chunk length, place) -> its slices (large: a full chunk's and the tail's,
    # at each of the ``ROTATE`` places for two ranks, else at place 0 only)
    cuts: dict[tuple[int, int], _Cut]
    pair: _Pair | None  # two ranks summing a small message: its copies without torch
    pair_cut: _PairCut | None  # two ranks summing a one-chunk message: the same, sliced


def allreduce_shm(
    call: Call, buf: torch.Tensor, red: Reduction, op: OpCode = OpCode.ALLREDUCE
) -> None:
    """Allreduce of the flat CPU tensor ``buf``, in place, through the slot areas."""
    area = call.mesh.slots
    assert area is not None, "internal: the policy chose SHM without slot areas"
    shape = _shape(call, area, op, buf, red)
    if shape.small and shape.pair is not None and buf.is_contiguous():
        allreduce_shm_pair(call, buf, shape, op)
        if red.kind is Kind.AVG:
            finish_(buf, red, call.mesh.world)
        return
    stamp_seq(shape.packed, call.seq)
    if shape.small:
        _small(call, area, buf, shape, op)
    elif shape.pair_cut is not None and buf.is_contiguous():
        _sliced_pair(call, area, buf, shape.pair_cut, shape.packed, op)
    else:
        _chunked(call, area, buf, shape, op)
    if red.kind is Kind.AVG:
        finish_(buf, red, call.mesh.world)


def shm_pair_shape(call: Call, buf: torch.Tensor, red: Reduction) -> PairShape | None:
    """The shape of the SUM allreduce of ``buf`` (flat, contiguous) where two
    ranks add it in one phase with numpy (``_Pair``), else None: the thin
    path (``runtime/thin.py``) then runs each such call with
    ``allreduce_shm_pair``, the same steps and bits as ``allreduce_shm``
    without finding its shape again (AVG is left out: it divides after)."""
    area = call.mesh.slots
    if area is None or red.kind is not Kind.SUM:
        return None
    shape = _shape(call, area, OpCode.ALLREDUCE, buf, red)
    return shape if shape.small and shape.pair is not None else None


def _shape(call: Call, area: SlotArea, op: OpCode, buf: torch.Tensor, red: Reduction) -> _Shape:
    """The cached shape of this call (made at its first call)."""
    key = ("shm", op, buf.dtype, red.kind, buf.numel(), call.choice.flags)
    shape = call.scratch.plan(key)
    if shape is None:
        shape = _new_shape(call, area, op, buf, red)
        call.scratch.keep_plan(key, shape)
    return shape


def _new_shape(call: Call, area: SlotArea, op: OpCode, buf: torch.Tensor, red: Reduction) -> _Shape:
    numel, dtype = buf.numel(), buf.dtype
    packed = bytearray(HEADER_BYTES)
    call.header(op, Algo.SHM, dtype, reduce_op=int(red.kind), numel=numel).pack_into(packed)
    nbytes = numel * dtype.itemsize
    chunk = chunk_elems(dtype)
    pair = _new_pair(area, dtype, nbytes, red.combine_kind) if numel <= chunk else None
    if nbytes <= small_max_bytes(area.world, numpy_sum=pair is not None):
        views = area.views(dtype, numel)  # [rank][parity]
        by_parity = [[views[q][p] for q in range(area.world)] for p in (0, 1)]
        return _Shape(packed, red.combine_kind, True, by_parity, chunk, {}, pair, None)
    lengths = {min(chunk, numel), numel % chunk or chunk}
    places = 1 if area.chunk_plan is None else ROTATE  # two ranks only may rotate
    cuts = {(m, k): _cut(area, dtype, m, k * chunk) for m in lengths for k in range(places)}
    pair_cut = None if pair is None else _new_pair_cut(area, pair, numel)
    return _Shape(packed, red.combine_kind, False, [], chunk, cuts, None, pair_cut)


def small_max_bytes(world: int, numpy_sum: bool = False) -> int:
    """The largest message the one-phase small path takes at ``world`` ranks;
    ``numpy_sum``: two ranks summing a ``_NUMPY_SUM`` dtype (``_Pair``)."""
    if world != 2:
        return SMALL_MAX_BYTES
    return PAIR_SUM_SMALL_MAX_BYTES if numpy_sum else PAIR_SMALL_MAX_BYTES


def chunk_elems(dtype: torch.dtype) -> int:
    """Elements of a large message's full chunk (the last one may be shorter)."""
    return max(1, CHUNK_BYTES // dtype.itemsize)


def _small(call: Call, area: SlotArea, buf: torch.Tensor, shape: _Shape, op: OpCode) -> None:
    began = time.perf_counter()
    phase = area.phase + 1
    parts = shape.slot_views[phase & 1]
    parts[area.rank].copy_(buf)
    _meet(call, area, phase, shape.packed, op, began)
    if len(parts) == 2:  # rank order is the tree order
        combine_into(buf, parts[0], parts[1], shape.kind)
    else:
        _combine(buf, parts, shape.kind, call.choice.tree, call.scratch)


def allreduce_shm_pair(
    call: Call,
    buf: torch.Tensor,
    shape: PairShape,
    op: OpCode = OpCode.ALLREDUCE,
    began: float | None = None,
    pace: Pace | None = None,
) -> None:
    """The one phase of two ranks summing with numpy (``_Pair``): ``_small``'s
    steps, for a shape with a pair and a contiguous ``buf`` of its size (the
    thin path calls it for a ``shm_pair_shape``; AVG's division is the caller's).
    ``began``: ``time.perf_counter()`` just before the call, if the caller has it;
    ``pace``: the wait's pace, if not ``call``'s (the thin path's reads its
    timeout only when a wait comes to sleep)."""
    if began is None:
        began = time.perf_counter()
    pair = shape.pair
    assert pair is not None, "internal: not a pair shape"
    area = pair.area
    packed = shape.packed
    stamp_seq(packed, call.seq)
    phase = area.phase + 1
    own, peer, peer_header = pair.slots[phase & pair.mask]
    raw, mine = pair.host.get(buf.data_ptr()) or _host_views(pair, buf)
    own[:] = raw  # memcpy
    # ``_meet`` for two ranks: one call where the peer is already there
    # (``publish_pair``'s first look and failure check), two where it comes
    # within ``arrived_pair``'s looks, then the header compare; else the rest
    # of ``_meet`` as it is.
    if not area.publish_pair(phase, packed) and not area.arrived_pair(phase):
        _met(call, area, phase, packed, op, began, pace or call)
    elif packed != peer_header:  # bytearray first: a memcmp (``_meet``)
        _check_headers(area, call, phase & 1, packed)
    # The peer's slot added into the caller's buffer in place, in rank
    # order (both ranks get the same bits, NaN payloads too: numpy's
    # loops take them alike whichever operand is the output, from two
    # elements on, ``_new_pair``), ``out`` passed by position: numpy's
    # keyword parsing costs ~0.35 us a call, as much as the 4 KiB add.
    # In place, numpy streams two arrays, not three: ~30% less time than
    # summing the two slots into the buffer from 32 KiB on.
    if pair.first:
        np.add(mine, peer, mine)
    else:
        np.add(peer, mine, mine)


def _meet(
    call: Call, area: SlotArea, phase: int, packed: bytearray, op: OpCode, began: float
) -> None:
    """The one phase's meeting: publish this rank's slot (and header), wait
    for every peer's (spinning for a multiple of the work since ``began``),
    compare every peer's header with ours, and stop if a peer failed."""
    area.publish(phase, packed)
    _met(call, area, phase, packed, op, began, call)


def _met(
    call: Call,
    area: SlotArea,
    phase: int,
    packed: bytearray,
    op: OpCode,
    began: float,
    pace: Pace,
) -> None:
    """``_meet`` after its publish: the wait (at ``pace``), the header compare,
    the failure check."""
    if not area.arrived(phase):
        _wait(area, phase, call, op, packed, _spin_for(began), pace)
    for raw in area.peer_headers[phase & 1]:
        if packed != raw:  # bytearray first: its compare is a memcmp, memoryview's is not
            _check_headers(area, call, phase & 1, packed)
    if area.failed_peer() is not None:
        _raise_failed(area, call, op)


# numpy warns where a float sum overflows or meets inf - inf (a RuntimeWarning
# attributed to this module's ``np.add``); torch's add, gloo's and our torch
# paths stay silent, and the result (inf, NaN) is the same. So its warnings
# from this module are ignored: a filter (re)installed with every pair shape,
# not at import (an import inside ``warnings.catch_warnings``, as pytest's
# collection, would drop it on leaving); ``np.errstate`` per call would cost
# ~1 us, as much as the 64 KiB add. (Non-finite gradients are the checker's
# to report, F-DP-003.)
_QUIET_MODULE = __name__.replace(".", r"\.") + "$"

# Two ranks summing a small message of these dtypes copy it in with a
# memoryview (a memcpy) and sum the two slots with numpy, not torch: each is
# ~0.5 us cheaper per call than a torch op at 4 KiB (no dispatch), and the
# bits are the same (one IEEE-754 addition of two operands per element,
# correctly rounded; integers wrap alike). Not float16/bfloat16 (numpy has no
# bfloat16, and a float16 sum need not round like torch's), nor bool.
_NUMPY_SUM: dict[torch.dtype, type] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
}
_MAX_HOST_VIEWS = 8  # caller buffers remembered per shape (a training loop reuses a few)
_V = TypeVar("_V")  # what a shape remembers of a caller's buffer


PairShape = _Shape  # the thin path's name for a ``shm_pair_shape``


@dataclass(slots=True)
class _Pair:
    """The two-rank SUM small path's views of the slots, and of callers' buffers."""

    area: SlotArea  # the group's (two ranks)
    raw: list[list[memoryview]]  # [parity][rank]: the slot data from its start, as bytes
    # [phase & mask]: this rank's place for the phase's data as bytes, the
    # peer's as an array, and the peer's wire header in its slot (one index
    # per call for the three). Place i is in slot i & 1 (the phase's parity,
    # as the protocol needs; ``SlotArea.place_bytes``), ``_pair_places`` of them.
    slots: list[tuple[memoryview, np.ndarray, memoryview]]
    mask: int = field(init=False)  # len(slots) - 1 (a power of two): one AND per call, no len()
    first: bool  # this rank is rank 0: its input is the sum's left operand
    dtype: type  # numpy's
    nbytes: int
    # A caller buffer's address -> its bytes and its numpy view. Made from the
    # address alone, so right for whatever tensor lies there now: a contiguous
    # buffer of this shape's size at that address is exactly those bytes.
    host: dict[int, tuple[memoryview, np.ndarray]]

    def __post_init__(self) -> None:
        self.mask = len(self.slots) - 1


def _new_pair(area: SlotArea, dtype: torch.dtype, nbytes: int, kind: Kind) -> _Pair | None:
    np_dtype = _NUMPY_SUM.get(dtype)
    # Not one element: numpy adds a one-element array into itself with its
    # reduction's loop, whose NaN takes the other operand's payload (the
    # two ranks, one adding into each operand, would disagree); torch's add
    # (``combine_into``, the same call on both ranks) takes it.
    if area.world != 2 or kind is not Kind.SUM or np_dtype is None or nbytes < 2 * dtype.itemsize:
        return None
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=_QUIET_MODULE)
    r = area.rank
    raw = [[area.data_bytes(q, p, nbytes) for q in (0, 1)] for p in (0, 1)]  # [parity][rank]
    places = _pair_places(nbytes)
    area.populate_places(places, nbytes)  # now, not a page fault per page in each first call
    slots: list[tuple[memoryview, np.ndarray, memoryview]] = [
        (
            area.place_bytes(r, i, nbytes),
            np.frombuffer(area.place_bytes(1 - r, i, nbytes), dtype=np_dtype),
            area.peer_headers[i & 1][0],
        )
        for i in range(places)
    ]
    return _Pair(area, raw, slots, r == 0, np_dtype, nbytes, {})


def _pair_places(nbytes: int) -> int:
    """How many places in the slots a two-rank sum of ``nbytes`` rotates its
    data over: the most, up to ``PAIR_PLACES_MAX``, a power of two, whose
    bytes together stay within ``PAIR_PLACES_BYTES``; at least the two
    parities, and only those below ``PAIR_PLACES_MIN_BYTES``."""
    places = 2
    if nbytes < PAIR_PLACES_MIN_BYTES:
        return places
    while places < PAIR_PLACES_MAX and 2 * places * nbytes <= PAIR_PLACES_BYTES:
        places *= 2
    return places


def _host_views(pair: _Pair, buf: torch.Tensor) -> tuple[memoryview, np.ndarray]:
    """``buf``'s bytes and numpy view, remembered by address (``_Pair.host``)."""
    address = buf.data_ptr()
    raw = memoryview((ctypes.c_char * pair.nbytes).from_address(address)).cast("B")
    array: np.ndarray = np.frombuffer(raw, dtype=pair.dtype)
    return _remember(pair.host, address, (raw, array))


def _remember(cache: dict[int, _V], address: int, views: _V) -> _V:
    """Keep ``views`` of the buffer at ``address`` (at most ``_MAX_HOST_VIEWS``
    buffers: a full cache starts again) and return them."""
    if len(cache) >= _MAX_HOST_VIEWS:
        cache.clear()
    cache[address] = views
    return views


@dataclass(slots=True)
class _PairCut:
    """Two ranks summing a one-chunk message: ``_chunked``'s slices as bytes
    and numpy views (``_Pair``), indexed by phase A's parity."""

    pair: _Pair  # the slot views, and the callers' buffers by address
    mine: tuple[int, int]  # this rank's slice, elements
    theirs: tuple[int, int]  # the peer's slice, elements
    host_first: bool  # this rank is rank 0: its input is the sum's left operand
    send: list[memoryview]  # [p]: this rank's slot p, the peer's slice (copied in)
    peer_in: list[np.ndarray]  # [p]: the peer's slot p, this rank's slice
    reduced: list[np.ndarray]  # [p]: this rank's slot p ^ 1, its slice (the sum)
    own_out: list[memoryview]  # [p]: the same, as bytes
    peer_out: list[memoryview]  # [p]: the peer's slot p ^ 1, its slice (its sum)
    host: dict[int, tuple[memoryview, memoryview, np.ndarray]]  # address -> its slices


def _new_pair_cut(area: SlotArea, pair: _Pair, numel: int) -> _PairCut:
    r, peer = area.rank, 1 - area.rank
    bounds = chunk_bounds(numel, 2)
    (lo, hi), (tlo, thi) = bounds[r], bounds[peer]
    size = pair.nbytes // numel
    arrays: list[list[np.ndarray]] = [
        [np.frombuffer(pair.raw[p][q], dtype=pair.dtype) for q in (0, 1)] for p in (0, 1)
    ]
    return _PairCut(
        pair,
        (lo, hi),
        (tlo, thi),
        r == 0,
        send=[pair.raw[p][r][tlo * size : thi * size] for p in (0, 1)],
        peer_in=[arrays[p][peer][lo:hi] for p in (0, 1)],
        reduced=[arrays[p ^ 1][r][lo:hi] for p in (0, 1)],
        own_out=[pair.raw[p ^ 1][r][lo * size : hi * size] for p in (0, 1)],
        peer_out=[pair.raw[p ^ 1][peer][tlo * size : thi * size] for p in (0, 1)],
        host={},
    )


def _sliced_pair(
    call: Call, area: SlotArea, buf: torch.Tensor, cut: _PairCut, packed: bytearray, op: OpCode
) -> None:
    """``_chunked`` for two ranks summing one chunk, with memcpy and numpy
    (``_NUMPY_SUM``: the same bits) on views made once: no torch op, no split."""
    host = cut.host.get(buf.data_ptr()) or _pair_cut_host(cut, buf)
    mine, theirs, mine_sum = host
    began = time.perf_counter()
    phase = area.phase + 1
    p = phase & 1
    cut.send[p][:] = theirs  # phase A: the peer's slice of this rank's input
    area.publish(phase, packed)
    _await(area, phase, call, op, packed, began)
    for raw in area.peer_headers[p]:  # as in ``_small``: a call only on a difference
        if packed != raw:
            _check_headers(area, call, p, packed)
    began = time.perf_counter()  # phase B: this rank's slice, summed in rank order
    if cut.host_first:
        np.add(mine_sum, cut.peer_in[p], cut.reduced[p])  # out by position (``_small``)
    else:
        np.add(cut.peer_in[p], mine_sum, cut.reduced[p])
    area.publish(phase + 1)
    mine[:] = cut.own_out[p]  # this rank's own sum out while the peer finishes its
    _await(area, phase + 1, call, op, packed, began)
    theirs[:] = cut.peer_out[p]


def _pair_cut_host(cut: _PairCut, buf: torch.Tensor) -> tuple[memoryview, memoryview, np.ndarray]:
    """``buf``'s slices (``_PairCut.host``; made from its address, like ``_Pair.host``)."""
    raw, array = _host_views(cut.pair, buf)
    size = cut.pair.nbytes // buf.numel()
    (lo, hi), (tlo, thi) = cut.mine, cut.theirs
    views = (raw[lo * size : hi * size], raw[tlo * size : thi * size], array[lo:hi])
    return _remember(cut.host, buf.data_ptr(), views)


def _await(
    area: SlotArea, phase: int, call: Call, op: OpCode, packed: bytearray, began: float
) -> None:
    """Every peer published ``phase`` (spinning for a multiple of the work
    since ``began``), and none failed since."""
    if not area.arrived(phase):
        _wait(area, phase, call, op, packed, _spin_for(began))
    if area.failed_peer() is not None:
        _raise_failed(area, call, op)


def _chunked(call: Call, area: SlotArea, buf: torch.Tensor, shape: _Shape, op: OpCode) -> None:
    """The large path (module docstring): per chunk, phase A copies it in
    (but for this rank's slice), phase B reduces this rank's slice into its
    other slot, then every rank's reduced slice is copied out. Two ranks
    place the chunks as rank 0 chose for the call (``chunk_plan.py``), more
    at the slots' start."""
    r = area.rank
    plan = area.chunk_plan  # two ranks only
    # before any publish: rank 0 writes its choice for the next call there
    places = ROTATE if plan is not None and plan.begin() else 1
    numel, step = buf.numel(), shape.chunk
    tree, kind = call.choice.tree, shape.kind
    met = 0.0  # this thread's CPU time when every rank had arrived (the call's own time)
    for start in range(0, numel, step):
        m = min(step, numel - start)
        cut = shape.cuts[m, start // step % places]
        pieces = buf[start : start + m].split(cut.sizes)  # [q]: rank q's slice of the chunk
        # Phase A: the chunk into this rank's slot, but for the slice this
        # rank reduces itself (read from ``buf`` directly: 1/N less copying).
        began = time.perf_counter()
        phase = area.phase + 1
        parity = phase & 1
        for q, dst in enumerate(cut.own_in[parity]):
            if q != r:
                dst.copy_(pieces[q])
        area.publish(phase, shape.packed if start == 0 else None)
        _await(area, phase, call, op, shape.packed, began)
        if start == 0:
            _check_headers(area, call, parity, shape.packed)
            if plan is not None:
                met = time.thread_time()
        # Phase B: this rank's slice, reduced across every slot, into its other slot.
        began = time.perf_counter()
        parts = cut.mine_in[parity].copy()
        parts[r] = pieces[r]
        outs = cut.out[parity ^ 1]
        _combine(outs[r], parts, kind, tree, call.scratch)
        area.publish(phase + 1)
        for q in cut.out_early:  # two ranks: its own sum out while the peer finishes its
            pieces[q].copy_(outs[q])
        _await(area, phase + 1, call, op, shape.packed, began)
        for q in cut.out_late:  # the other reduced slices out (more ranks: all, in rank order)
            pieces[q].copy_(outs[q])
    if plan is not None:
        plan.record(places > 1, numel * buf.element_size(), time.thread_time() - met)


@dataclass(slots=True)
class _Cut:
    """One chunk length's slices of the slot areas (rank q reduces slice q).

    Views made once per shape, so a chunk costs one ``split`` of the
    caller's tensor and the copies and combines themselves."""

    sizes: list[int]  # elements of each rank's slice
    own_in: list[list[torch.Tensor]]  # [parity][q]: this rank's slot, slice q (copied in)
    mine_in: list[list[torch.Tensor]]  # [parity][q]: rank q's slot, this rank's slice
    out: list[list[torch.Tensor]]  # [parity][q]: rank q's slot, slice q (its reduced slice)
    out_early: list[int]  # the ranks whose reduced slices are copied out before the last wait
    out_late: list[int]  # those copied out after it


def _cut(area: SlotArea, dtype: torch.dtype, m: int, at: int) -> _Cut:
    """The slices of an ``m``-element chunk placed ``at`` elements into the
    slots (``chunk_bounds``: the same on every rank)."""
    bounds = chunk_bounds(m, area.world)
    views = area.views(dtype, at + m)  # [q][parity]
    if at:  # from the place on
        views = [[v[at:] for v in rank_views] for rank_views in views]
    r = area.rank
    # Two ranks (the groups with a chunk plan) copy their own slice out before
    # waiting for the peer's (``_chunked``); more ranks copy every slice out
    # after the wait, in rank order (the early copy-out was not shown level at N=4).
    early = [r] if area.chunk_plan is not None else []
    lo, hi = bounds[r]
    return _Cut(
        sizes=[b - a for a, b in bounds],
        own_in=[[views[r][p][a:b] for a, b in bounds] for p in (0, 1)],
        mine_in=[[views[q][p][lo:hi] for q in range(area.world)] for p in (0, 1)],
        out=[[views[q][p][a:b] for q, (a, b) in enumerate(bounds)] for p in (0, 1)],
        out_early=early,
        out_late=[q for q in range(area.world) if q not in early],
    )


def _spin_for(began: float) -> float:
    """How long a wait spins before it sleeps: the peers do this phase's work
    too, so a few times as long as it took here (at least the loop's
    ``spin_s``). A sleeper wakes late (a wake-up byte, the scheduler, an
    idle core's exit) and makes its peers wait for it in the next phase."""
    return min(_SPIN_PER_WORK * (time.perf_counter() - began), _SPIN_MAX_S)


def _wait(
    area: SlotArea,
    phase: int,
    call: Call,
    op: OpCode,
    packed: bytearray,
    spin_s: float = 0.0,
    pace: Pace | None = None,
) -> None:
    """``area.wait`` (at ``pace``, else ``call``'s); a peer found running
    another collective (its plan's header in its ring to us) is a mismatch
    naming both calls."""
    try:
        area.wait(phase, call.mesh.progress, call.what(op), pace or call, spin_s)
    except ForeignTraffic as e:
        error = _mismatch(call.rank, e.peer, packed, e.raw) or CollectiveMismatchError(
            f"rank {call.rank}: {call.what(op)}: rank {e.peer} runs another collective"
        )
        raise error from None


def _raise_failed(area: SlotArea, call: Call, op: OpCode) -> None:
    """A peer's group failed after it published its part of this call: the
    call did not complete on every rank (``SlotArea.failed_peer``)."""
    peer = area.failed_peer()
    assert peer is not None
    raise call.mesh.progress.causes.peer_closed(peer, call.what(op))


def _check_headers(area: SlotArea, call: Call, parity: int, packed: bytearray) -> None:
    """Every peer's header in slot ``parity`` equals ours, byte for byte; else
    the mismatch, naming both calls (every rank compares every header, so
    every rank raises in the call)."""
    peers = [q for q in range(area.world) if q != area.rank]
    for q, raw in zip(peers, area.peer_headers[parity], strict=True):
        if raw != packed:
            error = _mismatch(area.rank, q, packed, bytes(raw))
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

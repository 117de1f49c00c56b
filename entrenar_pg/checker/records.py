"""A call's record: what one rank measured of its slots, as a list of int64.

Every rank builds one record per checked collective (``begin`` before the
job, ``finish`` after it) and the records are exchanged later, in batches
(checker/checker.py); checker/verdict.py judges them. Floats travel as the
int64 with the same bits. Layout: ``FIXED`` header fields, then per slot
``REDUCED_WIDTH`` (reducing contracts) or ``COPIED_WIDTH`` (copying ones)
fields; the first field is the record's length, so records of different
kinds can be concatenated.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch

from ..reduce_ops import FLOAT_DTYPES, INT_DTYPES, Kind
from ..wire import DTYPE_CODE, OpCode
from .hashing import digest, hasher, to_i64
from .kinds import Contract, Rule, Views
from .projection import PROJECTIONS, Projection, tensor_weight, variant_of

# Header fields.
(LEN, SEQ, OPCODE, FLAGS, DTYPE, KIND, FACTOR, BAD, NUMEL, BUCKET, STEP, DIGEST) = range(12)
FIXED = 12
# Per slot of a reducing contract: the input's projections and norm, the
# output's projections (this rank's share of them) and whether this rank holds
# the slot's output.
S_IN, NORM, S_OUT, HAS_OUT = 0, PROJECTIONS, PROJECTIONS + 1, 2 * PROJECTIONS + 1
REDUCED_WIDTH = 2 * PROJECTIONS + 2
# Per slot of a copying contract: whether this rank sent it and its hash;
# whether this rank received slot p (from rank p) and its hash.
HAS_IN, IN_HASH, HAS_RECV, RECV_HASH = range(4)
COPIED_WIDTH = 4

# FLAGS bits
IN_NONFINITE = 1
OUT_NONFINITE = 2
PROJECTED = 4

LINEAR = (Kind.SUM, Kind.AVG, Kind.PREMUL_SUM)
_MASK64 = (1 << 64) - 1


def f2i(x: float) -> int:
    """A float64 as the int64 with the same bits."""
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def i2f(i: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", i))[0])


_SLOT_INTS = struct.Struct(f"<{REDUCED_WIDTH - 1}q")
_SLOT_FLOATS = struct.Struct(f"<{REDUCED_WIDTH - 1}d")
# An input's fields (S_IN.., NORM: adjacent) and an output's (S_OUT..), each
# written as int64 in one conversion (``f2i`` of each).
_IN_INTS = struct.Struct(f"<{PROJECTIONS + 1}q")
_IN_FLOATS = struct.Struct(f"<{PROJECTIONS + 1}d")
_OUT_INTS = struct.Struct(f"<{PROJECTIONS}q")
_OUT_FLOATS = struct.Struct(f"<{PROJECTIONS}d")


def slot_floats(rec: Sequence[int], at: int) -> tuple[float, ...]:
    """A reduced slot's float fields (S_IN.., NORM, S_OUT..) at ``rec[at:]`` as floats,
    in one conversion (``i2f`` of each)."""
    return _SLOT_FLOATS.unpack(_SLOT_INTS.pack(*rec[at : at + REDUCED_WIDTH - 1]))


def width(contract: Contract) -> int:
    return REDUCED_WIDTH if contract.rule is Rule.REDUCED else COPIED_WIDTH


def slot_at(contract: Contract, s: int) -> int:
    """Index of slot ``s``'s first field in a record."""
    return FIXED + s * width(contract)


def _dtype(views: Views) -> torch.dtype | None:
    for slots in (views.inputs, views.outputs):
        for tensors in slots.values():
            for t in tensors:
                return t.dtype
    return None


def _finite(values: Sequence[float]) -> bool:
    # A loop, not all() over a generator: a frame per value, in every checked call.
    for v in values:
        if not math.isfinite(v):
            return False
    return True


def begin(
    proj: Projection,
    contract: Contract,
    views: Views,
    op: OpCode,
    seq: int,
    world: int,
    bucket: int,
    step: int,
) -> list[int]:
    """The record's header and everything measured of the inputs (before the job)."""
    slots = contract.slots(world)
    rec = [0] * (FIXED + slots * width(contract))
    rec[LEN], rec[SEQ], rec[OPCODE] = len(rec), seq, int(op)
    rec[BUCKET], rec[STEP], rec[BAD] = bucket, step, -1
    dtype = _dtype(views)
    rec[DTYPE] = DTYPE_CODE.get(dtype, 0) if dtype is not None else 0
    numel = 0
    for ts in views.inputs.values():  # (a loop: no generator frame per tensor)
        for t in ts:
            numel += t.numel()
    rec[NUMEL] = numel
    if contract.rule is Rule.COPIED:
        for key, tensors in views.inputs.items():
            at = slot_at(contract, key)
            rec[at + HAS_IN], rec[at + IN_HASH] = 1, digest(tensors)
    elif contract.rule is Rule.REDUCED and views.red is not None and dtype is not None:
        red = views.red
        rec[KIND] = int(red.kind)
        rec[FACTOR] = f2i(float(red.factor)) if red.kind is Kind.PREMUL_SUM else 0
        if dtype in FLOAT_DTYPES:
            _float_inputs(proj, contract, views, rec, linear=red.kind in LINEAR)
        elif dtype in INT_DTYPES and red.kind is Kind.SUM:
            # (Integer AVG truncates, so its output's checksum is not linear in
            # the inputs; the identical-output hash still covers allreduce.)
            rec[FLAGS] |= PROJECTED
            for s, tensors in views.inputs.items():
                at = slot_at(contract, s) + S_IN
                for j, t in enumerate(tensors):
                    w = tensor_weight(j)[1]
                    for k, v in enumerate(proj.ints(t, variant=variant_of(step, bucket))):
                        rec[at + k] = to_i64((rec[at + k] + w * v) & _MASK64)
    return rec


def _float_inputs(
    proj: Projection, contract: Contract, views: Views, rec: list[int], *, linear: bool
) -> None:
    """Projections and norms of float input slots; the first non-finite element, if any.

    The norm is non-finite iff an element is (or the float32 sum overflowed):
    F-DP-003 costs nothing beyond it. Non-linear ops need only that part.
    """
    part = (0, 1) if linear else (0, 0)
    variant = variant_of(rec[STEP], rec[BUCKET])
    offset = 0
    for s, tensors in views.inputs.items():
        at = slot_at(contract, s)
        sums, norm2 = [0.0] * PROJECTIONS, 0.0
        for j, t in enumerate(tensors):
            got, nrm = proj.floats(t, part=part, variant=variant)
            if not (_finite(got) and math.isfinite(nrm)):
                nonfinite = (~torch.isfinite(t)).nonzero()
                if nonfinite.numel():
                    if rec[BAD] < 0:
                        rec[FLAGS] |= IN_NONFINITE
                        rec[BAD] = offset + int(nonfinite[0].item())
                    got, nrm = [0.0] * PROJECTIONS, 0.0
                else:  # finite but overflowed float32: redo wide
                    got, nrm = proj.floats(t, wide=True, part=part, variant=variant)
            w = tensor_weight(j)[0]
            for k in range(PROJECTIONS):
                sums[k] += w * got[k]
            norm2 += (w * nrm) ** 2
            offset += t.numel()
        end = at + NORM + 1  # S_IN.. and NORM
        rec[at + S_IN : end] = _IN_INTS.unpack(_IN_FLOATS.pack(*sums, math.sqrt(norm2)))
    if linear and not rec[FLAGS] & IN_NONFINITE:
        rec[FLAGS] |= PROJECTED


def finish(
    proj: Projection, contract: Contract, views: Views, rec: list[int], rank: int, world: int
) -> None:
    """Everything measured of the outputs (after the job)."""
    if contract.rule is Rule.COPIED:
        for sender, tensors in views.outputs.items():
            at = slot_at(contract, sender)
            rec[at + HAS_RECV], rec[at + RECV_HASH] = 1, digest(tensors)
        return
    if contract.rule is not Rule.REDUCED:
        return
    # A replicated output is projected in 1/N shares, one per rank: they add up
    # to the projection of the output once the digests prove the outputs identical.
    part = (rank, world) if contract.replicated else (0, 1)
    variant = variant_of(rec[STEP], rec[BUCKET])
    is_float = CODE_IS_FLOAT.get(rec[DTYPE], False)
    projected = bool(rec[FLAGS] & PROJECTED)
    # A replicated float output is hashed in the projection's pass (one read);
    # otherwise on its own. The same digest either way (the hash streams).
    h = hasher() if contract.replicated and is_float and projected else None
    if contract.replicated and h is None:
        rec[DIGEST] = digest(t for ts in views.outputs.values() for t in ts)
    for s, tensors in views.outputs.items():
        at = slot_at(contract, s)
        rec[at + HAS_OUT] = 1
        if not projected:
            continue
        if is_float:
            sums = [0.0] * PROJECTIONS
            for j, t in enumerate(tensors):
                got, _ = proj.floats(t, norm=False, part=part, variant=variant, hasher=h)
                w = tensor_weight(j)[0]
                for k in range(PROJECTIONS):
                    sums[k] += w * got[k]
            if not _finite(sums):
                rec[FLAGS] |= OUT_NONFINITE
            rec[at + S_OUT : at + S_OUT + PROJECTIONS] = _OUT_INTS.unpack(_OUT_FLOATS.pack(*sums))
        else:
            for j, t in enumerate(tensors):
                w = tensor_weight(j)[1]
                for k, v in enumerate(proj.ints(t, part=part, variant=variant)):
                    rec[at + S_OUT + k] = to_i64((rec[at + S_OUT + k] + w * v) & _MASK64)
    if h is not None:
        rec[DIGEST] = to_i64(h.intdigest())


CODE_IS_FLOAT = {code: dt in FLOAT_DTYPES for dt, code in DTYPE_CODE.items()}

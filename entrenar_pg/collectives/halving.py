"""Recursive halving in the shape of the canonical tree: the deterministic
reduce-scatter on ceil(log2 N) partners.

The direct exchange (tree.py, ``exchange``) reaches the canonical order in one
hop, but every rank sends a chunk to every other: a socket to each of N - 1
peers. Recursive halving reaches it in ceil(log2 N) hops with one partner per
level, and the same bytes on the wire.

The levels follow the canonical tree (``reduce_ops.tree_reduce_``: a range of
n contributions splits at m = (n + 1) // 2), bottom up, as recursive doubling
does (doubling.py), but a range's sum is spread over its ranks instead of held
whole by each. Ownership goes top down: in the whole group rank c owns chunk
c; in a range split into a left half L (m ranks) and a right half R (n - m),
the owner o of a chunk in the range keeps it in its own half, and in the
other half it belongs to o's partner there: left position j and right
position j are partners, and the left half's extra rank (n odd) takes the
right half's last as its partner in R (as in doubling). A rank of a one-rank
range owns every chunk (its input). So at every range the ranks' chunk sets
partition all N chunks, and a rank's set shrinks (by about half) at each level
up.

At the level of a range, every rank holds its half's sum (``tree(L)`` or
``tree(R)``) of the chunks it owns in its half (by induction); a chunk it also
owns in the range it receives from its partner, who holds the other half's sum
of it, and combines them, L's operand first; a chunk owned in the range by its
partner (or, for the right half's last rank, by the extra rank too) it sends
there and never touches again. After the top level rank c holds
``tree(x0 .. xN-1)`` of chunk c, computed by the same operations on the same
operands as ``tree_reduce_``: the canonical tree's bits at any N.

Per rank: one partner per level (the right half's last rank: two), all
distinct: ceil(log2 N) for a power of two, at most 2 ceil(log2 N) sockets
(doubling's bound). Bytes: every chunk a rank does not
own leaves it once, after its last combine there, (N - 1) x chunk out in all,
the ring's and the direct exchange's. In: the chunks it keeps at each level,
about (N - 1) x chunk for a power of two (the extra ranks' partner, more).
Hops: ceil(log2 N). Each chunk moves in segments: a segment goes up a level as
soon as it is combined at the one below, so the levels overlap like the
ring's steps. Scratch: one slot per segment a rank receives (about
(N - 1)/N x nbytes; the direct exchange's was 2 x CREDIT segments per peer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..reduce_ops import Reduction, combine_into, finish_
from ..transport import Plan
from ..wire import Header
from .common import Call, bytes_of, is_set, segments


@dataclass(frozen=True, slots=True)
class Level:
    """One level of the halving as one rank runs it (positions in the team)."""

    source: int  # the partner whose half's sums of ``keeps`` arrive here
    left: bool  # this rank's half is the left operand
    keeps: tuple[int, ...]  # the chunks this rank owns in the range: received and combined
    sends: tuple[tuple[int, tuple[int, ...]], ...]  # (partner, the chunks it owns in the range)


def levels(world: int, rank: int) -> list[Level]:
    """``rank``'s levels of the halving over ``world`` ranks, deepest first."""
    owner = list(range(world))  # chunk -> its owner in the current range
    out = []
    lo, n = 0, world
    while n > 1:
        m = (n + 1) // 2
        right = n - m  # m or m - 1
        low, high = list(owner), list(owner)  # owners in the left and in the right half
        for c, o in enumerate(owner):
            if o < lo + m:
                high[c] = lo + m + min(o - lo, right - 1)
            else:
                low[c] = o - m
        if rank < lo + m:
            j = rank - lo
            source, left = lo + m + min(j, right - 1), True
            to = [lo + m + j] if j < right else []  # the extra rank sends nothing
            below, n = low, m
        else:
            j = rank - lo - m
            source, left = lo + j, False
            to = [lo + j] + ([lo + m - 1] if right < m and j == right - 1 else [])
            below, lo, n = high, lo + m, right
        sends = tuple((p, _owned_by(owner, p)) for p in to)
        out.append(Level(source, left, _owned_by(owner, rank), sends))
        owner = below
    out.reverse()
    return out


def _owned_by(owner: list[int], rank: int) -> tuple[int, ...]:
    return tuple(c for c, o in enumerate(owner) if o == rank)


def partners(world: int, rank: int) -> set[int]:
    """The positions ``rank`` exchanges data with in the halving (its sockets, beside
    whatever else its plan adds)."""
    return {p for lv in levels(world, rank) for p in (lv.source, *(q for q, _ in lv.sends))}


@dataclass(slots=True)
class _Segments:
    """Every segment of every chunk this rank handles, as the plan runs.

    Segment i (an index over all chunks' segments, chunk by chunk) is combined
    at each level that keeps its chunk, in level order (its data may arrive
    before the level below is done: the partner was ahead), then ``finished``:
    ready to send up, or, in this rank's own chunk (segments ``own`` on),
    reduced, ``Reduction.finish_`` applied, and its flag in ``reduced`` set.
    """

    mine: list[torch.Tensor]  # segment i of this rank's buffer
    slots: list[list[torch.Tensor]]  # segment i's receive slot at each level that keeps it
    left: list[bool]  # per level: this rank's half is the left operand
    own: int  # the index of the own chunk's first segment
    red: Reduction
    world: int
    reduced: list[bool]  # per segment of the own chunk
    arrived: list[list[bool]] = field(init=False)
    done: list[int] = field(init=False)  # levels combined, per segment
    finished: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.arrived = [[False] * len(s) for s in self.slots]
        self.done = [0] * len(self.slots)
        self.finished = [not s for s in self.slots]

    def received(self, i: int, level: int) -> None:
        self.arrived[i][level] = True
        k, slots, kind = self.done[i], self.slots[i], self.red.combine_kind
        mine = self.mine[i]
        while k < len(slots) and self.arrived[i][k]:
            if self.left[k]:
                combine_into(mine, mine, slots[k], kind)
            else:
                combine_into(mine, slots[k], mine, kind)
            k += 1
        self.done[i] = k
        if k == len(slots):
            if self.own <= i < self.own + len(self.reduced):
                finish_(mine, self.red, self.world)
                self.reduced[i - self.own] = True
            self.finished[i] = True


@dataclass(frozen=True, slots=True)
class _Arrived:
    """A receive's callback: segment ``i``'s data for level ``level`` is in."""

    state: _Segments
    i: int
    level: int

    def __call__(self) -> None:
        self.state.received(self.i, self.level)


def halve(
    call: Call, plan: Plan, chunks: Sequence[torch.Tensor], red: Reduction, header: Header
) -> list[bool]:
    """Add the halving reduce-scatter of ``chunks`` (N contiguous 1-D tensors of one
    dtype; afterwards ``chunks[rank]`` holds its reduced chunk) to ``plan``, opening
    its partners' links with ``header``; N >= 2.

    Returns the per-segment "reduced" flags of ``chunks[rank]`` (set as the plan
    runs), for a later phase to wait on.
    """
    n, r = call.world, call.rank
    dtype = chunks[r].dtype
    for chunk in chunks:
        if chunk.dtype != dtype:
            raise ValueError(f"rank {r}: reduce-scatter chunks of different dtypes")
    seg_elems = call.segment_elems(dtype)
    size = chunks[r].element_size()
    steps = levels(n, r)
    kept = [0] * n  # levels that keep each chunk (a prefix of the levels: the sets nest)
    for lv in steps:
        for c in lv.keeps:
            kept[c] += 1
    room = sum(chunks[c].numel() * kept[c] for c in range(n))
    scratch = call.scratch.get("halving", room, dtype)
    scratch_raw = bytes_of(scratch)
    # Per segment: its bytes in the buffer, and its slot's bytes at each level keeping it.
    first = [0] * (n + 1)  # index of each chunk's first segment
    mine: list[torch.Tensor] = []
    mine_raw: list[memoryview] = []
    slots: list[list[torch.Tensor]] = []
    slots_raw: list[list[memoryview]] = []
    at = 0
    for c in range(n):
        raw = bytes_of(chunks[c])
        for a, b in segments(0, chunks[c].numel(), seg_elems):
            mine.append(chunks[c][a:b])
            mine_raw.append(raw[a * size : b * size])
            ends = [(at + k * (b - a), at + (k + 1) * (b - a)) for k in range(kept[c])]
            slots.append([scratch[x:y] for x, y in ends])
            slots_raw.append([scratch_raw[x * size : y * size] for x, y in ends])
            at += kept[c] * (b - a)
        first[c + 1] = len(mine)
    reduced = [False] * (first[r + 1] - first[r])
    state = _Segments(mine, slots, [lv.left for lv in steps], first[r], red, n, reduced)
    sent = {p for lv in steps for p, _ in lv.sends}
    heard = {lv.source for lv in steps}
    for p in sorted(sent | heard):
        plan.open(p, header, send=p in sent, recv=p in heard)
    for k, lv in enumerate(steps):
        for p, owned in lv.sends:
            for c in owned:
                for i in range(first[c], first[c + 1]):
                    ready = is_set(state.finished, i) if kept[c] else None
                    plan.send(p, mine_raw[i], ready)
        for c in lv.keeps:
            for i in range(first[c], first[c + 1]):
                plan.recv(lv.source, slots_raw[i][k], _Arrived(state, i, k), chain=True)
    return reduced

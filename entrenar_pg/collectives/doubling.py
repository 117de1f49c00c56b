"""Recursive doubling in the shape of the canonical tree: log2 N partners per rank, tree bits.

The star (star.py) makes rank 0 talk to all N - 1 ranks: N - 1 sockets and
2(N - 1) frames handled one after the other at one rank, and (N - 1) x S
through its link. Recursive doubling bounds both: each rank exchanges its
partial sum with one partner per round, ceil(log2 N) rounds, and every rank
ends with the whole sum, with no root.

The rounds follow the canonical tree (``reduce_ops.tree_reduce_``: a range
of n contributions splits at m = (n + 1) // 2), bottom up. At the level of
a range [lo, lo + n) every rank of it already holds the sum of its own half
(by induction: every rank of a half holds the same bits), and:

- left position j pairs with right position j (both send their half's sum
  and combine left + right, the left half's operand first);
- n odd: the left half has one rank more; the right half's last rank also
  sends its sum to the left half's last rank, which only receives.

So after the top level every rank holds ``tree(x0 .. xN-1)`` computed by the
same operations on the same operands: the canonical tree's bits at any N,
deterministic mode or not (``choice.tree`` changes nothing here), and the
same bits as the star, direct and tree-ring algorithms in deterministic
mode. For N a power of two the pairs are the classic ones (position i with
i XOR 2^k), with no extra sends.

Per rank: ceil(log2 N) rounds at most (a leaf of the tree at depth d takes
d), one receive per round, one send (two for a range's extra sender),
partners all distinct: at most 2 ceil(log2 N) links, ceil(log2 N) x S each
way. Latency: ceil(log2 N) hops, each S plus a combine.

One plan: a round's send waits for the previous round's combine
(``ready``); a round's data may arrive before that combine is done (the
partner was ahead), so combines run in round order (``_Rounds.advance``).
Each round's value lives in its own scratch slot, so a send still in the
kernel is never overwritten. The data reaching a rank has crossed every
rank, each receive checking its sender's header first, so a rank that
completes has seen every rank's call agree (the star's argument).
``neighbours``: also exchange headers with the ring neighbours, so a rank
running another plan for the same call (the star, on a rank whose
thresholds differ) meets this one on a link instead of waiting for the
timeout (the flat row; a team inside a host-aware plan has its own meeting
point, the host's links).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..reduce_ops import Kind, Reduction, combine_into, finish_
from ..transport import Plan
from ..wire import Algo, OpCode
from .common import PLAN_CACHE_MAX_BYTES, Call, bytes_of, is_set


@dataclass(frozen=True, slots=True)
class Round:
    """One level of the canonical tree as one rank runs it (positions in the team)."""

    sends: tuple[int, ...]  # who gets this rank's value before the level (0, 1 or 2 ranks)
    source: int  # who sends this rank the other half's value
    left: bool  # this rank's half is the left operand


def rounds(world: int, rank: int) -> list[Round]:
    """``rank``'s rounds of the canonical-tree doubling over ``world`` ranks, deepest first."""
    out = []
    lo, n = 0, world
    while n > 1:
        m = (n + 1) // 2
        right = n - m  # m or m - 1
        if rank < lo + m:
            j = rank - lo
            if j < right:
                out.append(Round((lo + m + j,), lo + m + j, True))
            else:  # the left half's extra rank: only receives, from the right half's last
                out.append(Round((), lo + m + right - 1, True))
            n = m
        else:
            j = rank - lo - m
            extra = (lo + m - 1,) if right < m and j == right - 1 else ()
            out.append(Round((lo + j, *extra), lo + j, False))
            lo, n = lo + m, right
    out.reverse()
    return out


def partners(world: int, rank: int) -> set[int]:
    """The positions ``rank`` exchanges data with (its sockets, beside the ring neighbours')."""
    return {p for r in rounds(world, rank) for p in (*r.sends, r.source)}


@dataclass(slots=True)
class _Rounds:
    """A rank's round values as the plan runs: round k's value is ``slots[k]``
    (``mine`` before the first), combined in round order as data arrives."""

    mine: torch.Tensor
    slots: list[torch.Tensor]
    left: list[bool]
    kind: Kind
    arrived: list[bool] = field(init=False)
    done: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.arrived = [False] * len(self.slots)
        self.done = [False] * len(self.slots)

    def reset(self) -> None:
        """Ready for the next call of a cached plan (the same lists: its sends wait on them)."""
        for k in range(len(self.slots)):
            self.arrived[k] = self.done[k] = False

    def value(self, k: int) -> torch.Tensor:
        """The value this rank holds before round ``k`` (what it sends in round k)."""
        return self.mine if k == 0 else self.slots[k - 1]

    def received(self, k: int) -> None:
        self.arrived[k] = True
        self.advance()

    def advance(self) -> None:
        """Combine every round whose data is in and whose previous round is combined."""
        k = sum(self.done)
        while k < len(self.slots) and self.arrived[k]:
            ours, theirs = self.value(k), self.slots[k]
            if self.left[k]:
                combine_into(theirs, ours, theirs, self.kind)
            else:
                combine_into(theirs, theirs, ours, self.kind)
            self.done[k] = True
            k += 1


def allreduce_doubling(
    call: Call,
    buf: torch.Tensor,
    red: Reduction,
    op: OpCode = OpCode.ALLREDUCE,
    *,
    neighbours: bool = True,
) -> None:
    """Allreduce of the flat CPU tensor ``buf`` by recursive doubling in the
    canonical tree's shape, in place (see the module docstring).

    Bytes per rank: up to ceil(log2 N) x nbytes each way (one round's extra
    sender: one more). Scratch: ceil(log2 N) x nbytes. An empty ``buf``
    moves a one-byte token per round, so the rounds still chain.
    """
    n = call.world
    if n == 1:
        finish_(buf, red, 1)
        return
    # Small messages are dominated by building the plan: keep it per buffer
    # (address, shape) and everything its header says, as the direct exchange does.
    numel = buf.numel()
    key = ("doubling", op, buf.data_ptr(), numel, buf.dtype, n, red.kind, call.team, neighbours)
    cacheable = 0 < numel * buf.element_size() <= PLAN_CACHE_MAX_BYTES
    cached = call.scratch.plan(key) if cacheable else None
    if cached is not None:
        plan, state = cached
        plan.restamp(call.seq)
        state.reset()
        state.mine = buf  # the same memory (the key); the caller's tensor of this call
    else:
        plan, state = _build(call, buf, red, op, neighbours)
        if cacheable:
            call.scratch.keep_plan(key, (plan, state))
    call.mesh.run(plan, call.what(op), call)
    if numel:
        buf.copy_(state.slots[-1])
    finish_(buf, red, n)


def _build(
    call: Call, buf: torch.Tensor, red: Reduction, op: OpCode, neighbours: bool
) -> tuple[Plan, _Rounds]:
    """The plan of ``allreduce_doubling`` and the round values it fills."""
    n, r = call.world, call.rank
    header = call.header(op, Algo.DOUBLING, buf.dtype, reduce_op=int(red.kind), numel=buf.numel())
    mine, kind = buf, red.combine_kind
    if not buf.numel():
        mine, kind = torch.zeros(1, dtype=torch.uint8), Kind.MAX
    steps = rounds(n, r)
    scratch = call.scratch.get("doubling", len(steps) * mine.numel(), mine.dtype)
    slots = [scratch[k * mine.numel() : (k + 1) * mine.numel()] for k in range(len(steps))]
    state = _Rounds(mine, slots, [s.left for s in steps], kind)
    plan = call.plan()
    sent = {p for s in steps for p in s.sends}
    heard = {s.source for s in steps}
    for p in sorted(sent | heard):
        plan.open(p, header, send=p in sent, recv=p in heard)
    for k, step in enumerate(steps):
        out = bytes_of(state.value(k))
        for p in step.sends:
            plan.send(p, out, is_set(state.done, k - 1) if k else None)
        plan.recv(step.source, bytes_of(slots[k]), _Received(state, k))
    if neighbours:
        plan.confirm_neighbours(n, header)
    return plan, state


@dataclass(frozen=True, slots=True)
class _Received:
    """A round's receive callback: its data is in (``_Rounds.received``)."""

    state: _Rounds
    k: int

    def __call__(self) -> None:
        self.state.received(self.k)

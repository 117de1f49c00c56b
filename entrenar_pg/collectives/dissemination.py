"""Dissemination: the barrier, and small broadcasts carried along its binomial tree.

The dissemination barrier (Hensgen, Finkel and Manber, 1988; gloo's and
MPICH's barrier): R = ceil(log2 N) rounds; in round k rank r sends to r + d_k
and receives from r - d_k (mod N), d_k = 2^(R - 1 - k) (the longest step
first: the order does not change who hears from whom, every distance 0..N-1
being a sum of some of the steps), and sends round k's message only once it
has received every earlier round's. After the last round every rank has
heard, directly or forwarded, from every other since they entered the call.
Any N; a rank talks to 2 x ceil(log2 N) peers (the star's root talks to
N - 1), and every rank does the same work (the star's root handles 2(N - 1)
frames, a leaf 2). Hops: ceil(log2 N) (the star: 2).

A broadcast rides on the same links: counting ranks from the root (v = (r -
root) mod N), after round k the ranks v that are multiples of d_k hold the
data, so in round k rank v, a multiple of 2 d_k, sends the data to v + d_k
(when that is a rank): a binomial tree (gloo's broadcast's), (N - 1) x S on
the wire in all, at most ceil(log2 N) x S from any rank, ceil(log2 N) hops.
The long steps come first, so on hosts of consecutive ranks (a power of two
per host, the root a host's first) the data crosses to each other host once,
at the top of the tree, and the short steps stay inside a host. The other
links carry only the round's token. For small messages the header
confirmation with every peer that the direct broadcast pays
(``Plan.confirm_peers``: 2(N - 1) frames per rank, a socket to every peer)
costs more than the extra hops.

The header rule (docs/architecture.md) holds through the rounds: every link
opens with the call's header, and a round's message leaves only after every
earlier round's message arrived, each behind its header, which was checked
first. So a rank completes only after every rank's header was compared with
its predecessor's along a chain from that rank. The last round (d = 1, r ->
r + 1) is the ring neighbours' exchange that makes two different plans meet.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ..transport import Plan
from ..wire import Algo, Header, OpCode
from .common import Call, bytes_of, setter

_TOKEN = memoryview(b"\x01")  # a round's message where no data goes (contents unused)


def rounds_of(world: int) -> int:
    """ceil(log2 world): the rounds after which every rank has heard from every other."""
    return (world - 1).bit_length()


def step(round_: int, world: int) -> int:
    """Round ``round_``'s distance d: 2^(R - 1 - round_), the longest first."""
    return 1 << (rounds_of(world) - 1 - round_)


def partners(rank: int, world: int) -> list[tuple[int, int]]:
    """Per round: (the rank ``rank`` sends to, the rank it receives from)."""
    steps = [step(k, world) for k in range(rounds_of(world))]
    return [((rank + d) % world, (rank - d) % world) for d in steps]


def carries_data(sender: int, round_: int, world: int) -> bool:
    """Whether the broadcast's round ``round_`` link from ``sender`` (counted
    from the root) carries the data: the sender has it (a multiple of 2d) and
    the receiver ``sender + d`` is a rank (not wrapped round)."""
    d = step(round_, world)
    return sender % (2 * d) == 0 and sender + d < world


@dataclass(slots=True)
class Heard:
    """Which rounds' messages this rank has received (a round's message is its
    link's last piece, so the data before it, and the header, are in)."""

    rounds: list[bool]

    def clear(self) -> None:
        """Before a cached plan's next run: no round heard."""
        for k in range(len(self.rounds)):
            self.rounds[k] = False

    def through(self, round_: int) -> bool:
        """A send's ``ready`` for round ``round_``: every earlier round heard."""
        return all(self.rounds[:round_])


def disseminate(call: Call, op: OpCode, buf: torch.Tensor | None = None, root: int = 0) -> None:
    """Run the dissemination pattern for ``op``; with ``buf``, broadcast the
    root's flat CPU tensor ``buf`` into every rank's ``buf`` along it.

    The plan is kept per buffer, root and team (a barrier's and a small
    broadcast's time is mostly the Python that builds and runs it), so a
    repeat only restamps the sequence number and clears the rounds heard.
    """
    n = call.world
    if buf is None:
        key: tuple[object, ...] = (op, n, call.team)
    else:
        key = (op, buf.data_ptr(), buf.numel(), buf.dtype, n, root, call.team)
    cached = call.scratch.plan(key)
    if cached is None:
        cached = _plan(call, op, buf, root)
        call.scratch.keep_plan(key, cached)
    else:
        cached.plan.restamp(call.seq)
        cached.heard.clear()
    call.mesh.run(cached.plan, call.what(op), call)


@dataclass(slots=True)
class Rounds:
    """A dissemination plan, with what its gates and receives point into."""

    plan: Plan
    heard: Heard
    tokens: torch.Tensor  # each round's received token lands here


def _plan(call: Call, op: OpCode, buf: torch.Tensor | None, root: int) -> Rounds:
    header = call.header(
        op,
        Algo.DISSEMINATION,
        None if buf is None else buf.dtype,
        numel=0 if buf is None else buf.numel(),
        aux=root,
    )
    plan = call.plan()
    tokens = torch.empty(max(rounds_of(call.world), 1), dtype=torch.uint8)
    heard = _add_rounds(call, plan, header, tokens, buf, root)
    return Rounds(plan, heard, tokens)


def confirm_in_rounds(call: Call, plan: Plan, header: Header) -> None:
    """The header rule for ``plan`` (the chain broadcast: a rank hears only from the
    rank before it) through the dissemination rounds instead of a header frame
    with every peer (``Plan.confirm_peers``): each round's token follows whatever
    the plan already sends on that link (opened with ``header`` where it is not),
    so a rank talks to its plan's peers and 2 ceil(log2 N) more at most, and
    completes ceil(log2 N) hops after the last rank arrived. Call it after
    every ``open``."""
    tokens = call.scratch.get("dissemination", max(rounds_of(call.world), 1), torch.uint8)
    _add_rounds(call, plan, header, tokens)


def _add_rounds(
    call: Call,
    plan: Plan,
    header: Header,
    tokens: torch.Tensor,
    buf: torch.Tensor | None = None,
    root: int = 0,
) -> Heard:
    """Add the rounds to ``plan``: per round a token to the partner ahead and one
    from the partner behind (into ``tokens[k]``), after ``buf`` where that round's
    link carries the root's data, and after whatever the plan already has on the
    link (a direction not yet open is opened with ``header``). Returns the
    rounds' gate state."""
    n, r = call.world, call.rank
    data = None if buf is None else bytes_of(buf)
    received = bytes_of(tokens)
    heard = Heard([False] * rounds_of(n))
    for k, (to, frm) in enumerate(partners(r, n)):
        ready = None if k == 0 else partial(Heard.through, heard, k)
        if call.group_rank(to) not in plan.sends:
            plan.open(to, header, recv=False)
        if data is not None and carries_data((r - root) % n, k, n):
            plan.send(to, data, ready)
        plan.send(to, _TOKEN, ready)
        if call.group_rank(frm) not in plan.recvs:
            plan.open(frm, header, send=False)
        if data is not None and carries_data((frm - root) % n, k, n):
            plan.recv(frm, data, chain=True)
        plan.recv(frm, received[k : k + 1], setter(heard.rounds, k))
    return heard


def barrier(call: Call) -> None:
    """Every rank reaches this point before any leaves it: the dissemination
    rounds with a 1-byte token on each link, ceil(log2 N) hops."""
    disseminate(call, OpCode.BARRIER)

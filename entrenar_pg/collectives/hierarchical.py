"""Host-aware collectives: the work inside each host over its local links, across hosts the least.

A group spanning H hosts of L ranks each (``Mesh.topology``, uniform; the
policy falls back to the flat algorithms for uneven hosts, one host or one
rank per host) has two kinds of link: between ranks of a host (shared
memory, or loopback) and between hosts, which is 10-100x slower per byte
and shared by the host's L ranks. The flat ring sends 2(N-1)/N x S through
every host link and crosses hosts at every host boundary of the ring; the
star and the direct exchange send several copies of S through rank 0's
host link. The two algorithms here are compositions of the flat building
blocks run by a *team* (``Call.on``: an ordered subset of the ranks; a
team's plan names peers by position, so ring, tree and direct code runs on
a team unchanged):

- ``allreduce_host_slices`` (large messages; Horovod's hierarchical
  allreduce, NCCL's ring over nodes): the buffer is cut into L slices; (1)
  reduce-scatter inside each host (local rank i ends with its host's sum of
  slice i), (2) L allreduces across hosts at once, local rank i with its
  counterparts (the ranks at position i on every host) on slice i, (3)
  all-gather inside the host. Each host link carries 2(H-1)/H x S each way,
  the bound (the flat ring: 2(N-1)/N x S), in L parallel streams. Large
  buffers go in pieces through one plan, pipelined so the local phases
  hide behind the cross-host one, the plan kept for the buffer's next call.
- ``reduce_scatter_hosts`` / ``allgather_hosts`` (FSDP across hosts): the
  reduce-scatter reduces inside the host first (local rank i ends with its
  host's sum of the chunks of the ranks at position i on every host), then
  reduce-scatters those across hosts among the counterparts; the all-gather
  is the reverse. Each host link carries (H-1)/H of the whole buffer each
  way, the bound (the flat ring: (N-1)/N). Deterministic, the
  reduce-scatter is two tree exchanges (inside the host, then among the
  counterparts), the same bytes; the flat tree exchange sends L times them.
- ``allreduce_host_leaders`` (small messages, where hops and copies cost
  more than bytes): (1) every rank's buffer to its host's leader (its lowest
  rank), which combines them, (2) the leaders' direct exchange (each leader
  sends its host's sum to every other leader: one cross-host hop, (H-1) x S
  per host link), or, on many hosts where those bytes cost more than the
  hops saved (``leaders_doubling``), recursive doubling among the leaders
  (log2 H hops with one partner each, log2 H x S per host link, log2 H
  sockets per leader), (3) the leader's result back to its host's ranks.

Reductions. The phases combine only (``Reduction(red.combine_kind)``: AVG
and PREMUL_SUM sum; PREMUL_SUM's factor was applied before, by the job);
AVG's division by the group's size happens once, on the reduced values,
before the last phase copies them out, so every rank holds the same bits.

Order. Rank order inside a host, then host order; deterministic
(``choice.tree``): the canonical tree over the host's ranks, then over the
hosts. That is the canonical tree over all ranks exactly when every host's
ranks are consecutive and each host is one subtree of it
(``reduce_ops.tree_has_blocks``: 2 x 2, 4 x 2, 2 x 3 yes; 3 x 2 no); the
policy picks these algorithms in deterministic mode only then, and the flat
ones (the same bits, more cross-host bytes) otherwise.

Headers. The pipelined slices are one plan with ``HOST_SLICES`` (the
pieces' count in ``aux``) on the host's ring and on the counterparts'
ring; the leaders' first plan carries ``HOST_LEADERS`` and the
deterministic slices' first plan ``HOST_SLICES``, their later plans the
building blocks' headers (direct, broadcast, tree ring, ring) with the same
sequence number. So a rank running another algorithm for the same call (a
rank whose options say ``topology="flat"``) meets a header unlike its own
on its host's links. Each plan runs to completion before the next starts,
and a rank starts plan k+1 only after its plan k checked its headers, so
every rank's result depends on data sent after every other rank's checks
(the ring's argument, plan by plan; in the slices' one plan, a piece's
all-gather leaves a rank only after the piece came back from its
counterparts' ring, which forwarded it only after their checks, and every
rank is the counterpart of a rank of this host).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, pairwise

import torch

from ..reduce_ops import Kind, Reduction, finish_
from ..transport import Plan
from ..wire import Algo, Header, OpCode
from .broadcast import broadcast
from .common import Call, bytes_of, chunk_bounds
from .direct import allreduce_direct
from .doubling import allreduce_doubling
from .policy import leaders_doubling
from .ring import RingPass, allgather_ring, finished, open_ring, reduce_scatter_ring, ring_pass
from .star import gather_reduce
from .tree import allreduce_tree_ring, exchange, reduce_scatter_tree

LEADER = 0  # a host's leader: its first rank (position 0 of the host's team)
# The host slices' pipeline: pieces of at least this many bytes, at most this
# many pieces (each piece's plan is a round trip of every phase: fewer,
# larger pieces cost less Python; more hide the local phases better).
PIECE_BYTES = 4 << 20
MAX_PIECES = 16


def piece_count(nbytes: int, hosts: int) -> int:
    """The host slices' pieces for ``nbytes`` across ``hosts`` hosts.

    About ``PIECE_BYTES`` each, at most ``MAX_PIECES`` up to 4 hosts, then
    falling as 4 x MAX_PIECES / H (8 at 8 hosts, 1 from 64): every piece pays
    the cross-host rings' 2(H-1) steps again, in sequence, while what it
    hides (the local phases) does not grow with H. The cost model
    (benchmarks/model, docs/benchmarks.md "Where the code's pair stops being
    enough") predicted 16 pieces 1.12x the flat ring's time at 64 x 8 and
    1.71x at 1,024 x 8 for 64 MiB; 2 x 2 and 4 x 2 were measured best at 16.
    """
    most = max(1, min(MAX_PIECES, 4 * MAX_PIECES // max(hosts, 1)))
    return max(1, min(most, nbytes // PIECE_BYTES))


def piece_bounds(numel: int, count: int) -> list[tuple[int, int]]:
    """``count`` near-equal pieces of ``[0, numel)``, the first and the last cut
    again into quarters, a quarter and a half (when ``count`` >= 4).

    The link waits for the first piece's reduce-scatter before any byte
    crosses, and the call for the last piece's all-gather after the last
    byte did: smaller pieces at the ends shorten both waits.
    """
    if count < 4:
        return chunk_bounds(numel, count)
    edges = [0, *accumulate([1, 1, 2] + [4] * (count - 2) + [2, 1, 1])]  # quarters of a piece
    total = edges[-1]
    return [(a * numel // total, b * numel // total) for a, b in pairwise(edges)]


SEGMENTS_PER_CHUNK = 4
MIN_SEGMENT_BYTES = 64 << 10


def allreduce_host_slices(
    call: Call, buf: torch.Tensor, red: Reduction, op: OpCode = OpCode.ALLREDUCE
) -> None:
    """Host-aware allreduce of the flat CPU tensor ``buf``, in place (large messages).

    Steps: a reduce-scatter of L slices inside the host, then local rank i
    allreduces slice i with its counterparts on the other hosts, then an
    all-gather inside the host. Bytes per host link, each way: 2(H-1)/H x
    nbytes (the bound); per rank over the local links: 2(L-1)/L x nbytes.

    The buffer is cut into pieces of about ``PIECE_BYTES`` (``piece_count``:
    fewer as H grows), pipelined in one plan (``_SlicesPlan``): the pieces
    follow each other through the cross-host ring with no pause, and each
    piece's local phases run while the network carries others. Rings
    everywhere (2(L-1) local hops, 2(H-1) cross-host hops per piece).
    Deterministic: ``_slices_in_tree_order``.

    The plan is kept per buffer (address, size) and everything its header
    says, as the small collectives keep theirs: building it is ~2.6 ms of
    Python for 64 MiB (1,000 pieces), and where ranks share cores (4 x 2
    emulated hosts on 2 cores) 8-12 ms of every call's 880, spent before any
    byte moves. A DDP bucket is the same buffer every step.
    """
    if call.choice.tree:
        _slices_in_tree_order(call, buf, red, op)
        return
    key = ("host_slices", op, buf.data_ptr(), buf.numel(), buf.dtype, red.kind, call.choice)
    kept = call.scratch.plan(key)
    if kept is None:
        kept = _SlicesPlan.build(call, buf, red, op)
        if kept.reusable:
            call.scratch.keep_plan(key, kept)
    else:
        kept.rearm(call.seq)
    call.mesh.run(kept.plan, call.what(op), call)


@dataclass(slots=True)
class _SlicesPlan:
    """``allreduce_host_slices``'s plan for one buffer, and what a rerun resets.

    Its views lie over the buffer's address (``torch.frombuffer`` of a byte
    view that owns nothing, as the checker's projection views do), so a kept
    plan holds no reference to the caller's tensor: it is run only for a
    buffer at that address and of that size, which then holds the bytes.
    Its ring passes keep their receive flags and the scratch their receives
    land in (``RingPass``).
    """

    plan: Plan
    passes: list[RingPass]
    reusable: bool  # every chunk has data: one header per link, no extra rounds

    def rearm(self, seq: int) -> None:
        """Ready for the next call on the same buffer: its seq, no receive done."""
        self.plan.restamp(seq)
        for p in self.passes:
            p.rearm()

    @staticmethod
    def build(call: Call, buf: torch.Tensor, red: Reduction, op: OpCode) -> _SlicesPlan:
        topology = call.mesh.topology
        me = call.mesh.rank
        host = call.on(topology.local_peers(me))
        kind = red.combine_kind
        nbytes = buf.numel() * buf.element_size()
        count = piece_count(nbytes, len(topology.hosts))
        flat = torch.frombuffer(bytes_of(buf), dtype=buf.dtype)  # owns nothing (above)
        pieces = [flat[a:b] for a, b in piece_bounds(flat.numel(), count)]
        count = len(pieces)
        slices = [[p[a:b] for a, b in chunk_bounds(p.numel(), host.world)] for p in pieces]
        # The cross-host ring forwards a chunk while it still arrives: segments
        # of at most 1/SEGMENTS_PER_CHUNK of a chunk (else every ring step
        # leaves the link idle while the last segment is reduced, on all hosts at once).
        team = topology.counterparts(me)
        chunk_bytes = nbytes // (count * host.world * len(team))
        segment = max(
            MIN_SEGMENT_BYTES, min(call.choice.segment_bytes, chunk_bytes // SEGMENTS_PER_CHUNK)
        )
        across = call.on(team, segment)
        shares = [
            [m[a:b] for a, b in chunk_bounds(m.numel(), across.world)]
            for m in (s[host.rank] for s in slices)
        ]
        header = call.header(
            op, Algo.HOST_SLICES, buf.dtype, reduce_op=int(red.kind), numel=buf.numel(), aux=count
        )
        plan = call.plan()
        inside, outside = plan.on(host.team), plan.on(across.team)
        local_chunks = [c for s in slices for c in s]
        cross_chunks = [c for s in shares for c in s]
        open_ring(host, inside, header, local_chunks)
        open_ring(across, outside, header, cross_chunks)
        # Built in the order each link carries them. Across the hosts, piece
        # after piece, each once its reduce-scatter is done (the ring never
        # waits between pieces: a plan per piece left the host link idle at
        # every plan's end). Inside the host: the first two pieces'
        # reduce-scatters, then, as piece t comes back, its all-gather and
        # piece t+2's reduce-scatter, so the local work runs while the
        # network carries the piece between (all of it first took the cores
        # from the cross-host ring as it started).
        passes: list[RingPass] = []
        scattered: list[Callable[[], bool] | None] = []
        for t in range(count + 2):
            back = None
            if t >= 2:
                crossed = ring_pass(
                    across,
                    outside,
                    shares[t - 2],
                    reduce_steps=across.world - 1,
                    gather_steps=across.world - 1,
                    kind=kind,
                    on_reduced=partial(finish_, red=red, world=call.world),
                    scratch_name="across",
                    after=scattered[t - 2],
                )
                back = finished(crossed, scattered[t - 2])
                gathered = ring_pass(
                    host,
                    inside,
                    slices[t - 2],
                    reduce_steps=0,
                    gather_steps=host.world - 1,
                    after=back,
                )
                passes += (crossed, gathered)
            if t < count:
                local = ring_pass(
                    host,
                    inside,
                    slices[t],
                    reduce_steps=host.world - 1,
                    gather_steps=0,
                    shift=-1,
                    kind=kind,
                    after=back,
                )
                scattered.append(finished(local, back))
                passes.append(local)
        reusable = all(c.numel() for c in local_chunks + cross_chunks)
        return _SlicesPlan(plan, passes, reusable)


def _slices_in_tree_order(call: Call, buf: torch.Tensor, red: Reduction, op: OpCode) -> None:
    """``allreduce_host_slices`` in the canonical tree order (not pipelined).

    The reduce-scatter inside the host is the direct exchange (tree order
    over the host's ranks), the cross-host allreduce the tree ring (tree
    order over the hosts), then a ring all-gather inside the host: three
    plans. Latency: L-1 + H local and cross-host hops.
    """
    topology = call.mesh.topology
    me = call.mesh.rank
    host = call.on(topology.local_peers(me))
    across = call.on(topology.counterparts(me))
    part = Reduction(red.combine_kind)
    chunks = [buf[a:b] for a, b in chunk_bounds(buf.numel(), host.world)]
    header = call.header(
        op, Algo.HOST_SLICES, buf.dtype, reduce_op=int(red.kind), numel=buf.numel()
    )
    plan = host.plan()
    exchange(host, plan, chunks, part, header)
    call.mesh.run(plan, call.what(op), call)
    mine = chunks[host.rank]
    if across.world > 1:
        allreduce_tree_ring(across, mine, part, op)
    finish_(mine, red, call.world)
    allgather_ring(host, chunks, op)


def allreduce_host_leaders(
    call: Call, buf: torch.Tensor, red: Reduction, op: OpCode = OpCode.ALLREDUCE
) -> None:
    """Host-aware allreduce of the flat CPU tensor ``buf``, in place (small messages).

    Steps: every rank sends ``buf`` to its host's leader, which combines
    segment by segment as they arrive (the star's ``gather_reduce``: host
    order, the canonical tree when deterministic); the leaders' direct
    exchange (rank order of the hosts, or the tree); the leader sends the
    result to its host's ranks. Bytes per host link, each way: (H-1) x
    nbytes (one copy per other host). Latency: 1 local hop, 1 cross-host
    hop, 1 local hop.
    """
    topology = call.mesh.topology
    host = call.on(topology.local_peers(call.mesh.rank))
    leaders = topology.leaders()
    part = Reduction(red.combine_kind)
    header = call.header(
        op, Algo.HOST_LEADERS, buf.dtype, reduce_op=int(red.kind), numel=buf.numel()
    )
    # 1. Reduce to the host's leader.
    plan = host.plan()
    leading = host.rank == LEADER
    if leading:
        gather_reduce(host, plan, buf, part, LEADER, header, replies=False)
    else:
        plan.open(LEADER, header, recv=False)
        plan.send(LEADER, bytes_of(buf))
    plan.confirm_peers(host.world, header)
    call.mesh.run(plan, call.what(op), call)
    # 2. The leaders' exchange; AVG's division once, at the leader.
    if leading:
        if leaders_doubling(len(leaders), buf.numel() * buf.element_size()):
            # The canonical tree over the hosts (the direct exchange's bits),
            # one plan; no ring-neighbour headers: a leader running another
            # plan for this call already met its host's ranks in phase 1.
            allreduce_doubling(call.on(leaders), buf, part, op, neighbours=False)
        elif len(leaders) > 1:
            allreduce_direct(call.on(leaders), buf, part, op)
        finish_(buf, red, call.world)
    # 3. Back to the host's ranks.
    broadcast(host, buf, LEADER, op)


def _host_rings(
    call: Call, chunks: Sequence[torch.Tensor], header: Header, *, reduce: Kind | None
) -> None:
    """One plan inside the host: a ring pass over each host's ranks' chunks.

    For every host h (topology order), the chunks of h's ranks, indexed by
    position, make one ring pass among this host's ranks: position j's
    chunk is the one of h's rank at position j, which this host's rank at
    position j holds (all-gather: ``reduce`` None) or ends with, combined by
    ``reduce`` (reduce-scatter).
    """
    topology = call.mesh.topology
    host = call.on(topology.local_peers(call.mesh.rank))
    steps = host.world - 1
    plan = host.plan()
    open_ring(host, plan, header, chunks)
    for members in topology.hosts:
        group = [chunks[r] for r in members]
        if reduce is None:
            ring_pass(host, plan, group, reduce_steps=0, gather_steps=steps)
        else:
            ring_pass(host, plan, group, reduce_steps=steps, gather_steps=0, shift=-1, kind=reduce)
    call.mesh.run(plan, call.what(header.op), call)


def reduce_scatter_hosts(
    call: Call,
    chunks: Sequence[torch.Tensor],
    red: Reduction,
    op: OpCode = OpCode.REDUCE_SCATTER,
    *,
    aux: int = 0,
) -> None:
    """Host-aware reduce-scatter, in place: afterwards ``chunks[rank]`` holds the reduced chunk.

    ``chunks``: N contiguous 1-D tensors, one per rank of the group (rank
    order). Steps: inside the host, one ring reduce-scatter pass per host's
    chunks (local rank i ends with its host's sum of the chunk of the rank
    at position i on every host); then a ring reduce-scatter of those among
    the counterparts. Bytes per host link, each way: (H-1)/H x the whole
    buffer (the bound). Latency: H x (L-1) local hops + H-1 cross-host hops.
    Deterministic: ``_reduce_scatter_in_tree_order``. ``aux`` goes into the
    headers.
    """
    if call.choice.tree:
        _reduce_scatter_in_tree_order(call, chunks, red, op, aux)
        return
    me = call.mesh.rank
    numel = sum(c.numel() for c in chunks)
    kind = red.combine_kind
    header = call.header(
        op, Algo.HOST_SLICES, chunks[0].dtype, reduce_op=int(red.kind), numel=numel, aux=aux
    )
    _host_rings(call, chunks, header, reduce=kind)
    team = call.mesh.topology.counterparts(me)
    if len(team) > 1:
        theirs = [chunks[r] for r in team]
        reduce_scatter_ring(call.on(team), theirs, Reduction(kind), op, aux=aux)
    finish_(chunks[me], red, call.world)


def _reduce_scatter_in_tree_order(
    call: Call, chunks: Sequence[torch.Tensor], red: Reduction, op: OpCode, aux: int
) -> None:
    """``reduce_scatter_hosts`` in the canonical tree order: the flat tree exchange's bits.

    Two direct exchanges (``exchange``: each element combined by its owner,
    its contributions in tree order over the team): inside the host, local
    rank j ends with its host's sum (tree order over the host's ranks) of
    the chunks of the ranks at position j on every host, which it receives
    into one staging buffer (those chunks side by side, host order); then
    among the counterparts each rank combines its own chunk's host sums in
    tree order over the hosts. With every host one subtree of the canonical
    tree over all ranks (``reduce_ops.tree_has_blocks``, the policy's
    condition), that is the canonical tree over all ranks. AVG's division
    once, at the end. Bytes per host link, each way: (H-1)/H x the whole
    buffer (the flat exchange: L times that). Cost: one copy of the buffer
    into the staging areas. Latency: two hops, one local, one cross-host.
    """
    topology = call.mesh.topology
    me = call.mesh.rank
    local = topology.local_peers(me)
    host = call.on(local)
    kind = red.combine_kind
    numel = sum(c.numel() for c in chunks)
    # Position j's staging: the chunks of position j's counterparts, host order.
    groups = [[chunks[r] for r in topology.counterparts(p)] for p in local]
    sizes = [sum(c.numel() for c in g) for g in groups]
    stage = call.scratch.get("hosts_rs", numel, chunks[0].dtype)
    at, staged = 0, []
    for g, size in zip(groups, sizes, strict=True):
        part = stage[at : at + size]
        torch.cat(g, out=part)
        staged.append(part)
        at += size
    header = call.header(
        op, Algo.HOST_SLICES, chunks[0].dtype, reduce_op=int(red.kind), numel=numel, aux=aux
    )
    plan = host.plan()
    exchange(host, plan, staged, Reduction(kind), header)
    call.mesh.run(plan, call.what(op), call)
    mine = staged[host.rank]
    team = topology.counterparts(me)
    across = call.on(team)
    if across.world > 1:
        bounds = [chunks[r].numel() for r in team]
        parts, at = [], 0
        for size in bounds:
            parts.append(mine[at : at + size])
            at += size
        reduce_scatter_tree(across, parts, Reduction(kind), op, aux=aux)
        mine = parts[across.rank]
    chunks[me].copy_(mine)
    finish_(chunks[me], red, call.world)


def allgather_hosts(
    call: Call, chunks: Sequence[torch.Tensor], op: OpCode = OpCode.ALLGATHER
) -> None:
    """Host-aware all-gather: ``chunks[rank]`` holds this rank's input; fills the others.

    Steps: a ring all-gather among the counterparts (the ranks at this
    rank's position on every host), then inside the host one ring pass per
    host's chunks. Bytes per host link, each way: (H-1)/H x the whole buffer
    (the bound). Latency: H-1 cross-host hops + H x (L-1) local hops.
    """
    team = call.mesh.topology.counterparts(call.mesh.rank)
    if len(team) > 1:
        allgather_ring(call.on(team), [chunks[r] for r in team], op)
    numel = sum(c.numel() for c in chunks)
    header = call.header(op, Algo.HOST_SLICES, chunks[0].dtype, numel=numel)
    _host_rings(call, chunks, header, reduce=None)

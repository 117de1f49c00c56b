"""Each algorithm's time for H hosts x L ranks per host and S bytes, in the alpha-beta model.

Ranks are placed as torchrun places them: rank = host * L + local rank, so
a ring visits the L ranks of a host in a row and crosses each host's link
once per direction. An algorithm is a list of ``Phase``s run one after the
other; within a phase every link and CPU works at once, so a phase lasts

    max over kinds (messages in sequence x alpha) + max over kinds (bytes x beta)

(on shared cores the bytes' term is the larger of the bytes and the hops'
waits to be scheduled plus the last hop's bytes, ``Conditions`` and
``Phase.time``; a loop of calls on a token-bucket
link never beats its rate, ``total_time``), where a kind's bytes are those
through its busiest resource: for ``net``,
the busiest *host link* per direction (shared by the host's L ranks: the
contention of issue 26), for a local kind the busiest rank, for ``reduce``
the bytes combined by the busiest rank. A ``Fabric`` names the kinds one
implementation uses inside a host and between hosts (``links.py``).

The formulas follow the code (entrenar_pg/collectives/*.py): the ring's N
chunks and 2(N-1) steps, pipelined in segments so its links stream; the
star through rank 0; the direct exchange; the shm-native allreduce's one
phase (<= 1 MiB) or chunks of a slot; the host-aware pair
(collectives/hierarchical.py): the slices, pipelined in pieces, and the
leaders' direct exchange (recursive doubling among the leaders from 8
hosts, as the code; ``leaders_doubling`` does it at every H, a proposal).
gloo's allreduce is its ring (gloo/allreduce.cc: reduce-scatter then
all-gather over the ranks in order, TCP between every pair, same host or
not).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from benchmarks.model.links import (
    GLOO_CALL,
    GLOO_LOOPBACK,
    GLOO_NET,
    GLOO_WAKE,
    LOAD,
    LOOPBACK,
    NET,
    QUEUED_FRAME,
    REDUCE,
    SHM,
    SLOTS,
    WAKE,
    LinkTable,
)
from entrenar_pg.collectives.hierarchical import leaders_doubling as leaders_doubling_in_code
from entrenar_pg.collectives.hierarchical import piece_bounds, piece_count
from entrenar_pg.collectives.shm_allreduce import small_max_bytes

SEGMENT_BYTES = 1 << 20  # Options.segment_bytes: the pipelining unit of ring and star
SLOT_DATA_BYTES = 4 << 20  # transport/shm/slots.SLOT_DATA_BYTES: the chunk of the large path
# gloo's ring (gloo/allreduce.cc) cuts the buffer into at least 2N segments and
# keeps two in flight (recv/send issued at iteration i, waited for at i + 2), so
# that one segment's I/O overlaps the reduction of the other. (Only a blocking
# fabric's waits see it: ``Phase.time``.)
RING_IN_FLIGHT = 2


@dataclass(frozen=True)
class Shape:
    """Where one allreduce runs: ``hosts`` x ``local`` ranks, ``nbytes`` per rank."""

    hosts: int
    local: int
    nbytes: int

    @property
    def world(self) -> int:
        return self.hosts * self.local


@dataclass(frozen=True)
class Fabric:
    """The kinds one implementation's bytes use: inside a host, between hosts, to combine,
    and how its ranks wait for a message where ranks outnumber cores (``Conditions``).

    ``spins``: entrenar busy-polls while it waits (``Options.spin_us``,
    ``caller_spin_us``), so a rank that is sent to shares its core with
    every other rank on it, all runnable: a hop waits ``wake``'s alpha per
    turn of the others on the core (``hop_wait``: k-1 turns for a rooted
    hop, k/2 for a symmetric round). gloo blocks (an epoll thread and a condition
    variable per message, gloo/transport/tcp): the others sleep, and a hop
    pays one wake-up of a sleeping thread, whatever the number of ranks.

    ``call``: the kind whose alpha a call pays once, besides its messages'
    alphas (gloo: its work handed to a thread and waited for); ``queued``: the
    kind whose alpha a frame costs that the busiest rank of a hop handles
    after another one (``Phase.queued``: a star's root takes its N-1 peers'
    frames one after another). Each is charged only where fitted
    (``dedicated.py``: from rows with a core per rank).
    """

    intra: str
    inter: str
    reduce: str | None  # None: the implementation's betas include its sums (gloo)
    wake: str = WAKE
    spins: bool = True
    call: str | None = None
    queued: str | None = None

    def call_s(self, links: LinkTable) -> float:
        """Seconds a call pays once (0 where ``call`` is not fitted)."""
        if self.call is None or self.call not in links.params:
            return 0.0
        return links[self.call].alpha

    def queued_s(self, links: LinkTable) -> float:
        """Seconds per queued frame (0 where ``queued`` is not fitted)."""
        if self.queued is None or self.queued not in links.params:
            return 0.0
        return links[self.queued].alpha


ENTRENAR = Fabric(intra=SHM, inter=NET, reduce=REDUCE, queued=QUEUED_FRAME)  # TRANSPORT=auto
ENTRENAR_TCP = Fabric(intra=LOOPBACK, inter=NET, reduce=REDUCE, queued=QUEUED_FRAME)  # =tcp
GLOO = Fabric(
    intra=GLOO_LOOPBACK,
    inter=GLOO_NET,
    reduce=None,
    wake=GLOO_WAKE,
    spins=False,
    call=GLOO_CALL,
)


@dataclass(frozen=True)
class Phase:
    """Work done at once: messages in sequence and bytes on the busiest resource, per kind."""

    name: str
    messages: Mapping[str, float] = field(default_factory=dict)
    nbytes: Mapping[str, float] = field(default_factory=dict)
    fill: float = 0.0  # the bandwidth term's part spent filling a pipeline (moves no bytes)
    # Every rank sends and receives in each hop (a ring step, a doubling or dissemination
    # round): where spinning ranks share a core, a hop waits half as long as a rooted one
    # (``Conditions``: rooted hops wait behind k-1 turns, symmetric rounds k/2).
    symmetric: bool = False
    # Messages a rank keeps in flight per hop (gloo's ring: two segments,
    # gloo/allreduce.cc); a blocking wait overlaps only the others' bytes.
    in_flight: float = 1.0
    # Frames the busiest rank handles one after another beyond one per hop (a hop
    # from one rank to one other is what a 2-rank sweep's alpha measured): a star's
    # root takes N-1 frames in and sends N-1 out, 2(N-2) queued. That rank's CPU is
    # a resource of the phase like a link (``time``: the longer of the two), since
    # it handles one frame while the link carries the next (``Fabric.queued``).
    queued: float = 0.0

    def time(
        self, links: LinkTable, waits: float = 0.0, blocking: bool = False, frame_s: float = 0.0
    ) -> float:
        """Seconds: the alphas, then the bytes or ``waits`` (the hops' waits to be
        scheduled, ``Conditions``), whichever is longer.

        A spinning rank takes its turns on the core while the bytes it waits
        for are still on the link, so its turns overlap the bytes of every hop
        but its last: the turn that finishes the phase can only come once the
        last hop's message has arrived (the phase's bytes spread over its hops
        in sequence: ``bw / hops``). A one-hop phase (the leaders' exchange)
        pays its bytes and its turns; a ring's 2(N-1) steps hide all but one
        step's. (Checked held out on six quiet pairs of 2 x 2 and 4 x 2 runs:
        200 of 216 rows within 25 % with the turns overlapping every byte,
        206 with this; docs/benchmarks.md, "The rooted ops' own turn".) A
        ``blocking`` one (gloo) sleeps until its message has arrived and only
        then waits to be woken: the wait overlaps the other messages in
        flight, not its own (``in_flight`` 2: half the bytes). ``frame_s``: seconds
        per queued frame (``Fabric.queued_s``); the busiest rank's queued frames
        take their time while the links carry the bytes, so the longer of the two
        counts (the frames both ways already: no pipeline fill)."""
        lat = max((n * links[k].alpha for k, n in self.messages.items()), default=0.0)
        bw = max((b * links[k].beta for k, b in self.nbytes.items()), default=0.0)
        bw = max(bw * (1 + self.fill), self.queued * frame_s)
        if waits <= 0:
            return lat + bw
        if blocking:
            return lat + max(bw, waits + bw / self.in_flight)
        return lat + max(bw, waits + bw / max(1.0, self.hops()))

    def hops(self) -> float:
        """Messages in sequence (the phase waits for its slowest kind's)."""
        return max(self.messages.values(), default=0.0)

    def kinds(self) -> set[str]:
        return set(self.messages) | set(self.nbytes)

    def charged_after(self, free: float) -> tuple[Phase, float]:
        """This phase with up to ``free`` host-link bytes not charged, and the free bytes left."""
        nbytes = dict(self.nbytes)
        for kind in (NET, GLOO_NET):
            if kind in nbytes:
                taken = min(free, nbytes[kind])
                nbytes[kind] -= taken
                free -= taken
        return dataclasses.replace(self, nbytes=nbytes), free


@dataclass(frozen=True)
class Conditions:
    """Where a call runs, beyond its links (``DEDICATED``: a core per rank, real links).

    ``ranks_per_core``: ranks sharing one core. The emulated clusters put
    every rank of every host on this machine's cores (8 ranks on 2: 4);
    there every hop in sequence waits for its rank to be scheduled, as the
    fabric waits (``Fabric.spins``): entrenar ``WAKE``'s alpha per turn of
    the others on the core (``hop_wait``), gloo ``GLOO_WAKE``'s alpha per
    hop. A spinning wait overlaps the phase's bytes, a blocking one only the
    other messages in flight (``Phase.time``). (The links' alphas are
    fitted with 2 ranks on 2 cores: one per core.)
    ``free_net_bytes``: tc tbf's burst on the emulated links, 0 on a real
    link. A token bucket of that size, filled at the link's rate: a call's
    first ``free_net_bytes`` through a host link pass at once, but over a
    loop of calls the bucket refills only at the rate, so a call never
    takes less than its host-link bytes at the link's beta (``total_time``);
    ``back_to_back`` False: each call timed alone after a pause that refilled
    the bucket (``rooted_rank``'s control barrier), no such bound.
    ``busy_share``: the load, the share of the cores other processes took
    while the call ran (the cluster harness records it per row:
    ``benchmarks/cluster_load.py``). A spinning rank yields its core at every
    turn of its poll (``sched_yield``); where another job's thread is
    runnable there, a yield can hand it the core until the scheduler takes
    it back (at most a tick, 4 ms at this kernel's ``CONFIG_HZ`` 250), and
    the rank, runnable but not woken, waits: each turn of a hop (``hop_wait``)
    grows by ``LOAD``'s alpha x the share (``load_wait``; the alpha is
    fitted, and half a tick bounds it). A blocking rank (gloo) sleeps, and
    its wake-up is placed ahead of the other job's thread (EEVDF's lag): no
    term. 0: nothing else ran, or not recorded.
    """

    ranks_per_core: float = 1.0
    free_net_bytes: float = 0.0
    back_to_back: bool = True  # calls timed in a loop; False: each alone, the bucket full
    busy_share: float = 0.0

    def load_wait(self, links: LinkTable, fabric: Fabric) -> float:
        """Seconds one turn of a ``fabric`` hop waits for other jobs' threads (none
        if it blocks, nothing else ran, or ``LOAD`` is not fitted)."""
        if not fabric.spins or self.busy_share <= 0 or LOAD not in links.params:
            return 0.0
        return min(self.busy_share, 1.0) * links[LOAD].alpha


DEDICATED = Conditions()

Algorithm = Callable[[Shape, Fabric], list[Phase]]


def hops(phases: list[Phase]) -> float:
    """Messages in sequence over all phases (each phase waits for its slowest kind's)."""
    return sum(p.hops() for p in phases)


def hop_wait(links: LinkTable, where: Conditions, fabric: Fabric, symmetric: bool = False) -> float:
    """Seconds one hop waits to be scheduled under ``where`` (``Fabric.spins``):
    none with a core per rank or where the fabric's wake kind is not fitted.

    A spinning fabric's hop waits ``WAKE``'s alpha per turn of the other ranks on
    the core (each holds it for its spin before it yields). A *rooted* hop (the
    star's root, a host's leader) needs one rank that has just yielded and so
    queues behind all k-1 others: k-1 turns. In a *symmetric* round every rank on
    the core is a receiver, and its place in the line is uniform: k/2 turns on
    average, and pipelined rounds pay the average (a rank whose message came
    goes straight on). At k = 2 both are 1. A blocking fabric (gloo) pays one
    wake-up of a sleeping thread per hop either way.

    Load (``Conditions.load_wait``): each of a spinning hop's turns is also,
    in the share of the cores other jobs took, a turn of another job's thread
    (``LOAD``'s alpha x the share), and a rank alone on its core still waits
    one such turn; a blocking hop nothing more. With a core per rank and
    nothing else running, no wait.
    """
    k = where.ranks_per_core
    shared = k > 1 and fabric.wake in links.params
    alpha = links[fabric.wake].alpha if shared else 0.0
    if not fabric.spins:
        return alpha
    turn = alpha + where.load_wait(links, fabric)
    return turn * max(1.0, k / 2 if symmetric else k - 1)


def total_time(
    phases: list[Phase],
    links: LinkTable,
    where: Conditions = DEDICATED,
    fabric: Fabric = ENTRENAR,
) -> float:
    """Seconds for ``phases`` in sequence, under ``where``, waiting as ``fabric`` waits.

    On a token-bucket link (``where.free_net_bytes``) a loop of calls is
    bound by the link's rate: never below the call's host-link bytes x beta.
    Where fitted, the fabric's cost per call (``Fabric.call``) comes on top, and
    its queued frames (``Fabric.queued``) beside each phase's bytes.
    """
    free, link_bytes = where.free_net_bytes, 0.0
    seconds = fabric.call_s(links) if phases else 0.0
    for phase in phases:
        link_bytes += phase.nbytes.get(fabric.inter, 0.0)
        if free > 0:
            phase, free = phase.charged_after(free)
        wait = hop_wait(links, where, fabric, phase.symmetric)
        blocking = not fabric.spins
        seconds += phase.time(links, wait * phase.hops(), blocking, fabric.queued_s(links))
    if where.free_net_bytes > 0 and where.back_to_back and link_bytes > 0:
        seconds = max(seconds, link_bytes * links[fabric.inter].beta)
    return seconds


def _reduce_phase(name: str, fabric: Fabric, nbytes: float) -> list[Phase]:
    """A combine of ``nbytes`` done after the data arrived (nothing if gloo or none)."""
    if fabric.reduce is None or nbytes <= 0:
        return []
    return [Phase(name, {}, {fabric.reduce: nbytes})]


def _with_reduce(fabric: Fabric, nbytes: dict[str, float], combined: float) -> dict[str, float]:
    """``nbytes`` plus a combine overlapped with the transfers (segment by segment)."""
    if fabric.reduce is not None and combined > 0:
        nbytes = {**nbytes, fabric.reduce: combined}
    return nbytes


def _kinds_used(shape: Shape, fabric: Fabric) -> list[str]:
    """The link kinds a flat algorithm's messages cross: inside hosts if L > 1, between if H > 1."""
    used = []
    if shape.local > 1:
        used.append(fabric.intra)
    if shape.hosts > 1:
        used.append(fabric.inter)
    return used


def ring(shape: Shape, fabric: Fabric) -> list[Phase]:
    """The flat ring (collectives/ring.py; gloo's ring alike), N = H x L ranks.

    Steps: N-1 reduce-scatter then N-1 all-gather steps in sequence, each
    rank sending one chunk of S/N to its right neighbour per step; segments
    pipeline the steps, so every link streams. Bytes per link (and per host
    link per direction, which carries one ring edge): 2(N-1)/N x S.
    Messages in sequence: 2(N-1), each paying the slowest kind's alpha.
    Combined per rank: (N-1)/N x S, overlapped with the transfers.
    """
    n, s = shape.world, shape.nbytes
    if n == 1:
        return []
    per_link = 2 * (n - 1) / n * s
    used = _kinds_used(shape, fabric)
    nbytes = _with_reduce(fabric, {k: per_link for k in used}, (n - 1) / n * s)
    steps = {k: 2 * (n - 1) for k in used}
    return [Phase("ring", steps, nbytes, symmetric=True, in_flight=RING_IN_FLIGHT)]


def star(shape: Shape, fabric: Fabric) -> list[Phase]:
    """Star through rank 0 (collectives/star.py).

    Steps: every rank sends S to rank 0, which combines segment k once all
    have it and sends it straight back: 2 messages in sequence. Rank 0's
    host link carries (H-1) x L x S in and as much out (full duplex, at once
    but for the last segment: x (1 + 1/segments)); rank 0 itself moves
    (L-1) x S over its local links and combines (N-1) x S. Frames: rank 0
    takes N-1 in and sends N-1 out, 2(N-2) queued beyond a 2-rank hop's
    (per call: a larger S's further segments are the bytes' time).
    """
    n, s = shape.world, shape.nbytes
    if n == 1:
        return []
    fill = 1 / max(1, math.ceil(s / SEGMENT_BYTES))
    nbytes: dict[str, float] = {}
    if shape.local > 1:
        nbytes[fabric.intra] = (shape.local - 1) * s
    if shape.hosts > 1:
        nbytes[fabric.inter] = (shape.hosts - 1) * shape.local * s
    used = _kinds_used(shape, fabric)
    nbytes = _with_reduce(fabric, nbytes, (n - 1) * s)
    return [Phase("star", {k: 2 for k in used}, nbytes, fill, queued=2 * (n - 2))]


def doubling_rounds(shape: Shape) -> tuple[int, int]:
    """Rounds of the flat recursive doubling (collectives/doubling.py) inside a host
    and across hosts: ceil(log2 N) in all; the deepest ceil(log2 L) pair ranks at
    distance < L, which torchrun's placement keeps on one host (L a power of two;
    else the model still counts them local, as an estimate)."""
    n, local = shape.world, shape.local
    total = math.ceil(math.log2(n)) if n > 1 else 0
    inside = min(total, math.ceil(math.log2(local)) if local > 1 else 0)
    return inside, total - inside


def doubling(shape: Shape, fabric: Fabric) -> list[Phase]:
    """Recursive doubling in the canonical tree's shape (collectives/doubling.py).

    Steps: ceil(log2 N) rounds in sequence, each rank sending its partial sum
    (S) to one partner and combining the S it receives: the first
    ceil(log2 L) rounds inside the host, the rest across hosts, where all L
    ranks of a host send at once (L x S per host link per direction per
    round). No root: every rank moves and combines rounds x S.
    """
    inside, across = doubling_rounds(shape)
    s, phases = shape.nbytes, []
    if inside:
        nbytes = _with_reduce(fabric, {fabric.intra: inside * s}, inside * s)
        phases.append(Phase("doubling in the host", {fabric.intra: inside}, nbytes, symmetric=True))
    if across:
        nbytes = _with_reduce(fabric, {fabric.inter: across * shape.local * s}, across * s)
        phases.append(
            Phase("doubling across hosts", {fabric.inter: across}, nbytes, symmetric=True)
        )
    return phases


def direct(shape: Shape, fabric: Fabric) -> list[Phase]:
    """Direct exchange (collectives/direct.py): everyone sends S to everyone.

    Steps: 1 message in sequence, then each rank combines the N inputs.
    Bytes: each host link carries L x (H-1) x L x S per direction (its L
    ranks to every rank elsewhere); each rank moves (L-1) x S over its
    local links; each rank combines (N-1) x S after all arrived. Frames:
    each rank sends N-1 and takes N-1, 2(N-2) queued.
    """
    n, s = shape.world, shape.nbytes
    if n == 1:
        return []
    nbytes: dict[str, float] = {}
    if shape.local > 1:
        nbytes[fabric.intra] = (shape.local - 1) * s
    if shape.hosts > 1:
        nbytes[fabric.inter] = (shape.hosts - 1) * shape.local**2 * s
    used = _kinds_used(shape, fabric)
    exchange = Phase("direct", {k: 1 for k in used}, nbytes, symmetric=True, queued=2 * (n - 2))
    return [exchange, *_reduce_phase("direct-combine", fabric, (n - 1) * s)]


def _shm_small(local: int, s: int, fabric: Fabric) -> list[Phase]:
    """The shm allreduce's one phase: copy S into the own slot, publish, combine all L slots."""
    return [
        Phase("slots-in", {SLOTS: 1}, {SLOTS: s}),
        *_reduce_phase("slots-sum", fabric, (local - 1) * s),
    ]


def _shm_reduce_scatter(local: int, s: int, fabric: Fabric) -> list[Phase]:
    """The large path's first half, chunk by chunk: copy (L-1)/L x S in, sum the own 1/L slice."""
    chunks = max(1, math.ceil(s / SLOT_DATA_BYTES))
    copy_in = Phase("slots-in", {SLOTS: chunks}, {SLOTS: (local - 1) / local * s})
    return [copy_in, *_reduce_phase("slots-sum", fabric, (local - 1) / local * s)]


def _shm_all_gather(s: int) -> list[Phase]:
    """The large path's second half: every rank copies the L reduced slices out (S)."""
    chunks = max(1, math.ceil(s / SLOT_DATA_BYTES))
    return [Phase("slots-out", {SLOTS: chunks}, {SLOTS: s})]


def shm(shape: Shape, fabric: Fabric) -> list[Phase]:
    """The shm-native allreduce (collectives/shm_allreduce.py), one host (H must be 1).

    Up to ``small_max_bytes(L)`` (a float32 sum: 2 MiB for two ranks, else 1 MiB), one
    phase: 1 publish, S copied in per rank, (L-1) x S combined per rank.
    Above, per slot-sized chunk: copy in, each rank sums its 1/L slice
    across the L slots, copy out: 2 publishes per chunk,
    (2L-1)/L x S copied and (L-1)/L x S combined per rank. Assumes a core
    and its share of memory bandwidth per rank.
    """
    if shape.hosts != 1:
        raise ValueError(f"shm allreduce needs every rank on one host, got {shape.hosts} hosts")
    if shape.local == 1:
        return []
    if shape.nbytes <= small_max_bytes(shape.local, numpy_sum=True):  # the model's float32 SUM
        return _shm_small(shape.local, shape.nbytes, fabric)
    return _shm_reduce_scatter(shape.local, shape.nbytes, fabric) + _shm_all_gather(shape.nbytes)


def _local_pass(fabric: Fabric, local: int, piece: float) -> tuple[float, float]:
    """One ring pass inside a host (reduce-scatter or all-gather) over a piece:
    L-1 steps in sequence, (L-1)/L x piece through each rank's local links."""
    return local - 1, (local - 1) / local * piece


def host_slices(shape: Shape, fabric: Fabric) -> list[Phase]:
    """``HOST_SLICES`` (collectives/hierarchical.allreduce_host_slices), large messages.

    The buffer is cut into ``count`` = S / PIECE_BYTES pieces (``piece_count``:
    at most MAX_PIECES up to 4 hosts, fewer as H grows);
    per piece: a ring reduce-scatter of L slices inside the host (L-1 steps,
    (L-1)/L x piece per rank over the local links, the same combined), then
    L cross-host rings at once, local rank i with its counterparts on slice
    i (2(H-1) steps; L streams of 2(H-1)/H x piece/L share the host link:
    2(H-1)/H x piece per host link per direction, the bound; (H-1)/H x
    piece/L combined per rank), then a ring all-gather inside the host.
    Pipelined as the code runs it (one plan): while piece t crosses the hosts,
    the host's ring carries piece t-1's all-gather and piece t+1's
    reduce-scatter; the first piece's reduce-scatter comes before and the
    last one's all-gather after (one ``Phase`` per stage, count + 2 in
    sequence), with the first and last pieces cut smaller
    (``piece_bounds``). Over all stages: 2(H-1)/H x S per host link per
    direction, count x 2(H-1) cross-host steps in sequence.
    """
    return _slices(shape, fabric, piece_count(shape.nbytes, shape.hosts))


def host_slices_one_piece(shape: Shape, fabric: Fabric) -> list[Phase]:
    """A proposal, not code: ``host_slices`` without the pieces (one plan of each phase).

    The pieces hide the local phases behind the cross-host one, but each
    piece's rings pay their 2(H-1) cross-host steps again, in sequence: at
    large H the steps, not the bytes, are the time (1,024 hosts: 2,046 per
    piece), and one piece is faster.
    """
    return _slices(shape, fabric, 1)


def _slices(shape: Shape, fabric: Fabric, count: int) -> list[Phase]:
    """The slices in ``count`` pipelined pieces as the code cuts them (``host_slices``)."""
    h, local, s = shape.hosts, shape.local, shape.nbytes
    pieces = [float(b - a) for a, b in piece_bounds(int(s), count)]
    count = len(pieces)
    steps, _ = _local_pass(fabric, local, 0.0)
    through = [_local_pass(fabric, local, p)[1] for p in pieces]  # per rank, each local pass
    phases = []
    for t in range(count + 2):
        messages: dict[str, float] = {}
        nbytes: dict[str, float] = {}
        combined = 0.0
        # stage t: piece t's reduce-scatter and piece t-2's all-gather inside, piece t-1 across
        inside = [through[k] for k in (t, t - 2) if 0 <= k < count]
        if local > 1 and inside:
            messages[fabric.intra] = steps  # the passes share the ring and run side by side
            nbytes[fabric.intra] = sum(inside)
            if t < count:
                combined += through[t]
        if h > 1 and 0 <= t - 1 < count:
            piece = pieces[t - 1]
            messages[fabric.inter] = 2 * (h - 1)
            nbytes[fabric.inter] = 2 * (h - 1) / h * piece
            combined += (h - 1) / h * piece / local
        if messages:
            nbytes = _with_reduce(fabric, nbytes, combined)
            phases.append(Phase(f"slices stage {t}", messages, nbytes, symmetric=True))
    return phases


def _to_leader(shape: Shape, fabric: Fabric) -> list[Phase]:
    """Every rank's S to its host's leader, combined there as it arrives (the star's gather)."""
    local, s = shape.local, shape.nbytes
    if local == 1:
        return []
    nbytes = _with_reduce(fabric, {fabric.intra: (local - 1) * s}, (local - 1) * s)
    return [Phase("to leader", {fabric.intra: 1}, nbytes, queued=local - 2)]


def _from_leader(shape: Shape, fabric: Fabric) -> list[Phase]:
    """The leader's result to its host's L-1 ranks (the direct broadcast: (L-1) x S out)."""
    local, s = shape.local, shape.nbytes
    if local == 1:
        return []
    out = {fabric.intra: (local - 1) * s}
    return [Phase("from leader", {fabric.intra: 1}, out, queued=local - 2)]


def host_leaders(shape: Shape, fabric: Fabric) -> list[Phase]:
    """``HOST_LEADERS`` (collectives/hierarchical.allreduce_host_leaders), small messages.

    Steps: every rank's S to its host's leader ((L-1) x S into the leader
    over the local links, combined as it arrives); the leaders' direct
    exchange (1 cross-host message in sequence; each leader sends S to each
    other leader: (H-1) x S per host link per direction), then each leader
    combines the (H-1) x S it received; the leader's result back to its
    L-1 ranks ((L-1) x S out). Frames queued at a leader: L-2 in, 2(H-2) in
    the exchange, L-2 out (``Phase.queued``). From 8 hosts, where the code exchanges by
    recursive doubling among the leaders (``hierarchical.leaders_doubling``:
    the direct exchange's bytes cost more than the hops saved), the
    doubling's rounds instead (``leaders_doubling``).
    """
    if leaders_doubling_in_code(shape.hosts, shape.nbytes):
        return leaders_doubling(shape, fabric)
    h, s = shape.hosts, shape.nbytes
    phases = _to_leader(shape, fabric)
    if h > 1:
        exchange = {fabric.inter: (h - 1) * s}
        phases.append(Phase("leaders' exchange", {fabric.inter: 1}, exchange, queued=2 * (h - 2)))
        phases += _reduce_phase("leaders' combine", fabric, (h - 1) * s)
    return phases + _from_leader(shape, fabric)


def leaders_doubling(shape: Shape, fabric: Fabric) -> list[Phase]:
    """``host_leaders`` with recursive doubling among the leaders, at every H (the
    code does it only where ``hierarchical.leaders_doubling`` says it pays).

    The leaders exchange in ceil(log2 H) rounds with a partner at distance
    2^k, each round S each way then a combine of S (H a power of two; other
    H pay 2 more rounds): ceil(log2 H) x S per host link per direction
    instead of the direct exchange's (H-1) x S, ceil(log2 H) messages in
    sequence instead of 1.
    """
    h, s = shape.hosts, shape.nbytes
    phases = _to_leader(shape, fabric)
    if h > 1:
        rounds = math.ceil(math.log2(h))
        phases.append(Phase("doubling", {fabric.inter: rounds}, {fabric.inter: rounds * s}))
        phases += _reduce_phase("doubling combine", fabric, rounds * s)
    return phases + _from_leader(shape, fabric)


# What ``plan`` compares, with the fabric each runs on.
ALGORITHMS: dict[str, tuple[Algorithm, Fabric]] = {
    "ring": (ring, ENTRENAR),
    "star": (star, ENTRENAR),
    "doubling": (doubling, ENTRENAR),
    "direct": (direct, ENTRENAR),
    "gloo ring": (ring, GLOO),
    "host slices": (host_slices, ENTRENAR),
    "host leaders": (host_leaders, ENTRENAR),
    "leaders doubling": (leaders_doubling, ENTRENAR),
    "slices 1 piece": (host_slices_one_piece, ENTRENAR),
}
# Proposals for large H (not code): planned with, never matched to a measured row.
PROPOSALS = ("leaders doubling", "slices 1 piece")
HOST_AWARE = ("host slices", "host leaders")  # the code's host-aware pair (policy's HOST_* rows)


def predict(name: str, shape: Shape, links: LinkTable, where: Conditions = DEDICATED) -> float:
    """Seconds of algorithm ``name`` (a key of ``ALGORITHMS``) for ``shape``."""
    algo, fabric = ALGORITHMS[name]
    return total_time(algo(shape, fabric), links, where, fabric)


def host_link_bytes(phases: list[Phase], inter: str) -> float:
    """Bytes per host link per direction over all phases (the ``net`` kind's bytes)."""
    return sum(p.nbytes.get(inter, 0.0) for p in phases)

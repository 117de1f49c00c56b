"""Barrier and broadcast in the cost model: the flat algorithms as implemented, and
host-aware candidates (not code) to decide whether building them pays (issue 26 item 2).

The flat ones follow the code (collectives/dissemination.py,
collectives/broadcast.py, collectives/policy.py):

- ``barrier_dissemination`` (the barrier): R = ceil(log2 N) rounds, rank r to
  r + d (d = 2^(R-1), ..., 1, the longest first), a round's frame sent once
  every earlier round's arrived. R hops (each crossing a host boundary
  somewhere when H > 1); every rank handles 2R frames; a host link carries
  min(d, L) token frames per round.
- ``barrier_star`` (the barrier before, kept for comparison): a star
  allreduce of one byte: every rank's frame to rank 0, rank 0 answers once
  all arrived. 2 hops; rank 0 handles 2(N-1) frames; rank 0's host link
  carries (H-1) x L frames each way.
- ``broadcast_dissemination`` (the policy's pick with more than two ranks up
  to 64 KiB; 256 KiB on slow hosts of consecutive ranks): the binomial tree
  on the barrier's rounds, whole messages; R hops; the root's host link
  carries S for each round whose long step leaves the host (log2 H rounds on
  hosts of a power of two of consecutive ranks), the other links a token.
  No confirmation with every peer: the rounds carry it.
- ``broadcast_direct`` (the policy's pick with two ranks, or above that up to
  ``star_max_bytes``): the root sends S to every rank at once. 1 hop; the
  root's host link carries (N-L) x S out, its local links (L-1) x S.
- ``broadcast_chain`` (above): a chain in rank order from the root, segment
  by segment (``segment_bytes``). Ranks consecutive per host, so each host
  link carries S once per direction; N-1 hops in sequence (H-1 across
  hosts, N-H inside), each storing and forwarding one segment before the
  rest streams.
- The direct broadcast also confirms its header with every peer it does not
  otherwise talk to (``Plan.confirm_peers``): about 2(N-1) 32-byte frames per
  rank, L x (N-L) of them through each host link per direction. The chain
  confirms through the dissemination rounds' tokens after its data
  (``dissemination.confirm_in_rounds``): 2R frames per rank, min(d, L) token
  frames through a host link in the round of step d.

The candidates (root = its host's leader; "leader" = one rank per host):

- ``barrier_leaders_star``: in-host gather to the leader (1 hop over the
  local links, L-1 frames), the leaders' star (2 hops across hosts, the root
  leader handles 2(H-1) frames), in-host release (1 hop). 4 hops.
- ``barrier_leaders_dissemination``: the same with the leaders' dissemination
  barrier: ceil(log2 H) rounds, each leader sends and receives one frame per
  round. 2 + ceil(log2 H) hops.
- ``broadcast_hosts_direct``: root -> the H-1 other leaders at once ((H-1) x S
  on the root's host link), then each leader -> its L-1 ranks.
- ``broadcast_hosts_tree``: a binomial tree among the leaders, ceil(log2 H)
  rounds of S (not pipelined), then in-host fan-out.
- ``broadcast_hosts_chain``: the leaders' chain, segment by segment, each
  leader fanning every segment out to its L-1 ranks as it forwards it:
  H-1 cross-host hops + 1 local hop in sequence (the flat chain: N-1).
  Built since the twenty-fifth session (``HOST_CHAIN``, the policy's pick
  where the chain runs on several hosts; it confirms through the rounds, as
  the flat chain does): this model has it never slower than the flat chain,
  at any shape and size, which is why it was built.

A candidate keeps the flat broadcast's header confirmation (``confirm=True``,
what building it on the same ``Plan`` would do) unless asked to confirm only
along its own links (``confirm=False``: the data path alone).

The per-frame work of the busiest rank (Python: parse a header, post a
receive, run a callback) is the ``FRAME`` kind, beta seconds per frame, its
"bytes" counting frames, overlapped with the links' bytes like any bandwidth
term. The allreduce rows never needed it (at N <= 8 it is under a hop);
``frame_cost.py`` measures it as CPU time from the barrier's star on one
host: over TCP 1.3 µs (8 ranks) and 4.6-5.0 µs (16 ranks) per frame, over
the shm rings -12 (noise) and 21 µs, on the 2 loaded cores.
``ASSUMED_FRAME_S`` is the TCP figure (a cross-host frame's); ``plan`` prints
the tables at 0, it and 20 µs (the shm figure, and the policy's "a few tens
of µs of Python", collectives/policy.STAR_MORE_MESSAGES).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.model.costs import DEDICATED, Conditions, Fabric, Phase, Shape, total_time
from benchmarks.model.links import LinkParams, LinkTable
from benchmarks.sizes import format_bytes
from entrenar_pg.collectives.dissemination import carries_data, rounds_of, step
from entrenar_pg.collectives.policy import choose
from entrenar_pg.config import Options
from entrenar_pg.transport.topology import Topology
from entrenar_pg.wire import Algo, OpCode

FRAME = "frame"  # per-frame CPU work on the busiest rank: beta = seconds per frame
ASSUMED_FRAME_S = 5e-6  # frame_cost.py over TCP, 16 ranks
HEADER_BYTES = 32  # wire._HEADER: one header frame
TOKEN_BYTES = HEADER_BYTES + 1  # the barrier's frame: a header and its one byte

Rooted = Callable[[Shape, Fabric, bool], list[Phase]]


def with_frame(links: LinkTable, seconds: float = ASSUMED_FRAME_S) -> LinkTable:
    """``links`` with the ``FRAME`` kind at ``seconds`` per frame, unless it has one."""
    if FRAME in links.params:
        return links
    return LinkTable({**links.params, FRAME: LinkParams(0.0, seconds)}, dict(links.meta))


def _on(shape: Shape, fabric: Fabric, intra: float, inter: float) -> dict[str, float]:
    """Per kind: ``intra`` inside a host (if L > 1), ``inter`` between hosts (if H > 1)."""
    out: dict[str, float] = {}
    if shape.local > 1:
        out[fabric.intra] = intra
    if shape.hosts > 1:
        out[fabric.inter] = inter
    return out


def _confirm_peers(shape: Shape, fabric: Fabric) -> dict[str, float]:
    """``Plan.confirm_peers``' cost beside a broadcast's data: header frames through each
    host link per direction (its L ranks to the N-L elsewhere) and the frames a rank
    handles (a header to and from every peer)."""
    n, local = shape.world, shape.local
    out = _on(shape, fabric, 0.0, local * (n - local) * HEADER_BYTES)
    out[FRAME] = 2 * (n - 1)
    return out


def _confirm_rounds(shape: Shape, fabric: Fabric) -> dict[str, float]:
    """``dissemination.confirm_in_rounds``' cost beside the chain's data: a token frame
    per round each way (min(d, L) through a host link in the round of step d), 2R
    frames a rank handles; the last round's token trails the chain's data on the
    same link, so it adds no hop of its own to the chain's."""
    n, local = shape.world, shape.local
    rounds = rounds_of(n)
    crossing = sum(min(step(k, n), local) for k in range(rounds))
    out = _on(shape, fabric, rounds * TOKEN_BYTES, crossing * TOKEN_BYTES)
    out[FRAME] = 2 * rounds
    return out


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}


def barrier_star(shape: Shape, fabric: Fabric, confirm: bool = True) -> list[Phase]:
    """The flat barrier (star.barrier): 2 hops; rank 0 handles 2(N-1) frames; rank 0's
    host link (H-1) x L token frames each way, its local links L-1.
    ``confirm`` is unused: the answer's wait for every rank is the confirmation."""
    del confirm
    n, local, h = shape.world, shape.local, shape.hosts
    if n == 1:
        return []
    nbytes = _on(shape, fabric, (local - 1) * TOKEN_BYTES, (h - 1) * local * TOKEN_BYTES)
    nbytes[FRAME] = 2 * (n - 1)
    return [Phase("barrier star", _on(shape, fabric, 2, 2), nbytes)]


def barrier_dissemination(shape: Shape, fabric: Fabric, confirm: bool = True) -> list[Phase]:
    """The flat barrier (dissemination.barrier): R = ceil(log2 N) rounds in sequence, each
    a cross-host hop when H > 1 (some rank's partner is on another host in every round);
    every rank handles 2R frames; a host link carries min(d, L) token frames in the round
    of step d. ``confirm`` is unused: the rounds are the confirmation."""
    del confirm
    n, local = shape.world, shape.local
    if n == 1:
        return []
    rounds = rounds_of(n)
    crossing = sum(min(step(k, n), local) for k in range(rounds))
    nbytes = _on(shape, fabric, 0.0, crossing * TOKEN_BYTES)
    if shape.hosts == 1:
        nbytes[fabric.intra] = rounds * TOKEN_BYTES
    nbytes[FRAME] = 2 * rounds
    hops = {_hop_kind(shape, fabric): rounds}
    return [Phase("barrier dissemination", hops, nbytes, symmetric=True)]


def _hop_kind(shape: Shape, fabric: Fabric) -> str:
    """The kind a round's slowest link is: across hosts when there are several."""
    return fabric.inter if shape.hosts > 1 else fabric.intra


def broadcast_dissemination(shape: Shape, fabric: Fabric, confirm: bool = True) -> list[Phase]:
    """The small broadcast (dissemination.disseminate): the binomial tree on the barrier's
    R rounds, whole messages; the root (rank 0, its host's first) sends S in every round
    that has it send, across hosts where the step leaves its host; the other links carry
    a token per round. ``confirm`` is unused: the rounds are the confirmation."""
    del confirm
    n, local, s = shape.world, shape.local, shape.nbytes
    if n == 1:
        return []
    rounds = rounds_of(n)
    sent = [
        (v + step(k, n)) // local != 0
        for v in range(min(local, n))
        for k in range(rounds)
        if carries_data(v, k, n)
    ]
    crossing = sum(min(step(k, n), local) for k in range(rounds))
    nbytes = _on(
        shape,
        fabric,
        sent.count(False) * s + rounds * TOKEN_BYTES,
        sent.count(True) * s + crossing * TOKEN_BYTES,
    )
    if shape.hosts == 1:
        nbytes[fabric.intra] = len(sent) * s + rounds * TOKEN_BYTES
    nbytes[FRAME] = 2 * rounds + len(sent)
    hops = {_hop_kind(shape, fabric): rounds}
    return [Phase("broadcast dissemination", hops, nbytes, symmetric=True)]


def _in_host(name: str, shape: Shape, fabric: Fabric, nbytes: float) -> list[Phase]:
    """One hop between each leader and its L-1 ranks, ``nbytes`` per rank (nothing if L = 1)."""
    local = shape.local
    if local == 1:
        return []
    return [Phase(name, {fabric.intra: 1}, {fabric.intra: (local - 1) * nbytes, FRAME: local - 1})]


def barrier_leaders_star(shape: Shape, fabric: Fabric, confirm: bool = True) -> list[Phase]:
    """Candidate: in-host gather, the leaders' star (2 hops, 2(H-1) frames at the root
    leader, (H-1) token frames on its host link each way), in-host release."""
    del confirm
    h = shape.hosts
    phases = _in_host("to leader", shape, fabric, TOKEN_BYTES)
    if h > 1:
        phases.append(
            Phase(
                "leaders' star",
                {fabric.inter: 2},
                {fabric.inter: (h - 1) * TOKEN_BYTES, FRAME: 2 * (h - 1)},
            )
        )
    return phases + _in_host("release", shape, fabric, TOKEN_BYTES)


def barrier_leaders_dissemination(
    shape: Shape, fabric: Fabric, confirm: bool = True
) -> list[Phase]:
    """Candidate: in-host gather, ceil(log2 H) dissemination rounds among the leaders
    (a frame to the leader 2^k hosts on, one from 2^k back, per round), in-host release."""
    del confirm
    h = shape.hosts
    phases = _in_host("to leader", shape, fabric, TOKEN_BYTES)
    if h > 1:
        rounds = math.ceil(math.log2(h))
        nbytes = {fabric.inter: rounds * TOKEN_BYTES, FRAME: 2 * rounds}
        # every leader sends and receives in each round: symmetric, as the flat rounds
        phases.append(Phase("dissemination", {fabric.inter: rounds}, nbytes, symmetric=True))
    return phases + _in_host("release", shape, fabric, TOKEN_BYTES)


def broadcast_direct(shape: Shape, fabric: Fabric, confirm: bool = True) -> list[Phase]:
    """The flat direct broadcast: 1 hop; the root sends (N-L) x S through its host link
    and (L-1) x S over its local links, N-1 frames (plus the confirmation's)."""
    n, local, s = shape.world, shape.local, shape.nbytes
    if n == 1:
        return []
    nbytes = _on(shape, fabric, (local - 1) * s, (n - local) * s)
    nbytes[FRAME] = n - 1
    if confirm:
        nbytes = _add(nbytes, _confirm_peers(shape, fabric))
    return [Phase("broadcast direct", _on(shape, fabric, 1, 1), nbytes)]


def _segments(s: int) -> tuple[int, int]:
    """(segment bytes, segment count) of a pipelined move of ``s`` bytes."""
    seg = min(s, Options().segment_bytes)
    return seg, math.ceil(s / seg) if seg else 0


def _store_and_forward(name: str, kind: str, hops: int, seg: int) -> Phase:
    """The first segment through ``hops`` links of ``kind`` in sequence, each receiving it
    whole before passing it on: ``hops`` alphas and ``hops`` segment times, of which
    all but one are the pipeline's fill (a link carries the segment once)."""
    return Phase(name, {kind: hops}, {kind: seg}, fill=hops - 1)


def broadcast_chain(shape: Shape, fabric: Fabric, confirm: bool = True) -> list[Phase]:
    """The flat chain in rank order: the first segment stores and forwards through H-1
    cross-host and N-H local hops, the rest streams at the slower link's rate (S per
    host link per direction: one crossing per host boundary); a middle rank handles
    2 frames per segment (plus the confirmation's)."""
    n, h, s = shape.world, shape.hosts, shape.nbytes
    if n == 1:
        return []
    seg, count = _segments(s)
    phases = []
    if h > 1:
        phases.append(_store_and_forward("chain across hosts", fabric.inter, h - 1, seg))
    if n > h:
        phases.append(_store_and_forward("chain inside hosts", fabric.intra, n - h, seg))
    stream = _on(shape, fabric, s - seg, s - seg)
    stream[FRAME] = 2 * count
    if confirm:
        stream = _add(stream, _confirm_rounds(shape, fabric))
    return [*phases, Phase("chain stream", {}, stream)]


def broadcast_hosts_direct(shape: Shape, fabric: Fabric, confirm: bool = True) -> list[Phase]:
    """Candidate: the root to the H-1 other leaders at once ((H-1) x S on its host link,
    H-1 frames), then every leader to its L-1 ranks."""
    h, s = shape.hosts, shape.nbytes
    phases = []
    if h > 1:
        nbytes: dict[str, float] = {fabric.inter: (h - 1) * s, FRAME: h - 1}
        if confirm:
            nbytes = _add(nbytes, _confirm_peers(shape, fabric))
        phases.append(Phase("root to leaders", {fabric.inter: 1}, nbytes))
    return phases + _in_host("leader to ranks", shape, fabric, s)


def broadcast_hosts_tree(shape: Shape, fabric: Fabric, confirm: bool = True) -> list[Phase]:
    """Candidate: a binomial tree among the leaders (ceil(log2 H) rounds, S per round
    through a sender's host link, whole messages), then in-host fan-out."""
    h, s = shape.hosts, shape.nbytes
    phases = []
    if h > 1:
        rounds = math.ceil(math.log2(h))
        nbytes: dict[str, float] = {fabric.inter: rounds * s, FRAME: rounds}
        if confirm:
            nbytes = _add(nbytes, _confirm_peers(shape, fabric))
        phases.append(Phase("leaders' tree", {fabric.inter: rounds}, nbytes))
    return phases + _in_host("leader to ranks", shape, fabric, s)


def broadcast_hosts_chain(shape: Shape, fabric: Fabric, confirm: bool = True) -> list[Phase]:
    """The hosts' chain (``HOST_CHAIN``, collectives/broadcast.py; a candidate
    until the twenty-fifth session): the heads' chain, segment by segment,
    each head handing every segment to its L-1 ranks as it forwards it: H-1
    cross-host hops and 1 local hop store and forward the first segment; the
    rest streams, S per host link per direction, (L-1) x S out of a head over
    its local links. It confirms through the dissemination rounds, as the
    rank-order chain does."""
    h, local, s = shape.hosts, shape.local, shape.nbytes
    if shape.world == 1:
        return []
    seg, count = _segments(s)
    phases = []
    if h > 1:
        phases.append(_store_and_forward("leaders' chain", fabric.inter, h - 1, seg))
    if local > 1:
        phases.append(Phase("fan-out", {fabric.intra: 1}, {fabric.intra: (local - 1) * seg}))
    stream = _on(shape, fabric, (local - 1) * (s - seg), s - seg)
    stream[FRAME] = (local + 1) * count
    if confirm:
        stream = _add(stream, _confirm_rounds(shape, fabric))
    return [*phases, Phase("chain stream", {}, stream)]


def broadcast_algo(
    shape: Shape, topology: Topology | None = None, options: Options | None = None
) -> Algo:
    """The broadcast algorithm the policy picks for ``shape`` (with ``topology``)."""
    opts = Options() if options is None else options
    return choose(OpCode.BROADCAST, shape.nbytes, shape.world, opts, False, topology).algo


def broadcast_flat(
    shape: Shape,
    fabric: Fabric,
    confirm: bool = True,
    topology: Topology | None = None,
    algo: Algo | None = None,
) -> list[Phase]:
    """The one-host rule (policy.choose, BROADCAST, asked with no topology): the
    dissemination rounds with more than two ranks up to 64 KiB, direct with two ranks
    or up to ``star_max_bytes``, the chain above. With ``topology`` (what a run on
    emulated hosts ran): on slow hosts of consecutive ranks the policy takes the
    dissemination rounds up to 1 MiB and the chain above (measured,
    ``policy.broadcast_dissemination_max_bytes``). ``algo``: the one a
    measured run ran, where it differs from today's policy."""
    if algo is None:
        algo = broadcast_algo(shape, topology)
    if algo is Algo.DISSEMINATION:
        return broadcast_dissemination(shape, fabric, confirm)
    if algo is Algo.DIRECT or shape.world <= 2:
        return broadcast_direct(shape, fabric, confirm)
    if algo is Algo.HOST_CHAIN:
        return broadcast_hosts_chain(shape, fabric, confirm)
    return broadcast_chain(shape, fabric, confirm)


FLAT: dict[str, Rooted] = {"barrier": barrier_dissemination, "broadcast": broadcast_flat}
RETUNED: dict[str, tuple[Rooted, ...]] = {
    "barrier": (barrier_dissemination, barrier_star),
    "broadcast": (broadcast_dissemination, broadcast_direct, broadcast_chain),
}
CANDIDATES: dict[str, dict[str, Rooted]] = {
    "barrier": {
        "leaders star": barrier_leaders_star,
        "leaders dissemination": barrier_leaders_dissemination,
    },
    "broadcast": {
        "hosts direct": broadcast_hosts_direct,
        "hosts tree": broadcast_hosts_tree,
        "hosts chain": broadcast_hosts_chain,
    },
}


@dataclass(frozen=True)
class Compared:
    """The flat algorithm against the fastest host-aware candidate, for one shape."""

    op: str
    shape: Shape
    flat_s: float
    candidate: str
    host_aware_s: float
    retuned_s: float  # the fastest flat algorithm (broadcast: direct or chain, any threshold)

    @property
    def ratio(self) -> float:
        """Host-aware time / flat time: below 1, host-aware pays."""
        return self.host_aware_s / self.flat_s if self.flat_s > 0 else 1.0

    @property
    def retuned_ratio(self) -> float:
        """The fastest flat algorithm's time / the policy's: what a threshold alone gains."""
        return self.retuned_s / self.flat_s if self.flat_s > 0 else 1.0


def compare(
    op: str,
    shape: Shape,
    fabric: Fabric,
    links: LinkTable,
    confirm: bool = True,
    where: Conditions = DEDICATED,
) -> Compared:
    """``op`` ("barrier" or "broadcast") flat against its fastest candidate on ``shape``.

    ``confirm``: whether the candidates keep the flat broadcast's header confirmation
    (the flat one always does: it is the code). ``links`` without ``FRAME``: the
    assumed ``ASSUMED_FRAME_S``."""
    links = with_frame(links)
    flat = total_time(FLAT[op](shape, fabric, True), links, where)
    times = {
        name: total_time(algo(shape, fabric, confirm), links, where)
        for name, algo in CANDIDATES[op].items()
    }
    best = min(times, key=lambda k: times[k])
    flats = [total_time(algo(shape, fabric, True), links, where) for algo in RETUNED[op]]
    return Compared(op, shape, flat, best, times[best], min(flats))


def cross_host_bytes(phases: list[Phase], inter: str) -> float:
    """Bytes through the busiest host link per direction over all phases."""
    return sum(p.nbytes.get(inter, 0.0) for p in phases)


TABLE_SHAPES = ((2, 2), (4, 2), (8, 8), (64, 8), (1024, 8))
TABLE_SIZES = {"barrier": (0,), "broadcast": (0, 4 << 10, 1 << 20, 64 << 20)}
FRAME_CASES = (0.0, ASSUMED_FRAME_S, 20e-6)
PLAN_HOSTS = tuple(2**i for i in range(1, 11))
PLAN_LOCALS = (2, 8)
PAYS = 0.95  # host-aware "pays" where it takes at most this share of the flat time
PLAN_SIZES = {"barrier": (0,), "broadcast": (0, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)}


def ratio_table(op: str, links: LinkTable, fabric: Fabric, confirm: bool = True) -> str:
    """Markdown: host-aware / flat for ``op`` per shape and size, with ``FRAME`` at each
    of ``FRAME_CASES`` (cells ``ratio (candidate)``, one per frame cost, "/" between)."""
    sizes = TABLE_SIZES[op]
    frames = " / ".join(f"{f * 1e6:.0f} µs" for f in FRAME_CASES)
    head = f"| H x L (frame {frames}) | " + " | ".join(format_bytes(s) for s in sizes) + " |"
    lines = [head, "|---" * (len(sizes) + 1) + "|"]
    for h, local in TABLE_SHAPES:
        cells = []
        for s in sizes:
            shape = Shape(h, local, s)
            got = [compare(op, shape, fabric, with_frame(links, f), confirm) for f in FRAME_CASES]
            cells.append(" / ".join(f"{c.ratio:.2f} ({c.candidate})" for c in got))
        lines.append(f"| {h} x {local} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def crossover_lines(op: str, links: LinkTable, fabric: Fabric, confirm: bool = True) -> list[str]:
    """Per (H, L) of ``PLAN_HOSTS`` x ``PLAN_LOCALS``: the sizes of ``PLAN_SIZES`` where
    the fastest candidate pays (at most ``PAYS`` of the flat time), by how much
    (host-aware / flat), beside what the fastest flat algorithm alone would give."""
    out = []
    for h in PLAN_HOSTS:
        for local in PLAN_LOCALS:
            got = [compare(op, Shape(h, local, s), fabric, links, confirm) for s in PLAN_SIZES[op]]
            wins = [c for c in got if c.ratio <= PAYS]
            if not wins:
                out.append(
                    f"- {h} x {local}: flat everywhere (best {min(c.ratio for c in got):.2f})"
                )
                continue
            cells = ", ".join(
                f"{format_bytes(c.shape.nbytes)} {c.ratio:.2f} ({c.candidate}; "
                f"flat retuned {c.retuned_ratio:.2f})"
                for c in wins
            )
            out.append(f"- {h} x {local}: host-aware at {cells}")
    return out

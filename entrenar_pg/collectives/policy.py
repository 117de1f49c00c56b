"""The algorithm policy: the one place that turns a call and the Options into a plan choice.

``choose(op, nbytes, world, options)`` returns a ``Choice``: which algorithm
runs (the ``wire.Algo`` its headers carry), whether contributions are summed
in the canonical tree order over ranks (``Options.deterministic``) or in rank
/ ring order, the pipelining segment and the header flags. Nothing else reads
``Options.algorithm``, ``deterministic``, ``direct_max_bytes``,
``star_max_bytes`` or ``segment_bytes``: the runtime asks here, and the plan
builders follow the ``Choice`` they are handed (``Call.choice``).

The table (docs/architecture.md, "The policy table", lists it row by row):

- One rank, any op: ``NONE`` (nothing moves; local copies only).
- ``ALLREDUCE``: ``algorithm="auto"``: every rank on one host with shared
  memory between all (``local``: the slot areas exist): ``SHM`` at any size
  and world (collectives/shm_allreduce.py: reduced straight from each
  other's memory); else, several hosts (``host_aware``: ``Mesh.topology``
  at least 2 hosts of the same number >= 2 of ranks, and ``topology="hosts"``
  or ``"auto"`` with the cross-host link measured slow at set-up,
  ``Topology.fast_links``; a loopback-class link takes the flat rows;
  deterministic also each host's ranks consecutive and one subtree of the
  canonical tree, else the flat rows keep the bits): ``HOST_LEADERS`` up to
  ``host_leaders_max_bytes`` while the leaders' direct exchange puts at
  most ``host_leaders_link_bytes`` on each host link (``leaders_fit``;
  ``STAR`` instead on few hosts while the
  star's extra bytes on the root host's link stay within
  ``host_star_max_bytes``: ``star_beats_leaders``), ``HOST_SLICES`` above
  (collectives/hierarchical.py; crossovers measured on 1 Gbit/s host links
  with a core per rank, docs/benchmarks.md); uneven hosts, one host without shared memory
  between all, or one rank per host: the flat rows; with two ranks ``DIRECT`` up to
  ``direct_max_bytes``, else ``RING``; with more, ``STAR`` up to
  ``star_max_bytes``, else ``RING`` (crossovers measured on 2 cores,
  docs/benchmarks.md), except that from ``FLAT_DOUBLING_MIN_WORLD`` ranks
  ``DOUBLING`` replaces the star (no rank with a socket to every rank; the
  cost model's crossover). An explicit ``algorithm`` is taken as is.
  Deterministic: ``RING`` becomes ``TREE_RING`` (the ring's order differs per
  chunk); ``STAR``, ``DIRECT`` and ``SHM`` keep their plan and sum in tree
  order; ``DOUBLING`` sums in tree order in either mode.
- ``BARRIER``: ``DISSEMINATION`` (ceil(log2 N) rounds, rank r to r + 2^k).
- ``BROADCAST``: more than two ranks and up to 64 KiB (several hosts of
  consecutive ranks over a slow link: 256 KiB; never above
  ``star_max_bytes``: ``broadcast_dissemination_max_bytes``):
  ``DISSEMINATION`` (the binomial tree on the barrier's rounds); else
  ``DIRECT`` from the root with two ranks or up to
  ``star_max_bytes`` (several hosts over a slow link: up to 64 KiB,
  measured: ``broadcast_direct_max_bytes``);
  ``CHAIN`` (pipelined, in rank order from the root) above; on several
  hosts (``several_hosts``, as the allreduce's host-aware rows) the chain
  through one head per host instead (``HOST_CHAIN``: a host link carries the
  message once whatever the ranks' placement, and the first segment makes
  H-1 + 1 hops where the rank-order chain makes N-1; in the cost model never
  slower; 2-64 MiB on 64 hosts 0.94-0.97x its time with 2 ranks per host,
  0.68-0.80x with 8: docs/benchmarks.md).
- ``REDUCE``: ``STAR`` with two ranks or up to ``star_max_bytes``; above, a
  reduce-scatter, ``RING`` (``DIRECT``, the tree halving, when
  deterministic), then each rank's chunk straight to the root.
- ``REDUCE_SCATTER``: ``RING``, ``DIRECT`` (the tree halving) when
  deterministic; several hosts (``host_aware``, as for the allreduce:
  deterministic only where the hosts are subtrees of the canonical tree)
  ``HOST_SLICES``.
- ``ALLGATHER``: ``RING``; several hosts ``HOST_SLICES``. Everything else
  (gather, scatter, all-to-all, sparse allreduce, the checker's exchange): ``DIRECT``.
- Every row: ``tree`` and the header's ``DETERMINISTIC`` flag follow
  ``deterministic``; the segment is ``segment_bytes``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import Options
from ..reduce_ops import tree_has_blocks
from ..transport.topology import Topology
from ..wire import Algo, Flags, OpCode


class Choice(NamedTuple):
    """How one collective runs on one rank (every rank computes the same one)."""

    algo: Algo  # the plan, as its headers name it
    tree: bool  # sum in the canonical tree order over ranks (else rank / ring order)
    segment_bytes: int  # pipelining unit of ring, star, chain and the tree halving
    flags: Flags  # the header's flags

    def segment_elems(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` per segment (at least one)."""
        return max(1, self.segment_bytes // dtype.itemsize)


_NAMED = {"ring": Algo.RING, "star": Algo.STAR, "direct": Algo.DIRECT, "doubling": Algo.DOUBLING}


def host_aware(topology: Topology | None, options: Options) -> bool:
    """Whether the host-aware algorithms may run (collectives/hierarchical.py):
    ``topology="auto"``, at least two hosts of the same number (at least two)
    of ranks; deterministic, also the canonical tree's order kept: every
    host's ranks consecutive and one subtree (else the flat algorithms keep
    the bits)."""
    if not several_hosts(topology, options):
        return False
    if options.deterministic:
        assert topology is not None and topology.shape is not None
        return topology.is_contiguous and tree_has_blocks(topology.world, topology.shape[1])
    return True


def several_hosts(topology: Topology | None, options: Options) -> bool:
    """At least two hosts of the same number (>= 2) of ranks, and: ``topology="hosts"``,
    or ``"auto"`` where the cross-host link measured slower than a link inside a
    host (``Topology.fast_links``, transport/link_probe.py: on a loopback-class
    link the host-aware phases are CPU the link does not repay)."""
    if topology is None or options.topology == "flat":
        return False
    shape = topology.shape
    if shape is None or shape[0] < 2 or shape[1] < 2:
        return False
    return options.topology == "hosts" or not topology.fast_links


# Recursive doubling among the leaders: from this many hosts (a power of two;
# 2 x L and 4 x L keep the measured direct exchange), where the direct
# exchange's extra bytes on each host link, (H - 1 - log2 H) x S, cost more
# than the extra hops, (log2 H - 1), each worth HOP_BYTES: a cross-host hop's
# alpha in bytes of the link (the cost model's fitted net kind at 1 Gbit/s:
# 168 us x 119 MB/s = 20 KiB). That puts the crossover at 10 KiB for 8
# hosts, 1.8 KiB for 64, under 200 B for 1,024 (the model's plan,
# docs/benchmarks.md; no layout this large can run here).
DOUBLING_MIN_HOSTS = 8
HOP_BYTES = 20 << 10


def leaders_doubling(hosts: int, nbytes: int) -> bool:
    """Whether ``hosts`` leaders exchange ``nbytes`` by recursive doubling (else directly)."""
    if hosts < DOUBLING_MIN_HOSTS or hosts & (hosts - 1):
        return False
    rounds = hosts.bit_length() - 1
    return (hosts - 1 - rounds) * nbytes > (rounds - 1) * HOP_BYTES


def leaders_fit(hosts: int, nbytes: int, options: Options) -> bool:
    """Whether an ``nbytes`` allreduce on ``hosts`` hosts goes through the leaders
    (else in slices): up to ``host_leaders_max_bytes``, and where the leaders
    exchange directly, while the (H - 1) copies each leader sends at once stay
    within ``host_leaders_link_bytes`` on its host's link (96 KiB). The slices
    put 2(H - 1)/H x ``nbytes`` on it, in 2(H - 1) + 2 hops to the leaders' 3.

    Measured on emulated hosts at 1 Gbit/s with a core per rank (the 16-core
    device machine, docs/benchmarks.md, "A core per rank"): 2 x 2 the leaders
    at or under the slices' time up to 64 KiB (525 against 602 us); 4 x 2
    equal at 32 KiB (96 KiB on the link: 868 against 806 us), the slices
    0.61x at 64 KiB (1.06 against 1.73 ms: the leaders were 1.21x gloo's time
    there); 8 x 2, where the leaders double (log2 H rounds of one copy), the
    leaders 0.48x at 32 KiB and 0.92x at 64 KiB. On the 2-core machine,
    where eight ranks share two cores and every hop waits for a process, the
    crossover is higher (4 x 2 near 100 KiB: 64 KiB in slices 5.8 against
    4.0 ms, 0.31x gloo's time either way); a real host has a core per rank.
    """
    if nbytes > options.host_leaders_max_bytes:
        return False
    direct = (hosts - 1) * nbytes <= options.host_leaders_link_bytes
    return direct or leaders_doubling(hosts, nbytes)


# How many more messages than a leader the star's root may handle (each a
# few tens of µs of Python) for its hop fewer (a process wake-up, 100-300 µs
# on the 2 loaded cores measured): 4 hosts x 2 (two more) measured, below.
STAR_MORE_MESSAGES = 2


def star_beats_leaders(topology: Topology, nbytes: int, options: Options) -> bool:
    """Whether the flat star serves a message meant for the host-aware leaders better.

    The star is one hop shorter (2 against the leaders' 3, each a wake-up of
    a process) and moves (N - L - H + 1) x ``nbytes`` more through the root
    host's link, each way, than the leaders' (H - 1) x ``nbytes``; its root
    handles N - 1 messages, a leader (L - 1) + (H - 1) + (L - 1), so
    (H - 2)(L - 1) more. The star, then, where that is at most
    ``STAR_MORE_MESSAGES`` (2 x L, 3 x 2, 3 x 3, 4 x 2) and the extra bytes
    at most ``host_star_max_bytes`` (2 x 2: up to 16 KiB; 4 x 2: 5 KiB).
    Measured on emulated hosts at 1 Gbit/s with a core per rank (the
    16-core device machine, docs/benchmarks.md, "A core per rank"): 2 x 2
    the star 0.78-0.85x the leaders' time at 4-16 KiB, 1.9x at 32 KiB and
    2.2x at 64 KiB (1.57x gloo's time); 4 x 2 at 16 KiB (48 KiB more at
    host 0) 1.9x. (On the 2-core machine, where every hop waits for a
    process, the star held to 64 KiB at 2 x 2: docs/benchmarks.md, "Issue
    26, small messages on few hosts".)
    """
    shape = topology.shape
    assert shape is not None
    hosts, local = shape
    more_messages = (hosts - 2) * (local - 1)
    extra = (hosts * local - local - hosts + 1) * nbytes
    return more_messages <= STAR_MORE_MESSAGES and extra <= options.host_star_max_bytes


# Broadcast on several hosts over a slow link: the root sends to every rank
# itself (``DIRECT``) up to this many bytes, the chain above. Measured on
# emulated hosts at 1 Gbit/s (benchmarks/model/rooted_measure.py, the one-host
# rule against this one, docs/benchmarks.md "Barrier and broadcast"): at 2 x 2
# DIRECT 0.49 ms against the chain's 0.69 at 64 KiB, 1.18 against 0.81 at
# 128 KiB, 16.1 against 8.3 at 1 MiB; at 4 x 2 2.25 against 2.85 ms at 64 KiB,
# 10.6 against 5.4 at 256 KiB, 52.3 against 26.3 at 1 MiB. (The cost model
# puts the crossover at 24-40 KiB; tbf's 128 KiB burst lets the first bytes
# of DIRECT's (N - L) x S through at once, which it does not charge.)
HOST_BROADCAST_DIRECT_MAX_BYTES = 64 << 10


# Broadcasts of more than two ranks up to these many bytes go along the
# dissemination rounds (a binomial tree, ceil(log2 N) hops, headers checked
# along the rounds: 2 ceil(log2 N) frames per rank where ``DIRECT`` and its
# header confirmation with every peer handle 2(N - 1), and a socket to every
# peer). Measured with benchmarks/model/rooted_measure.py against the star
# barrier's tree (docs/benchmarks.md, "Barrier and broadcast: the
# dissemination rounds"; 2-core machine, load 4-18): one host of 4, 4 KiB
# 0.79 against DIRECT's 0.94 ms, 64 KiB 0.85 against 0.86, 256 KiB 0.96
# against 0.89: up to 64 KiB. Several hosts of consecutive ranks at 1 Gbit/s,
# against the chain above 64 KiB: 256 KiB 1.2-1.6 against 1.9-2.0 ms at
# 2 x 2, 4.1-5.7 against 6.9-8.0 ms at 4 x 2. At 1 MiB (eighteenth session,
# one run each, gloo in the same job): 8.1 against 8.3 ms at 2 x 2, 17.5
# against 24.4 at 4 x 2, 34.8 against 53.1 at 8 x 1 (gloo's binomial tree
# 40.6-42: the chain's 1 MiB segment made it store-and-forward, 1.26x gloo):
# up to 1 MiB, the cap (``star_max_bytes``). Above it the chain's segments
# pipeline: S/B + (N - 2) segments against the tree's log2(H) x S/B.
BROADCAST_DISSEMINATION_MAX_BYTES = 64 << 10
HOST_BROADCAST_DISSEMINATION_MAX_BYTES = 1 << 20


def broadcast_dissemination_max_bytes(topology: Topology | None, options: Options) -> int:
    """The largest broadcast of more than two ranks sent along the
    dissemination rounds (``DISSEMINATION``); larger ones go ``DIRECT`` or
    down the ``CHAIN`` (``broadcast_direct_max_bytes``).

    ``HOST_BROADCAST_DISSEMINATION_MAX_BYTES`` on several hosts of
    consecutive ranks over a slow link (the tree's long steps cross hosts,
    its short ones stay inside), else ``BROADCAST_DISSEMINATION_MAX_BYTES``;
    never above ``star_max_bytes`` (above it a chain is asked for).
    """
    if slow_contiguous_hosts(topology, options):
        return min(options.star_max_bytes, HOST_BROADCAST_DISSEMINATION_MAX_BYTES)
    return min(options.star_max_bytes, BROADCAST_DISSEMINATION_MAX_BYTES)


def broadcast_direct_max_bytes(topology: Topology | None, options: Options) -> int:
    """The largest broadcast the root sends to every rank itself (``DIRECT``);
    larger ones go down a chain (``CHAIN``, or ``HOST_CHAIN`` on several hosts).

    One host: ``star_max_bytes`` (measured on loopback). Several hosts over a
    slow link where the chain crosses each host boundary once (S on a host
    link, where ``DIRECT`` puts (N - L) x S on the root host's):
    ``HOST_BROADCAST_DIRECT_MAX_BYTES``. That is every uniform layout
    (``several_hosts``: the hosts' chain, whatever the placement; the cost
    model puts its crossover with ``DIRECT`` at 16-64 KiB from 2 x 2 to
    8 x 8) and one rank per host (the rank-order chain).
    """
    if slow_contiguous_hosts(topology, options) or several_hosts(topology, options):
        return min(options.star_max_bytes, HOST_BROADCAST_DIRECT_MAX_BYTES)
    return options.star_max_bytes


def slow_contiguous_hosts(topology: Topology | None, options: Options) -> bool:
    """Several hosts over a slow link (``several_hosts``) whose ranks are
    consecutive: the broadcast's rows for a tree or chain that crosses each
    host boundary once. One rank per host counts too (unless
    ``topology="flat"``): every hop crosses a host, and there is no link
    inside a host to probe against. There the one-host rule sent 256 KiB
    ``DIRECT``, (N - 1) x S through the root's link: 8 hosts x 1 at 1 Gbit/s,
    14.8 ms against gloo's binomial tree's 7.2 (docs/benchmarks.md,
    seventeenth session)."""
    if topology is None or not topology.is_contiguous:
        return False
    shape = topology.shape
    if shape is not None and shape[0] >= 2 and shape[1] == 1:
        return options.topology != "flat"
    return several_hosts(topology, options)


# The flat rows' small messages from this many ranks: recursive doubling in
# the canonical tree's shape (collectives/doubling.py: ceil(log2 N) partners
# and hops per rank) instead of the star, whose root holds a socket to every
# rank, handles 2(N - 1) frames in sequence and moves (N - 1) x S each way.
# The cost model on a core per rank (``python -m benchmarks.model flat``,
# docs/benchmarks.md): one rank per host, doubling is faster from N = 4 at
# every size up to star_max_bytes (0.57x the star's time at 16, 0.08x at 256
# for 4 KiB); one host over TCP, from 4 for 64 KiB and up but only from 32
# for 4 KiB (1.05-1.11x the star's time at 8-16, 0.83x at 32). So from 32:
# no layout slower in the model, and at N = 256 no rank above
# 2 log2 N + 2 data sockets where the star's root held N - 1. (Measured here,
# N ranks sharing 2 cores, the star's 2 hops stay cheaper at every N: each
# hop waits for a process to be scheduled; docs/benchmarks.md.)
FLAT_DOUBLING_MIN_WORLD = 32


def choose(
    op: OpCode,
    nbytes: int,
    world: int,
    options: Options,
    local: bool = False,
    topology: Topology | None = None,
) -> Choice:
    """The ``Choice`` for collective ``op`` of ``nbytes`` payload bytes on ``world`` ranks;
    ``local``: every rank is on this host with shared memory between all
    (``Mesh.all_local``: its slot areas exist; the same on every rank);
    ``topology``: which ranks share a host (``Mesh.topology``, the same on every rank)."""
    tree = options.deterministic
    if world == 1:
        algo = Algo.NONE
    elif op is OpCode.ALLREDUCE:
        name = options.algorithm
        if name != "auto":
            algo = _NAMED[name]
        elif local:
            algo = Algo.SHM
        elif host_aware(topology, options):
            assert topology is not None and topology.shape is not None
            if not leaders_fit(topology.shape[0], nbytes, options):
                algo = Algo.HOST_SLICES
            elif star_beats_leaders(topology, nbytes, options):
                algo = Algo.STAR
            else:
                algo = Algo.HOST_LEADERS
        elif world == 2:
            algo = Algo.DIRECT if nbytes <= options.direct_max_bytes else Algo.RING
        elif nbytes > options.star_max_bytes:
            algo = Algo.RING
        else:
            algo = Algo.DOUBLING if world >= FLAT_DOUBLING_MIN_WORLD else Algo.STAR
        if algo is Algo.RING and tree:
            algo = Algo.TREE_RING
    elif op is OpCode.BROADCAST:
        if world > 2 and nbytes <= broadcast_dissemination_max_bytes(topology, options):
            algo = Algo.DISSEMINATION
        elif world <= 2 or nbytes <= broadcast_direct_max_bytes(topology, options):
            algo = Algo.DIRECT
        elif several_hosts(topology, options):
            algo = Algo.HOST_CHAIN
        else:
            algo = Algo.CHAIN
    elif op is OpCode.REDUCE:
        if world <= 2 or nbytes <= options.star_max_bytes:
            algo = Algo.STAR
        else:
            algo = Algo.DIRECT if tree else Algo.RING
    elif op is OpCode.REDUCE_SCATTER:
        if host_aware(topology, options):  # deterministic: the tree's order kept
            algo = Algo.HOST_SLICES
        else:
            algo = Algo.DIRECT if tree else Algo.RING
    elif op is OpCode.ALLGATHER:
        algo = Algo.HOST_SLICES if several_hosts(topology, options) else Algo.RING
    elif op is OpCode.BARRIER:
        algo = Algo.DISSEMINATION
    else:
        algo = Algo.DIRECT
    flags = Flags.DETERMINISTIC if tree else Flags.NONE
    return Choice(algo, tree, options.segment_bytes, flags)

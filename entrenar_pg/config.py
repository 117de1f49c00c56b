"""Configuration: one frozen, keyword-only dataclass, read from ``ENTRENAR_*``.

Nothing else in the package reads the environment. ``Options.from_env()`` is
called once per process group at creation; a user can also pass an ``Options``
instance as ``pg_options`` to ``init_process_group`` / ``new_group``, which wins
over the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

# Environment variable names (one constant each, so grep finds every use).
ENV_ALGORITHM = "ENTRENAR_ALGO"
ENV_SEGMENT_BYTES = "ENTRENAR_SEGMENT_BYTES"
ENV_STAR_MAX_BYTES = "ENTRENAR_STAR_MAX_BYTES"
ENV_DIRECT_MAX_BYTES = "ENTRENAR_DIRECT_MAX_BYTES"
ENV_DETERMINISTIC = "ENTRENAR_DETERMINISTIC"
ENV_CHECK = "ENTRENAR_CHECK"
ENV_HOST = "ENTRENAR_HOST"
ENV_IFNAME = "ENTRENAR_IFNAME"
ENV_SOCKET_BUFFER_BYTES = "ENTRENAR_SOCKET_BUFFER_BYTES"
ENV_SPIN_US = "ENTRENAR_SPIN_US"
ENV_CALLER_SPIN_US = "ENTRENAR_CALLER_SPIN_US"
ENV_IDLE_SPIN_US = "ENTRENAR_IDLE_SPIN_US"
ENV_INLINE_MAX_BYTES = "ENTRENAR_INLINE_MAX_BYTES"
ENV_CHECK_TOLERANCE = "ENTRENAR_CHECK_TOLERANCE"
ENV_LEDGER = "ENTRENAR_LEDGER"
ENV_TRANSPORT = "ENTRENAR_TRANSPORT"
ENV_TOPOLOGY = "ENTRENAR_TOPOLOGY"
ENV_HOST_LEADERS_MAX_BYTES = "ENTRENAR_HOST_LEADERS_MAX_BYTES"
ENV_HOST_LEADERS_LINK_BYTES = "ENTRENAR_HOST_LEADERS_LINK_BYTES"
ENV_HOST_STAR_MAX_BYTES = "ENTRENAR_HOST_STAR_MAX_BYTES"
ENV_HOST_ID = "ENTRENAR_HOST_ID"
ENV_SHM_PLACEMENT = "ENTRENAR_SHM_PLACEMENT"
ENV_TCP_PLACEMENT = "ENTRENAR_TCP_PLACEMENT"
ENV_MASTER_ADDR = "MASTER_ADDR"  # torch's own; read only to pick the listen address
# torchrun's; every restart attempt reuses the same store, so our keys carry it.
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
# torch's flight-recorder names (each with the older NCCL-era name torch still reads).
ENV_FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
ENV_FR_BUFFER_SIZE_OLD = "TORCH_NCCL_TRACE_BUFFER_SIZE"
ENV_FR_DUMP_ON_TIMEOUT = "TORCH_FR_DUMP_ON_TIMEOUT"
ENV_FR_DUMP_ON_TIMEOUT_OLD = "TORCH_NCCL_DUMP_ON_TIMEOUT"
ENV_FR_DUMP_TEMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
ENV_FR_DUMP_TEMP_FILE_OLD = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
# Where torch 2.13 puts dumps when no prefix is given: $XDG_CACHE_HOME (else
# $HOME/.cache, else /tmp/.cache) /torch/comm_lib_trace_rank_<rank>.
ENV_XDG_CACHE_HOME = "XDG_CACHE_HOME"
ENV_HOME = "HOME"
FR_DEFAULT_FILE_NAME = "comm_lib_trace_rank_"

ALGORITHMS = ("auto", "ring", "star", "direct", "doubling")
TRANSPORTS = ("auto", "tcp", "shm")
TOPOLOGIES = ("auto", "flat", "hosts")

# Time bounds: every fixed wait of the package, in seconds (a group's own
# timeout is the caller's: ``GroupTimeout``).
#
# The shortest timeout a wait accepts: a timedelta that rounds to zero or
# below (or a deadline already past) still gets one poll, not a busy error.
MIN_TIMEOUT_S = 0.001
# The longest one sleep on shared-memory words or rings lasts before they are
# looked at again: only a lost wake-up needs it (``shm._Fence``), and this is
# what one costs.
SHM_SLEEP_CAP_S = 0.05
# How long abort() waits for each of the group's two threads to end, the p2p
# thread (a break hook) and then the comm thread: both wake at once when the
# links drop, so only a completion callback of the caller's can keep one
# longer (it then ends on its own, as a daemon, once its job fails). One bound
# for both: the joins run in turn, and two of them stay under abort()'s
# promise to return within a second.
ABORT_JOIN_S = 0.4
# How long the p2p thread waits for a peer's own connection after the peer
# hung up this rank's (``P2PChannel._out_event``): its handshake is done before
# it sends, so only the acceptor thread's hand-over is left; the messages it
# sent before leaving then complete their recvs.
P2P_ENDING_GRACE_S = 0.5
# How long shutdown() lets the running job finish before closing its links
# under it (a job waiting on a silent peer would otherwise keep its thread
# until the job's own timeout).
SHUTDOWN_DRAIN_S = 10.0


def timeout_seconds(timeout: timedelta) -> float:
    """``timeout`` in seconds, at least ``MIN_TIMEOUT_S``."""
    return max(timeout.total_seconds(), MIN_TIMEOUT_S)


class GroupTimeout:
    """The one keeper of a group's no-progress timeout.

    The runtime (collectives whose options set none) and the p2p channel read
    the same object, so ``set_timeout`` changes both at once.
    """

    __slots__ = ("seconds",)

    def __init__(self, timeout: timedelta) -> None:
        self.seconds = timeout_seconds(timeout)

    def set(self, timeout: timedelta) -> None:
        self.seconds = timeout_seconds(timeout)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True, kw_only=True)
class Options:
    """Every knob of an entrenar process group.

    Attributes:
        algorithm: allreduce algorithm: ``"ring"`` (bandwidth-optimal),
            ``"star"`` (rank 0 gathers, reduces, broadcasts: 2 hops),
            ``"direct"`` (everyone sends to everyone and reduces locally: 1 hop,
            (N-1) x the bytes), ``"doubling"`` (recursive doubling in the
            canonical tree's shape: ceil(log2 N) hops and partners per rank)
            or ``"auto"`` (the policy table, collectives/policy.py: two ranks
            direct up to ``direct_max_bytes``, ring above; more: star, from
            32 ranks doubling, up to ``star_max_bytes``, ring above; one
            host with shared memory: shm; several slow hosts: host-aware).
            Env ``ENTRENAR_ALGO``.
        segment_bytes: pipelining unit of the ring/star/chain algorithms: a
            chunk moves in segments of this many bytes so that receiving,
            reducing and sending overlap. Env ``ENTRENAR_SEGMENT_BYTES``.
        direct_max_bytes: with ``algorithm="auto"`` and two ranks (or every
            rank on one host), messages up to this many bytes use direct.
            Env ``ENTRENAR_DIRECT_MAX_BYTES``.
        star_max_bytes: with ``algorithm="auto"`` and more than two ranks,
            messages up to this many bytes use star, larger ones ring; also
            the size up to which a broadcast goes straight from the root.
            Measured crossovers: docs/benchmarks.md. Env ``ENTRENAR_STAR_MAX_BYTES``.
        deterministic: fix the summation order of every reduction to the
            canonical pairwise tree over ranks, so results are bitwise
            reproducible and identical across algorithms.
            Env ``ENTRENAR_DETERMINISTIC``.
        check: run the contract checker (C-RING-001 on every allreduce,
            F-DP-003 on every allreduce input, C-DDP-001 after every optimizer
            step). Env ``ENTRENAR_CHECK``.
        check_tolerance: relative tolerance of the C-RING-001 float checksum
            comparison. Env ``ENTRENAR_CHECK_TOLERANCE``.
        ledger: path of the run ledger (empty: none). After every optimizer
            step, rank 0 appends one JSON line: the step, the world size, a
            SHA-256 of the parameters, the checker's verdicts and the previous
            line's hash (a hash chain); ``python -m entrenar_pg.ledger`` verifies
            and compares ledgers (``entrenar_pg/ledger_writer.py``).
            Env ``ENTRENAR_LEDGER``.
        host: address to listen on and publish to peers. Empty: the address of
            ``ifname`` if set, else the local address that routes to
            ``MASTER_ADDR``, else 127.0.0.1. Env ``ENTRENAR_HOST``.
        ifname: network interface whose IPv4 address to listen on (used when
            ``host`` is empty). Env ``ENTRENAR_IFNAME``.
        socket_buffer_bytes: SO_SNDBUF/SO_RCVBUF for every peer socket;
            0 keeps the kernel's autotuning. Env ``ENTRENAR_SOCKET_BUFFER_BYTES``.
        spin_us: how long the comm thread busy-polls, for a new job and for a
            peer's bytes, before sleeping (a sleeping thread costs tens of us
            to wake on these machines, and DDP waits for its last bucket with
            nothing else to do). Each turn yields the core and the GIL
            (``sched_yield``), so a thread that is computing on that core, or
            that needs the GIL, runs first. 0 turns it off.
            Env ``ENTRENAR_SPIN_US``.
        caller_spin_us: the same, for a collective running in the caller's
            thread (a blocking call on an idle group): the caller waits anyway,
            so polling costs no work, and a 4 KiB allreduce's median halved
            here with it. Each turn yields the core (``sched_yield``), so ranks
            sharing a core still make progress. Env ``ENTRENAR_CALLER_SPIN_US``.
        idle_spin_us: how long a wait may go on spinning past its thread's
            spin (``spin_us`` or ``caller_spin_us``) while no other thread
            waits for a core: the machine's runnable threads no more than
            this process's CPUs (``transport/spin.py``). Meant for hosts
            with a core per rank, where a halted core's wake-up (a virtual
            machine's vCPU above all) may cost more than a hop. 0 (the
            default): the threads' spins alone. On the two cores here it
            gains nothing: where ranks share them (4 x 2 emulated hosts) it
            cost up to 1.26x at 4 KiB, and where a rank has a core (2 x 1)
            it changed no time but burned CPU (1 MiB: 1.8 cores against
            0.5). Its gain where wake-ups are dear is not measured yet
            (docs/benchmarks.md, "The idle spin"). Never starts a spin where
            that spin is 0.
            Env ``ENTRENAR_IDLE_SPIN_US``.
        inline_max_bytes: an *async* collective (``async_op=True``, DDP's
            buckets) of at most this many bytes issued while the group is idle
            runs in the caller's thread instead of the comm thread (saves two
            thread wake-ups, but the call returns only once every peer took
            part, and a program that issues async collectives on two groups
            in a different order on different ranks deadlocks); 0 disables.
            Blocking calls on CPU tensors always run in the caller's thread
            when the group is idle: the caller waits anyway.
            Env ``ENTRENAR_INLINE_MAX_BYTES``.
        transport: how collective data moves between two ranks: ``"auto"``
            (shared memory between ranks on the same host, TCP to the
            others), ``"tcp"`` (TCP between every pair) or ``"shm"`` (shared
            memory between every pair; group creation fails, naming the
            ranks, if some peer is not on this host). The control channel,
            p2p and set-up stay on TCP in every mode (docs/architecture.md,
            "Shared-memory transport"). Env ``ENTRENAR_TRANSPORT``.
        shm_placement: keep the ranks that share a slot area on cores of their
            own: a rank whose shared-memory wait finds its peer running on its
            own core moves its thread to a core no peer names, by narrowing
            its affinity for an instant and restoring it
            (``transport/shm/placement.py``; never where the ranks outnumber
            the thread's CPUs). False: the threads' placement is left to the
            scheduler alone. Env ``ENTRENAR_SHM_PLACEMENT``.
        tcp_placement: the same for the ranks of one host that talk over
            TCP: a rank whose spinning wait gave its core away before a
            lower local peer's bytes came, and finds that the peer last sent
            from its own core (``SO_INCOMING_CPU``), moves its thread off it
            (``transport/tcp_placement.py``; never where the host's ranks
            outnumber the thread's CPUs). Env ``ENTRENAR_TCP_PLACEMENT``.
        topology: ``"auto"``: the group learns which ranks share a host
            (``transport/topology.py``) and, when every host holds the same
            number of ranks (at least two hosts of at least two ranks),
            measures the cross-host link once at set-up
            (``transport/link_probe.py``); where it is slower than a link
            inside a host, allreduce runs host-aware
            (``collectives/hierarchical.py``: in the host over its local
            links, across hosts one rank per host or per slice), where it is
            as fast, flat; ``"hosts"``: host-aware on any link (the probe still runs,
            so set-up is alike on every rank; its verdict is ignored);
            ``"flat"``: every rank is treated alike, as on one host (the
            flat ring, star and direct). Env ``ENTRENAR_TOPOLOGY``.
        host_leaders_max_bytes: host-aware allreduce (``topology``): messages
            up to this many bytes go through one leader per host (3 hops,
            (H-1) x the bytes on each host link), larger ones in slices, one
            per rank of the host (2(H-1)/H x the bytes, more hops). Measured
            crossover: docs/benchmarks.md, "Emulated clusters".
            Env ``ENTRENAR_HOST_LEADERS_MAX_BYTES``.
        host_leaders_link_bytes: the most bytes the leaders' direct exchange
            may put on each host link at once, (H-1) x the message (every
            leader sends its host's sum to every other leader); a message
            for the leaders above it goes in slices, unless the leaders
            double (many hosts, ``collectives.policy.leaders_doubling``).
            Measured with a core per rank: docs/benchmarks.md, "A core per
            rank" (``collectives.policy.leaders_fit``).
            Env ``ENTRENAR_HOST_LEADERS_LINK_BYTES``.
        host_star_max_bytes: host-aware allreduce on few hosts (its root
            handling at most 2 more messages than a leader: 2 x L, 4 x 2),
            messages for the leaders: the flat star (2 hops, not 3) instead,
            while the bytes it adds on the root host's link,
            (N - L - H + 1) x the message, are at most this many (0: always
            the leaders; ``collectives.policy.star_beats_leaders``).
            Env ``ENTRENAR_HOST_STAR_MAX_BYTES``.
        host_id: a label added to this rank's host identity: ranks with
            different labels are never one host (no shared memory between
            them, different hosts for the topology), even on one machine.
            For tests and for containers that share a kernel and IPC
            namespace but should count as separate hosts; it can only
            split hosts, never join ranks the kernel keeps apart. Empty:
            the identity alone. Env ``ENTRENAR_HOST_ID``.
        master_addr: torch's ``MASTER_ADDR``, only used to choose ``host``.
        fr_buffer_size: how many of its latest collectives and p2p ops each
            group keeps for the flight recorder (0: none, nothing recorded).
            Env ``TORCH_FR_BUFFER_SIZE`` (or torch's older
            ``TORCH_NCCL_TRACE_BUFFER_SIZE``), as for NCCL and gloo.
        fr_dump_on_timeout: when the group breaks (a timeout, a peer's
            failure, a mismatch), write this process's flight-recorder dump
            to ``fr_dump_prefix`` + global rank. Env ``TORCH_FR_DUMP_ON_TIMEOUT``
            (or ``TORCH_NCCL_DUMP_ON_TIMEOUT``).
        fr_dump_prefix: the dump file's path without the rank. Env
            ``TORCH_FR_DUMP_TEMP_FILE`` (or ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``);
            empty: torch's default, ``$XDG_CACHE_HOME/torch/comm_lib_trace_rank_``
            (``$HOME/.cache/...`` without it; ``dump_prefix()``).
        attempt: torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``).
            torchrun hands every restart attempt the same store, so every key
            entrenar writes there (addresses, secret, abort records) is
            namespaced by it; otherwise a restarted job would read the dead
            attempt's addresses.
    """

    algorithm: str = "auto"
    segment_bytes: int = 1 << 20
    direct_max_bytes: int = 256 << 10
    star_max_bytes: int = 1 << 20
    deterministic: bool = False
    check: bool = False
    check_tolerance: float = 1e-3
    ledger: str = ""
    host: str = ""
    ifname: str = ""
    socket_buffer_bytes: int = 0
    spin_us: int = 200
    caller_spin_us: int = 50
    idle_spin_us: int = 0
    inline_max_bytes: int = 0
    transport: str = "auto"
    shm_placement: bool = True
    tcp_placement: bool = True
    topology: str = "auto"
    host_leaders_max_bytes: int = 64 << 10
    host_leaders_link_bytes: int = 96 << 10
    host_star_max_bytes: int = 16 << 10
    host_id: str = ""
    fr_buffer_size: int = 0
    fr_dump_on_timeout: bool = False
    fr_dump_prefix: str = ""
    master_addr: str = field(default="", repr=False)
    attempt: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"{ENV_ALGORITHM}/algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"{ENV_TRANSPORT}/transport must be one of {TRANSPORTS}, got {self.transport!r}"
            )
        if self.topology not in TOPOLOGIES:
            raise ValueError(
                f"{ENV_TOPOLOGY}/topology must be one of {TOPOLOGIES}, got {self.topology!r}"
            )
        if self.segment_bytes < 1:
            raise ValueError(
                f"{ENV_SEGMENT_BYTES}/segment_bytes must be >= 1, got {self.segment_bytes}"
            )
        for name in (
            "direct_max_bytes",
            "star_max_bytes",
            "socket_buffer_bytes",
            "spin_us",
            "caller_spin_us",
            "idle_spin_us",
            "inline_max_bytes",
            "host_leaders_max_bytes",
            "host_leaders_link_bytes",
            "host_star_max_bytes",
            "fr_buffer_size",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (0.0 < self.check_tolerance < 1.0):
            raise ValueError(f"check_tolerance must be in (0, 1), got {self.check_tolerance}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Options:
        """Build Options from ``ENTRENAR_*`` variables (bad values: ValueError)."""
        env = os.environ if environ is None else environ
        kw: dict[str, object] = {}
        if ENV_ALGORITHM in env:
            kw["algorithm"] = env[ENV_ALGORITHM].strip().lower()
        if ENV_TRANSPORT in env:
            kw["transport"] = env[ENV_TRANSPORT].strip().lower()
        if ENV_TOPOLOGY in env:
            kw["topology"] = env[ENV_TOPOLOGY].strip().lower()
        if ENV_HOST_ID in env:
            kw["host_id"] = env[ENV_HOST_ID].strip()
        for var, name in (
            (ENV_SEGMENT_BYTES, "segment_bytes"),
            (ENV_STAR_MAX_BYTES, "star_max_bytes"),
            (ENV_DIRECT_MAX_BYTES, "direct_max_bytes"),
            (ENV_SOCKET_BUFFER_BYTES, "socket_buffer_bytes"),
            (ENV_SPIN_US, "spin_us"),
            (ENV_CALLER_SPIN_US, "caller_spin_us"),
            (ENV_IDLE_SPIN_US, "idle_spin_us"),
            (ENV_INLINE_MAX_BYTES, "inline_max_bytes"),
            (ENV_HOST_LEADERS_MAX_BYTES, "host_leaders_max_bytes"),
            (ENV_HOST_LEADERS_LINK_BYTES, "host_leaders_link_bytes"),
            (ENV_HOST_STAR_MAX_BYTES, "host_star_max_bytes"),
        ):
            if var in env:
                kw[name] = _parse_int(var, env[var])
        for var, name in (
            (ENV_DETERMINISTIC, "deterministic"),
            (ENV_CHECK, "check"),
            (ENV_SHM_PLACEMENT, "shm_placement"),
            (ENV_TCP_PLACEMENT, "tcp_placement"),
        ):
            if var in env:
                kw[name] = _parse_bool(var, env[var])
        if ENV_CHECK_TOLERANCE in env:
            try:
                kw["check_tolerance"] = float(env[ENV_CHECK_TOLERANCE])
            except ValueError:
                raise ValueError(
                    f"{ENV_CHECK_TOLERANCE} must be a float, got {env[ENV_CHECK_TOLERANCE]!r}"
                ) from None
        if ENV_LEDGER in env:
            kw["ledger"] = env[ENV_LEDGER].strip()
        for var in (ENV_FR_BUFFER_SIZE, ENV_FR_BUFFER_SIZE_OLD):  # the new name wins
            if var in env:
                kw["fr_buffer_size"] = _parse_int(var, env[var])
                break
        for var in (ENV_FR_DUMP_ON_TIMEOUT, ENV_FR_DUMP_ON_TIMEOUT_OLD):
            if var in env:
                kw["fr_dump_on_timeout"] = _parse_bool(var, env[var])
                break
        for var in (ENV_FR_DUMP_TEMP_FILE, ENV_FR_DUMP_TEMP_FILE_OLD):
            if env.get(var):
                kw["fr_dump_prefix"] = env[var]
                break
        kw["host"] = env.get(ENV_HOST, "")
        kw["ifname"] = env.get(ENV_IFNAME, "")
        kw["master_addr"] = env.get(ENV_MASTER_ADDR, "")
        if ENV_RESTART_COUNT in env:
            kw["attempt"] = _parse_int(ENV_RESTART_COUNT, env[ENV_RESTART_COUNT])
        kw.update(overrides)
        return cls(**kw)  # type: ignore[arg-type]

    def dump_prefix(self) -> str:
        """Where this process's flight-recorder dump goes (+ global rank)."""
        return self.fr_dump_prefix or default_fr_dump_prefix(os.environ)

    def replace(self, **changes: object) -> Options:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


class AgreedField(NamedTuple):
    """An ``Options`` field every rank of a group must set alike, and its variable."""

    name: str
    env: str


# The Options fields every rank of a group must set alike, checked at creation
# (``transport/options_agreement.py``): they decide which plan a call runs
# (algorithm, the thresholds, determinism, transport, topology) or a verdict
# every rank must reach alike (the checker and its tolerance). Ranks
# that set one differently would run other plans for the same call and wait
# for each other until the timeout, so the group refuses to form instead.
AGREED_FIELDS: tuple[AgreedField, ...] = (
    AgreedField("algorithm", ENV_ALGORITHM),
    AgreedField("direct_max_bytes", ENV_DIRECT_MAX_BYTES),
    AgreedField("star_max_bytes", ENV_STAR_MAX_BYTES),
    AgreedField("deterministic", ENV_DETERMINISTIC),
    AgreedField("check", ENV_CHECK),
    AgreedField("check_tolerance", ENV_CHECK_TOLERANCE),
    AgreedField("transport", ENV_TRANSPORT),
    AgreedField("topology", ENV_TOPOLOGY),
    AgreedField("host_leaders_max_bytes", ENV_HOST_LEADERS_MAX_BYTES),
    AgreedField("host_leaders_link_bytes", ENV_HOST_LEADERS_LINK_BYTES),
    AgreedField("host_star_max_bytes", ENV_HOST_STAR_MAX_BYTES),
)
# The fields that may differ per rank: where this rank listens and how it
# tunes its own sockets, threads and cores (host, ifname, socket buffers,
# spins, inline calls, placements); its pipelining segment (how its plan cuts
# what it sends and receives: links carry bytes, not segments, and allreduce,
# broadcast, all-gather, reduce-scatter and reduce gave the same results with
# four segment sizes on four ranks, over shared memory, TCP, host-aware and
# deterministic); what it records or writes for itself (ledger: rank 0 writes
# it; the flight recorder); its host label (host_id exists to tell ranks
# apart) and MASTER_ADDR. ``attempt`` namespaces the store keys themselves,
# so ranks of different attempts never meet to compare.
PER_RANK_FIELDS: tuple[str, ...] = (
    "segment_bytes",
    "ledger",
    "host",
    "ifname",
    "socket_buffer_bytes",
    "spin_us",
    "caller_spin_us",
    "idle_spin_us",
    "inline_max_bytes",
    "shm_placement",
    "tcp_placement",
    "host_id",
    "fr_buffer_size",
    "fr_dump_on_timeout",
    "fr_dump_prefix",
    "master_addr",
    "attempt",
)


def default_fr_dump_prefix(env: Mapping[str, str]) -> str:
    """The dump prefix torch 2.13 uses: the variable's value, else under the user's cache."""
    for var in (ENV_FR_DUMP_TEMP_FILE, ENV_FR_DUMP_TEMP_FILE_OLD):
        if env.get(var):
            return env[var]
    cache = env.get(ENV_XDG_CACHE_HOME) or os.path.join(env.get(ENV_HOME) or "/tmp", ".cache")
    return os.path.join(cache, "torch", FR_DEFAULT_FILE_NAME)


def _parse_int(var: str, text: str) -> int:
    try:
        return int(text.strip().replace("_", ""), 0)
    except ValueError:
        raise ValueError(f"{var} must be an integer, got {text!r}") from None


def _parse_bool(var: str, text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"{var} must be 0/1/true/false, got {text!r}")

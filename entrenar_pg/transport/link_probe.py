"""Is the cross-host link as fast as one inside a host? Measured at set-up; one verdict for all.

The host-aware collectives (collectives/hierarchical.py) spend extra local
phases to send fewer bytes and messages across hosts. That pays where the
cross-host link is the slow part (a 1 Gbit/s network: 1.5x gloo's busbw at
2 x 2), and costs where it is not (hosts on one machine, or a network as fast
as loopback: the extra phases are pure CPU, up to 1.9x the flat path's time
at 4 x 2, docs/benchmarks.md). Only a measurement tells the two apart.

Three ranks take part, and only where the policy could run host-aware (at
least two hosts of the same number >= 2 of ranks; whatever
``Options.topology`` says, which only the policy reads): the *prober*
(host 0's leader), its *local* peer (host 0's second rank) and the *remote*
peer (host 1's leader). The prober times round trips
of a small message (a hop's latency) and a large one (bandwidth) to both, the
two peers interleaved, and keeps each best time (the least disturbed by
other work on a loaded machine); while the link still looks slow it takes
more rounds, up to a bound. The link is *fast* where every remote round
trip takes at most ``FAST_FACTOR`` x the local one. The prober publishes the
verdict in the store; every other rank reads it from there, so every rank
holds the same one and the policy chooses alike everywhere.

The sockets are made at set-up with the others and closed after the probe:
the probe leaves no link behind (the collectives make theirs on first use).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from ..errors import PeerConnectionError
from .topology import Topology

PROBE_KEY = "entrenar/a{attempt}/link-probe"

# Message bytes: 4 KiB is a hop's latency; 1 MiB is far above a shaped link's
# burst (tbf's 128 KiB in launch/netns_cluster.sh), so its best round trip is
# the link's rate, not the bucket's.
SIZES: tuple[int, ...] = (4 << 10, 1 << 20)

# Rounds (one round trip of every size to both peers each): at least
# MIN_ROUNDS, then more while the link still looks slow, up to MAX_ROUNDS. A
# loaded machine can delay every one of five round trips to a peer (CI: a
# loopback 1 MiB best of 5 at 7.9x the local one, "slow"); the extra rounds
# are paid only by a link that looks slow, about 0.25 s at set-up on a
# 1 Gbit/s one.
MIN_ROUNDS = 5
MAX_ROUNDS = 15
_GO, _DONE = b"\x01", b"\x00"  # the prober's byte before each round / at the end

# A remote round trip within this many local ones is loopback-class. Measured
# between emulated hosts (veth and a bridge) on the loaded 2-core machine:
# unshaped, 1 MiB 0.9-3.0x loopback from one group to the next (4 KiB
# 1.5-1.7x); shaped to 1 Gbit/s, 1 MiB 39x (4 KiB 1.6x: within tbf's burst).
# 4 leaves the unshaped spread room and still calls a 10 Gbit/s link (about
# 0.2 ms per MiB on the wire each way) slow where loopback turns 1 MiB in
# under 0.1 ms.
FAST_FACTOR = 4.0


@dataclass(frozen=True)
class Roles:
    """Who takes part: the prober and its two peers."""

    prober: int
    local: int
    remote: int

    @classmethod
    def of(cls, topology: Topology) -> Roles | None:
        """The roles where the host-aware policy could apply (>= 2 hosts of the
        same number >= 2 of ranks), else None (no probe)."""
        shape = topology.shape
        if shape is None or shape[0] < 2 or shape[1] < 2:
            return None
        return cls(topology.hosts[0][0], topology.hosts[0][1], topology.hosts[1][0])

    def peers(self, rank: int) -> tuple[int, ...]:
        """The probe's socket peers of ``rank`` (none for a rank not taking part)."""
        if rank == self.prober:
            return (self.local, self.remote)
        return (self.prober,) if rank in (self.local, self.remote) else ()


@dataclass(frozen=True)
class Verdict:
    """The probe's result: the best round trip per size (seconds) to each peer."""

    local_s: tuple[float, ...]
    remote_s: tuple[float, ...]

    @property
    def fast(self) -> bool:
        """Every size's remote round trip within ``FAST_FACTOR`` x the local one."""
        return all(r <= FAST_FACTOR * lo for lo, r in zip(self.local_s, self.remote_s, strict=True))

    def encode(self) -> bytes:
        return " ".join(repr(t) for t in (*self.local_s, *self.remote_s)).encode()  # exact

    @classmethod
    def decode(cls, raw: bytes) -> Verdict:
        times = tuple(float(t) for t in raw.decode().split())
        n = len(times) // 2
        return cls(times[:n], times[n:])

    def describe(self) -> str:
        ratios = ", ".join(
            f"{size >> 10} KiB {r / lo:.2f}x"
            for size, lo, r in zip(SIZES, self.local_s, self.remote_s, strict=True)
        )
        speed = "fast" if self.fast else "slow"
        return f"{speed} cross-host link (remote/local round trip: {ratios})"


def measure(rank: int, roles: Roles, local: socket.socket, remote: socket.socket) -> Verdict:
    """The prober's side: rounds of round trips of every size to both peers,
    interleaved, keeping the best of each; more rounds while the link looks
    slow (``MIN_ROUNDS`` to ``MAX_ROUNDS``). The sockets are blocking, with the
    set-up's timeout."""
    peers = ((roles.local, local), (roles.remote, remote))
    buffers = {size: (bytes(size), bytearray(size)) for size in SIZES}
    best: dict[tuple[int, int], float] = {}
    verdict = None
    for done in range(MAX_ROUNDS):
        if done >= MIN_ROUNDS and verdict is not None and verdict.fast:
            break
        for peer, sock in peers:
            _send(rank, peer, sock, _GO)
        for size in SIZES:
            payload, buf = buffers[size]
            for peer, sock in peers:
                t0 = time.perf_counter()
                _send(rank, peer, sock, payload)
                _recv_into(rank, peer, sock, buf)
                took = time.perf_counter() - t0
                key = (peer, size)
                best[key] = min(best.get(key, took), took)
        verdict = Verdict(
            tuple(best[(roles.local, size)] for size in SIZES),
            tuple(best[(roles.remote, size)] for size in SIZES),
        )
    for peer, sock in peers:
        _send(rank, peer, sock, _DONE)
    assert verdict is not None  # MAX_ROUNDS >= 1
    return verdict


def echo(rank: int, prober: int, sock: socket.socket) -> None:
    """A peer's side: each round the prober announces, send every message of
    ``SIZES`` back as it arrives."""
    flag = bytearray(1)
    buffers = [bytearray(size) for size in SIZES]
    while True:
        _recv_into(rank, prober, sock, flag)
        if flag == _DONE:
            return
        for buf in buffers:
            _recv_into(rank, prober, sock, buf)
            _send(rank, prober, sock, buf)


def _send(rank: int, peer: int, sock: socket.socket, data: bytes | bytearray) -> None:
    try:
        sock.sendall(data)
    except OSError as e:
        raise _lost(rank, peer, e) from e


def _recv_into(rank: int, peer: int, sock: socket.socket, buf: bytearray) -> None:
    view = memoryview(buf)
    got = 0
    try:
        while got < len(buf):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("closed by the peer")
            got += n
    except OSError as e:
        raise _lost(rank, peer, e) from e


def _lost(rank: int, peer: int, e: OSError) -> PeerConnectionError:
    return PeerConnectionError(
        f"rank {rank}: lost rank {peer} while probing the cross-host link at set-up: {e}"
    )

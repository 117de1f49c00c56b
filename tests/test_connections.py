"""Connections made on first use (issue 26, item 4): what a rank holds, and that
failures are still named without a p2p link between every pair.

A rank holds, from set-up, a data socket to each rank on its host and a
control socket to each overlay neighbour (ranks one bit apart); its other
data sockets come with the first plan that talks to a peer (the lower rank
connects), its p2p sockets with the first send to or recv from a peer (each
rank sends on the connection it opened and reads the one its peer opened).
Failures are still named on every rank: aborts and deaths are relayed along
the overlay, stall queries routed. These tests
count the process's socket descriptors in ``/proc/self/fd`` (the kernel's
view: a leaked or lazily made socket counts whoever holds it), check p2p
between ranks that never talked (both ways at once), and that a killed peer
is named by every rank that waits on it with no link made before.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from conftest import allreduce_errors, make_groups, run_ranks
from test_failures import run_blame

from entrenar_pg import EntrenarProcessGroup, Options, PeerConnectionError
from entrenar_pg.transport.control import overlay

# Sockets the ranks of one host hold after set-up and a collective, with no
# p2p yet: a data socket per peer (all on this host: made at set-up), a
# control socket per overlay neighbour (at most ceil(log2 N)), the listener
# kept for lazy connections, the p2p loop's wake-up pair. (Before: 2(N - 1) + 3,
# a control socket per peer; before that 3(N - 1) + 2, a p2p socket per peer.)


def allreduce_only_sockets(world: int) -> int:
    return sum((world - 1) + len(overlay(r, world)) + 3 for r in range(world))


def socket_fds() -> int:
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{name}").startswith("socket:")
        except OSError:
            pass  # the directory's own descriptor
    return n


def settled_socket_fds(want: int, within_s: float = 5.0) -> int:
    """The socket count once it reaches ``want`` (connections made on first use
    finish in their own threads, just after the message that started them), or
    the last count seen after ``within_s``."""
    deadline = time.monotonic() + within_s
    while (n := socket_fds()) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def allreduce_all(groups: list, numel: int = 4) -> list[float]:
    """One ``numel``-element allreduce on every rank (threads); each rank's first element."""

    def one(rank: int, pg: EntrenarProcessGroup) -> float:
        t = torch.full((numel,), float(rank + 1))
        pg.allreduce([t]).wait()
        return t[0].item()

    return run_ranks(len(groups), one, groups=groups)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [4, 8])
def test_an_allreduce_only_group_holds_no_p2p_sockets(world: int) -> None:
    """N thread ranks over TCP set up and allreduce: the process holds exactly
    ``allreduce_only_sockets`` new sockets (before: N(2(N - 1) + 3), 4 and 32
    more; before that N(3(N - 1) + 2)).
    One p2p message from rank 0 to rank 1 then adds exactly four: each end's
    own connection to the other (the send's, and the recv's, which watches
    for the sender's death)."""
    before = socket_fds()
    groups = make_groups(world, Options(transport="tcp"))
    try:
        total = world * (world + 1) / 2
        assert allreduce_all(groups) == [total] * world
        assert socket_fds() - before == allreduce_only_sockets(world)
        got = torch.empty(3)
        recv = groups[1].recv([got], 0, 5)
        groups[0].send([torch.full((3,), 7.0)], 1, 5).wait(timeout=None)
        recv.wait()
        assert got.tolist() == [7.0] * 3
        want = before + allreduce_only_sockets(world) + 4
        assert settled_socket_fds(want) - before == want - before
    finally:
        for g in groups:
            g.shutdown()
    assert socket_fds() == before, "every socket closed at shutdown"


@pytest.mark.timeout(120)
def test_first_p2p_both_ways_at_once_between_ranks_that_never_talked() -> None:
    """Ranks 1 and 3 of 4 send to each other at the same instant, each its
    first p2p message (no connection either way), then receive: both messages
    arrive, in tag order, with no deadlock; ranks 0 and 2 make no p2p socket.
    Then a second round over the connections now open."""
    world = 4
    groups = make_groups(world, Options(transport="tcp"))
    try:
        allreduce_all(groups)
        before = socket_fds()
        start = threading.Barrier(2)
        got: dict[int, list[float]] = {}

        def exchange(rank: int, peer: int) -> None:
            bufs = [torch.empty(2) for _ in range(2)]
            start.wait(10)
            sends = [
                groups[rank].send([torch.full((2,), 10.0 * rank + k)], peer, k) for k in (0, 1)
            ]
            recvs = [groups[rank].recv([bufs[k]], peer, k) for k in (1, 0)]  # posted out of order
            for w in sends + recvs:
                w.wait()
            got[rank] = [b[0].item() for b in bufs]

        for _ in range(2):
            threads = [
                threading.Thread(target=exchange, args=(r, p), daemon=True)
                for r, p in ((1, 3), (3, 1))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads), "the first p2p exchange hung"
            assert got == {1: [30.0, 31.0], 3: [10.0, 11.0]}
            # 1 -> 3 and 3 -> 1, both ends of each
            assert settled_socket_fds(before + 4) - before == 4
        for r in (0, 2):
            p2p = groups[r]._runtime.p2p
            assert not any(ln.out_open or ln.in_open for ln in p2p._links.values()), r
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_peer_is_named_by_every_rank_waiting_on_it_with_no_link_before() -> None:
    """N = 4 processes; ranks 0, 1 and 3 wait in a recv from rank 2, which never
    sends and is SIGKILLed. No p2p link existed (the recvs open the first):
    every survivor still fails, naming rank 2, instead of waiting out its
    timeout (the group's is 30 s; the job is failed at 60 s as hung)."""
    results = run_blame("p2pkill", 2, world=4, timeout_s=30.0, transport="tcp")
    assert sorted(results) == [0, 1, 3]
    for rank, (cls, culprit, message) in results.items():
        assert cls == "PeerConnectionError", (rank, message)
        assert culprit == "2", f"rank {rank} blamed {culprit}: {message}"
        assert "recv from rank 2" in message, message


@pytest.mark.timeout(60)
def test_a_first_send_to_a_rank_that_left_names_it() -> None:
    """Rank 2 of 3 destroys its group; rank 0 then sends to it for the first
    time: the connection is refused, and the send fails at once naming rank 2
    as gone (from its goodbye on the control link), not after a timeout."""
    groups = make_groups(3, Options(transport="tcp"), timeout_s=20.0)
    try:
        allreduce_all(groups)
        groups[2].shutdown()
        start = time.monotonic()
        with pytest.raises(PeerConnectionError, match=r"rank 0: .*rank 2 left the group") as info:
            groups[0].send([torch.ones(2)], 2, 0).wait()
        assert time.monotonic() - start < 5
        assert info.value.culprit == 2
    finally:
        for g in groups:
            g.abort()


def emulated_hosts(world: int, per_host: int, algorithm: str) -> list[Options]:
    """One Options per rank: TCP, ``algorithm``, hosts of ``per_host`` consecutive
    ranks (``host_id`` splits this machine into emulated hosts)."""
    return [
        Options(transport="tcp", algorithm=algorithm, host_id=f"h{r // per_host}")
        for r in range(world)
    ]


def partners(rank: int, world: int, algorithm: str) -> set[int]:
    """Whom a rank's allreduce plans talk to (every ring chunk non-empty): its
    ring neighbours; the star: rank 0 everyone, everyone rank 0 and its ring
    neighbours (the star confirms its header with them)."""
    ring = {(rank - 1) % world, (rank + 1) % world}
    if algorithm == "ring":
        return ring
    return set(range(1, world)) if rank == 0 else {0} | ring


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["ring", "star"])
def test_data_sockets_only_to_local_peers_and_plan_partners(algorithm: str) -> None:
    """8 thread ranks as 4 emulated hosts x 2 over TCP: after set-up and one
    allreduce a rank holds data sockets only to the rank on its host (made at
    set-up) and the partners its plan used (made on first use): the ring 2
    per rank, the star N - 1 at rank 0 and 2-3 elsewhere; a control socket
    per overlay neighbour (3 at N = 8); the listener and the p2p wake-up pair.
    (Before: a data and a control socket per peer from set-up: 8 x 17 = 136.)"""
    world, per_host = 8, 2
    before = socket_fds()
    groups = make_groups(world, emulated_hosts(world, per_host, algorithm))
    try:
        total = world * (world + 1) / 2
        assert allreduce_all(groups, numel=64) == [total] * world  # no empty ring chunk
        data = [
            {r - r % per_host + k for k in range(per_host)} - {r} | partners(r, world, algorithm)
            for r in range(world)
        ]
        want = sum(len(overlay(r, world)) + len(d) + 3 for r, d in enumerate(data))
        assert socket_fds() - before == want
        for r, g in enumerate(groups):
            assert g._runtime.mesh.data_peers == data[r], r
        # A second allreduce makes no socket: the first one's are reused.
        assert allreduce_all(groups, numel=64) == [total] * world
        assert socket_fds() - before == want
    finally:
        for g in groups:
            g.shutdown()
    assert socket_fds() == before, "every socket closed at shutdown"


@pytest.mark.timeout(60)
def test_a_rank_that_never_joins_the_first_collective_is_named_by_every_rank() -> None:
    """4 thread ranks, each its own emulated host (no data socket at set-up):
    rank 1 never calls the first allreduce. Rank 0 connects to it (its
    acceptor answers) and waits for data; rank 2 waits for rank 1's
    connection; rank 3 waits on them. Every one of them names rank 1 within
    the timeout, from the wait-for walk."""
    world = 4
    groups = make_groups(world, emulated_hosts(world, 1, "ring"), timeout_s=2.0)
    try:
        errors = allreduce_errors(groups, [0, 2, 3], numel=4)
        assert sorted(errors) == [0, 2, 3]
        for r, e in errors.items():
            assert isinstance(e, PeerConnectionError), (r, e)
            assert e.culprit == 1, (r, e)
            assert "rank 1" in str(e), (r, e)
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.timeout(60)
def test_an_abort_reaches_ranks_with_no_link_to_the_failing_one() -> None:
    """8 thread ranks, each its own emulated host, ring: after one allreduce
    rank 2 holds no link of any kind to rank 5 (control: overlay 0, 3, 6;
    data: ring 1, 3). Rank 5 aborts naming rank 3 while the rest are idle:
    its neighbours relay the record, and every rank learns it (rank 2 only
    through others). Then the other 7 allreduce: every one raises rank 5's
    error class with its culprit, none waits for the timeout."""
    from entrenar_pg.errors import CollectiveMismatchError
    from entrenar_pg.transport.control import AbortRecord

    world, victim, far = 8, 5, 2
    groups = make_groups(world, emulated_hosts(world, 1, "ring"), timeout_s=20.0)
    try:
        allreduce_all(groups, numel=64)
        mesh = groups[far]._runtime.mesh
        assert victim not in mesh.control.links and victim not in mesh.data_peers
        groups[victim]._runtime.mesh.abort(CollectiveMismatchError("rank 5: injected", culprit=3))
        for r in range(world):
            if r != victim:
                end = groups[r]._runtime.mesh.causes.how_ended(victim, 10.0)
                assert isinstance(end, AbortRecord) and end.culprit == 3, (r, end)
        start = time.monotonic()
        errors = allreduce_errors(groups, [r for r in range(world) if r != victim], numel=64)
        assert time.monotonic() - start < 10.0, "a rank waited for the timeout"
        assert sorted(errors) == [r for r in range(world) if r != victim]
        for r, e in errors.items():
            assert isinstance(e, CollectiveMismatchError), (r, e)
            assert e.culprit == 3 and "rank 5: injected" in str(e), (r, e)
    finally:
        for g in groups:
            g.abort()


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("mode", "victim"), [("stall", 1), ("kill", 5)])
def test_a_stalled_or_dead_rank_is_named_by_every_rank_at_eight(mode: str, victim: int) -> None:
    """8 rank processes (torchrun-style env://): the victim SIGSTOPs itself in a
    loop of star allreduces, or SIGKILLs itself in a loop of allreduces. Most
    survivors hold no control link to it (overlay: 3 of 7 do): the stall walk
    reaches it through relays (rank 3's query to the root goes around rank 1,
    which it would otherwise cross), and its death is passed on. Every
    survivor names the victim."""
    results = run_blame(mode, victim, world=8, timeout_s=4.0, transport="tcp")
    assert sorted(results) == [r for r in range(8) if r != victim]
    for rank, (cls, culprit, message) in results.items():
        assert cls == "PeerConnectionError", (rank, message)
        assert culprit == str(victim), f"rank {rank} blamed {culprit}: {message}"


@pytest.mark.timeout(60)
def test_a_first_data_connect_to_a_rank_that_left_names_it_on_every_rank() -> None:
    """4 thread ranks, each its own emulated host (no data socket at set-up):
    rank 3 shuts its group down, then the others allreduce (ring) for the
    first time. Ranks 0 and 2 connect to rank 3 (the lower rank connects) and
    are refused: they name it as gone, from its goodbye relayed along the
    overlay; rank 1 hears their aborts. Every rank names rank 3, long before
    the timeout."""
    world = 4
    groups = make_groups(world, emulated_hosts(world, 1, "ring"), timeout_s=20.0)
    try:
        groups[3].shutdown()
        start = time.monotonic()
        errors = allreduce_errors(groups, [0, 1, 2], numel=64)
        assert time.monotonic() - start < 10.0, "a rank waited for the timeout"
        assert sorted(errors) == [0, 1, 2]
        for r, e in errors.items():
            assert isinstance(e, PeerConnectionError), (r, e)
            assert e.culprit == 3, (r, e)
        for r in (0, 2):
            assert "rank 3 left the group" in str(errors[r]), errors[r]
    finally:
        for g in groups[:3]:
            g.abort()

"""Point-to-point semantics: tags, order, anysource, buffering, self-sends, failures.

Ranks are threads, each with its own EntrenarProcessGroup over real loopback
TCP (conftest.run_ranks); the methods called are the ones torch's
``dist.isend`` / ``dist.irecv`` / ``dist.recv`` call.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks

from entrenar_pg import CollectiveMismatchError, EntrenarProcessGroup, PeerConnectionError


def _allreduce(pg: EntrenarProcessGroup, t: torch.Tensor) -> torch.Tensor:
    pg.allreduce([t]).wait()
    return t


@pytest.mark.timeout(60)
def test_tags_match_independently_and_in_order_per_tag() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> list[float]:
        if rank == 0:
            works = [
                pg.send([torch.full((3,), float(10 * tag + i))], 1, tag)
                for i in range(3)
                for tag in (1, 2)
            ]
            for w in works:
                w.wait()
            return []
        # Post tag 2 before tag 1, and interleave: each tag is FIFO on its own.
        bufs = {(tag, i): torch.empty(3) for tag in (2, 1) for i in range(3)}
        works = [pg.recv([bufs[(tag, i)]], 0, tag) for tag in (2, 1) for i in range(3)]
        for w in works:
            w.wait()
        return [bufs[(tag, i)][0].item() for tag in (1, 2) for i in range(3)]

    _, got = run_ranks(2, fn)
    assert got == [10.0, 11.0, 12.0, 20.0, 21.0, 22.0]


@pytest.mark.timeout(60)
def test_unexpected_messages_are_buffered_until_recv() -> None:
    """Sends complete before any recv is posted; later recvs get them in order."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[float]:
        if rank == 0:
            for i in range(4):
                pg.send([torch.full((5,), float(i))], 1, 0).wait()
            _allreduce(pg, torch.ones(1))  # now rank 1 posts its recvs
            return []
        _allreduce(pg, torch.ones(1))
        out = []
        for _ in range(4):
            t = torch.empty(5)
            pg.recv([t], 0, 0).wait()
            out.append(t[0].item())
        return out

    assert run_ranks(2, fn)[1] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.timeout(60)
def test_send_does_not_wait_for_the_recv_even_beyond_socket_buffers() -> None:
    """Both ranks send 16 MiB to each other and wait for the sends before posting recvs."""
    n = 4 << 20

    def fn(rank: int, pg: EntrenarProcessGroup) -> bool:
        peer = 1 - rank
        pg.send([torch.full((n,), float(rank))], peer, 3).wait()
        t = torch.empty(n)
        pg.recv([t], peer, 3).wait()
        return bool((t == peer).all())

    assert run_ranks(2, fn) == [True, True]


@pytest.mark.timeout(60)
def test_recv_anysource_reports_the_sender() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> list[tuple[int, float]]:
        if rank != 0:
            pg.send([torch.tensor([float(rank * 100)])], 0, 9).wait()
            return []
        got = []
        for _ in range(3):
            t = torch.empty(1)
            w = pg.recv_anysource([t], 9)
            w.wait()
            got.append((w._source_rank(), t.item()))
        return sorted(got)

    assert run_ranks(4, fn)[0] == [(1, 100.0), (2, 200.0), (3, 300.0)]


@pytest.mark.timeout(60)
def test_send_to_self_and_noncontiguous_tensors() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> bool:
        src = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
        dst = torch.zeros(3, 4).t()  # non-contiguous too
        r = pg.recv([dst], rank, 4)  # posted first: the send matches it
        pg.send([src], rank, 4).wait()
        r.wait()
        ok = torch.equal(dst, src)
        peer = 1 - rank
        other = torch.zeros(3, 4).t()
        w = pg.send([src * (rank + 1)], peer, 5)
        pg.recv([other], peer, 5).wait()
        w.wait()
        return ok and torch.equal(other, src * (peer + 1))

    assert run_ranks(2, fn) == [True, True]


@pytest.mark.timeout(60)
def test_a_pending_recv_does_not_block_collectives() -> None:
    """Rank 1 posts a recv whose send comes only after two collectives."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> float:
        t = torch.empty(2)
        w = pg.recv([t], 0, 0) if rank == 1 else None
        _allreduce(pg, torch.ones(3))
        pg.barrier().wait()
        if rank == 0:
            pg.send([torch.tensor([7.0, 8.0])], 1, 0).wait()
            return 0.0
        assert w is not None
        w.wait()
        return t.sum().item()

    assert run_ranks(2, fn)[1] == 15.0


@pytest.mark.timeout(60)
def test_size_mismatch_fails_that_recv_only() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> str:
        if rank == 0:
            pg.send([torch.ones(5)], 1, 0).wait()
            pg.send([torch.full((2,), 3.0)], 1, 0).wait()
            return ""
        with pytest.raises(
            CollectiveMismatchError, match=r"rank 1: recv from rank 0 \(tag 0\).*20 bytes"
        ):
            pg.recv([torch.empty(4)], 0, 0).wait()
        t = torch.empty(2)
        pg.recv([t], 0, 0).wait()  # the link is still in step
        return str(t.tolist())

    assert run_ranks(2, fn)[1] == "[3.0, 3.0]"


@pytest.mark.timeout(60)
def test_dead_peer_fails_pending_p2p_naming_both_ranks() -> None:
    groups = make_groups(2)
    try:
        w = groups[0].recv([torch.empty(3)], 1, 0)
        time.sleep(0.1)
        groups[1].abort()  # its sockets close: the pending recv must fail, not hang
        start = time.monotonic()
        with pytest.raises(PeerConnectionError, match=r"rank 0: p2p recv from rank 1 .*rank 1"):
            w.wait()
        assert time.monotonic() - start < 5
        with pytest.raises(PeerConnectionError, match="rank 1"):
            groups[0].send([torch.ones(1)], 1, 0).wait()
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.timeout(60)
def test_unmatched_recv_times_out_with_the_group_timeout() -> None:
    groups = make_groups(2, timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(
            PeerConnectionError, match=r"rank 1: p2p recv from rank 0 \(tag 6\).*1\.0s"
        ):
            groups[1].recv([torch.empty(1)], 0, 6).wait()
        assert 0.9 < time.monotonic() - start < 5
        # The link itself is fine: a later message still gets through.
        t = torch.empty(1)
        r = groups[1].recv([t], 0, 6)
        groups[0].send([torch.ones(1)], 1, 6).wait()
        r.wait()
        assert t.item() == 1.0
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.timeout(60)
def test_bad_arguments_raise_in_the_caller() -> None:
    (pg,) = make_groups(1)
    try:
        with pytest.raises(ValueError, match="rank 0: send: peer rank 3 outside"):
            pg.send([torch.ones(1)], 3, 0)
        with pytest.raises(ValueError, match="exactly one tensor"):
            pg.recv([torch.ones(1), torch.ones(1)], 0, 0)
    finally:
        pg.shutdown()


@pytest.mark.timeout(60)
def test_many_concurrent_streams_between_all_pairs() -> None:
    """Every rank sends 20 messages of varying size to every other rank, tags mixed."""
    world = 4

    def payload(src: int, dst: int, i: int) -> torch.Tensor:
        return torch.full(((i * 997) % 5000,), float(src * 1000 + dst * 100 + i))

    def fn(rank: int, pg: EntrenarProcessGroup) -> bool:
        sends, recvs = [], []
        for i in range(20):
            for p in range(world):
                if p == rank:
                    continue
                sends.append(pg.send([payload(rank, p, i)], p, i % 3))
                t = torch.empty(payload(p, rank, i).numel())
                recvs.append((pg.recv([t], p, i % 3), t, payload(p, rank, i)))
        for w in sends:
            w.wait()
        ok = True
        for w, t, want in recvs:
            w.wait()
            ok = ok and torch.equal(t, want)
        return ok

    assert run_ranks(world, fn) == [True] * world


@pytest.mark.timeout(60)
def test_dist_api_p2p_on_threads_is_thread_safe() -> None:
    """Two user threads on one rank post sends/recvs concurrently on one group."""
    groups = make_groups(2)
    try:
        errors: list[BaseException] = []

        def pump(rank: int, tag: int) -> None:
            try:
                pg, peer = groups[rank], 1 - rank
                for i in range(50):
                    w = pg.send([torch.tensor([float(i)])], peer, tag)
                    t = torch.empty(1)
                    pg.recv([t], peer, tag).wait()
                    w.wait()
                    assert t.item() == float(i)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=pump, args=(r, tag)) for r in (0, 1) for tag in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.timeout(60)
def test_work_timeout_argument() -> None:
    (pg,) = make_groups(1)
    try:
        w = pg.recv([torch.empty(1)], 0, 1)
        with pytest.raises(PeerConnectionError, match="timed out"):
            w.wait(timedelta(seconds=0.2))
        pg.send([torch.ones(1)], 0, 1).wait()
        w.wait()
        assert isinstance(w, dist.Work)
    finally:
        pg.shutdown()


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_staged_through_the_host() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> bool:
        peer = 1 - rank
        src = torch.arange(6.0, device="cuda").reshape(2, 3) + 10 * rank
        dst = torch.empty(2, 3, device="cuda")
        w = pg.send([src], peer, 0)
        pg.recv([dst], peer, 0).wait()
        w.wait()
        torch.cuda.synchronize()
        return torch.equal(dst.cpu(), torch.arange(6.0).reshape(2, 3) + 10 * peer)

    assert run_ranks(2, fn) == [True, True]


@pytest.mark.timeout(60)
def test_p2p_reads_the_peers_abort_cause_and_breaks_the_group() -> None:
    """Rank 1 aborts with a cause naming a culprit; rank 0's pending recv from it
    fails with the same class and culprit a collective would raise (the abort
    protocol is shared), and rank 0's group is broken by it: a later collective
    is refused with that cause. (Before: the recv failed as a plain close,
    without the cause or culprit, and the group stayed usable.)"""
    groups = make_groups(3, timeout_s=20.0)
    try:
        w = groups[0].recv([torch.empty(3)], 1, 0)
        time.sleep(0.1)
        groups[1].mesh.abort(CollectiveMismatchError("rank 1: injected", culprit=2))
        start = time.monotonic()
        with pytest.raises(CollectiveMismatchError, match=r"rank 0: p2p recv from rank 1") as info:
            w.wait()
        assert time.monotonic() - start < 5
        assert info.value.culprit == 2 and "rank 1: injected" in str(info.value)
        assert isinstance(groups[0].errored(), CollectiveMismatchError)
        with pytest.raises(CollectiveMismatchError, match="rank 1: injected"):
            groups[0].barrier().wait()
    finally:
        for g in groups:
            g.abort()


@pytest.mark.timeout(60)
def test_a_failed_collective_fails_pending_p2p_at_once() -> None:
    """A collective fails (the ranks disagree on its size); a recv rank 0 posted
    earlier from rank 2, which will never come, fails at once with the group's
    error instead of waiting out the 20 s timeout (before: the p2p channel
    stayed open after the group broke)."""
    groups = make_groups(3, timeout_s=20.0)
    try:
        pending = groups[0].recv([torch.empty(1)], 2, 9)
        errors: dict[int, BaseException] = {}

        def call(rank: int) -> None:
            try:
                groups[rank].allreduce([torch.ones(4 if rank == 1 else 8)]).wait()
            except BaseException as e:  # every rank must raise
                errors[rank] = e

        threads = [threading.Thread(target=call, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(isinstance(errors.get(r), CollectiveMismatchError) for r in range(3)), errors
        start = time.monotonic()
        with pytest.raises(
            CollectiveMismatchError, match=r"rank 0: p2p recv from rank 2 \(tag 9\)"
        ):
            pending.wait()
        assert time.monotonic() - start < 5
    finally:
        for g in groups:
            g.abort()


@pytest.mark.timeout(60)
def test_a_stalled_p2p_link_names_the_peer_and_breaks_the_group() -> None:
    """Rank 1 stops reading its p2p link (its p2p thread is made to skip every
    read); rank 0's send of 32 MiB, more than the socket buffers hold, makes
    no progress. After the 1 s timeout it fails the way a stalled collective
    does: "no progress", the peer blamed by the wait-for walk (culprit 1),
    and rank 0's group is broken by it."""
    groups = make_groups(2, timeout_s=1.0)
    channel = groups[1]._runtime.p2p
    real_pump = channel._pump

    def no_reads(link: object, *, receiving: bool) -> None:
        if not receiving:
            real_pump(link, receiving=False)

    channel._pump = no_reads  # type: ignore[method-assign]
    try:
        start = time.monotonic()
        with pytest.raises(PeerConnectionError, match=r"no progress for 1\.0s") as info:
            groups[0].send([torch.ones(8 << 20)], 1, 0).wait()
        assert 0.9 < time.monotonic() - start < 6
        assert info.value.culprit == 1 and "culprit: rank 1" in str(info.value)
        assert isinstance(groups[0].errored(), PeerConnectionError)
    finally:
        for g in groups:
            g.abort()


@pytest.mark.timeout(60)
def test_a_message_sent_before_the_peer_left_is_received() -> None:
    """A peer sends, then destroys its group (the end of a pipeline schedule):
    the recv of what it sent must complete, even where this rank's p2p thread
    sees the peer's hang-up on its own connection in the same poll as the
    message on the peer's (found as "rank 1 left the group mid-collective" in
    the pipelining test under load). The thread is held while both arrive."""
    groups = make_groups(2)
    try:
        # Both connections exist first (rank 0's own made first, so it comes first
        # in the poll): the message is many calls into the job, as in a pipeline.
        got = torch.empty(4)
        groups[0].send([torch.ones(4)], 1, 0).wait()
        groups[1].recv([got], 0, 0).wait()
        groups[1].send([torch.ones(4)], 0, 0).wait()
        groups[0].recv([got], 1, 0).wait()
        channel = groups[0]._runtime.p2p
        out = torch.empty(4)
        w = groups[0].recv([out], 1, 0)
        with channel._lock:  # hold rank 0's p2p thread out of its poll
            channel._loop.wake()
            time.sleep(0.2)  # it woke, and waits for the lock to handle that
            groups[1].send([torch.full((4,), 7.0)], 0, 0).wait()
            groups[1].shutdown()  # its goodbye and hang-ups, after the message
            time.sleep(0.2)
        w.wait(timedelta(seconds=10))
        assert out.tolist() == [7.0] * 4
        assert groups[0]._runtime.state.error is None  # a peer that finished is not a failure
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.timeout(60)
def test_a_first_message_sent_just_before_the_peer_left_is_received() -> None:
    """As above, but the message is the peer's first to this rank: its
    connection reaches this rank's acceptor thread, which hands it to the p2p
    thread only after the peer's hang-up of this rank's own connection was
    seen. The p2p thread waits for it (``config.P2P_ENDING_GRACE_S``)
    instead of failing the recv at once."""
    groups = make_groups(2)
    try:
        got = torch.empty(4)
        groups[0].send([torch.ones(4)], 1, 0).wait()  # rank 0's own connection only
        groups[1].recv([got], 0, 0).wait()
        channel = groups[0]._runtime.p2p
        out = torch.empty(4)
        w = groups[0].recv([out], 1, 0)
        with channel._lock:  # the p2p thread and the acceptor's hand-over wait here
            channel._loop.wake()
            time.sleep(0.2)
            groups[1].send([torch.full((4,), 7.0)], 0, 0).wait()
            groups[1].shutdown()
            time.sleep(0.2)
        w.wait(timedelta(seconds=10))
        assert out.tolist() == [7.0] * 4
        assert groups[0]._runtime.state.error is None
    finally:
        for g in groups:
            g.shutdown()

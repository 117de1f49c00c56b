"""The p2p matching on its own: events in, placements and outcomes out.

``Matching`` is sans-IO (no sockets, threads, tensors or futures), so these
tests drive it directly, as h11's tests drive its state machine: each test
feeds a sequence of events (recv posted, header in, payload in, deadline,
link down, close) and checks every answer. The last test plays random
interleavings against a plain reference model, through a driver that keeps
buffers the way the channel does (so a payload that lands in the wrong recv,
a buffer that leaks or is dropped too early, fails it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from entrenar_pg.errors import CollectiveMismatchError, EntrenarError, PeerConnectionError
from entrenar_pg.p2p.matching import (
    ANY_SOURCE,
    Delivered,
    Discarded,
    Failed,
    IntoBuffer,
    IntoRecv,
    Matching,
    Message,
    Placement,
    PostedRecv,
)

pytestmark = pytest.mark.timeout(30)

RANK = 0
F32 = torch.float32


class Recvs:
    """Makes PostedRecvs with fresh ids (what the channel does)."""

    def __init__(self) -> None:
        self.next_id = 0

    def __call__(
        self, peer: int, tag: int = 0, nbytes: int = 8, deadline: float = 100.0
    ) -> PostedRecv:
        who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
        recv = PostedRecv(
            self.next_id, peer, tag, nbytes, F32, deadline, f"recv from {who} (tag {tag})"
        )
        self.next_id += 1
        return recv


@pytest.fixture
def recv() -> Recvs:
    return Recvs()


def arrive(
    m: Matching, peer: int, tag: int = 0, nbytes: int = 8, dtype: torch.dtype = F32
) -> Placement:
    return m.arrive(peer, tag, nbytes, dtype)


# ------------------------------------------------------------------ matching


def test_posted_recv_then_message_goes_straight_into_it(recv: Recvs) -> None:
    m = Matching(RANK)
    r = recv(1)
    m.post(r)
    assert m.posted == (r,) and m.take() == []
    place = arrive(m, 1)
    assert isinstance(place, IntoRecv) and place.recv == r and place.msg.peer == 1
    assert m.posted == () and m.unexpected == ()
    assert m.take() == [], "nothing completes before the payload is in"
    m.arrived(place.msg)
    assert m.take() == [Delivered(r, place.msg, buffered=False)]
    assert m.take() == []


def test_message_before_recv_is_buffered_then_delivered_on_post(recv: Recvs) -> None:
    m = Matching(RANK)
    place = arrive(m, 1, tag=3)
    assert isinstance(place, IntoBuffer) and place.msg.nbytes == 8
    m.arrived(place.msg)
    assert m.unexpected == (place.msg,) and m.take() == []
    r = recv(1, tag=3)
    assert m.has_message_for(r)
    m.post(r)
    assert m.take() == [Delivered(r, place.msg, buffered=True)]
    assert m.unexpected == () and m.posted == ()


def test_recv_posted_while_a_buffered_payload_is_still_coming(recv: Recvs) -> None:
    m = Matching(RANK)
    place = arrive(m, 2)
    assert isinstance(place, IntoBuffer)
    r = recv(2)
    m.post(r)
    assert m.take() == [] and m.posted == () and m.unexpected == ()
    m.arrived(place.msg)
    assert m.take() == [Delivered(r, place.msg, buffered=True)]


def test_one_tag_is_fifo_and_tags_overtake_each_other(recv: Recvs) -> None:
    m = Matching(RANK)
    msgs = []
    for tag in (1, 1, 2, 1):
        place = arrive(m, 1, tag=tag)
        m.arrived(place.msg)
        msgs.append(place.msg)
    r2 = recv(1, tag=2)
    m.post(r2)  # overtakes the tag-1 messages that came first
    ra, rb, rc = recv(1, tag=1), recv(1, tag=1), recv(1, tag=1)
    for r in (ra, rb, rc):
        m.post(r)
    got = {d.recv.id: d.msg.id for d in m.take() if isinstance(d, Delivered)}
    assert got == {r2.id: msgs[2].id, ra.id: msgs[0].id, rb.id: msgs[1].id, rc.id: msgs[3].id}


def test_posted_recvs_match_in_post_order(recv: Recvs) -> None:
    m = Matching(RANK)
    first, second = recv(1, tag=5), recv(1, tag=5)
    m.post(first)
    m.post(second)
    a, b = arrive(m, 1, tag=5), arrive(m, 1, tag=5)
    assert isinstance(a, IntoRecv) and isinstance(b, IntoRecv)
    assert (a.recv, b.recv) == (first, second)
    m.arrived(b.msg)  # payloads complete in any order; each goes to its own recv
    m.arrived(a.msg)
    assert m.take() == [Delivered(second, b.msg, False), Delivered(first, a.msg, False)]


def test_any_source_takes_the_earliest_unexpected_message(recv: Recvs) -> None:
    m = Matching(RANK)
    from2 = arrive(m, 2, tag=0).msg
    from1 = arrive(m, 1, tag=0).msg
    other_tag = arrive(m, 3, tag=9).msg
    for msg in (from1, other_tag, from2):
        m.arrived(msg)
    r = recv(ANY_SOURCE)
    m.post(r)
    assert m.take() == [Delivered(r, from2, True)], "arrival order, not rank order"
    r = recv(ANY_SOURCE)
    m.post(r)
    assert m.take() == [Delivered(r, from1, True)]
    assert m.unexpected == (other_tag,)


def test_a_later_message_matches_the_first_posted_of_any_source_and_specific(
    recv: Recvs,
) -> None:
    m = Matching(RANK)
    specific, anyone, also_specific = recv(1), recv(ANY_SOURCE), recv(2)
    for r in (specific, anyone, also_specific):
        m.post(r)
    from2 = arrive(m, 2)
    assert isinstance(from2, IntoRecv) and from2.recv == anyone, "post order decides"
    from1 = arrive(m, 1)
    assert isinstance(from1, IntoRecv) and from1.recv == specific
    third = arrive(m, 2)
    assert isinstance(third, IntoRecv) and third.recv == also_specific
    assert m.posted == ()


def test_self_messages_match_like_any_other(recv: Recvs) -> None:
    m = Matching(RANK)
    place = arrive(m, RANK, tag=4)
    m.arrived(place.msg)
    r = recv(RANK, tag=4)
    m.post(r)
    assert m.take() == [Delivered(r, place.msg, True)]


# ------------------------------------------------------------------ mismatches


def test_size_mismatch_fails_the_recv_naming_the_ranks_and_drains_the_message(
    recv: Recvs,
) -> None:
    m = Matching(3)
    r, after = recv(1, tag=2, nbytes=8), recv(1, tag=2, nbytes=16)
    m.post(r)
    m.post(after)
    place = arrive(m, 1, tag=2, nbytes=16)
    assert isinstance(place, IntoBuffer), "the payload is drained into a buffer"
    (failed,) = m.take()
    assert isinstance(failed, Failed) and failed.recv == r
    assert isinstance(failed.error, CollectiveMismatchError)
    text = str(failed.error)
    assert text.startswith("rank 3: recv from rank 1 (tag 2) of 8 bytes (float32)"), text
    assert "send of 16 bytes (float32) from rank 1" in text
    m.arrived(place.msg)
    assert m.take() == [Discarded(place.msg)]
    nxt = arrive(m, 1, tag=2, nbytes=16)  # the link is in step: the next message matches
    assert isinstance(nxt, IntoRecv) and nxt.recv == after


def test_dtype_mismatch_and_mismatch_with_a_buffered_message(recv: Recvs) -> None:
    m = Matching(RANK)
    done = arrive(m, 1, nbytes=8, dtype=torch.int64).msg
    m.arrived(done)
    coming = arrive(m, 1, nbytes=4).msg
    r = recv(1, nbytes=8)
    m.post(r)
    failed, discarded = m.take()
    assert isinstance(failed, Failed) and "(int64) from rank 1" in str(failed.error)
    assert discarded == Discarded(done), "a message consumed by a failed recv frees its buffer"
    r2 = recv(1, nbytes=8)
    m.post(r2)  # matches the half-received 4-byte message: fails now, drains later
    (failed,) = m.take()
    assert isinstance(failed, Failed) and failed.recv == r2
    m.arrived(coming)
    assert m.take() == [Discarded(coming)]
    assert m.unexpected == () and m.posted == ()


def test_unknown_sender_dtype_is_checked_by_size_only(recv: Recvs) -> None:
    m = Matching(RANK)
    r = recv(1)
    m.post(r)
    place = m.arrive(1, 0, 8, None)
    assert isinstance(place, IntoRecv)


# ------------------------------------------------------------------ timeouts, failures


def test_expire_fails_only_unmatched_recvs_past_their_deadline(recv: Recvs) -> None:
    m = Matching(RANK)
    early, late, matched = recv(1, deadline=5.0), recv(2, deadline=50.0), recv(3, deadline=5.0)
    for r in (early, late, matched):
        m.post(r)
    inflight = arrive(m, 3)
    assert m.next_deadline() == 5.0
    m.expire(4.9, 2.0)
    assert m.take() == []
    m.expire(5.0, 2.0)
    (failed,) = m.take()
    assert isinstance(failed, Failed) and failed.recv == early
    assert isinstance(failed.error, PeerConnectionError)
    assert (
        "rank 0: p2p recv from rank 1 (tag 0) failed: no matching send arrived within 2.0s"
        in str(failed.error)
    )
    assert m.posted == (late,) and m.next_deadline() == 50.0
    m.arrived(inflight.msg)  # a matched recv does not expire: its link's stall rule covers it
    assert m.take() == [Delivered(matched, inflight.msg, False)]


def test_peer_down_fails_its_recvs_and_forgets_its_partial_message(recv: Recvs) -> None:
    m = Matching(RANK)
    kept = arrive(m, 1, tag=7).msg
    m.arrived(kept)  # already in: stays receivable after the link goes
    mine, waiting, other, anyone = recv(1), recv(1, tag=1), recv(2), recv(ANY_SOURCE, tag=3)
    for r in (mine, waiting, other, anyone):
        m.post(r)
    half = arrive(m, 1, tag=1)
    assert isinstance(half, IntoRecv) and half.recv == waiting
    stray = arrive(m, 1, tag=8)  # unexpected, half received when the link goes
    assert isinstance(stray, IntoBuffer)
    cause = PeerConnectionError("rank 1 aborted: boom", culprit=1)
    m.peer_down(1, cause)
    out = m.take()
    failed = {o.recv.id: o.error for o in out if isinstance(o, Failed)}
    assert set(failed) == {mine.id, waiting.id}
    for r in (mine, waiting):
        error = failed[r.id]
        assert type(error) is PeerConnectionError and error.culprit == 1
        assert str(error).startswith(f"rank 0: p2p {r.what} failed: rank 1 aborted: boom")
    assert Discarded(stray.msg) in out
    assert m.posted == (other, anyone) and m.unexpected == (kept,)
    r = recv(1, tag=7)
    m.post(r)
    assert m.take() == [Delivered(r, kept, True)]
    m.all_peers_down()
    (failed_any,) = m.take()
    assert isinstance(failed_any, Failed) and failed_any.recv == anyone
    assert "every peer's connection is closed" in str(failed_any.error)
    assert m.posted == (other,)


def test_a_bare_abort_cause_reads_as_a_lost_peer(recv: Recvs) -> None:
    m = Matching(RANK)
    r = recv(1)
    m.post(r)
    m.peer_down(1, EntrenarError("rank 1 called abort()", culprit=1))
    (failed,) = m.take()
    assert isinstance(failed, Failed) and type(failed.error) is PeerConnectionError
    assert failed.error.culprit == 1


def test_close_fails_every_pending_recv_and_frees_every_buffer(recv: Recvs) -> None:
    m = Matching(RANK)
    posted, waiting, buffered_waiting = recv(1), recv(2), recv(3)
    m.post(posted)
    m.post(waiting)
    direct = arrive(m, 2)
    partial = arrive(m, 3)
    m.post(buffered_waiting)  # matched to the half-received buffered message
    unexpected = arrive(m, 1, tag=9)
    m.arrived(unexpected.msg)
    cause = CollectiveMismatchError("rank 0: allreduce: the group failed", culprit=2)
    m.close(cause, "unused when there is a cause")
    out = m.take()
    failed = {o.recv.id: o.error for o in out if isinstance(o, Failed)}
    assert set(failed) == {posted.id, waiting.id, buffered_waiting.id}
    assert all(type(e) is CollectiveMismatchError and e.culprit == 2 for e in failed.values())
    discarded = {o.msg.id for o in out if isinstance(o, Discarded)}
    assert discarded == {partial.msg.id, unexpected.msg.id}, "direct payloads own no buffer"
    assert direct.msg.id not in discarded
    assert m.posted == () and m.unexpected == () and m.take() == []

    m2 = Matching(RANK)
    r = recv(1)
    m2.post(r)
    m2.close(None, "the process group was destroyed")
    (failed2,) = m2.take()
    assert isinstance(failed2, Failed) and type(failed2.error) is PeerConnectionError
    assert str(failed2.error) == (
        "rank 0: p2p recv from rank 1 (tag 0) failed: the process group was destroyed"
    )


# ------------------------------------------------------------------ random interleavings


@dataclass
class ModelMsg:
    seq: int  # arrival order (= Matching's message id)
    peer: int
    tag: int
    nbytes: int
    complete: bool = False
    recv: int | None = None  # the recv id it matched (payload still coming)


@dataclass
class Model:
    """The rules, written as plainly as possible (lists scanned in order)."""

    posted: list[tuple[int, int, int, int, float]] = field(
        default_factory=list
    )  # id, peer, tag, nbytes, deadline
    unexpected: list[ModelMsg] = field(default_factory=list)
    partial: dict[int, ModelMsg] = field(default_factory=dict)
    results: dict[int, tuple[str, int]] = field(
        default_factory=dict
    )  # recv -> (ok, msg) | (kind, -1)

    def pair(self, rid: int, nbytes: int, msg: ModelMsg) -> None:
        if nbytes != msg.nbytes:
            self.results[rid] = ("mismatch", -1)
        elif msg.complete:
            self.results[rid] = ("ok", msg.seq)
        else:
            msg.recv = rid

    def post(self, rid: int, peer: int, tag: int, nbytes: int, deadline: float) -> None:
        for msg in self.unexpected:
            if msg.tag == tag and peer in (ANY_SOURCE, msg.peer):
                self.unexpected.remove(msg)
                self.pair(rid, nbytes, msg)
                return
        self.posted.append((rid, peer, tag, nbytes, deadline))

    def arrive(self, msg: ModelMsg) -> None:
        self.partial[msg.seq] = msg
        for entry in self.posted:
            rid, peer, tag, nbytes, _ = entry
            if msg.tag == tag and peer in (ANY_SOURCE, msg.peer):
                self.posted.remove(entry)
                self.pair(rid, nbytes, msg)
                return
        self.unexpected.append(msg)

    def arrived(self, seq: int) -> None:
        msg = self.partial.pop(seq)
        msg.complete = True
        if msg.recv is not None:
            self.results[msg.recv] = ("ok", msg.seq)

    def expire(self, now: float) -> None:
        for entry in [e for e in self.posted if e[4] <= now]:
            self.posted.remove(entry)
            self.results[entry[0]] = ("timeout", -1)

    def peer_down(self, peer: int) -> None:
        for entry in [e for e in self.posted if e[1] == peer]:
            self.posted.remove(entry)
            self.results[entry[0]] = ("down", -1)
        for msg in [m for m in self.partial.values() if m.peer == peer]:
            del self.partial[msg.seq]
            if msg in self.unexpected:
                self.unexpected.remove(msg)
            if msg.recv is not None:
                self.results[msg.recv] = ("down", -1)


class Driver:
    """Drives a Matching as the channel does: payload bytes are the message's
    seq, written where the placement says; buffers live until Delivered or
    Discarded."""

    def __init__(self) -> None:
        self.m = Matching(RANK)
        self.slots: dict[int, int | None] = {}  # recv id -> what its buffer holds
        self.buffers: dict[int, int] = {}  # message id -> payload (the message's seq)
        self.placements: dict[int, IntoRecv | IntoBuffer] = {}
        self.results: dict[int, tuple[str, int]] = {}
        self.keys: dict[int, tuple[int, int]] = {}  # message id -> (peer, tag)

    def settle(self) -> None:
        for o in self.m.take():
            if isinstance(o, Discarded):
                assert o.msg.id in self.buffers, "discarded a buffer it never asked for"
                del self.buffers[o.msg.id]
                continue
            assert o.recv.id not in self.results, "a recv finished twice"
            if isinstance(o, Failed):
                if isinstance(o.error, CollectiveMismatchError):
                    self.results[o.recv.id] = ("mismatch", -1)
                elif "no matching send" in str(o.error):
                    self.results[o.recv.id] = ("timeout", -1)
                else:
                    self.results[o.recv.id] = ("down", -1)
                continue
            if o.buffered:
                self.slots[o.recv.id] = self.buffers.pop(o.msg.id)
            got = self.slots[o.recv.id]
            assert got is not None, "delivered before its payload was written"
            self.results[o.recv.id] = ("ok", got)

    def post(self, r: PostedRecv) -> None:
        self.slots[r.id] = None
        self.m.post(r)

    def arrive(self, peer: int, tag: int, nbytes: int) -> Message:
        place = self.m.arrive(peer, tag, nbytes, F32)
        self.placements[place.msg.id] = place
        self.keys[place.msg.id] = (peer, tag)
        if isinstance(place, IntoBuffer):
            self.buffers[place.msg.id] = -1  # allocated, not written yet
        return place.msg

    def arrived(self, msg: Message) -> None:
        place = self.placements.pop(msg.id)
        if isinstance(place, IntoRecv):
            self.slots[place.recv.id] = msg.id
        else:
            self.buffers[msg.id] = msg.id
        self.m.arrived(msg)


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_agree_with_the_reference_model(seed: int) -> None:
    rng = random.Random(seed)
    model, drv, make = Model(), Driver(), Recvs()
    peers = [1, 2, 3]
    down: set[int] = set()
    inflight: dict[int, Message] = {}  # one message per link at a time, as on a stream
    for step in range(120):
        now = float(step)
        kind = rng.choices(
            ["post", "header", "payload", "expire", "down"], weights=[30, 30, 30, 6, 1]
        )[0]
        if kind == "post":
            peer = rng.choice([*peers, ANY_SOURCE])
            r = make(peer, rng.choice([0, 1]), rng.choice([8, 8, 8, 4]), now + rng.randint(3, 40))
            model.post(r.id, r.peer, r.tag, r.nbytes, r.deadline)
            drv.post(r)
        elif kind == "header":
            free = [p for p in peers if p not in down and p not in inflight]
            if not free:
                continue
            peer = rng.choice(free)
            msg = drv.arrive(peer, rng.choice([0, 1]), rng.choice([8, 8, 8, 4]))
            model.arrive(ModelMsg(msg.id, msg.peer, msg.tag, msg.nbytes))
            inflight[peer] = msg
        elif kind == "payload":
            if not inflight:
                continue
            msg = inflight.pop(rng.choice(sorted(inflight)))
            drv.arrived(msg)
            model.arrived(msg.id)
        elif kind == "expire":
            drv.m.expire(now, 1.0)
            model.expire(now)
        else:
            live = [p for p in peers if p not in down]
            if not live:
                continue
            peer = rng.choice(live)
            down.add(peer)
            inflight.pop(peer, None)
            drv.m.peer_down(peer, PeerConnectionError(f"rank {peer} died", culprit=peer))
            model.peer_down(peer)
            if len(down) == len(peers):
                drv.m.all_peers_down()
                model.peer_down(ANY_SOURCE)
        drv.settle()
        assert drv.results == model.results, f"step {step} ({kind})"
        assert [r.id for r in drv.m.posted] == [e[0] for e in model.posted]
        assert [m.id for m in drv.m.unexpected] == [m.seq for m in model.unexpected]
        # Only unexpected messages, and drained ones still coming, hold buffers.
        unexpected = {m.id for m in drv.m.unexpected}
        assert unexpected <= set(drv.buffers)
        assert set(drv.buffers) - unexpected <= set(drv.placements)
    drv.m.close(None, "closed")
    drv.settle()
    assert drv.buffers == {}, "close must free every buffer"
    assert set(drv.results) == set(range(make.next_id)), "every recv finished"
    # One tag's messages from one peer went to recvs in post order.
    delivered = sorted((msg, rid) for rid, (k, msg) in drv.results.items() if k == "ok")
    for peer in peers:
        for tag in (0, 1):
            rids = [rid for msg, rid in delivered if drv.keys[msg] == (peer, tag)]
            assert rids == sorted(rids), (peer, tag, rids)

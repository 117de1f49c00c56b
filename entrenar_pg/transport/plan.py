"""The plan model: what one collective sends and receives on each link, in order.

An algorithm (``entrenar_pg.collectives``) describes a collective on one rank
as a ``Plan``: for each peer, an ordered list of byte ranges to send and an
ordered list of byte ranges to receive into. A send may wait for a receive to
finish (``ready``), a receive may run a callback when it completes (``done``:
reduce a segment, mark it forwardable). That is all an algorithm needs; the
progress loop (``loop.py``) executes plans over whichever transport carries
the bytes, and no algorithm touches a socket.

Every collective opens each link direction it uses with a header
(``wire.Header``); ``Plan`` packs headers once, compares what arrives byte for
byte, and carries the header rule (see ``Plan``).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CollectiveMismatchError
from ..wire import HEADER_BYTES, Header, stamp_seq

MAX_IOV = 64  # buffers per sendmsg/recvmsg_into (the kernel allows 1024)


@dataclass(slots=True)
class Send:
    """Bytes to send to a peer, once ``ready()`` (if given) is true; ``done()``
    (if given) runs once the kernel has taken the last byte (p2p completes a
    send's Work there; collectives never need it)."""

    view: memoryview
    ready: Callable[[], bool] | None = None
    done: Callable[[], None] | None = None


@dataclass(slots=True)
class Recv:
    """A buffer to fill from a peer, once ``ready()`` (if given) is true;
    ``done()`` runs once it is full.

    ``chain``: the next piece's buffer is distinct from this one, so both may
    be filled by one syscall (false for pieces that share a scratch buffer,
    and before a piece that waits on ``ready``). ``ready``: its bytes may not
    be taken in yet (their ``done`` combines into memory that other links'
    receives still write: the host slices' pieces).
    """

    view: memoryview
    done: Callable[[], None] | None = None
    chain: bool = False
    ready: Callable[[], bool] | None = None


@dataclass(slots=True)
class _Stamp:
    """A header as this rank sends it and expects it back, packed once.

    ``packed`` is the truth: ``Plan.restamp`` rewrites its sequence number in
    place, so ``header`` (what the plan was built with) may carry an older one.
    """

    header: Header
    packed: bytearray


@dataclass(slots=True)
class LinkPlan:
    """One direction of one link in a plan, as the progress loop drives it.

    ``whole``: every piece's view, when the link can go in one syscall from
    the start (sends: no piece waits on a receive; receives: every piece but
    the last is ``chain``), else None. Computed once per plan (cached plans
    reuse it), so a small collective's first attempt on a link is one
    ``sendmsg`` / ``recvmsg_into`` with no per-piece work.
    """

    peer: int
    pieces: list[Any]  # Send or Recv, in order
    whole: list[memoryview] | None
    total: int


@dataclass(slots=True)
class _Tally:
    """How many of a plan's received headers have passed their check (see ``Plan.acknowledge``)."""

    expected: int = 0
    passed: int = 0

    def all_passed(self) -> bool:
        return self.passed == self.expected


@dataclass
class Plan:
    """Per-peer ordered sends and receives of one collective on one rank.

    The header rule: no rank may complete a collective before every peer's
    header has been compared with its own, here or (through data that peer
    sent only after its own checks) on the way. A plan whose data reaches
    every rank through every other (ring, star, direct) gets that from its
    data; one where some rank only sends or only hears from some peers adds
    ``confirm_peers`` (header-only frames on the links it does not use),
    ``confirm_at_root`` (rooted plans: the root checks every header and
    answers each rank with a verdict) or the dissemination rounds
    (collectives/dissemination.py, ``confirm_in_rounds``), and
    one whose links carry different headers (all-to-all: per-link sizes)
    adds ``acknowledge``. Every plan also exchanges headers with its ring
    neighbours (star plans through ``confirm_neighbours``), so two different
    plans for one call always meet (a large reduce's final move to the root
    is the exception: every rank agreed in the reduce-scatter before it).
    docs/architecture.md, "The header rule", says which algorithm does what.

    A team's plan (``members``: an ordered subset of the group's ranks, this
    rank among them) names peers by their position in ``members``, so an
    algorithm written for ranks 0..n-1 runs unchanged on any subset (the
    host-aware collectives run rings inside a host and across hosts); the
    links, and every message, carry the group's ranks.
    """

    rank: int
    sends: dict[int, list[Send]] = field(default_factory=dict)
    recvs: dict[int, list[Recv]] = field(default_factory=dict)
    _stamps: list[_Stamp] = field(default_factory=list)
    _tally: _Tally = field(default_factory=_Tally)
    _links: tuple[list[LinkPlan], list[LinkPlan]] | None = None
    members: tuple[int, ...] | None = None  # a team's ranks; peers are then positions in it
    # Every peer of the plan has a data socket (``Mesh.run``): a cached plan
    # checks once, not on every call.
    connected: bool = False

    def on(self, members: tuple[int, ...] | None) -> Plan:
        """This plan, with peers named by position in ``members`` (None: by rank):
        one plan over several teams, each team's algorithm adding to its own
        view (the pieces, headers and links are shared)."""
        return dataclasses.replace(self, members=members)

    def _rank_of(self, peer: int) -> int:
        return peer if self.members is None else self.members[peer]

    def open(self, peer: int, header: Header, *, send: bool = True, recv: bool = True) -> None:
        """Start this collective's frame on the link(s) with ``peer``.

        The header goes first in each direction used; the received one must
        equal ``header`` (same collective, seq, dtype, size, algorithm), else
        CollectiveMismatchError. A direction opens once, before its pieces.
        """
        peer = self._rank_of(peer)
        assert peer != self.rank
        stamp = self._stamp(header)
        if send:
            assert peer not in self.sends, "internal: a link direction opens once, first"
            self._send(peer, memoryview(stamp.packed))
        if recv:
            assert peer not in self.recvs, "internal: a link direction opens once, first"
            self._expect(peer, stamp, self._tally)

    def confirm_peers(self, world: int, header: Header) -> None:
        """Exchange ``header`` alone on every link direction this plan leaves unused.

        Call it after every ``open``. Afterwards this rank sends its header to
        every peer and receives every peer's, so it completes only once it has
        compared every peer's call with its own, and every peer compares ours:
        if any two ranks disagree, every rank sees a header unlike its own.
        Costs one 32-byte frame per unused direction, sent at the start (no
        extra round trip).
        """
        for i in range(world):
            peer = self._rank_of(i)
            if peer != self.rank and (peer not in self.sends or peer not in self.recvs):
                self.open(i, header, send=peer not in self.sends, recv=peer not in self.recvs)

    def confirm_neighbours(self, world: int, header: Header) -> None:
        """Send ``header`` to the next rank and receive the previous rank's, if the
        plan does not already (header-only frames); call it after every ``open``.

        Every plan talks to its ring neighbours this way or through its own
        links, so when ranks run different plans for one call (a star beside a
        ring, when their sizes or thresholds disagree) some rank always reads
        a header from a rank whose plan differs, instead of all waiting for
        messages that go elsewhere until the timeout.
        """
        me = self.rank if self.members is None else self.members.index(self.rank)
        right, left = (me + 1) % world, (me - 1) % world
        if self._rank_of(right) not in self.sends:
            self.open(right, header, recv=False)
        if self._rank_of(left) not in self.recvs:
            self.open(left, header, send=False)

    def confirm_at_root(self, root: int, world: int, header: Header) -> None:
        """The header rule through ``root`` (rooted plans: the root talks to every
        rank, the others to the root); call it after every ``open``.

        Every rank and the root exchange headers (a header-only frame on a
        direction the plan leaves unused); the root compares all N - 1 with its
        own and, only once every header it receives has passed, sends each rank
        a verdict: ``header`` again, received and checked like a header, after
        whatever the plan sends that rank. So a rank completes only after the
        root found every rank's call equal to its own, and a rank other than
        the root needs no socket to any rank but the root (where
        ``confirm_peers`` exchanged a frame with every peer). One more hop for
        the ranks that only send to the root; 32 or 64 bytes each way per
        rank. The root's header goes out at once, unlike its verdict, so a
        rank running another plan for this call (one over shared memory,
        say) still finds a frame from the root on its link; and two different
        plans meet through ``confirm_neighbours``.
        """
        me, root_rank = self.rank, self._rank_of(root)
        peers = [i for i in range(world) if self._rank_of(i) != me]
        for i in [root] if me != root_rank else peers:
            peer = self._rank_of(i)
            if peer not in self.sends or peer not in self.recvs:
                self.open(i, header, send=peer not in self.sends, recv=peer not in self.recvs)
        stamp = self._stamp(header)
        if me != root_rank:
            self._expect(root_rank, stamp, None)
            return
        for i in peers:
            self._send(self._rank_of(i), memoryview(stamp.packed), self._tally.all_passed)

    def acknowledge(self, peer: int, header: Header) -> None:
        """End the link with ``peer`` with an acknowledgement both ways.

        For plans whose links carry different headers (all-to-all: each
        link's sizes), where comparing headers on every link does not compare
        every pair of calls: a third rank cannot see that two others disagree
        about the link between them. The acknowledgement is ``header`` (the
        link's) again, sent only once every header this plan receives has
        passed its check, and received and checked like a header; so a rank
        completes only after every peer found all of its own links in
        agreement. One more hop; 32 bytes per direction.
        """
        peer = self._rank_of(peer)
        stamp = self._stamp(header)
        self._send(peer, memoryview(stamp.packed), self._tally.all_passed)
        self._expect(peer, stamp, None)

    def restamp(self, seq: int) -> None:
        """Re-arm a cached plan (one header on every link) for its next call:
        the same collective on the same buffers, only the sequence number new."""
        assert len(self._stamps) == 1, "internal: restamp needs a one-header plan"
        stamp_seq(self._stamps[0].packed, seq)
        self._tally.passed = 0

    def links(self) -> tuple[list[LinkPlan], list[LinkPlan]]:
        """The plan's send and receive links, for the progress loop (built on first use)."""
        if self._links is None:
            sends = [
                LinkPlan(p, lst, _whole(lst, all(s.ready is None for s in lst)), _total(lst))
                for p, lst in self.sends.items()
            ]
            recvs = [
                LinkPlan(
                    p,
                    lst,
                    _whole(lst, lst[0].ready is None and all(r.chain for r in lst[:-1])),
                    _total(lst),
                )
                for p, lst in self.recvs.items()
            ]
            self._links = (sends, recvs)
        return self._links

    def send(self, peer: int, view: memoryview, ready: Callable[[], bool] | None = None) -> None:
        self._send(peer if self.members is None else self.members[peer], view, ready)

    def _send(self, peer: int, view: memoryview, ready: Callable[[], bool] | None = None) -> None:
        assert self._links is None, "internal: plan changed after it ran"
        if not len(view):
            # Nothing to move, and the send loop must not stop at an empty
            # piece whose successor waits (sendmsg of nothing "moves" forever).
            return
        self.sends.setdefault(peer, []).append(Send(view, ready))

    def recv(
        self,
        peer: int,
        view: memoryview,
        done: Callable[[], None] | None = None,
        chain: bool = False,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        if self.members is not None:
            peer = self.members[peer]
        self._recv(peer, view, done, chain, ready)

    def _recv(
        self,
        peer: int,
        view: memoryview,
        done: Callable[[], None] | None,
        chain: bool,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        assert self._links is None, "internal: plan changed after it ran"
        pieces = self.recvs.setdefault(peer, [])
        if ready is not None and pieces:
            pieces[-1].chain = False  # one syscall must not fill past a closed gate
        pieces.append(Recv(view, done, chain, ready))

    def _stamp(self, header: Header) -> _Stamp:
        """The packed form of ``header``: the plan's last one when equal (the same
        header on several links is packed once), else a new one."""
        stamps = self._stamps
        if stamps and (stamps[-1].header is header or stamps[-1].header == header):
            return stamps[-1]
        stamp = _Stamp(header, bytearray(HEADER_BYTES))
        header.pack_into(stamp.packed)
        stamps.append(stamp)
        return stamp

    def _expect(self, peer: int, stamp: _Stamp, tally: _Tally | None) -> None:
        """Receive a header from ``peer`` and compare it with ``stamp`` (counted in ``tally``)."""
        raw = bytearray(HEADER_BYTES)
        if tally is not None:
            tally.expected += 1
        self._recv(peer, memoryview(raw), _header_check(self.rank, peer, stamp, raw, tally), True)


def _whole(pieces: list[Any], one_go: bool) -> list[memoryview] | None:
    if not one_go or len(pieces) > MAX_IOV:
        return None
    return [p.view for p in pieces]


def _total(pieces: list[Any]) -> int:
    return sum(len(p.view) for p in pieces)


def _header_check(
    rank: int, peer: int, stamp: _Stamp, raw: bytearray, tally: _Tally | None
) -> Callable[[], None]:
    def check() -> None:
        if raw == stamp.packed:  # the common case: byte-equal headers are equal headers
            if tally is not None:
                tally.passed += 1
            return
        mine = Header.unpack(stamp.packed)  # with the current seq (see _Stamp)
        try:
            theirs = Header.unpack(raw)
        except ValueError as e:
            raise CollectiveMismatchError(
                f"rank {rank}: garbage from rank {peer} where the header of "
                f"{mine.describe()} was due ({e}); the ranks are out of step"
            ) from None
        if theirs != mine:
            raise CollectiveMismatchError(
                f"rank {rank}: collective mismatch with rank {peer}: this rank called "
                f"{mine.describe()}, rank {peer} called {theirs.describe()}"
            )
        if tally is not None:  # equal after all (bytes that parse alike)
            tally.passed += 1

    return check


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous 1-D CPU tensor's memory (no copy).

    Through ctypes, not ``Tensor.numpy()``: numpy marks the tensor's storage
    non-resizable for good, and user code resizes buffers it passed to a
    collective (DDP's batched PowerSGD hook resizes the bucket buffer). The
    view does not keep ``t`` alive: callers hold ``t`` while it is in use.
    """
    assert t.dim() == 1 and t.is_contiguous() and t.device.type == "cpu", "internal: flat CPU"
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    key = (t.data_ptr(), n)
    view = _VIEWS.get(key)
    if view is None:
        # Keyed by address and length, a cached view is exactly the memory
        # asked for, whichever tensor owns it now.
        if len(_VIEWS) >= _MAX_CACHED_VIEWS:
            _VIEWS.clear()
        view = _VIEWS[key] = memoryview((ctypes.c_char * n).from_address(key[0])).cast("B")
    return view


_MAX_CACHED_VIEWS = 256
_VIEWS: dict[tuple[int, int], memoryview] = {}

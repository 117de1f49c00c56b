"""Slot areas: the shared memory of the shm-native allreduce (``collectives/shm_allreduce.py``).

When every rank of a group is on this host and every pair mapped the
other's segment (``setup.connect``), each rank's segment also holds a *slot
area*, mapped by every peer:

    one page of control words | slot 0 | slot 1

Each slot is ``SLOT_HEADER_BYTES`` (a collective's 32-byte wire header,
padded to a cache line) then ``slot_data_bytes(N)`` of data. A collective
moves through *phases*: in phase k a rank writes its slot ``k % 2`` and then
publishes k in its ``ARRIVED`` word; a rank reads the peers' slot ``k % 2``
only once every peer published k. A rank publishes k + 1 only after it has
finished reading phase k, so when any rank writes slot ``k % 2`` again (phase
k + 2) every peer has finished reading it: double-buffering by parity means
no separate "done reading" word and no wait for readers, except that a rank
cannot get more than one phase ahead of the slowest.

Waiting (``SlotArea.arrived``, then ``SlotArea.wait``): look at the peers'
words (fewer times after a wait whose peer came only while this rank's
core was away: it likely shares the core); spin a little with
``sched_yield`` (the job's ``spin_s``, or longer where the caller says
the peers are busy with a large copy); then set this rank's ``SLEEPS`` word,
fence, look again, and sleep in the progress loop's ``poll()`` (``Sleeper``) on the peers'
TCP data sockets (a publisher that sees ``SLEEPS`` set sends one wake-up
byte there), which also watches the control sockets (aborts, QUERY) and
hang-ups (a killed peer is named at once). Nothing moving for the job's
timeout is ``Causes.stalled`` naming the ranks still missing. A publisher
whose peers are awake makes no syscall.

Memory order: x86-64 only (``setup.connect`` offers shared memory nowhere
else); the fence before ``ARRIVED`` also drains the non-temporal stores a
large ``memcpy`` may use.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from typing import TYPE_CHECKING, Protocol

import torch

from ...config import SHM_SLEEP_CAP_S
from ..spin import GAVE_AWAY_S, Spin
from .chunk_plan import ChunkChoice, ChunkPlan
from .placement import Placement
from .populate import POPULATE_READ, POPULATE_WRITE, populate

if TYPE_CHECKING:
    from ..control import Causes
    from ..loop import Pace
    from .ring import ShmLink

SLOT_HEADER_BYTES = 64
# Data bytes of one slot: a small allreduce (<= SMALL_MAX_BYTES) fits whole;
# a larger one moves in chunks of this size (two phases each).
SLOT_DATA_BYTES = 4 << 20
# The same where the group is two ranks: its 4 MiB chunks go at the slots'
# start or rotate over their four quarters, as rank 0 chose for the call
# (``chunk_plan.py``). Pages are touched only as far as the calls reach.
# Three or more ranks keep ``SLOT_DATA_BYTES`` and the chunks at the start:
# with the rotation, N=4 read 1.11-1.28x the previous release in 4 of 8
# cells (and took 4x the slot memory), docs/benchmarks.md.
PAIR_SLOT_DATA_BYTES = 16 << 20
_PAGE = mmap.PAGESIZE


def slot_data_bytes(world: int) -> int:
    """Data bytes of one slot in a group of ``world`` ranks (see above)."""
    return PAIR_SLOT_DATA_BYTES if world == 2 else SLOT_DATA_BYTES


def _whole_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of the page."""
    return -(-nbytes // _PAGE) * _PAGE


def _slot_stride(world: int) -> int:
    """Bytes from one slot's start to the next (a multiple of the page)."""
    return _whole_pages(SLOT_HEADER_BYTES + slot_data_bytes(world))


def area_bytes(world: int) -> int:
    """One rank's slot area in a group of ``world`` ranks: the control page, two slots."""
    return _PAGE + 2 * _slot_stride(world)


# Control words (indices into the area's first page viewed as 'q'), each on
# a cache line of its own: the last phase published, and "asleep: wake me".
_ARRIVED = 64 // 8
_SLEEPS = 128 // 8
_FAILED = 192 // 8  # set (once) when this rank's group was aborted: its calls did not complete
_CPU = 256 // 8  # the CPU this rank last found itself on, + 1 (``placement.Placement``)
_CHUNK_PLAN = 320 // 8  # two words: rank 0's placement of the next chunks (``chunk_plan``)
_HEADER_BYTES = 32  # wire.HEADER_BYTES (a plan's frame starts with one)
_NONCE = 0  # bytes [0, 16): the area's nonce (set-up checks it, like a ring block's)


class ForeignTraffic(Exception):
    """A peer wrote a plan's frame into its byte ring to this rank while this
    rank waits in the shm-native allreduce: it runs another collective.
    ``raw`` is its header (the caller names both calls)."""

    def __init__(self, peer: int, raw: bytes) -> None:
        super().__init__(peer, raw)
        self.peer = peer
        self.raw = raw


class Sleeper(Protocol):
    """What a slot wait needs of the progress loop (``loop.Progress`` is one)."""

    @property
    def causes(self) -> Causes: ...
    @property
    def spin(self) -> Spin: ...
    def sleep_on(
        self, waiting_on: list[int], peers: list[int], what: str, wait_s: float
    ) -> list[int]: ...
    def forget(self, fd: int) -> None: ...
    def done_sleeping(self) -> None: ...


class SlotArea:
    """This rank's slot area and its mappings of every peer's, for one group.

    ``areas[q]`` is rank q's area (``areas[rank]`` this rank's own). Not
    thread-safe: one collective runs at a time on a group (the engine's token).
    """

    def __init__(
        self,
        rank: int,
        areas: dict[int, memoryview],
        links: dict[int, ShmLink],
        placement: bool = True,
    ) -> None:
        self.rank = rank
        self.world = len(areas)
        self._areas = [areas[q] for q in range(self.world)]
        self._ctl = [a[:_PAGE].cast("q") for a in self._areas]
        self._own = self._ctl[rank]
        self._peers = [q for q in range(self.world) if q != rank]
        self._peer_ctl = [(q, self._ctl[q]) for q in self._peers]
        # Two ranks: the peer's words (``publish_pair``); else unused.
        self._pair_ctl = self._ctl[self._peers[0]] if self.world == 2 else self._own
        self._socks = {q: links[q].sock for q in self._peers}
        self._links = [links[q] for q in self._peers]
        # Data sockets not known to have hung up. A peer left out hung up after
        # it did its part of a call (it left, or died, between calls): a later
        # wait for it names it at once, where nothing would wake it before the timeout.
        self._watched = list(self._peers)
        self.slot_bytes = slot_data_bytes(self.world)  # data bytes of one slot
        self._stride = stride = _slot_stride(self.world)
        self._slots = [
            [a[_PAGE + p * stride : _PAGE + p * stride + SLOT_HEADER_BYTES] for p in (0, 1)]
            for a in self._areas
        ]
        # ``peer_headers[parity]``: every peer's wire header in its slot
        # ``parity`` (read after ``wait``; the collective compares them).
        self.peer_headers = [
            [self._slots[q][p][:_HEADER_BYTES] for q in self._peers] for p in (0, 1)
        ]
        self._own_headers = [self._slots[rank][p][:_HEADER_BYTES] for p in (0, 1)]
        # The fence (``fence.Fence``'s kind: an uncontended lock round trip, a
        # locked instruction, a full barrier on x86-64), inlined where it is hot.
        self._lock = threading.Lock()
        self._views: dict[tuple[torch.dtype, int], list[list[torch.Tensor]]] = {}
        self.phase = int(self._own[_ARRIVED])  # the last phase this rank published
        self._looks = _TIGHT_LOOKS  # tight looks of the next wait (``wait``)
        self.placement = Placement(rank, self._own, self._peer_ctl, _CPU, enabled=placement)
        # Two ranks: where the large path's chunks go per call, rank 0's choice
        # (``chunk_plan.py``); more ranks: always at the slots' start (None).
        self.chunk_plan: ChunkPlan | None = None
        if self.world == 2:
            choice = ChunkChoice() if rank == 0 else None
            self.chunk_plan = ChunkPlan(self._ctl[0], _CHUNK_PLAN, choice)

    # ---------------------------------------------------------------- data

    def views(self, dtype: torch.dtype, numel: int) -> list[list[torch.Tensor]]:
        """``views[q][parity]``: the first ``numel`` ``dtype`` elements of rank
        q's slot ``parity`` (cached: a training loop reuses a few shapes)."""
        key = (dtype, numel)
        got = self._views.get(key)
        if got is None:
            assert numel * dtype.itemsize <= self.slot_bytes, "internal: more than a slot"
            got = [
                [
                    torch.frombuffer(
                        a,
                        dtype=dtype,
                        count=numel,
                        offset=_PAGE + p * self._stride + SLOT_HEADER_BYTES,
                    )
                    if numel
                    else torch.empty(0, dtype=dtype)
                    for p in (0, 1)
                ]
                for a in self._areas
            ]
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            self._views[key] = got
        return got

    def data_bytes(self, q: int, parity: int, nbytes: int, offset: int = 0) -> memoryview:
        """``nbytes`` of rank q's slot ``parity`` from ``offset``, as bytes."""
        assert offset + nbytes <= self.slot_bytes, "internal: more than a slot"
        start = _PAGE + parity * self._stride + SLOT_HEADER_BYTES + offset
        return self._areas[q][start : start + nbytes]

    def populate_places(self, places: int, nbytes: int) -> None:
        """Fault in every rank's pages of places ``0 .. places - 1`` of a rotation
        of ``nbytes`` messages (``place_bytes``): this rank's own as a write
        would, the peers' as a read, contents untouched (``populate.py``: what
        the first call at each place paid). Once per shape, so one ``madvise``
        a place, taken from ``place_bytes`` rather than its layout again."""
        for q in range(self.world):
            advice = POPULATE_WRITE if q == self.rank else POPULATE_READ
            for place in range(places):
                populate(self.place_bytes(q, place, nbytes), advice)

    def place_bytes(self, q: int, place: int, nbytes: int) -> memoryview:
        """Place ``place`` of a rotation of ``nbytes`` messages over rank q's
        slots, as bytes: in slot ``place & 1`` (so consecutive phases still
        alternate slots), ``place >> 1`` whole-page strides from its data's start."""
        return self.data_bytes(q, place & 1, nbytes, (place >> 1) * _whole_pages(nbytes))

    # ---------------------------------------------------------------- phases

    def publish(self, phase: int, header: bytes | bytearray | None = None) -> None:
        """This rank's slot of ``phase`` is written (and ``header``, if given,
        goes into the slot's header now): say so, waking sleeping peers."""
        if header is not None:  # a wire header: _HEADER_BYTES
            self._own_headers[phase & 1][:] = header
        self._say(phase)
        for q, ctl in self._peer_ctl:
            if ctl[_SLEEPS]:
                self._wake(q)

    def publish_pair(self, phase: int, header: bytearray) -> bool:
        """``publish(phase, header)`` where there are two ranks, then the first
        of ``arrived``'s looks and ``failed_peer``'s: True when the peer has
        published ``phase`` and its group has not failed (the caller then
        only compares headers), else False (it waits and checks as after
        ``publish``). One call for the whole meeting when the peer is there."""
        self._own_headers[phase & 1][:] = header
        self._say(phase)
        ctl = self._pair_ctl
        if ctl[_SLEEPS]:
            self._wake(self._peers[0])
        return ctl[_ARRIVED] >= phase and not ctl[_FAILED]

    def _say(self, phase: int) -> None:
        """Store ``phase`` in this rank's ``ARRIVED`` word between two fences:
        the slot's bytes (even a large memcpy's non-temporal stores) before
        the word, and (Dekker) the word before our look at the peers'
        ``SLEEPS`` flags (see ``wait``). The lock's acquire and its release
        are each a locked instruction, a full barrier on x86-64 (``fence.py``):
        one round trip split around the store is both fences."""
        lock = self._lock
        lock.acquire()
        self._own[_ARRIVED] = phase
        self.phase = phase
        lock.release()

    def _wake(self, q: int) -> None:
        """Peer q sleeps on its data socket: one wake-up byte."""
        try:
            self._socks[q].send(b"w")
        except (BlockingIOError, InterruptedError):
            pass  # a socket full of wake-ups wakes it anyway
        except OSError:
            pass  # gone: our own wait hears its hang-up

    def arrived(self, phase: int) -> bool:
        """Every peer published ``phase``, looking up to ``_looks`` times (no
        syscall): a peer running on another core publishes within
        microseconds, so the caller's ``wait`` (and the arguments it builds)
        comes only after these looks."""
        peers = self._peer_ctl
        for _ in range(self._looks):
            for _, ctl in peers:
                if ctl[_ARRIVED] < phase:
                    break
            else:
                return True
        return False

    def arrived_pair(self, phase: int) -> bool:
        """``arrived`` where there are two ranks, then ``failed_peer``'s look:
        True once the peer published ``phase`` (looking up to ``_looks`` times
        at its one word, a tighter loop than ``arrived``'s) and its group has
        not failed; else False (the caller waits and checks as after
        ``publish``). The rank that came first waits here, and the call
        ends with its own work right after: each look is a third of
        ``arrived``'s, and nothing more is called once the peer is there."""
        ctl = self._pair_ctl
        for _ in range(self._looks):
            if ctl[_ARRIVED] >= phase:
                return not ctl[_FAILED]
        return False

    def failed_peer(self) -> int | None:
        """A peer whose group failed (``mark_failed``), or None. One that
        published its part of this call and then failed: the call did not
        complete on every rank and must not complete here (the caller raises
        ``Causes.peer_closed``, whose record the peer's ABORT frame, sent
        before the word, carries; TCP plans end with the same check,
        ``Progress.run``). Memory reads only."""
        for q, ctl in self._peer_ctl:
            if ctl[_FAILED]:
                return q
        return None

    def mark_failed(self) -> None:
        """This rank's group is aborted: peers still in (or entering) a call raise."""
        self._own[_FAILED] = 1

    def missing(self, phase: int) -> list[int]:
        """The peers that have not published ``phase`` yet."""
        return [q for q, ctl in self._peer_ctl if ctl[_ARRIVED] < phase]

    def wait(
        self, phase: int, progress: Sleeper, what: str, pace: Pace, spin_s: float = 0.0
    ) -> None:
        """Return once every peer published ``phase`` (module docstring: how),
        timing out at the job's ``pace``; called once ``arrived`` said no.

        ``spin_s``: spin at least this long before sleeping (the job's
        ``pace.spin_s`` if longer): a phase whose peers are busy with the same
        large copy as this rank is worth spinning for, where a sleep's
        wake-up would make this rank the one its peers wait for next."""
        # The caller looked first (``arrived``). If the peer then came only
        # while this rank's core was given away, it probably shares this
        # core: the next wait looks only ``_FEW_LOOKS`` times, as more looks
        # would only delay the yield that lets it run, and this rank moves
        # off that core if the peer is indeed there (``placement.py``).
        # How long it spins: ``transport/spin.py``.
        now = time.perf_counter()
        spin = progress.spin
        spin.start(now, max(spin_s, pace.spin_s))
        while spin.on(now):
            os.sched_yield()
            then, now = now, time.perf_counter()
            if not self.missing(phase):
                if now - then > GAVE_AWAY_S:
                    self._looks = _FEW_LOOKS
                    self.placement.shared_core()
                else:
                    self._looks = _TIGHT_LOOKS
                return
        self._looks = _TIGHT_LOOKS
        self._sleep_until(phase, progress, what, pace.timeout_s)

    def _foreign_traffic(self, phase: int) -> None:
        """Raise ``ForeignTraffic`` if a peer that has not published ``phase``
        runs a plan instead (its header is in its ring to us). A peer that
        is a call ahead writes there only after every rank published this
        phase, so the words are looked at again after the ring (x86-64's
        stores are seen in one order by all)."""
        for link in self._links:
            raw = link.peek(_HEADER_BYTES)
            if raw is not None and self.missing(phase):
                raise ForeignTraffic(link.peer, raw)

    def _sleep_until(self, phase: int, progress: Sleeper, what: str, timeout_s: float) -> None:
        own, lock = self._own, self._lock
        missing = self.missing(phase)
        deadline = time.monotonic() + timeout_s
        try:
            for q in missing:
                if q not in self._watched:  # it hung up after its part of an earlier call
                    raise progress.causes.peer_closed(q, what)
            while missing:
                self._foreign_traffic(phase)
                own[_SLEEPS] = 1
                lock.acquire()  # fence, Dekker: our flag before their words (see ``publish``)
                lock.release()
                now_missing = self.missing(phase)
                if now_missing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        own[_SLEEPS] = 0
                        raise progress.causes.stalled(what, now_missing, [], timeout_s)
                    closed = progress.sleep_on(
                        now_missing, self._watched, what, min(left, SHM_SLEEP_CAP_S)
                    )
                    own[_SLEEPS] = 0
                    now_missing = self.missing(phase)
                    for q in closed:
                        if q in now_missing:  # gone before doing its part: name it now
                            raise progress.causes.peer_closed(q, what)
                        # It published and left (its last call): stop watching
                        # it; a later wait for it names it at once (``_watched``).
                        self._watched.remove(q)
                        progress.forget(self._socks[q].fileno())
                if len(now_missing) < len(missing):  # progress: the timeout starts again
                    deadline = time.monotonic() + timeout_s
                missing = now_missing
        finally:
            own[_SLEEPS] = 0
            progress.done_sleeping()


_MAX_CACHED_VIEWS = 64
# Looks at the peers' words before the first sched_yield (~0.2 us each).
_TIGHT_LOOKS = 50
# The same after a wait whose peer came while the core was away: a yield
# that took longer than ``spin.GAVE_AWAY_S`` (an idle core's takes ~0.6 us)
# ran someone else, likely the peer itself on this core (two ranks on one
# core: 50 looks would cost each wait ~8 us of the peer's time).
_FEW_LOOKS = 2


def new_area_nonce(view: memoryview, nonce: bytes) -> None:
    """Write ``nonce`` at the start of a fresh area (its control page's first bytes)."""
    view[_NONCE : _NONCE + len(nonce)] = nonce

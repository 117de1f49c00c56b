"""The mesh: one rank's links to every other rank of a group, and the loop that drives them.

Set-up (``rendezvous.py``) gives each pair of ranks a *control* socket (the
abort protocol's frames, ``control.ControlChannel``) and, for the ranks on
one host, a *data* socket (collectives, driven by ``loop.Progress.run``);
every other data socket is made when a plan first needs it (``run``,
``data_links.py``), so a rank holds data sockets to its local peers and
whoever its algorithms talk to: a ring's two neighbours, the host-aware
algorithms' partners, everyone at a star's root. *p2p* (send/recv, driven by
the p2p thread with the same loop) is connected on first use: each rank
sends on a connection it opens to the peer (``p2p_connect``) and receives on
the one the peer opened (``serve_p2p``), so a pair that never exchanges a
message holds no p2p socket. One listen port (kept open for the p2p
connections), one store exchange and one secret per group serve all three.

Collective data between ranks on one host goes through shared memory
instead (``shm/``, ``Options.transport``): the mesh hands the loop a ring
link in place of such a pair's data socket, which stays open for that
link's wake-ups and hang-up. Control, p2p and set-up stay on TCP.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..config import Options, timeout_seconds
from .control import Causes, ControlChannel, abort_record, overlay
from .data_links import DataLinks
from .in_flight import InFlight
from .link_probe import PROBE_KEY, Roles, Verdict, echo, measure
from .loop import Links, Pace, Progress
from .plan import Plan
from .rendezvous import CONTROL, DATA, P2P, Rendezvous
from .shm.ring import ShmLink
from .shm.setup import connect as connect_shm
from .shm.setup import offered_key
from .shm.slots import SlotArea
from .tcp_placement import TcpPlacement
from .topology import Topology

log = logging.getLogger(__name__)


class Mesh:
    """One rank's links to every other rank of a group: TCP, and shared memory on this host."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        options: Options,
        timeout: timedelta,
        name: str = "",
    ) -> None:
        self.rank = rank
        self.world = world
        self.name = name
        self._store = store
        self._close_lock = threading.Lock()
        self._links: dict[tuple[int, int], socket.socket] = {}
        # p2p connections, made on first use (both directions); closed with the rest.
        self._p2p_socks: list[socket.socket] = []
        self._p2p_handler: Callable[[int, socket.socket], None] | None = None
        self._p2p_early: list[tuple[int, socket.socket]] = []  # opened by peers before a handler
        self._data_early: list[tuple[int, socket.socket]] = []  # opened before the loop exists
        # Data sockets made on first use (after set-up; data_links.py).
        self._data_links: DataLinks | None = None
        self._closed = False  # (under _close_lock) no p2p connection is taken any more
        timeout_s = timeout_seconds(timeout)  # set-up's bound (each job brings its own)
        self._rendezvous: Rendezvous | None = None
        # Which ranks share a host (identical on every rank: built from every
        # rank's host key, exchanged through the store at set-up).
        self.topology = Topology.flat(world)
        # The cross-host link's measurement (link_probe.py), where taken.
        self.probe: Verdict | None = None
        self._probe_roles: Roles | None = None
        keys = [""] * world
        if world > 1:
            self._rendezvous = Rendezvous(
                store, rank, world, options, timeout_s, (DATA, P2P), self._lazy_opened
            )
            try:
                keys = self._rendezvous.exchange(offered_key(options.host_id))
                self.topology = Topology.from_keys(keys)
                # Whatever Options.topology says (every rank's is the same:
                # exchange checked it), so set-up does not depend on it.
                self._probe_roles = Roles.of(self.topology)
                self._links = self._rendezvous.connect_set_up(self._set_up_pairs(keys))
                if self._probe_roles is not None:
                    self._probe_link(self._probe_roles, timeout_s)
            except BaseException:
                self._drop_setup()
                raise
        data: dict[int, Any] = self._channel(DATA)
        # Peers whose collective data goes through shared memory (Options.transport).
        self.shm: dict[int, ShmLink] = {}
        # Every rank of the group is on this host and every pair shares
        # memory (the slot areas exist; the same answer on every rank, so the
        # policy may depend on it: the shm-native allreduce).
        self.all_local = False
        self.slots: SlotArea | None = None
        if world > 1:
            try:
                found = connect_shm(
                    rank, data, options.transport, timeout_s, keys, options.shm_placement
                )
                self.shm, self.slots = found.links, found.slots
                self.all_local = found.slots is not None
                log.info(
                    "rank %d: collective data over shared memory with rank(s) %s, TCP with "
                    "the rest (connected on first use)",
                    rank,
                    sorted(self.shm),
                )
            except BaseException:
                self._drop_setup()
                raise
        data.update(self.shm)
        ctrl = self._channel(CONTROL)
        # The call this rank runs (the runtime stores it; in_flight.py): what
        # the control thread answers a peer that asks, and data_links compares.
        self.in_flight = InFlight()
        self.control: ControlChannel | None = (
            ControlChannel(rank, ctrl, self.in_flight) if ctrl else None
        )
        self.causes = Causes(rank, self.control)
        self.placement = self._tcp_placement(data, options.tcp_placement)
        self.progress = Progress(
            rank,
            data,
            self.causes,
            control=self.control,
            woken=self.shm,
            placement=self.placement,
            idle_spin_s=options.idle_spin_us / 1e6,
        )
        if self._rendezvous is not None:
            data_links = DataLinks(
                rank, self._rendezvous, self.progress, self.causes, self.in_flight
            )
            with self._close_lock:
                self._data_links = data_links
                early, self._data_early = self._data_early, []
            for peer, sock in early:
                data_links.arrived(peer, sock)

    def _tcp_placement(self, data: dict[int, Any], enabled: bool) -> TcpPlacement:
        """Keeping this rank off the cores of its host's TCP peers (``tcp_placement.py``):
        the data sockets to the ranks of this host that are not shared-memory links."""
        host = self.topology.hosts[self.topology.host_of[self.rank]]
        local = {p: data[p] for p in host if p != self.rank and p in data and p not in self.shm}
        lower = [s for p, s in local.items() if p < self.rank]
        return TcpPlacement(lower, list(local.values()), len(host), enabled=enabled)

    def _set_up_pairs(self, keys: list[str]) -> set[tuple[int, int]]:
        """The (peer, channel) sockets made at set-up: control with the overlay
        neighbours (``control.overlay``); data with the peers on this host
        (shared memory's set-up and wake-ups need them); any other data socket
        is made on first use (``run``)."""
        mine = keys[self.rank]
        pairs = {(p, CONTROL) for p in overlay(self.rank, self.world)}
        pairs |= {(p, DATA) for p, k in enumerate(keys) if p != self.rank and mine and k == mine}
        if self._probe_roles is not None:  # the probe's (closed after it: _probe_link)
            pairs |= {(p, DATA) for p in self._probe_roles.peers(self.rank)}
        return pairs

    def _probe_link(self, roles: Roles, timeout_s: float) -> None:
        """Measure the cross-host link (``link_probe.py``: the prober times round
        trips to its local and its remote peer, they echo) and take the verdict
        every rank reads from the store into ``topology.fast_links``. The
        remote peer's socket is closed after: the probe leaves no link."""
        assert self._rendezvous is not None
        rendezvous, rank = self._rendezvous, self.rank
        key = rendezvous.key(PROBE_KEY)
        socks = {p: self._links[(p, DATA)] for p in roles.peers(rank)}
        for sock in socks.values():
            sock.settimeout(timeout_s)
        try:
            if rank == roles.prober:
                self.probe = measure(rank, roles, socks[roles.local], socks[roles.remote])
                self._store.set(key, self.probe.encode())
            else:
                if socks:
                    echo(rank, roles.prober, socks[roles.prober])
                deadline = time.monotonic() + timeout_s
                self.probe = Verdict.decode(rendezvous.store_get(key, deadline))
        finally:
            for sock in socks.values():
                sock.setblocking(False)
            across = roles.remote if rank == roles.prober else roles.prober
            if rank in (roles.prober, roles.remote):
                self._links.pop((across, DATA)).close()
        self.topology = dataclasses.replace(self.topology, fast_links=self.probe.fast)
        log.info("rank %d: %s", rank, self.probe.describe())

    def run(self, plan: Plan, what: str, pace: Pace) -> None:
        """Run a collective's plan (``loop.Progress.run``), first making the data
        sockets it needs that do not exist yet (``data_links.py``). The
        collectives' entry point (tests spy on it)."""
        if not plan.connected:
            self._connect(plan, what, pace)
        self.progress.run(plan, what, pace)

    def _connect(self, plan: Plan, what: str, pace: Pace) -> None:
        """Make the data sockets ``plan`` needs that do not exist yet (once per
        plan: sockets stay for the mesh's life, and cached plans run again)."""
        linked = self.progress.linked
        sends, recvs = plan.links()
        missing = [ln.peer for ln in sends if not linked(ln.peer)]
        missing += [ln.peer for ln in recvs if not linked(ln.peer) and ln.peer not in missing]
        if missing:
            assert self._data_links is not None
            self._data_links.reach(missing, what, pace.timeout_s)
        plan.connected = True

    @property
    def data_peers(self) -> set[int]:
        """The ranks this one holds a data socket to, now."""
        return set(self.progress.sockets)

    def _channel(self, channel: int) -> dict[int, socket.socket]:
        return {p: s for (p, ch), s in self._links.items() if ch == channel}

    @property
    def store(self) -> Any:
        return self._store

    def p2p_links(self) -> Links:
        """The loop's pumps and a wake-up for the p2p thread; its sockets come
        later (``p2p_connect``, ``serve_p2p``)."""
        return Links(self.rank, {}, self.causes, wakeable=True)

    def p2p_connect(self, peer: int, timeout_s: float) -> socket.socket:
        """This rank's p2p connection to ``peer`` (it carries this rank's
        messages to it), made now within ``timeout_s``. Raises
        ``PeerConnectionError`` (its ``__cause__`` the ``OSError``)."""
        assert self._rendezvous is not None
        sock = self._rendezvous.connect(peer, P2P, timeout_s)
        with self._close_lock:
            if self._closed:
                sock.close()
                raise self.causes.here_closed(f"p2p connection to rank {peer}")
            self._p2p_socks.append(sock)
        return sock

    def serve_p2p(self, handler: Callable[[int, socket.socket], None]) -> None:
        """Hand each p2p connection a peer opens to ``handler(peer, sock)``
        (in the acceptor's thread), those already opened first."""
        with self._close_lock:
            self._p2p_handler = handler
            early, self._p2p_early = self._p2p_early, []
        for peer, sock in early:
            handler(peer, sock)

    def _lazy_opened(self, peer: int, channel: int, sock: socket.socket) -> None:
        """A peer opened a connection of a lazy channel (the acceptor's thread)."""
        if channel == DATA:
            with self._close_lock:
                if self._closed:
                    sock.close()
                    return
                data_links = self._data_links
                if data_links is None:
                    self._data_early.append((peer, sock))
                    return
            data_links.arrived(peer, sock)
            return
        self._p2p_opened(peer, sock)

    def _p2p_opened(self, peer: int, sock: socket.socket) -> None:
        with self._close_lock:
            if self._closed:
                sock.close()
                return
            self._p2p_socks.append(sock)
            handler = self._p2p_handler
            if handler is None:
                self._p2p_early.append((peer, sock))
                return
        handler(peer, sock)

    def _data_early_socks(self) -> list[socket.socket]:
        early, self._data_early = self._data_early, []
        return [sock for _, sock in early]

    def _drop_setup(self) -> None:
        """Set-up failed: close whatever it opened."""
        if self._rendezvous is not None:
            self._rendezvous.stop()
        with self._close_lock:
            self._closed = True
            for sock in [*self._links.values(), *self._p2p_socks, *self._data_early_socks()]:
                sock.close()

    # ------------------------------------------------------------------ ending

    def abort(self, error: BaseException) -> None:
        """Tell every peer why this rank fails (an ABORT frame on each control
        link), then drop every link. The frame goes first, so a peer that sees
        a link close can name the cause, even when the store is gone."""
        self._close(hard=True, error=error)

    def close(self, hard: bool = False) -> None:
        """Close every link, saying goodbye on the control links first."""
        self._close(hard=hard, error=None)

    def _close(self, *, hard: bool, error: BaseException | None) -> None:
        if self._rendezvous is not None:
            self._rendezvous.stop()  # no more p2p connections (outside the lock: it joins)
        with self._close_lock:
            if self.causes.closed_here:
                return
            self._closed = True
            self.causes.closed_here = True
            self.causes.destroyed = error is None
            if self.control is not None:
                self.control.close(None if error is None else abort_record(self.rank, error))
            if self.slots is not None and error is not None:
                self.slots.mark_failed()  # after the ABORT frames: a peer reads the record
            for link in self.shm.values():
                link.close()
            data = [s for (_, ch), s in self._links.items() if ch != CONTROL]
            data += self._data_early_socks()
            if self._data_links is not None:
                self._data_links.close()
                data += self._data_links.socks
            # (control sockets are closed by the control channel, after its frame)
            for sock in [*data, *self._p2p_socks]:
                try:
                    if hard:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

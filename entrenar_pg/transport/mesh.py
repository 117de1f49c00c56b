"""The mesh: one rank's links to every other rank of a group, and the loop that drives them.

Set-up (``rendezvous.py``) gives each pair of ranks three TCP sockets: *data*
(collectives, driven by ``loop.Progress.run``), *control* (the abort
protocol's frames, ``control.ControlChannel``) and *p2p* (send/recv, driven by
the p2p thread with the same loop). One listen port, one store exchange and
one secret per group serve all three.

Collective data between ranks on one host goes through shared memory
instead (``shm/``, ``Options.transport``): the mesh hands the loop a ring
link in place of such a pair's data socket, which stays open for that
link's wake-ups and hang-up. Control, p2p and set-up stay on TCP.
"""

from __future__ import annotations

import logging
import socket
import threading
from datetime import timedelta
from typing import Any

from ..config import Options, timeout_seconds
from .control import Causes, ControlChannel, abort_record
from .loop import Links, Progress
from .rendezvous import CONTROL, DATA, P2P, Rendezvous
from .shm.ring import ShmLink
from .shm.setup import connect as connect_shm
from .shm.slots import SlotArea
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
        timeout_s = timeout_seconds(timeout)  # set-up's bound (each job brings its own)
        if world > 1:
            channels = (DATA, CONTROL, P2P)
            self._links = Rendezvous(store, rank, world, options, timeout_s, channels).connect_all()
        data: dict[int, Any] = self._channel(DATA)
        # Peers whose collective data goes through shared memory (Options.transport).
        self.shm: dict[int, ShmLink] = {}
        # Every rank of the group is on this host and every pair shares
        # memory (the slot areas exist; the same answer on every rank, so the
        # policy may depend on it: the shm-native allreduce).
        self.all_local = False
        self.slots: SlotArea | None = None
        # Which ranks share a host (identical on every rank: built from every
        # rank's host key, exchanged in the shared-memory set-up).
        self.topology = Topology.flat(world)
        if data:
            try:
                found = connect_shm(rank, data, options.transport, timeout_s, options.host_id)
                self.shm, self.slots = found.links, found.slots
                if found.keys is not None:
                    self.topology = Topology.from_keys([found.keys[r] for r in range(world)])
                self.all_local = found.slots is not None
                log.info(
                    "rank %d: collective data over shared memory with rank(s) %s, TCP with %s",
                    rank,
                    sorted(self.shm),
                    sorted(set(data) - set(self.shm)),
                )
            except BaseException:
                for sock in self._links.values():
                    sock.close()
                raise
        data.update(self.shm)
        ctrl = self._channel(CONTROL)
        self.control: ControlChannel | None = ControlChannel(rank, ctrl) if ctrl else None
        self.causes = Causes(rank, self.control)
        self.progress = Progress(rank, data, self.causes, control=self.control, woken=self.shm)
        # The collectives' entry point (an attribute: tests spy on it).
        self.run = self.progress.run

    def _channel(self, channel: int) -> dict[int, socket.socket]:
        return {p: s for (p, ch), s in self._links.items() if ch == channel}

    @property
    def store(self) -> Any:
        return self._store

    def p2p_links(self) -> Links:
        """The p2p sockets with the loop's pumps and a wake-up, for the p2p thread."""
        return Links(self.rank, self._channel(P2P), self.causes, wakeable=True)

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
        with self._close_lock:
            if self.causes.closed_here:
                return
            self.causes.closed_here = True
            self.causes.destroyed = error is None
            if self.control is not None:
                self.control.close(None if error is None else abort_record(self.rank, error))
            if self.slots is not None and error is not None:
                self.slots.mark_failed()  # after the ABORT frames: a peer reads the record
            for link in self.shm.values():
                link.close()
            for (_, ch), sock in self._links.items():
                if ch == CONTROL:
                    continue  # closed by the control channel, after its frame
                try:
                    if hard:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

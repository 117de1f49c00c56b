"""The p2p links' connections: made on first use, and which of them the loop polls.

Most pairs of a job never exchange a p2p message, so no p2p connection is
made at set-up. The first send to a peer, or recv from it, opens this rank's
connection to it (``reach``: ``Mesh.p2p_connect`` in a short-lived thread of
its own, so the caller never waits for a peer, even a stopped one; bounded by
the group's timeout). A rank sends on the connection it opened and reads the
one the peer opened (``opened``, called by the mesh's acceptor), so two ranks
starting at once never wait on each other.

Only the p2p thread touches the poller: connections made in other threads
wait in a list until that thread's next turn (``watch``), and connects that
failed are handed to it as link failures (``take_unreached``). Everything
here runs under the channel's lock, which it shares.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable

from ..config import GroupTimeout
from ..errors import EntrenarError, PeerConnectionError
from ..transport.loop import Links
from ..transport.mesh import Mesh
from .link import PeerLink

# A connect that failed: the link, why, and whether the group breaks.
Unreached = tuple[PeerLink, EntrenarError, bool]


class Connections:
    """One channel's p2p connections (the channel's lock guards all of it)."""

    def __init__(
        self,
        mesh: Mesh,
        loop: Links,
        timeout: GroupTimeout,
        lock: threading.Lock,
        stopped: Callable[[], bool],
    ) -> None:
        self.rank = mesh.rank
        self._mesh = mesh
        self._causes = mesh.causes
        self._loop = loop
        self._timeout = timeout
        self._lock = lock
        self._stopped = stopped  # whether the channel stopped (then a new socket is closed)
        self._links: dict[int, PeerLink] = {}  # every peer's link (register)
        self.active: list[PeerLink] = []  # the links with a connection, in the loop's poll
        self._fd_role: dict[int, tuple[PeerLink, bool]] = {}  # fd -> (link, this rank's own)
        self._unwatched: list[PeerLink] = []  # links given a connection the loop must watch
        self._unreached: list[Unreached] = []

    def register(self, link: PeerLink) -> None:
        self._links[link.peer] = link

    # ------------------------------------------------------------ other threads

    def reach(self, link: PeerLink) -> None:
        """Start opening this rank's connection to ``link``'s peer if it has
        none and none is under way (under the lock)."""
        if link.out_open or link.connecting or link.dead is not None:
            return
        link.connecting = True
        threading.Thread(
            target=self._connect,
            args=(link,),
            name=f"entrenar-p2p-connect-r{self.rank}-{link.peer}",
            daemon=True,
        ).start()

    def _connect(self, link: PeerLink) -> None:
        """Open this rank's connection to ``link``'s peer (its own thread). A
        peer that cannot be reached takes the link down, as a hang-up does."""
        timeout_s = self._timeout.seconds
        try:
            sock = self._mesh.p2p_connect(link.peer, timeout_s)
        except EntrenarError as e:
            stalled = isinstance(e.__cause__, TimeoutError)
            error = self._unreachable(link, e, timeout_s, stalled)
            with self._lock:
                link.connecting = False
                # The p2p thread takes the link down: only it touches the poller.
                self._unreached.append((link, error, stalled))
            self._loop.wake()
            return
        with self._lock:
            link.connecting = False
            if self._stopped() or link.dead is not None:
                sock.close()
                return
            link.attach(sock, outgoing=True)
            self._unwatched.append(link)
        self._loop.wake()

    def _unreachable(
        self, link: PeerLink, e: EntrenarError, timeout_s: float, stalled: bool
    ) -> EntrenarError:
        """Why ``link``'s peer could not be reached: no answer within the timeout
        is a stall (the wait-for walk names whom; it breaks the group, as a
        stalled link does); a refusal is its abort, goodbye or death, as its
        control link tells it (the ops on it fail alone, as on a link that
        ended while idle)."""
        if self._causes.closed_here:
            return self._causes.here_closed(link.what)
        if stalled:
            return self._causes.stalled(link.what, [], [link.peer], timeout_s)
        ended = self._causes.how_ended(link.peer)
        if ended is not None:
            return self._causes.peer_closed(link.peer, link.what, ended)
        return PeerConnectionError(f"{e}; culprit: rank {link.peer}", culprit=link.peer)

    def opened(self, peer: int, sock: socket.socket) -> None:
        """``peer`` opened its connection to this rank (the acceptor's thread)."""
        with self._lock:
            link = self._links[peer]
            if link.in_open or link.dead is not None or self._stopped():
                sock.close()  # (a second one would be a confused peer; the mesh owns it)
                return
            link.attach(sock, outgoing=False)
            self._unwatched.append(link)
        self._loop.wake()

    # ------------------------------------------------------------ the p2p thread

    def watch(self) -> None:
        """Put the connections made since the last turn into the loop's poll."""
        for link in self._unwatched:
            if link.dead is not None:
                continue
            for st, own, up in ((link.out, True, link.out_open), (link.inc, False, link.in_open)):
                if up and st.sock.fileno() not in self._fd_role:
                    self._fd_role[st.sock.fileno()] = (link, own)
                    self._loop.add(link.peer, st.sock)
            if link not in self.active:
                self.active.append(link)
        self._unwatched.clear()

    def take_unreached(self) -> list[Unreached]:
        unreached, self._unreached = self._unreached, []
        return unreached

    def poll_mask(self) -> dict[int, int]:
        """What to poll for on each live connection: always input (data, or a
        hang-up); output on this rank's own while it has something to send."""
        return {
            fd: select.POLLIN | (select.POLLOUT if own and not link.out.idle() else 0)
            for fd, (link, own) in self._fd_role.items()
            if link.dead is None
        }

    def role(self, fd: int) -> tuple[PeerLink, bool] | None:
        """The live link a polled ``fd`` belongs to, and whether it is this
        rank's own connection; None for the wake-up or a link given up."""
        role = self._fd_role.get(fd)
        if role is None or role[0].dead is not None:
            return None
        return role

    def forget(self, link: PeerLink) -> None:
        """Take a link given up out of the poll. By the link, not its sockets'
        fileno (the mesh may have closed them): a later connection may be
        given the same descriptor number."""
        for fd in [fd for fd, (ln, _) in self._fd_role.items() if ln is link]:
            del self._fd_role[fd]
            self._loop.forget(fd)

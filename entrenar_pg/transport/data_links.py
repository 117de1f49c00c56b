"""Collective data sockets made on first use: a rank connects only to the peers its plans use.

Set-up makes the data sockets of the pairs on one host (shared memory needs
them: wake-ups and hang-ups) and no other. The first plan that talks to
another peer makes that pair's socket (``DataLinks.reach``, called by
``Mesh.run`` before the plan runs): a ring allreduce connects a rank to its
two neighbours, the star rank 0 to everyone, a host-aware algorithm the
local peers and the cross-host partners.

One socket per pair, both directions (the loop sends and receives on it), so
exactly one end makes it: the lower rank connects, the higher one waits for
it to arrive through its acceptor (``arrived``). Plans are symmetric (a send
on one end is a receive on the other), so both ends of a pair reach it in
the same collective and the lower one connects as soon as it gets there; no
rank waits on a rank above it, so there is no cycle and no deadlock. A
connect needs only the peer's acceptor thread, never the peer's own progress.

Failures read as in a collective: a peer that refuses (it is gone) is named
from its control link (its abort, goodbye or death); a connect or a wait
that sees nothing within the call's timeout is a stall, and the wait-for
walk names whom (``control.Causes``). While it waits a rank answers the
control channel's queries as one waiting in a collective.

A mismatch can break the symmetry: ranks that issued different collectives
in one call (a user's bug) run different plans, and a rank may wait for a
lower rank's connect that the lower rank's plan never makes (a star leaf
waits for rank 0, whose gather connects only to the gather's root and its
ring neighbours). No header ever meets, so nothing would name the mismatch
before the call's timeout (torch's default: 30 minutes). So a wait that has
lasted ``ASK_AFTER_S`` asks the ranks it waits for which call they are in
(the control channel's QUERY, the stall walk's question; again every
``ASK_AFTER_S``): one in this call (the same sequence number) but in another
collective, or in this collective with other terms (``in_flight.Terms``:
the size, dtype, root or reduce op every rank must agree on; an allreduce
whose size makes a star here and a ring there) raises
``CollectiveMismatchError`` naming both calls, and this rank's abort
carries it to every rank in that call. One in an earlier call, in none, in
this same call with the same terms or silent is waited for as before (its
connect may still come; a silent one is the stall walk's at the timeout).
A wait this long is rare (a rank that reaches the call late), so the
questions cost nothing on the common path; the answer's terms cost the
long path one reference stored per call, the thin path nothing
(``in_flight.InFlight``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from ..errors import CollectiveMismatchError, EntrenarError, PeerConnectionError
from ..wire import OpCode
from .control import Causes
from .in_flight import InFlight, Terms
from .loop import Progress
from .rendezvous import DATA, Rendezvous

log = logging.getLogger(__name__)

# A rank waiting for a lower rank's connection looks for it this often (and
# answers control queries in between); only a pair's first collective waits.
_ARRIVAL_POLL_S = 0.002
# A wait for a lower rank's connect this long asks that rank which call it
# is in (module docstring); its answer is awaited this long (no answer: wait on).
ASK_AFTER_S = 0.5
_ANSWER_S = 0.25


# The contract checker's exchange runs in its collective's job, with the
# collective's sequence number (checker.after): a rank in it beside one still
# in the collective is in step.
_SHARES_SEQ = OpCode.CHECK.name.lower()


def other_call(mine: str, theirs: str | None) -> bool:
    """Whether ``theirs`` (the call a peer says it is in, ``Call.what``'s
    ``<collective>#<seq>``; None: none) is another collective in the call
    ``mine``: the same sequence number, another collective. Every phase of
    one call carries the call's collective, so ranks in step never differ
    (but for the checker's exchange)."""
    if theirs is None:
        return False
    op, _, seq = mine.rpartition("#")
    their_op, sep, their_seq = theirs.rpartition("#")
    return bool(sep) and their_seq == seq and their_op != op and _SHARES_SEQ not in (op, their_op)


def other_terms(mine: str, my_call: Terms | None, their_call: Terms | None) -> bool:
    """Whether a peer runs the call ``mine`` (``<collective>#<seq>``) names,
    with other terms than this rank's (``in_flight.Terms``): the same
    sequence number, another request's collective or another thing every
    rank must agree on. Where either side has nothing to compare (a call
    with no terms, or ``my_call`` not this call's: a job that publishes
    none, like the contract checker's own), nothing is concluded."""
    if my_call is None or their_call is None:
        return False
    seq = mine.rpartition("#")[2]
    return (
        str(my_call.seq) == seq
        and their_call.seq == my_call.seq
        and (their_call.op, their_call.agreed) != (my_call.op, my_call.agreed)
    )


class DataLinks:
    """One rank's data sockets made after set-up (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        rendezvous: Rendezvous,
        progress: Progress,
        causes: Causes,
        in_flight: InFlight | None = None,
    ):
        self.rank = rank
        self._in_flight = in_flight or InFlight()  # this rank's call, to compare with a peer's
        self._rendezvous = rendezvous
        self._progress = progress
        self._causes = causes
        self._lock = threading.Lock()
        self._arrived: dict[int, socket.socket] = {}  # from lower ranks, not yet in the loop
        self.socks: list[socket.socket] = []  # every one made (closed with the mesh)
        self._closed = False

    def arrived(self, peer: int, sock: socket.socket) -> None:
        """A lower rank made its data socket to this one (the acceptor's thread)."""
        with self._lock:
            if self._closed or peer > self.rank or peer in self._arrived:
                sock.close()  # (a higher rank never connects: a confused peer)
                return
            self._arrived[peer] = sock
            self.socks.append(sock)

    def reach(self, peers: list[int], what: str, timeout_s: float) -> None:
        """Make (or take) the data sockets to ``peers`` and give them to the loop:
        higher ranks first (connects answered by their acceptors), then wait
        for the lower ones' (in the loop's thread)."""
        for peer in sorted(peers, reverse=True):
            if peer > self.rank:
                self._progress.attach(peer, self._connect(peer, what, timeout_s))
        lower = [p for p in peers if p < self.rank]
        if lower:
            self._wait(lower, what, timeout_s)

    def _connect(self, peer: int, what: str, timeout_s: float) -> socket.socket:
        try:
            sock = self._rendezvous.connect(peer, DATA, timeout_s)
        except EntrenarError as e:
            raise self._unreachable(peer, what, e, timeout_s) from e
        with self._lock:
            if self._closed:
                sock.close()
                raise self._causes.here_closed(what)
            self.socks.append(sock)
        return sock

    def _unreachable(
        self, peer: int, what: str, e: EntrenarError, timeout_s: float
    ) -> EntrenarError:
        """Why ``peer`` could not be reached: no answer is a stall (the walk names
        whom); a refusal is its abort, goodbye or death, as the control channel
        says, else the abort of another rank this one heard of."""
        causes = self._causes
        if causes.closed_here:
            return causes.here_closed(what)
        if isinstance(e.__cause__, TimeoutError):
            return causes.stalled(what, [], [peer], timeout_s)
        ended = causes.how_ended(peer)
        if ended is not None:
            return causes.peer_closed(peer, what, ended)
        # Its own word did not reach this rank (the ranks that would relay it
        # may be aborting too): another rank's abort is the group's cause.
        heard = causes.first_abort()
        if heard is not None:
            return causes.peer_closed(heard[0], what, heard[1])
        return PeerConnectionError(
            f"rank {self.rank}: {what}: {e}; culprit: rank {peer}", culprit=peer
        )

    def _wait(self, lower: list[int], what: str, timeout_s: float) -> None:
        """Until every rank of ``lower`` has connected: each arrival is handed to
        the loop; a peer that ends meanwhile is named; nothing within
        ``timeout_s`` is a stall (on whichever have not connected)."""
        waiting = sorted(lower)
        now = time.monotonic()
        deadline, ask_at = now + timeout_s, now + ASK_AFTER_S
        progress = self._progress
        try:
            while True:
                with self._lock:
                    got = {p: self._arrived.pop(p) for p in waiting if p in self._arrived}
                for peer, sock in got.items():
                    progress.attach(peer, sock)
                waiting = [p for p in waiting if p not in got]
                if not waiting:
                    return
                now = time.monotonic()
                if now >= deadline:
                    raise self._causes.stalled(what, waiting, [], timeout_s)
                if now >= ask_at:
                    self._ask(waiting, what)
                    ask_at = time.monotonic() + ASK_AFTER_S
                progress.watch_control(what, waiting, _ARRIVAL_POLL_S)
                for peer in waiting:
                    ended = self._causes.how_ended(peer, 0.0)
                    if ended is not None:
                        raise self._causes.peer_closed(peer, what, ended)
        finally:
            progress.done_sleeping()

    def _ask(self, waiting: list[int], what: str) -> None:
        """Ask the ranks still awaited which call they are in; raise
        CollectiveMismatchError if one is in another collective of this call
        (module docstring)."""
        answers = self._causes.calls(waiting, _ANSWER_S)
        mine = self._in_flight.terms()
        for peer in waiting:
            state = answers.get(peer)
            if state is None:
                continue
            if other_call(what, state.what):
                ours, theirs = what, state.what
            elif other_terms(what, mine, state.call):
                assert mine is not None and state.call is not None
                ours, theirs = mine.describe(), state.call.describe()
            else:
                continue
            raise CollectiveMismatchError(
                f"rank {self.rank}: collective mismatch with rank {peer}: this rank "
                f"called {ours}, rank {peer} called {theirs} (found waiting for rank "
                f"{peer}'s first connection, which its plan does not make)"
            )

    def close(self) -> None:
        """No more sockets are taken; the caller closes ``socks``."""
        with self._lock:
            self._closed = True
            self._arrived.clear()

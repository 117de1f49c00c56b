"""Keeping a rank off the core of a peer on its host that it talks to over TCP.

The TCP side of what ``shm/placement.py`` does for slot areas (the why is
there): two ranks on one host that trade small messages run well only on
two cores. On one, each turn of a spinning wait (``Progress.run``) gives the
core to the peer through ``sched_yield`` and back: a 4 KiB allreduce at N=2
over loopback TCP took 200-250 us with both ranks pinned to one CPU against
19-20 us on two (load 7 here), 80 us against 18 on a quieter machine. Linux
puts them together easily (a rank woken from ``poll`` by its peer's segment
is placed beside the waker) and then leaves them there: the bench's TCP
rows were bimodal, per job and at times per block of calls, in every tree
(docs/benchmarks.md, "Before and after").

Where the peer runs, the kernel says: a loopback segment is processed on the
CPU that sent it, and the receiving socket keeps the CPU that processed its
last segment (``SO_INCOMING_CPU``). On a link between ranks of one host,
that is where the peer last sent from.

So when a spin finds the peer's bytes only after a ``sched_yield`` that
gave this rank's core away (longer than ``spin.GAVE_AWAY_S``; an idle core's
takes well under a microsecond), ``Progress.run`` calls ``shared_core``: if
a lower rank's last segment on this host came from this thread's CPU, the
thread moves to an allowed CPU that no peer on this host last sent from,
by narrowing its affinity to it and restoring it at once (the kernel
migrates the thread on the first call; the restored mask leaves the
scheduler free again). The lower rank stays, so a pair never swaps cores.

Bounded as the slot areas' placement is: one move per ``MOVE_EVERY_S`` at
most; none where the host's ranks outnumber the thread's CPUs (sharing is
then the plan); nothing where ``sched_getcpu`` or ``SO_INCOMING_CPU`` is
missing, or once changing the affinity failed (a cpuset that forbids it).
Links to other hosts are never looked at (their segments' CPU is this
host's network card's). A machine busy with other work is no reason to
stay: two ranks apart, each beside other work, took 25-31 us a 4 KiB call
against 175-220 us on one core (load 4.5 here; a rule that stayed while
more threads were runnable than CPUs kept them together).
``Options.tcp_placement=False``
(``ENTRENAR_TCP_PLACEMENT=0``) turns it off.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from time import monotonic

from .cpu_move import MOVE_EVERY_S, libc_getcpu, move_to_free_cpu

__all__ = ["MOVE_EVERY_S", "TcpPlacement", "incoming_cpu"]

_INCOMING_CPU = getattr(socket, "SO_INCOMING_CPU", None)  # Linux >= 3.19, Python >= 3.11


def incoming_cpu(sock: socket.socket) -> int:
    """The CPU that processed ``sock``'s last incoming segment; -1 if unknown."""
    if _INCOMING_CPU is None:
        return -1
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, _INCOMING_CPU))
    except OSError:
        return -1  # closed meanwhile (a peer that left): nothing to learn


class TcpPlacement:
    """One rank's side of keeping its host's TCP peers off its core.

    ``lower``: the data sockets to this host's ranks below this one (a
    sharing with one of those moves this rank); ``local``: the data sockets
    to every rank of this host (their CPUs are not moved to); ``host_ranks``:
    how many ranks the host holds, this one included.
    """

    def __init__(
        self,
        lower: Sequence[socket.socket],
        local: Sequence[socket.socket],
        host_ranks: int,
        getcpu: Callable[[], int] | None = None,
        enabled: bool = True,
    ) -> None:
        self._lower = list(lower)
        self._local = list(local)
        self._host_ranks = host_ranks
        self._getcpu = getcpu if getcpu is not None else libc_getcpu()
        if (
            not enabled
            or not self._lower
            or _INCOMING_CPU is None
            or len(os.sched_getaffinity(0)) < host_ranks
        ):
            self._getcpu = None  # off, nobody to move from, or sharing is the plan
        self._next_move = 0.0
        self.moves = 0  # moves made (tests and benchmarks read it)

    @property
    def active(self) -> bool:
        """Whether a shared core can ever move this rank (the loop skips its clock if not)."""
        return self._getcpu is not None

    def shared_core(self) -> None:
        """This rank's spin found a peer's bytes after its core was away: if a
        lower rank on this host last sent from this CPU, move off it."""
        getcpu = self._getcpu
        if getcpu is None:
            return
        now = monotonic()
        if now < self._next_move:
            return  # the clock first: on a shared core this runs every call
        cpu = getcpu()
        if cpu < 0 or not any(incoming_cpu(s) == cpu for s in self._lower):
            return
        self._next_move = now + MOVE_EVERY_S
        self._move_off(cpu)

    def _move_off(self, cpu: int) -> None:
        """Move this thread to an allowed CPU no peer on this host last sent from."""
        named = {incoming_cpu(s) for s in self._local}
        try:
            target = move_to_free_cpu(cpu, named, self._host_ranks)
        except OSError:
            self._getcpu = None  # not allowed here (a cpuset): never again
            return
        if target is not None:
            self.moves += 1

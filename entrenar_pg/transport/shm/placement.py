"""Keeping the ranks of a slot area on cores of their own.

Two ranks that meet every few microseconds through shared memory run well
only on two cores: on one, each wait must give the core to the peer
(``sched_yield``): a 64 KiB allreduce at N=2 took 38-45 us there against
8.1-8.2 us on two cores (one run, each call's ``sched_getcpu`` on both
ranks; docs/benchmarks.md).
Linux puts them on one core easily: a rank woken by its peer (the slot
wait's sleep, gloo's barrier) is placed beside its waker, and two tasks
that take turns on one core through ``sched_yield`` look balanced enough
to the load balancer to stay there, for whole runs here, on a quiet
machine too. DeepSpeed's SHM allreduce, whose ranks never yield, gets
pulled apart by the balancer (and pays milliseconds per call until then).

So a slot wait that found its peer arrived only while its own core was
away (``SlotArea.wait``: a ``sched_yield`` that took longer than an idle
core's) calls ``Placement.shared_core``: it writes the CPU it runs on in
its area's ``CPU`` word and, when a lower rank's word names the same CPU,
moves its own thread to a CPU no peer names, by narrowing its affinity to
that CPU and restoring it at once (the kernel migrates it on the first
call; the restored mask leaves the scheduler free again). The lower rank
stays, so a pair never swaps cores and ends together again.

Bounded: at most one move per ``MOVE_EVERY_S``, and none where the
thread's affinity has fewer CPUs than the area has ranks (oversubscribed,
as four ranks on two cores: sharing is then the plan, and the waits'
yields handle it; looked at when the area is made, which then does
nothing more, and before each move), where ``sched_getcpu`` is missing, or once changing the
affinity failed (a cpuset that forbids it). The word can be stale (a peer
the scheduler moved since it wrote it): a wrong move then costs one
migration, and the next shared wait puts it right.

``Options.shm_placement=False`` (``ENTRENAR_SHM_PLACEMENT=0``) turns it off:
the threads' placement is then the scheduler's alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from time import monotonic

from ..cpu_move import MOVE_EVERY_S, libc_getcpu, move_to_free_cpu

__all__ = ["MOVE_EVERY_S", "Placement"]


class Placement:
    """One rank's side of keeping a slot area's ranks on separate cores.

    ``own``: this rank's control words; ``peers``: (rank, control words) of
    every peer; ``word``: the index of the CPU word (CPU + 1; 0: not known).
    """

    def __init__(
        self,
        rank: int,
        own: memoryview,
        peers: list[tuple[int, memoryview]],
        word: int,
        getcpu: Callable[[], int] | None = None,
        enabled: bool = True,
    ) -> None:
        self._rank = rank
        self._own = own
        self._peers = peers
        self._word = word
        self._world = len(peers) + 1
        self._getcpu = getcpu if getcpu is not None else libc_getcpu()
        if not enabled or len(os.sched_getaffinity(0)) < self._world:
            # Off (``Options.shm_placement``), or more ranks than CPUs (as
            # made): sharing is the plan.
            self._getcpu = None
        self._next_move = 0.0
        self.moves = 0  # moves made (tests and benchmarks read it)

    def shared_core(self) -> None:
        """This rank's wait found its peer arrived while its core was away:
        say where it runs and, if a lower rank runs there too, move off."""
        getcpu = self._getcpu
        if getcpu is None:
            return
        cpu = getcpu()
        if cpu < 0:
            return
        word = self._word
        self._own[word] = cpu + 1
        if not any(q < self._rank and ctl[word] == cpu + 1 for q, ctl in self._peers):
            return
        now = monotonic()
        if now < self._next_move:
            return
        self._next_move = now + MOVE_EVERY_S
        target = self._free_cpu(cpu)
        if target is not None:
            self._own[word] = target + 1

    def _free_cpu(self, cpu: int) -> int | None:
        """Move this thread to an allowed CPU no peer names; the CPU, or None."""
        named = {ctl[self._word] - 1 for _, ctl in self._peers if ctl[self._word]}
        try:
            target = move_to_free_cpu(cpu, named, self._world)
        except OSError:
            self._getcpu = None  # not allowed here (a cpuset): never again
            return None
        if target is not None:
            self.moves += 1
        return target

"""How long one wait busy-polls before it sleeps: its job's spin, longer while no one else runs.

A wait (``loop.Progress.run`` on its links, ``shm.slots.SlotArea.wait`` on
its peers' words) busy-polls, one ``sched_yield`` a turn, and sleeps once
its spin is over. Where ranks share cores, a spin past the job's
(``spin_us``, ``caller_spin_us``) takes the core from the rank that has the
work: 4 x 2 emulated hosts on two cores ran 4 KiB in 1.9 ms with 50 us of
caller spin and 4.0-5.1 ms with 500 us. Where a rank has a core of its own,
spinning costs no one anything, while a sleeper's wake-up comes through a
halted core (on a virtual machine, the hypervisor): on the lent 16-core
VM, a core per rank, the 4 x 2, 4 KiB calls fell into two modes ~150 us
apart (docs/benchmarks.md, "A core per rank"), the lead being that wake-up.

So past the job's spin a wait goes on, up to ``Spin.idle_s``
(``Options.idle_spin_us``), only while the machine has no more runnable
threads than this thread has CPUs (``machine_crowded``: ``/proc/loadavg``'s
running count, ~2 us a look, every ``LOOK_EVERY`` turns). Neither a yield's
duration nor the thread's involuntary switches can tell this: spinners that
share a core hand it to each other in ~3 us a yield, under any threshold an
idle core's ~0.6 us would pass; and a woken thread that the scheduler does
not find eligible yet (the likely case) waits behind a spinner's yields
without any yield switching to it. Both were tried: 4 x 2 on two cores then
took 4.3 and 5.2 ms at 4 KiB against 1.8 and 1.5 ms with the job's spin
alone; with the running count, 0.93-1.26x of it over five jobs (not nothing:
where ranks share cores it is the wrong setting). No spin at all (a job's
spin of 0) stays no spin, and a wait that ends within its job's spin pays
nothing more. Off by default (``Options.idle_spin_us``): here it gains
nothing, and its gain where wake-ups are dear is not measured yet.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

# A yield that took longer gave the core to another thread (an idle core's
# takes under a microsecond here): the placements are told (loop.py, slots.py).
GAVE_AWAY_S = 5e-6
# Turns past the job's spin between two looks at the machine's runnable threads.
LOOK_EVERY = 8

_LOADAVG = "/proc/loadavg"  # "1.82 1.92 2.59 3/80 18066": 3 runnable of 80


@dataclass(slots=True)
class _RunQueue:
    """The machine's runnable threads against this process's CPUs (opened at first use)."""

    fd: int = -2  # -2: not opened yet; -1: not readable here
    cpus: int = 0

    def crowded(self) -> bool:
        """True if more threads are runnable than this process has CPUs (or it cannot tell)."""
        if self.fd == -2:
            try:
                self.fd = os.open(_LOADAVG, os.O_RDONLY)
                self.cpus = len(os.sched_getaffinity(0))
            except (OSError, AttributeError):
                self.fd = -1
        if self.fd < 0:
            return True
        try:
            running = os.pread(self.fd, 64, 0).split()[3].split(b"/")[0]
            return int(running) > self.cpus
        except (OSError, IndexError, ValueError):
            return True


machine_crowded = _RunQueue().crowded


@dataclass(slots=True)
class Spin:
    """One wait's spin: ``start`` it when the wait begins, then ask ``on(now)`` before
    each turn (False: sleep now)."""

    idle_s: float  # the longest spin while no other thread waits for a core
    crowded: Callable[[], bool] = machine_crowded
    until: float = 0.0  # the job's spin ends
    idle_until: float = 0.0  # the spin past it ends
    idle: bool = False  # the spin may go past the job's
    turns: int = 0  # turns past the job's spin

    def start(self, now: float, spin_s: float) -> None:
        """A wait begins at ``now`` with its job's spin ``spin_s`` (0: no spin)."""
        self.until = now + spin_s
        self.idle_until = now + self.idle_s
        self.idle = spin_s > 0 and self.idle_s > spin_s
        self.turns = 0

    def on(self, now: float) -> bool:
        """Whether the wait takes another turn at ``now``: within its job's spin, or
        past it while no other thread waits for a core (looked at every
        ``LOOK_EVERY`` turns, the first at once)."""
        if now < self.until:
            return True
        if not self.idle or now >= self.idle_until:
            return False
        if self.turns % LOOK_EVERY == 0 and self.crowded():
            self.idle = False
        self.turns += 1
        return self.idle

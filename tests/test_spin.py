"""How long a wait spins (``transport/spin.py``): its job's spin, and up to the idle
spin while no other thread waits for a core; then in the loop and the slot area."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

from entrenar_pg import Options
from entrenar_pg.transport import loop, spin
from entrenar_pg.transport.shm import slots
from entrenar_pg.transport.spin import LOOK_EVERY, Spin, _RunQueue

# Binary fractions (~1 us a turn, ~50 us the job's spin, ~1 ms the idle spin): the
# turns add up exactly.
TURN_S = 2.0**-20
JOB_S = 52 * TURN_S
IDLE_S = 1024 * TURN_S


@dataclass
class Crowd:
    """Whether other threads wait for a core, as the test says: ``at[k]`` at the k-th
    look (the last value holds)."""

    at: list[bool]
    looks: int = 0

    def __call__(self) -> bool:
        value = self.at[min(self.looks, len(self.at) - 1)]
        self.looks += 1
        return value


def spin_for(s: Spin, start: float, spin_s: float = JOB_S) -> float:
    """Turn ``s`` from ``start`` (each turn one ``TURN_S``) until it says sleep; how
    long it spun."""
    now = start
    s.start(now, spin_s)
    while s.on(now):
        now += TURN_S
        assert now - start < 1.0, "the spin never ended"
    return now - start


def test_with_no_one_waiting_for_a_core_it_spins_to_the_idle_spin() -> None:
    crowd = Crowd([False])
    assert spin_for(Spin(IDLE_S, crowd), 8.0) == IDLE_S
    # it looked at once past the job's spin, then every LOOK_EVERY turns
    turns_past = (IDLE_S - JOB_S) / TURN_S
    assert crowd.looks == -(-turns_past // LOOK_EVERY)


def test_a_crowded_machine_ends_the_spin_at_the_next_look() -> None:
    took = spin_for(Spin(IDLE_S, Crowd([False, False, True])), 0.0)
    assert took == JOB_S + 2 * LOOK_EVERY * TURN_S
    took = spin_for(Spin(IDLE_S, Crowd([True])), 0.0)  # at once: the job's spin alone
    assert took == JOB_S


def test_the_job_spin_costs_no_look_and_each_wait_starts_afresh() -> None:
    crowd = Crowd([True, False])
    s = Spin(IDLE_S, crowd)
    spin_for(s, 0.0)
    assert crowd.looks == 1 and not s.idle
    # A wait that ends within its job's spin never looks.
    s.start(5.0, JOB_S)
    assert s.on(5.0) and s.on(5.0 + JOB_S / 2)
    assert crowd.looks == 1
    assert s.idle  # a new wait may go past its job's spin again
    assert spin_for(s, 6.0) == IDLE_S


@pytest.mark.parametrize("idle_s", [0.0, JOB_S / 4, JOB_S])
def test_never_shorter_than_the_jobs_spin_nor_longer_without_an_idle_spin(idle_s: float) -> None:
    crowd = Crowd([False])
    assert spin_for(Spin(idle_s, crowd), 0.0) == JOB_S
    assert crowd.looks == 0


def test_no_spin_stays_none() -> None:
    s = Spin(IDLE_S, Crowd([False]))
    s.start(0.0, 0.0)  # ENTRENAR_SPIN_US=0: no spin, however idle the machine
    assert not s.on(0.0)


@pytest.mark.timeout(30)
def test_the_machine_is_crowded_with_more_busy_threads_than_cpus() -> None:
    """What ``Spin`` relies on, on this machine: ``/proc/loadavg``'s running count
    sees busy processes beyond this process's CPUs."""
    if not os.path.exists("/proc/loadavg"):
        pytest.skip("no /proc/loadavg here")
    cpus = len(os.sched_getaffinity(0))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus + 1)]
    try:
        time.sleep(0.3)  # all of them started and running
        queue = _RunQueue()
        assert sum(queue.crowded() for _ in range(20)) >= 15
        assert queue.cpus == cpus
    finally:
        for p in busy:
            p.kill()
            p.wait(timeout=10)


def test_the_placements_and_the_spin_share_one_threshold() -> None:
    assert loop.GAVE_AWAY_S is spin.GAVE_AWAY_S and slots.GAVE_AWAY_S is spin.GAVE_AWAY_S
    assert not hasattr(slots, "_GAVE_AWAY_S")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_late_peer_and_the_idle_spin_give_the_same_results(transport: str) -> None:
    """A peer late by more than every spin: the waits spin (on an idle core up to
    the idle spin), sleep and wake, over TCP and over the slot area alike."""

    def fn(rank: int, pg) -> list[float]:  # type: ignore[no-untyped-def]
        out = []
        for i in range(3):
            if rank == 1:
                time.sleep(0.03)  # longer than the 5 ms idle spin
            t = torch.full((1024,), float(rank + 1 + i))
            pg.allreduce([t]).wait()
            out.append(float(t[-1]))
        return out

    opts = Options(transport=transport, caller_spin_us=50, idle_spin_us=5000)
    assert run_ranks(2, fn, options=opts) == [[3.0, 5.0, 7.0]] * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("kind", ["broadcast", "scatter"])
def test_with_no_spin_an_empty_payload_behind_its_header_completes(
    transport: str, kind: str
) -> None:
    """No spin at all (both spins 0): a leaf that waits for a call of no
    elements receives the root's header, and the empty piece behind it
    completes at once. Before the fix the loop marked the link blocked after
    the header and slept on it for bytes that never come (the spin's next
    turn had always unblocked it), so the last such call stalled until the
    timeout (over shared memory every such call did: the next collective's
    bytes went through the slot area, not the ring)."""

    def fn(rank: int, pg) -> float:  # type: ignore[no-untyped-def]
        if rank == 0:
            time.sleep(0.2)  # the leaf waits first: its first attempt finds nothing
        t = torch.zeros(0)
        began = time.monotonic()
        if kind == "broadcast":
            bo = dist.BroadcastOptions()
            bo.rootRank = 0
            pg.broadcast([t], bo).wait()
        else:
            so = dist.ScatterOptions()
            so.rootRank = 0
            ins = [[torch.zeros(0), torch.zeros(0)]] if rank == 0 else []
            pg.scatter([t], ins, so).wait()
        return time.monotonic() - began

    opts = Options(transport=transport, spin_us=0, caller_spin_us=0)
    took = run_ranks(2, fn, options=opts, timeout_s=30)
    assert max(took) < 2.0, took  # well inside the group's 20 s timeout

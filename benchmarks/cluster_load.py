"""The machine's load beside an emulated-cluster job: what the cost model's load term reads.

The emulated hosts share this machine's cores with whatever else runs on it
(other jobs, test suites). A block's *background* is the CPU the rest of the
machine took while the block ran, in cores:

    (machine CPU busy over the block - the job's own ranks' CPU) / block wall

The machine's busy time is ``/proc/stat``'s first line (user, nice, system
and steal: a hypervisor's other guests take cores too; idle, iowait and the
interrupt columns are not a process's); a rank's CPU is its own process's
(every thread: ``time.process_time``). Each rank reads its own CPU at a
block's fences and one rank reads ``/proc/stat``; the driver sums the job's
CPU per block (``background_cores``). Two small reads per block: the
recording costs nothing measurable beside the blocks' barriers. ``/proc/stat``
counts in clock ticks (10 ms), so a row's figure is the sum over its blocks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal guest guest_nice
_BUSY_COLUMNS = (0, 1, 2, 7)  # user, nice, system, steal (guest time is inside user)


def machine_busy_s(stat: str | None = None) -> float:
    """CPU seconds the whole machine has been busy since boot, all cores (``/proc/stat``)."""
    text = stat if stat is not None else Path("/proc/stat").read_text()
    fields = text.split("\n", 1)[0].split()
    if fields[0] != "cpu":
        raise ValueError(f"/proc/stat: expected the 'cpu' line first, got {fields[0]!r}")
    values = [int(v) for v in fields[1:]]
    return sum(values[i] for i in _BUSY_COLUMNS if i < len(values)) * _TICK_S


class BlockClock:
    """One rank's CPU and wall clock at a block's fences (and the machine's, on the reader)."""

    def __init__(self, reads_machine: bool) -> None:
        self.reads_machine = reads_machine

    def read(self) -> tuple[float, float, float | None]:
        """(wall, this process's CPU, the machine's busy CPU or None) now."""
        busy = machine_busy_s() if self.reads_machine else None
        return time.monotonic(), time.process_time(), busy

    @staticmethod
    def block(
        start: tuple[float, float, float | None], end: tuple[float, float, float | None]
    ) -> dict[str, float]:
        """One block's record: its wall, the rank's CPU, the machine's busy CPU if read."""
        out = {"wall_s": end[0] - start[0], "cpu_s": end[1] - start[1]}
        if start[2] is not None and end[2] is not None:
            out["busy_s"] = end[2] - start[2]
        return out


def background_cores(blocks_per_rank: Sequence[Sequence[dict[str, Any]]]) -> float | None:
    """Cores the rest of the machine took over some blocks: every rank's records of the
    same blocks (in the same order), one of them with the machine's ``busy_s``.

    Summed over the blocks before dividing (the ticks are coarse beside a
    short block); never below 0 (the job's CPU and the machine's are read
    a few microseconds apart). None when no rank read the machine."""
    readers = [b for b in blocks_per_rank if b and "busy_s" in b[0]]
    if not readers:
        return None
    reader = readers[0]
    wall = sum(b["wall_s"] for b in reader)
    if wall <= 0:
        return None
    busy = sum(b["busy_s"] for b in reader)
    job = sum(b["cpu_s"] for blocks in blocks_per_rank for b in blocks)
    return max(0.0, (busy - job) / wall)


def job_cores(blocks_per_rank: Sequence[Sequence[dict[str, Any]]]) -> float | None:
    """Cores the job's own ranks took over some blocks: every rank's CPU (all its
    threads, not the kernel's softirq work for its sockets) summed, over the
    blocks' wall on the first rank. Where ranks outnumber cores, a variant near
    the machine's core count is contending for them (docs/benchmarks.md, 4 x 2
    at 64 MiB). None without records."""
    if not blocks_per_rank or not blocks_per_rank[0]:
        return None
    wall = sum(b["wall_s"] for b in blocks_per_rank[0])
    if wall <= 0:
        return None
    return sum(b["cpu_s"] for blocks in blocks_per_rank for b in blocks) / wall

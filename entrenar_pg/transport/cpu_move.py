"""Moving this thread to a CPU of its own: what both placements share.

``shm/placement.py`` (slot areas) and ``tcp_placement.py`` (same-host TCP
links) decide differently *when* a rank shares its core with a lower peer;
once it does, the move is the same: narrow this thread's affinity to a free
allowed CPU and restore it at once (the kernel migrates the thread on the
first call; the restored mask leaves the scheduler free again).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Set

MOVE_EVERY_S = 0.002  # at most one move per this many seconds (a move costs ~10-50 us)


def libc_getcpu() -> Callable[[], int] | None:
    """glibc's ``sched_getcpu`` (the vDSO's, no syscall), or None."""
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn  # type: ignore[no-any-return]


def move_to_free_cpu(cpu: int, taken: Set[int], ranks: int) -> int | None:
    """Move this thread off ``cpu`` to the lowest allowed CPU not in ``taken``;
    that CPU, or None where there is none or the thread's CPUs are fewer than
    ``ranks`` (sharing is then the plan). Raises OSError where the affinity
    cannot be read or changed (a cpuset that forbids it): callers stop trying."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < ranks:
        return None
    free = sorted(allowed - taken - {cpu})
    if not free:
        return None
    try:
        os.sched_setaffinity(0, {free[0]})  # the kernel migrates this thread now
    finally:
        os.sched_setaffinity(0, allowed)  # the thread's own mask again
    return free[0]

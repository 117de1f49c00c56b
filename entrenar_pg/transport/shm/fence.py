"""The one memory barrier of the shared-memory transport.

The rings use it; the slot areas inline the same lock round trip where it is hot.
"""

from __future__ import annotations

import threading


class Fence:
    """A full memory barrier between a store and a later load.

    The sleep protocol is Dekker's (each side stores its word, then loads the
    other's); x86-64 may let a load pass an earlier store, which could lose a
    wake-up. An uncontended ``threading.Lock`` round trip is an atomic
    read-modify-write (a locked instruction: a full barrier on x86-64), the
    cheapest one Python offers. On weaker architectures the loop's bounded
    sleep (``config.SHM_SLEEP_CAP_S``) would bound what a lost wake-up costs, but
    the rings' data/index order needs x86-64 too, so ``connect`` offers
    shared memory only there.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self) -> None:
        self._lock.acquire()
        self._lock.release()

"""Fault shared pages in ahead of their first use, leaving their contents alone.

A slot area's pages are touched only as far as the calls reach, so the first
call to reach a page pays a page fault for it, on both ranks: the writer's
allocates the page, the reader's maps it. Two ranks summing 64 KiB rotate
over 16 places (``collectives/shm_allreduce.py``: 1 MiB of slots per rank),
so each of the first 16 calls of that size paid its place's 16 faults: 100-160 µs
against 30-50 µs once every place was mapped, three to five times a warm
call, measured on the 2-core VM here (docs/benchmarks.md, twenty-sixth
session). A benchmark's first interleaved rounds of a size are exactly those
calls.

``madvise(MADV_POPULATE_WRITE / MADV_POPULATE_READ)`` (Linux 5.14) faults a
range in as a write (a read) would, without writing or reading the memory:
safe while a peer reads or writes the same pages, so a rank can populate a
whole rotation when it makes the shape, whatever the peer is doing. Best
effort: an older kernel (EINVAL) or another system leaves the pages to their
first touch, as before.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

# madvise(2)'s advice values (Linux uapi, include/uapi/asm-generic/mman-common.h): this
# Python's mmap module has no names for them.
POPULATE_READ = 22
POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE

_madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform == "linux" else None
if _madvise is not None:
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int


def address_of(view: memoryview) -> int:
    """The address of a memoryview's first byte, read-only or not (numpy's view
    of it holds the buffer only for this call)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def populate(view: memoryview, advice: int) -> None:
    """Fault in the pages under ``view`` (widened to whole pages) with
    ``advice`` (``POPULATE_READ`` or ``POPULATE_WRITE``); where the kernel
    cannot, nothing happens (best effort: the first touches fault them)."""
    if _madvise is None or not len(view):
        return
    address = address_of(view)
    start = address - address % _PAGE
    _madvise(start, address + len(view) - start, advice)

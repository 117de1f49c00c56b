"""The checker's hash: 64 bits of a tensor's bytes (XXH3-64, or blake2b without xxhash).

XXH3-64 from ``xxhash`` (the ``check`` extra), chosen by measurement: per
16 MiB, XXH3-64 0.62 ms (~26 GB/s), XXH64 1.2 ms, ``hashlib.blake2b``
16.5 ms (~1 GB/s), the fallback when xxhash is not installed.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable
from typing import Any

import torch

_xxhash: Any
try:  # optional dependency (extra "check"); blake2b is the fallback
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - exercised only without the extra
    _xxhash = None

FAST_HASH = "xxh3_64"
HASH_NAME = FAST_HASH if _xxhash is not None else "blake2b-64"


class _Blake2b64:
    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=8)

    def update(self, data: memoryview) -> None:
        self._h.update(data)

    def intdigest(self) -> int:
        return int.from_bytes(self._h.digest(), "little")


def hasher() -> Any:
    """A fresh streaming 64-bit hasher (``update(bytes)``, ``intdigest()``)."""
    return _xxhash.xxh3_64() if _xxhash is not None else _Blake2b64()


def to_i64(u: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (records are int64)."""
    return u - (1 << 64) if u >= 1 << 63 else u


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor's values: a view of its memory when it is a contiguous
    CPU tensor (no copy; the caller holds ``t``), else of a contiguous CPU copy that
    the view keeps alive."""
    if t.is_cpu and t.is_contiguous():
        return tensor_memory(t)
    # The copy is ours: numpy's view of it keeps it alive as long as the
    # memoryview (a ctypes view would outlive it: freed memory, SIGSEGV).
    copy = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    view: memoryview = copy.numpy().data
    return view


_MEMORY: dict[tuple[int, int], memoryview] = {}
_MAX_CACHED = 1024  # views kept: a model's parameters and buckets, with room


def tensor_memory(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory (no copy; the caller holds ``t``)."""
    return memory_at(t.data_ptr(), t.nbytes)


def memory_at(address: int, nbytes: int) -> memoryview:
    """A byte view of ``nbytes`` at ``address`` (a live tensor's values).

    Cached by address and size, which name exactly the bytes of the values
    whichever tensor owns them now: the same parameters and buckets are
    hashed every step, and a ctypes view costs a few us to build.
    """
    key = (address, nbytes)
    view = _MEMORY.get(key)
    if view is None:
        if len(_MEMORY) >= _MAX_CACHED:
            _MEMORY.clear()
        view = _MEMORY[key] = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    return view


def digest(tensors: Iterable[torch.Tensor]) -> int:
    """64-bit hash of the tensors' bytes, in order (streaming: the pieces of a
    tensor hash as the tensor does); as an int64."""
    return digest_sized(tensors)[0]


def digest_sized(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """``digest(tensors)`` and the number of bytes it read, in one pass over the list.

    A contiguous CPU tensor is hashed where it lies: its address and size name
    exactly the bytes of its values (C-DDP-001 hashes every parameter every
    step, so the per-tensor Python is most of that check's cost for small ones).
    """
    h = hasher()
    nbytes = 0
    for t in tensors:
        if t.is_cpu and t.is_contiguous():
            size = t.nbytes  # read once per tensor
            if size:
                h.update(memory_at(t.data_ptr(), size))
                nbytes += size
        elif t.numel():
            view = tensor_bytes(t)
            h.update(view)
            nbytes += view.nbytes
    return to_i64(h.intdigest()), nbytes

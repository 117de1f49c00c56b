"""Device staging: give the comm thread flat, contiguous host tensors, and put results back.

CPU tensors that are already contiguous are used in place (no copy). Others
are copied into a flat host buffer and, if the collective writes them, copied
back afterwards.

CUDA tensors: at call time an event is recorded on the caller's current
stream; the comm thread makes its own stream wait on it, copies device to a
pinned host buffer (reused across calls), runs the algorithm on host memory,
copies back host to device on that same stream, and the future is completed
inside that stream's context, so a stream that waits on the Work is ordered
after the copy. ``record_stream`` tells the caching allocator that the comm
stream used the caller's memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class Staged:
    """One user tensor and the flat host tensor the algorithm works on."""

    user: torch.Tensor
    read: bool
    write: bool
    host: torch.Tensor | None = None


class PinnedPool:
    """Pinned host buffers keyed by slot, grown on demand and reused."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def get(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 64), dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buf
        return buf[:nbytes].view(dtype)


class Staging:
    """The staging of one collective's tensors (created in the caller's thread)."""

    def __init__(self, device: torch.device, pool: PinnedPool | None, stream: Any | None) -> None:
        self.device = device
        self._pool = pool
        self._stream = stream
        self._items: list[Staged] = []
        self._ready: Any | None = None
        if device.type == "cuda":
            # Everything the caller's stream queued so far must be done before we copy.
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def add(self, tensors: Sequence[torch.Tensor], *, read: bool, write: bool) -> list[Staged]:
        items = [Staged(t, read, write) for t in tensors]
        self._items.extend(items)
        return items

    def load(self) -> None:
        """Comm thread: make every ``host`` tensor, with the input data where read."""
        if not self.is_cuda:
            for it in self._items:
                if it.user.is_contiguous():
                    it.host = it.user.detach().view(-1)
                else:
                    it.host = torch.empty(it.user.numel(), dtype=it.user.dtype)
                    if it.read:
                        it.host.copy_(it.user.detach().reshape(-1))
            return
        assert self._pool is not None and self._stream is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._ready)
            for slot, it in enumerate(self._items):
                it.host = self._pool.get(slot, it.user.numel(), it.user.dtype)
                it.user.record_stream(self._stream)
                if it.read:
                    it.host.copy_(it.user.detach().reshape(-1), non_blocking=True)
            self._stream.synchronize()

    def store(self) -> None:
        """Comm thread: copy written host tensors back to the user's tensors."""
        if not self.is_cuda:
            for it in self._items:
                assert it.host is not None
                if it.write and it.host.data_ptr() != it.user.data_ptr():
                    it.user.detach().copy_(it.host.view(it.user.shape))
            return
        with torch.cuda.stream(self._stream):
            for it in self._items:
                assert it.host is not None
                if it.write:
                    it.user.detach().copy_(it.host.view(it.user.shape), non_blocking=True)
            # The pinned buffers are reused by the next call: wait for the copies.
            self._stream.synchronize()

    def completion_context(self) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
        if not self.is_cuda:
            return None
        stream = self._stream

        @contextlib.contextmanager
        def ctx() -> Iterator[None]:
            with torch.cuda.stream(stream):
                yield

        return ctx

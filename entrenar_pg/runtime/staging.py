"""Device staging: give the comm thread flat, contiguous host tensors, and put results back.

The algorithms only ever see flat host tensors. A ``Staging`` is made in the
caller's thread when a collective is issued, and used by whichever thread
runs the job (the comm thread, or the caller's own for an inline job):
``load()`` before the algorithm, ``store()`` after.

CPU tensors
    Contiguous ones are used in place (the host tensor is a flat view of the
    user's memory: no copy). Others get a flat host tensor of their own, filled
    from the user's tensor when the collective reads it, and copied back into it
    when the collective writes it. A host tensor of an item that is read but not
    written may alias the user's memory, so algorithms must not write to it.

CUDA tensors (the same stream discipline as ProcessGroupGloo's CUDA path)
    1. Call time, caller's thread: an event is recorded on the caller's current
       stream of the tensors' device. Everything the caller queued before the
       collective (the kernel that produced a gradient bucket, say) comes
       before it.
    2. ``load()``, comm thread: the group's comm stream for that device (high
       priority) waits on the event, copies device -> pinned host buffers, and
       the comm thread synchronizes that stream before the algorithm touches
       host memory. Non-contiguous tensors are packed on the comm stream first.
    3. The algorithm runs on the pinned host buffers (so deterministic mode and
       the contract checker, whose hooks run inside the job body, see the
       device data as of step 1, never a stale host copy).
    4. ``store()``, comm thread: host -> device copies of written tensors are
       queued on the comm stream, asynchronously (no host synchronization).
    5. The engine completes the future inside ``completion_context()``: the
       comm stream is current, so ``Future.set_result`` (the future was made
       with ``devices=[device]``) records its completion event on the comm
       stream, after the copies. ``Work.wait()`` / ``Future.wait()`` (what DDP
       calls) makes the waiter's current stream wait on that event; callbacks
       added with ``then`` run on a stream that waits on it. No stream of the
       caller is ever blocked on the host.

Lifetimes
    - Pinned buffers live in a ``PinnedPool``, keyed by (device, slot) and
      reused across calls. Reuse is safe without per-buffer events because all
      copies touching one device's buffers run on that device's single comm
      stream, in job order, and ``load()`` synchronizes that stream (so any
      earlier job's host -> device copy out of a buffer has finished) before
      the host writes a buffer. A buffer replaced by a bigger one may still be
      the source of an in-flight copy: torch's caching host allocator keeps it
      until that copy is done (non-blocking copies record an event on it).
    - User tensors written by ``store()`` get ``record_stream(comm stream)``:
      the host -> device copy may still be in flight when the user drops the
      last reference (e.g. never waits on the Work), and the caching allocator
      must not hand the block to another tensor of the caller's stream until the
      copy is done. Reads need no ``record_stream``: ``load()`` synchronizes
      while the job still holds the tensors. Temporaries (packing of
      non-contiguous tensors) are allocated on the comm stream itself.
    - The comm thread enters each device's context with a device guard before
      selecting the stream, so a comm thread (whose current device is 0) never
      initializes a CUDA context on GPU 0 when the process uses another GPU,
      whatever ``torch.cuda.current_device()`` the caller had.

The CUDA calls go through a small ``StreamOps`` object, so the bookkeeping above
can be unit-tested on CPU with an instrumented fake (tests/test_staging.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class Staged:
    """One user tensor and the flat host tensor the algorithm works on."""

    user: torch.Tensor
    read: bool
    write: bool
    host: torch.Tensor | None = None


class PinnedPool:
    """Host staging buffers keyed by (device index, slot), grown on demand and reused.

    ``pin``: allocate page-locked memory (required for truly asynchronous
    copies); default: when CUDA is available. ``pin=False`` gives ordinary
    memory with the same reuse logic (tests on machines without CUDA).
    Only the group's comm thread uses a pool; it is not locked.
    """

    def __init__(self, pin: bool | None = None) -> None:
        if pin is None:
            pin = torch.cuda.is_available()
        elif pin and not torch.cuda.is_available():
            raise ValueError("PinnedPool(pin=True) needs CUDA; use pin=False without it")
        self.pin = pin
        self.allocations = 0  # buffers allocated so far (reuse is what keeps this small)
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool."""
        return sum(b.numel() for b in self._buffers.values())

    def get(self, device_index: int, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat ``numel``-element ``dtype`` view of the buffer for (device_index, slot)."""
        nbytes = numel * dtype.itemsize
        key = (device_index, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 64), dtype=torch.uint8, pin_memory=self.pin)
            self._buffers[key] = buf
            self.allocations += 1
        return buf[:nbytes].view(dtype)

    def clear(self) -> None:
        self._buffers.clear()


class StreamOps(Protocol):
    """The stream operations staging needs (real: ``CUDA_OPS``; tests: a fake)."""

    def caller_event(self, device: torch.device) -> Any:
        """An event recorded now on the calling thread's current stream of ``device``."""
        ...

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` (and its device) current in this thread, restoring both on exit."""
        ...

    def wait_event(self, stream: Any, event: Any) -> None: ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...

    def synchronize(self, stream: Any) -> None: ...

    def new_future(self, device: torch.device) -> torch.futures.Future[Any]: ...


class CudaOps:
    """``StreamOps`` on torch.cuda."""

    def caller_event(self, device: torch.device) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        # Device guard first: inside it the stream is on the current device, so
        # torch.cuda.stream neither switches nor restores the device (restoring
        # with cudaSetDevice would create a context on the thread's old device).
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            yield

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def new_future(self, device: torch.device) -> torch.futures.Future[Any]:
        # devices=[...]: set_result extracts the CUDA storages of the value and
        # records an event on the completing thread's current stream of each
        # device; wait() makes the waiter's current streams wait on it. Without
        # devices, CUDA values would complete with no synchronization at all.
        return torch.futures.Future(devices=[device])


CUDA_OPS = CudaOps()


def new_comm_stream(device_index: int) -> Any:
    """A group's comm stream for one device: high priority, like ProcessGroupGloo's."""
    return torch.cuda.Stream(device=device_index, priority=-1)


class Staging:
    """The staging of one collective's tensors (created in the caller's thread).

    ``device``: the tensors' common device. For CUDA, ``stream`` (the group's
    comm or p2p stream for that device) is required; ``ops`` defaults to
    torch.cuda. Passing ``ops`` with a CPU device runs the stream path with
    those ops (tests). ``pool``: the pinned buffers reused across calls (the
    comm thread's collectives); None: buffers of this staging's own (p2p,
    whose many ops in flight each hold theirs until their bytes have moved;
    torch's caching host allocator recycles them).
    """

    def __init__(
        self,
        device: torch.device,
        pool: PinnedPool | None = None,
        stream: Any | None = None,
        ops: StreamOps | None = None,
    ) -> None:
        self._cuda = device.type == "cuda"  # once: device.type builds a new str each time
        if self._cuda:
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if ops is None:
                ops = CUDA_OPS
        self.device = device
        self._ops = ops
        self._pool = pool
        self._stream = stream
        self._items: list[Staged] = []
        self._ready: Any | None = None
        if ops is not None:
            if stream is None:
                raise ValueError(f"staging on {device} needs a comm stream")
            # Everything the caller's stream queued so far comes before our copies.
            self._ready = ops.caller_event(device)

    @property
    def is_cuda(self) -> bool:
        return self._cuda

    @property
    def uses_streams(self) -> bool:
        """Whether this staging copies through pinned buffers on a comm stream."""
        return self._ops is not None

    @property
    def items(self) -> list[Staged]:
        return list(self._items)

    def add(self, tensors: Sequence[torch.Tensor], *, read: bool, write: bool) -> list[Staged]:
        """Register tensors the collective reads and/or writes; returns their items."""
        items = [Staged(t, read, write) for t in tensors]
        self._items.extend(items)
        return items

    def new_future(self) -> torch.futures.Future[Any]:
        """The future the collective's Work wraps (device-aware on the stream path)."""
        if self._ops is None:
            return torch.futures.Future()
        return self._ops.new_future(self.device)

    def load(self) -> None:
        """Comm thread: make every ``host`` tensor, holding the input data where read."""
        if self._ops is None:
            for it in self._items:
                user = it.user
                if user.requires_grad:
                    user = user.detach()
                if user.is_contiguous():
                    it.host = user if user.dim() == 1 else user.view(-1)
                else:
                    it.host = torch.empty(user.numel(), dtype=user.dtype)
                    if it.read:
                        it.host.copy_(user.reshape(-1))
            return
        ops, pool, stream = self._ops, self._pool, self._stream
        index = self.device.index if self.device.index is not None else 0
        copied = False
        with ops.use(stream):
            ops.wait_event(stream, self._ready)
            for slot, it in enumerate(self._items):
                numel, dtype = it.user.numel(), it.user.dtype
                if pool is None:
                    host = torch.empty(numel, dtype=dtype, pin_memory=self._cuda)
                else:
                    host = pool.get(index, slot, numel, dtype)
                if it.read and host.numel():
                    # reshape packs a non-contiguous tensor on the comm stream.
                    host.copy_(it.user.detach().reshape(-1), non_blocking=True)
                    copied = True
                it.host = host
            # The host may touch the buffers only once (a) these copies and (b)
            # any earlier job's host -> device copies out of them are done.
            # Buffers of our own have no earlier job: with nothing read
            # (a recv), the caller's thread does not wait for its stream.
            if copied or pool is not None:
                ops.synchronize(stream)

    def store(self) -> None:
        """Comm thread: copy written host tensors back into the user's tensors."""
        if self._ops is None:
            for it in self._items:
                assert it.host is not None, "internal: store() before load()"
                if it.write and it.host.data_ptr() != it.user.data_ptr():
                    it.user.detach().copy_(it.host.view(it.user.shape))
            return
        ops, stream = self._ops, self._stream
        with ops.use(stream):
            for it in self._items:
                assert it.host is not None, "internal: store() before load()"
                if it.write and it.host.numel():
                    ops.record_stream(it.user, stream)
                    it.user.detach().copy_(it.host.view(it.user.shape), non_blocking=True)
        # No synchronization: the future's event (completion_context) orders
        # waiters after these copies; the next load() orders buffer reuse.

    def completion_context(self) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
        """What the engine enters around ``set_result``: the comm stream, current."""
        if self._ops is None:
            return None
        ops, stream = self._ops, self._stream

        def ctx() -> contextlib.AbstractContextManager[Any]:
            return ops.use(stream)

        return ctx

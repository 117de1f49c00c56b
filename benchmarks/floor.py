# mypy: disable-error-code="override,misc,call-arg"
# (torch's stubs type ProcessGroup's methods as overloads no Python override can match.)
"""A process group that moves nothing: the floor under the bench's DDP step.

DDP over it does all of its own work (gradient hooks, bucket copies, the
comm hook's division, waiting on futures), but every collective completes at
once with the rank's own data, so a step costs compute plus DDP's bookkeeping
and nothing else: no bytes move and the ranks never wait for each other. No
backend can be faster; the bench reports this row so that a backend's step
time reads against what is possible at all on the machine (``step - floor``
is what communication costs). Results are wrong by design (replicas drift
apart): it is for timing only and is registered only by the bench, under its
own backend name, in each worker process that asks for it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

BACKEND = "bench_floor"


class DoneWork(dist.Work):
    """A Work that is complete from the start: ``wait()`` returns, the future holds ``value``."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(value)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class FloorProcessGroup(dist.ProcessGroup):
    """Every collective returns a completed Work; allgather copies the local input."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)

    def _done(self, value: Any) -> DoneWork:
        return DoneWork(value)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> DoneWork:
        return self._done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> DoneWork:
        return self._done(tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> DoneWork:
        for out, inp in zip(outputs, inputs, strict=True):
            for o in out:
                o.copy_(inp)
        return self._done(outputs)

    def barrier(self, opts: Any = None) -> DoneWork:
        return self._done([])


def _create(store: Any, rank: int, size: int, timeout: Any) -> FloorProcessGroup:
    return FloorProcessGroup(rank, size)


def register() -> None:
    """Make ``new_group(backend="bench_floor")`` available in this process (idempotent)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])

"""EntrenarWork: the handle every collective returns (P2PWork: a send's or recv's).

torch's ``_create_work_from_future`` wrapper returns True from ``wait()`` even
when the future failed, which would turn a broken collective into silent
garbage. This Work re-raises the collective's error (PeerConnectionError,
CollectiveMismatchError, ContractViolation) from ``wait()``, so
``dist.all_reduce`` and friends raise it in the caller, and exposes the future
that DDP's reducer chains on. The engine holds a reference until the job is
done, so a Work handed to C++ stays alive while it is pending.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PeerConnectionError


class EntrenarWork(dist.Work):
    def __init__(
        self, future: torch.futures.Future, what: str, rank: int, seq: int | None = None
    ) -> None:
        super().__init__()
        self._future = future
        # "allreduce#12": the label is only read on errors and in repr, so it is
        # joined there, not on the hot path.
        self._kind = what
        self._seq = seq
        self._rank = rank

    @property
    def _what(self) -> str:
        return self._kind if self._seq is None else f"{self._kind}#{self._seq}"

    def wait(self, timeout: timedelta | float | None = timedelta(0)) -> bool:
        """Block until done; raise the collective's error (its own class).

        ``timedelta(0)`` or None (torchft's default) means no timeout.
        """
        if timeout is None:
            seconds = 0.0
        elif isinstance(timeout, timedelta):
            seconds = timeout.total_seconds()
        else:
            seconds = float(timeout)
        if seconds > 0 and not self._future.done():
            # Rare path (torch's own calls pass no timeout): poll, since a
            # torch Future has no timed wait.
            deadline = time.monotonic() + seconds
            while not self._future.done():
                if time.monotonic() >= deadline:
                    raise PeerConnectionError(
                        f"rank {self._rank}: {self._what}: Work.wait timed out after {seconds:.1f}s"
                    )
                time.sleep(0.0005)
        # Future.wait re-raises the error and, for CUDA futures, makes the
        # current stream wait for the streams that produced the result.
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        # A chained future: Future.set_exception only sets an unwrap function
        # Python honours, so C++ consumers (DDP's reducer) would read the error
        # object as a result and crash; a failing callback is a real C++ error.
        return self._future.then(lambda fut: fut.value())

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def exception(self) -> Any:
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as e:  # the collective's error, returned not raised
            return e
        return None

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def result(self) -> Any:
        self.wait()
        return self._future.value()

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"EntrenarWork({self._what}, rank={self._rank}, {state})"


class P2PWork(EntrenarWork):
    """The Work of a send or recv; a recv's knows the rank it came from (``_source_rank``)."""

    def __init__(self, future: torch.futures.Future, what: str, rank: int, src: int) -> None:
        super().__init__(future, what, rank)
        self.src = src

    def _source_rank(self) -> int:
        if self.src < 0:
            raise ValueError(f"rank {self._rank}: {self._what}: not received yet")
        return self.src

    def source_rank(self) -> int:
        return self._source_rank()

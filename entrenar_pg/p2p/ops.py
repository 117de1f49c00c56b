"""A p2p op (a send or a recv) from its posting to its completion.

``new_op`` stages the user's tensor (``Staging``: the runtime's
``p2p_staging`` hands each op one; the runtime builds the channel, a floor
up, so this package knows its staging by protocol) and makes the op's
future and Work; ``complete`` completes finished ops outside the channel's
lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.autograd import profiler as _profiler

from ..call.work import P2PWork
from ..flight_recorder import Entry, FlightRecorder, p2p_name
from ..profiling import event_until
from .matching import ANY_SOURCE


class StagedTensor(Protocol):
    """One staged tensor (``runtime.staging.Staged``): the user's and its host copy."""

    user: torch.Tensor
    host: torch.Tensor | None


class Staging(Protocol):
    """What an op needs of its staging. The runtime (which builds this channel, a
    floor up) owns ``runtime.staging`` and hands each op one (``Runtime.p2p_staging``)."""

    def add(
        self, tensors: Sequence[torch.Tensor], *, read: bool, write: bool
    ) -> Sequence[StagedTensor]: ...
    def load(self) -> None: ...
    def store(self) -> None: ...
    def new_future(self) -> torch.futures.Future[Any]: ...
    def completion_context(
        self,
    ) -> Callable[[], contextlib.AbstractContextManager[Any]] | None: ...


@dataclass(eq=False)
class Op:
    """A send or recv: the user's tensor staged (``item.host`` is the flat host
    tensor on the wire), its future and Work."""

    peer: int  # destination (send), source or ANY_SOURCE (recv)
    tag: int
    staging: Staging
    item: StagedTensor
    future: torch.futures.Future
    work: P2PWork
    what: str
    is_recv: bool
    record: Entry | None = None  # its flight-recorder entry, when the group records

    @property
    def host(self) -> torch.Tensor:
        assert self.item.host is not None, "internal: p2p op not staged"
        return self.item.host

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


Done = tuple[Op, BaseException | None]


def new_op(
    staging: Staging,
    tensor: torch.Tensor,
    rank: int,
    peer: int,
    tag: int,
    what: str,
    *,
    is_recv: bool,
    recorder: FlightRecorder | None,
    timeout_s: float,
) -> Op:
    """Stage ``tensor`` (read by a send, written by a recv) and make its op and Work."""
    (item,) = staging.add([tensor], read=not is_recv, write=is_recv)
    staging.load()
    fut = staging.new_future()  # devices=[device] on CUDA: stream-synchronizing
    seen = fut  # the caller's; under a profiler, complete once the event ended
    if _profiler._is_profiler_enabled:  # one attribute test when no profiler runs
        name = p2p_name(is_recv, rank, peer)
        seen = event_until(fut, name, tensor, tensor.numel() * tensor.element_size(), tag)
    work = P2PWork(seen, what, rank, peer if peer != ANY_SOURCE else -1)
    op = Op(peer, tag, staging, item, fut, work, what, is_recv)
    if recorder is not None:
        op.record = recorder.p2p(is_recv, peer, tensor, timeout_s)
    return op


def complete(done: list[Done]) -> None:
    """Complete the futures of finished ops (outside the channel's lock): a
    recv's data goes back into the user's tensor first (``Staging.store``),
    and the future completes in the staging's completion context (CUDA: the
    p2p stream current, so its event follows the copy)."""
    for op, error in done:
        if op.record is not None:
            if error is None:
                op.record.complete()
            else:
                op.record.retire()
        if error is not None:
            op.future.set_exception(error)
            continue
        try:
            if op.is_recv:
                op.staging.store()
        except BaseException as e:  # a failed copy-back fails the recv, not the thread
            op.future.set_exception(e)
            continue
        context = op.staging.completion_context()
        if context is None:
            op.future.set_result([op.item.user])
        else:
            with context():
                op.future.set_result([op.item.user])

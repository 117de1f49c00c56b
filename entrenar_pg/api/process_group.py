# mypy: disable-error-code="override,misc,call-arg"
# (torch's stubs type ProcessGroup's methods as overloads no Python override can match.)
"""EntrenarProcessGroup: torch's ProcessGroup surface, and nothing else.

Each collective method is the same two steps: ``overloads.normalize`` turns
whichever call form torch bound into the options form, and a builder of
``api/checks.py`` checks the arguments (in the caller's thread, before
anything is sent) and returns a request, which ``Runtime.submit`` runs as the
group's next job; the method returns its Work at once. ``allreduce`` first
offers the call to the thin path (``runtime/thin.py``), which runs the common
blocking call straight through and declines every other. Point-to-point calls
are checked the same way and go to the p2p channel, outside the FIFO.

Method names cover torch 2.11 and 2.13 alike (2.13 renamed several:
``all_to_all_single`` / ``alltoall_base``, ``reduce_scatter_single`` /
``_reduce_scatter_base``, ``*_single_coalesced`` / ``*_tensor_coalesced``).
"""

from __future__ import annotations

import atexit
import collections
import logging
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import sparse
from .._plugin import BACKEND_NAME
from ..call.work import EntrenarWork, P2PWork
from ..checker import ContractChecker
from ..checker.checker import settle
from ..config import Options
from ..errors import EntrenarError, PeerConnectionError
from ..ledger_writer import RunLedger
from ..overloads import normalize
from ..p2p import ANY_SOURCE
from ..runtime.runtime import Runtime
from ..runtime.thin import DoneWork, ThinPath
from . import checks as rq
from .dynamo_boundary import hide_from_dynamo

log = logging.getLogger(__name__)


class EntrenarProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run over entrenar's TCP mesh."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        *,
        timeout: timedelta = timedelta(minutes=30),
        options: Options | None = None,
        group_name: str = "",
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self.options = options if options is not None else Options.from_env()
        self._group_name = group_name
        self._global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self._runtime = Runtime(store, rank, size, self.options, timeout, group_name)
        if self._runtime.recorder is not None:  # dumps name the group as torch does
            self._runtime.recorder.describe(self, self._global_ranks)
        self._checks = rq.Checks(rank, size, self._runtime.state)
        self._thin = ThinPath(self._runtime)  # the common allreduce's short route
        self.checker = ContractChecker(self) if self.options.check else None
        # The run ledger (one line per optimizer step on rank 0): ledger_writer.py.
        self.ledger = RunLedger(self, self.options.ledger) if self.options.ledger else None
        _LIVE_GROUPS.add(self)
        log.info(
            "rank %d: entrenar group %r up: world %d, options %s",
            rank,
            group_name,
            size,
            self.options,
        )

    # ------------------------------------------------------------ identity

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def __repr__(self) -> str:
        return (
            f"EntrenarProcessGroup(rank={self._rank}, size={self._size}, name={self._group_name!r})"
        )

    def stats(self) -> dict[str, float]:
        """Communication counters: ``<kind>_calls``, ``<kind>_bytes``, ``<kind>_seconds``."""
        return self._runtime.engine.stats.as_dict()

    @property
    def mesh(self) -> Any:
        """The collective mesh (the contract checker and tests reach the transport here)."""
        return self._runtime.mesh

    @property
    def checker(self) -> Any | None:
        """The contract checker run around every collective, if any (``ContractChecker``)."""
        return self._runtime.checker

    @checker.setter
    def checker(self, checker: Any | None) -> None:
        self._runtime.checker = checker

    def submit_check(self, run: Callable[[Any], None]) -> Any:
        """The checker's entry: ``run(call)`` as the next job (a Work; idle: ``ThinPath.check``)."""
        done = self._thin.check(run)
        return done if done is not None else self._runtime.submit_check(run)

    def mark_issue(self, marks: collections.deque[tuple[int, Any]], value: Any) -> None:
        """The checker's step mark, in issue order with no job (``Runtime.mark_issue``)."""
        self._runtime.mark_issue(marks, value)

    # ------------------------------------------------------------ torch integration
    #
    # A Python backend must subclass ProcessGroup (torch exposes no constructor
    # for a Python ``Backend``), so it registers no per-device backend and
    # torch's ``pg._get_backend(device)`` would raise. torch's Python side asks
    # it only for capabilities (init_process_group(device_id=...), new_group,
    # FSDP2's allocator, destroy): this group answers for every device itself.

    supports_splitting = False  # no communicator splitting: new_group builds a fresh mesh
    supports_coalescing = False  # batch_isend_irecv issues each op (p2p never blocks)
    supports_shrinking = False
    supports_time_estimate = False

    def _get_backend(self, device: Any) -> Any:
        return self

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    @property
    def bound_device_id(self) -> Any:
        """Always None: nothing is eagerly bound, so torch never splits this group.
        ``init_process_group(device_id=...)`` sets it; the device is kept in
        ``requested_device_id`` (staging follows each tensor's own device)."""
        return None

    @bound_device_id.setter
    def bound_device_id(self, device: Any) -> None:
        self.requested_device_id = device

    # ------------------------------------------------------------ collectives

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        """``(tensors, opts=None)``, ``(tensors, op=SUM, timeout=None)`` or
        ``(tensor, op=SUM, timeout=None)``: torch's three forms (overloads.py)."""
        work = self._thin.allreduce(args, kwargs)  # None: not the common call (runtime/thin.py)
        if work is not None:
            return work
        (tensors,), opts = normalize("allreduce", args, kwargs, self._rank)
        if sparse.is_sparse_call(tensors):  # before the dense-only checks
            return self._runtime.submit(rq.sparse_allreduce(self._checks, tensors, opts), opts)
        return self._runtime.submit(rq.allreduce(self._checks, "allreduce", tensors, opts), opts)

    def allreduce_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(tensors, opts=None)``; also ``(tensors, op=SUM, timeout=None)`` (torchft)."""
        name = "allreduce_coalesced"
        (tensors,), opts = normalize(name, args, kwargs, self._rank)
        return self._runtime.submit(rq.allreduce(self._checks, name, tensors, opts), opts)

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        """``(tensors, opts=None)`` or ``(tensor, root, timeout=None)``."""
        (tensors,), opts = normalize("broadcast", args, kwargs, self._rank)
        return self._runtime.submit(rq.broadcast(self._checks, tensors, opts), opts)

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        """``(tensors, opts=None)`` or ``(tensor, root, op=SUM, timeout=None)``."""
        (tensors,), opts = normalize("reduce", args, kwargs, self._rank)
        return self._runtime.submit(rq.reduce(self._checks, tensors, opts), opts)

    def allgather(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_tensors, input_tensors, opts=None)`` or
        ``(output_tensors, input_tensor, timeout=None)``."""
        (outs, ins), opts = normalize("allgather", args, kwargs, self._rank)
        return self._runtime.submit(rq.allgather(self._checks, outs, ins), opts)

    def all_gather_single(self, *args: Any, **kwargs: Any) -> Any:
        """``(output, input, opts=None)``."""
        return self._allgather_into("all_gather_single", args, kwargs)

    def _allgather_base(self, *args: Any, **kwargs: Any) -> Any:
        """``(output, input, opts=None)``."""
        return self._allgather_into("_allgather_base", args, kwargs)

    def _allgather_into(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        (output, inp), opts = normalize(name, args, kwargs, self._rank)
        return self._runtime.submit(rq.allgather_into(self._checks, name, output, inp), opts)

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_lists, input_list, opts=None)``."""
        (outs, ins), opts = normalize("allgather_coalesced", args, kwargs, self._rank)
        return self._runtime.submit(rq.allgather_coalesced(self._checks, outs, ins), opts)

    def allgather_into_tensor_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputs, inputs, opts=None)``."""
        return self._allgather_tensors("allgather_into_tensor_coalesced", args, kwargs)

    def all_gather_single_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputs, inputs, opts=None)``."""
        return self._allgather_tensors("all_gather_single_coalesced", args, kwargs)

    def _allgather_tensors(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        (outs, ins), opts = normalize(name, args, kwargs, self._rank)
        return self._runtime.submit(rq.allgather_tensors(self._checks, name, outs, ins), opts)

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_tensors, input_tensors, opts=None)`` or
        ``(output_tensors, input_tensor, root, timeout=None)``."""
        (outs, ins), opts = normalize("gather", args, kwargs, self._rank)
        return self._runtime.submit(rq.gather(self._checks, outs, ins, opts), opts)

    def scatter(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_tensors, input_tensors, opts=None)`` or
        ``(output_tensor, input_tensors, root, timeout=None)``."""
        (outs, ins), opts = normalize("scatter", args, kwargs, self._rank)
        return self._runtime.submit(rq.scatter(self._checks, outs, ins, opts), opts)

    def alltoall(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_tensors, input_tensors, opts=None)``."""
        (outs, ins), opts = normalize("alltoall", args, kwargs, self._rank)
        return self._runtime.submit(rq.alltoall(self._checks, outs, ins), opts)

    def alltoall_base(self, *args: Any, **kwargs: Any) -> Any:
        """``(output, input, output_split_sizes, input_split_sizes, opts=None | timeout=None)``."""
        return self._alltoall_single("alltoall_base", args, kwargs)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Any:
        """``(output, input, output_split_sizes, input_split_sizes, opts=None | timeout=None)``."""
        return self._alltoall_single("all_to_all_single", args, kwargs)

    def _alltoall_single(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        (out, inp, out_splits, in_splits), opts = normalize(name, args, kwargs, self._rank)
        req = rq.alltoall_single(self._checks, name, out, inp, out_splits, in_splits)
        return self._runtime.submit(req, opts)

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_tensors, input_tensors, opts=None)`` or
        ``(output, input, op=SUM, timeout=None)``."""
        (outs, ins), opts = normalize("reduce_scatter", args, kwargs, self._rank)
        return self._runtime.submit(rq.reduce_scatter(self._checks, outs, ins, opts), opts)

    def _reduce_scatter_base(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputTensor, inputTensor, opts=None)``."""
        return self._reduce_scatter_tensors("_reduce_scatter_base", args, kwargs)

    def reduce_scatter_single(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputTensor, inputTensor, opts=None)``."""
        return self._reduce_scatter_tensors("reduce_scatter_single", args, kwargs)

    def reduce_scatter_tensor_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputs, inputs, opts=None)``."""
        return self._reduce_scatter_tensors("reduce_scatter_tensor_coalesced", args, kwargs)

    def reduce_scatter_single_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(outputs, inputs, opts=None)``."""
        return self._reduce_scatter_tensors("reduce_scatter_single_coalesced", args, kwargs)

    def _reduce_scatter_tensors(
        self, name: str, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        (outs, ins), opts = normalize(name, args, kwargs, self._rank)
        req = rq.reduce_scatter_tensors(self._checks, name, outs, ins, opts)
        return self._runtime.submit(req, opts)

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        """``(opts=None)`` or ``(timeout=None)``."""
        _, opts = normalize("barrier", args, kwargs, self._rank)
        return self._runtime.submit(rq.barrier(self._checks), opts)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier that raises if it is not passed within ``timeout`` (default: the group's)."""
        if timeout is None:
            timeout = timedelta(seconds=self._runtime.timeout.seconds)
        elif not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        self.barrier().wait(timeout)

    # ------------------------------------------------------------ point-to-point

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> P2PWork:  # noqa: N803
        t = rq.p2p(self._checks, "send", tensors, dstRank, tag, writes=False)
        return self._runtime.p2p.send(t, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> P2PWork:  # noqa: N803
        t = rq.p2p(self._checks, "recv", tensors, srcRank, tag, writes=True)
        return self._runtime.p2p.recv(t, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> P2PWork:
        t = rq.p2p(self._checks, "recv_anysource", tensors, ANY_SOURCE, tag, writes=True)
        return self._runtime.p2p.recv(t, ANY_SOURCE, tag)

    # ------------------------------------------------------------ lifecycle, health

    def shutdown(self) -> None:
        """Release threads and sockets (torch's destroy_process_group calls this), once
        the checker judged a step still waiting (a collective; may raise)."""
        try:
            settle(self.checker)
        finally:
            self._runtime.close()

    def abort(self) -> None:
        """Break the group at once (within a second, whatever peers and store do):
        running, pending and later calls fail with a ``PeerConnectionError`` saying
        the group was aborted (NCCL's class for it); ``errored()`` returns it."""
        why = f"rank {self._rank}: the process group was aborted (abort())"
        self._runtime.abort(PeerConnectionError(why, culprit=self._rank))

    def errored(self) -> EntrenarError | None:
        """The group's first failure (an exception object; after ``abort()`` one saying
        so), or None while healthy: torchft asks its inner group this to reconfigure."""
        return self._runtime.state.error

    def set_timeout(self, timeout: timedelta) -> None:
        """The no-progress timeout of later collectives and p2p calls whose opts set none
        (collectives already issued keep the timeout they were issued with)."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else -1.0
        if seconds <= 0:
            raise ValueError(
                f"rank {self._rank}: set_timeout: the timeout must be a positive timedelta, "
                f"got {timeout!r}"
            )
        self._runtime.set_timeout(timeout)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


# Every method torch can call on a group or on the Work it returns runs outside
# torch.compile's tracer, as gloo's C++ methods do (dynamo_boundary.py says why
# this way: nothing is added to the eager path).
hide_from_dynamo(EntrenarProcessGroup, EntrenarWork, DoneWork, P2PWork)

_LIVE_GROUPS: weakref.WeakSet[EntrenarProcessGroup] = weakref.WeakSet()


@atexit.register
def _close_live_groups() -> None:
    """Interpreter exit with groups still up: drop their links, stop their threads."""
    for pg in list(_LIVE_GROUPS):
        try:
            pg._runtime.close(at_exit=True)
        except Exception:  # exiting anyway; never mask the program's own exit status
            log.debug("closing a group at exit failed", exc_info=True)


def create_process_group(dist_opts: Any, backend_options: Any = None) -> EntrenarProcessGroup:
    """The creator torch calls (extended API): ``pg_options`` may be an ``Options``."""
    if backend_options is None:
        options = Options.from_env()
    elif isinstance(backend_options, Options):
        options = backend_options
    else:
        raise TypeError(
            f"rank {dist_opts.group_rank}: entrenar's pg_options must be entrenar_pg.Options, "
            f"got {type(backend_options).__name__}"
        )
    return EntrenarProcessGroup(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        timeout=dist_opts.timeout,
        options=options,
        group_name=str(dist_opts.group_id or ""),
        global_ranks=list(dist_opts.global_ranks_in_group or []),
    )

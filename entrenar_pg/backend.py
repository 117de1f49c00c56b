# mypy: disable-error-code="override,misc,call-arg"
# (torch's stubs type ProcessGroup's methods as overloads no Python override can match.)
"""EntrenarProcessGroup: the thin adapter from torch's collective calls to jobs.

Each method validates its arguments in the caller's thread (ValueError /
TypeError naming the rank and the call, before anything is sent), records what
to stage, wraps the algorithm as a job with the next sequence number, hands it
to the comm thread, and returns at once a Work whose future completes with the
output tensors. One core path (``_launch``) serves every collective.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from . import algorithms as alg
from . import sparse
from .collectives import CollectivesMixin
from .config import Options
from .contracts import ContractChecker
from .engine import Engine, Job
from .errors import EntrenarError
from .overlap import overlaps_itself
from .overloads import normalize
from .p2p import P2PChannel
from .reduce_ops import SUPPORTED_DTYPES, Reduction, prepare_
from .staging import PinnedPool, Staged, Staging, new_comm_stream
from .transport import Mesh
from .wire import OpCode
from .work import EntrenarWork

log = logging.getLogger(__name__)

BACKEND_NAME = "entrenar"
_CPU = torch.device("cpu")

Body = Callable[[alg.Call], None]


class EntrenarProcessGroup(CollectivesMixin, dist.ProcessGroup):
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
        self._timeout = timeout
        # The no-progress bound of a collective whose opts carry no timeout of
        # their own (set_timeout changes it for later calls).
        self._timeout_s = _seconds(timeout)
        self._lock = threading.Lock()  # orders seq assignment with enqueueing
        self._seq = 0
        self._scratch = alg.ScratchPool()
        self._pinned: PinnedPool | None = None
        self._cuda_streams: dict[int, Any] = {}
        self._closed = False
        self._comm_spin_s = self.options.spin_us / 1e6
        self._caller_spin_s = self.options.caller_spin_us / 1e6
        self.checker: Any | None = ContractChecker(self) if self.options.check else None
        self.mesh = Mesh(store, rank, size, self.options, timeout, name=group_name)
        # p2p has its own channel and thread: a recv must never block the collectives.
        self._p2p = P2PChannel(self.mesh, self._timeout_s, name=group_name)
        self._engine = Engine(
            rank, f"r{rank}-{group_name or 'pg'}", self._on_failure, self.options.spin_us
        )
        self._p2p.on_failure = self._on_p2p_failure
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
        return self._engine.stats.as_dict()

    # ------------------------------------------------------------ core path

    def _where(self, call: str) -> str:
        return f"rank {self._rank}: {call}"

    def _validate(
        self,
        call: str,
        tensors: Sequence[Any],
        *,
        same_dtype: bool = True,
        written: Sequence[torch.Tensor] = (),
    ) -> torch.device:
        """Check a call's tensors; returns their common device. Raises before anything is sent.

        ``written``: those of ``tensors`` the call writes; none may have
        elements sharing memory (an expand()ed output), which could not take
        the result. Written for the hot path (every collective runs it):
        cheap checks first, the message built only when raising.
        """
        if self._closed:
            raise ValueError(f"{self._where(call)}: the process group was destroyed")
        if self._engine.error is not None:
            raise self._engine.broken_error(call)
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(
                f"{self._where(call)}: expected a list of tensors, got {type(tensors).__name__}"
            )
        device: torch.device | None = None
        dtype: torch.dtype | None = None
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self._where(call)}: expected tensors, got {type(t).__name__}")
            if t.layout is not torch.strided:
                raise ValueError(
                    f"{self._where(call)}: only dense tensors are supported, got {t.layout}"
                )
            if not (t.is_cpu or t.is_cuda):
                raise ValueError(
                    f"{self._where(call)}: device {t.device} is not supported (cpu, cuda)"
                )
            if t.dtype not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"{self._where(call)}: dtype {t.dtype} is not supported by entrenar"
                )
            if device is None:
                device, dtype = t.device, t.dtype
            elif t.device != device:
                raise ValueError(
                    f"{self._where(call)}: tensors on different devices ({device} and {t.device})"
                )
            elif same_dtype and t.dtype != dtype:
                raise ValueError(
                    f"{self._where(call)}: tensors of different dtypes ({dtype} and {t.dtype})"
                )
        for t in written:
            if not t.is_contiguous() and overlaps_itself(t):
                raise ValueError(
                    f"{self._where(call)}: an output tensor (shape {tuple(t.shape)}, strides "
                    f"{t.stride()}) has elements that share memory (an expand()ed tensor?), "
                    "so it cannot hold the result; pass one with memory of its own "
                    "(.contiguous() or .clone())"
                )
        return device if device is not None else _CPU

    def _staging(self, device: torch.device) -> Staging:
        if device == _CPU or device.type != "cuda":  # the first test spares a str per call
            return Staging(device, None, None)
        if self._pinned is None:
            self._pinned = PinnedPool()
        # A CUDA tensor's device always has an index (never current_device()).
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._cuda_streams.get(index)
        if stream is None:
            stream = new_comm_stream(index)
            self._cuda_streams[index] = stream
        return Staging(torch.device("cuda", index), self._pinned, stream)

    def _launch(
        self,
        kind: OpCode,
        staging: Staging,
        nbytes: int,
        body: Body,
        result: Any,
        *,
        opts: Any = None,
    ) -> Any:
        """Run ``body`` as the group's next job; return a Work completing with ``result``.

        Where the job runs: a blocking call (torch's ``async_op=False`` sets
        ``opts.asyncOp = False``; the caller waits on the Work at once) on CPU
        tensors runs in the caller's thread when the group has nothing queued
        or running, sparing the two thread wake-ups (~50-100 us each here) a
        hand-off costs; so does an async call of at most ``inline_max_bytes``.
        Everything else (async calls, CUDA staging, a busy group) goes to the
        comm thread's FIFO. Either way jobs run one at a time in issue order.
        """
        fut = staging.new_future()  # devices=[device] on CUDA: stream-synchronizing
        name = alg.op_name(kind)
        engine = self._engine
        blocking = opts is not None and getattr(opts, "asyncOp", True) is False
        timeout_s = self._timeout_s
        if opts is not None:
            # torch's per-call timeout; its default (kUnsetTimeout, -1 ms)
            # means the group's, as it does for gloo.
            per_call = getattr(opts, "timeout", None)
            if per_call is not None and per_call > _UNSET:
                timeout_s = per_call.total_seconds()
        with self._lock:  # seq order == queue order
            self._seq += 1
            seq = self._seq
            work = EntrenarWork(fut, name, self._rank, seq)
            job = Job(
                seq,
                name,
                nbytes,
                partial(self._run_job, seq, staging, body, result, timeout_s),
                fut,
                staging.completion_context(),
                work,
            )
            inline = (
                (blocking or nbytes <= self.options.inline_max_bytes)
                and not staging.is_cuda
                and engine.try_claim()
            )
            if not inline:
                engine.submit(job)
        if inline:
            engine.run_claimed(job)
        elif engine.holds_token():
            engine.drain_until(job)  # issued from a future callback: see drain_until
        else:
            # Let the comm thread start now. It was just woken, but when every
            # core is busy computing (a DDP backward on each rank) the
            # scheduler may leave it waiting for our time slice to end:
            # measured here, the hand-off's 90th percentile fell from 2.5-3.7 ms
            # to 0.2-0.7 ms with this yield. It costs one syscall.
            os.sched_yield()
        return work

    def _run_job(
        self, seq: int, staging: Staging, body: Body, result: Any, timeout_s: float
    ) -> Any:
        """A job's work, in whichever thread holds the engine's token."""
        mesh = self.mesh
        mesh.spin_s = self._comm_spin_s if self._engine.in_comm_thread() else self._caller_spin_s
        mesh.timeout_s = timeout_s  # the call's own timeout, or the group's when it set none
        staging.load()
        body(alg.Call(self.mesh, seq, self.options, self._scratch))
        staging.store()
        return result

    @staticmethod
    def _host(items: Sequence[Staged]) -> list[torch.Tensor]:
        out = []
        for it in items:
            assert it.host is not None, "internal: staging.load() not run"
            out.append(it.host)
        return out

    # ------------------------------------------------------------ allreduce

    def _allreduce_algorithm(self, nbytes: int) -> str:
        """``auto``'s rule, from the crossovers measured on 2 cores (docs/benchmarks.md):
        with two ranks the direct exchange (1 hop, the same bytes per link as
        star) wins up to ``direct_max_bytes``; with more, its N(N-1) messages
        cost more than star's 2(N-1), and star wins up to ``star_max_bytes``.
        Ring above."""
        algo = self.options.algorithm
        if algo == "auto":
            if self._size == 2:
                algo = "direct" if nbytes <= self.options.direct_max_bytes else "ring"
            else:
                algo = "star" if nbytes <= self.options.star_max_bytes else "ring"
        return algo

    def _allreduce_flat(self, call: alg.Call, flat: torch.Tensor, red: Reduction) -> None:
        """The one allreduce of a flat host tensor every allreduce entry point ends in."""
        if self.checker is not None:
            self.checker.before_allreduce(call, flat, red)
        prepare_(flat, red)
        if call.world > 1:
            algo = self._allreduce_algorithm(flat.numel() * flat.element_size())
            if algo == "direct":
                alg.allreduce_direct(call, flat, red)  # tree order if deterministic
            elif algo == "star":
                alg.allreduce_star(call, flat, red)  # tree order at the root if deterministic
            elif self.options.deterministic:
                alg.allreduce_tree_ring(call, flat, red)
            else:
                alg.allreduce_ring(call, flat, red)
        if self.checker is not None:
            self.checker.after_allreduce(call, flat, red)

    def allreduce(self, *args: Any, **kwargs: Any) -> Any:
        """``(tensors, opts=None)``, ``(tensors, op=SUM, timeout=None)`` or
        ``(tensor, op=SUM, timeout=None)``: torch's three forms (overloads.py)."""
        (tensors,), opts = normalize("allreduce", args, kwargs, self._rank)
        if sparse.is_sparse_call(tensors):  # before the dense-only checks
            return self._allreduce_sparse(tensors, opts)
        return self._allreduce_many("allreduce", tensors, opts)

    def _allreduce_sparse(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """``allreduce([sparse COO])``: checked here, then one job (entrenar_pg.sparse)."""
        where = self._where("allreduce")
        self._validate("allreduce", [])  # a destroyed or broken group refuses first
        t = sparse.the_tensor(where, tensors)
        nbytes = sparse.payload_nbytes(where, t, self._reduction("allreduce", opts, t.dtype))
        job = sparse.SparseAllreduce(t)
        return self._launch(
            OpCode.SPARSE_ALLREDUCE, self._staging(t.device), nbytes, job, [t], opts=opts
        )

    def allreduce_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        """``(tensors, opts=None)``; also ``(tensors, op=SUM, timeout=None)`` (torchft)."""
        (tensors,), opts = normalize("allreduce_coalesced", args, kwargs, self._rank)
        return self._allreduce_many("allreduce_coalesced", tensors, opts)

    def _allreduce_many(self, call_name: str, tensors: list[torch.Tensor], opts: Any) -> Any:
        device = self._validate(call_name, tensors, written=tensors)
        if not tensors:
            raise ValueError(f"{self._where(call_name)}: no tensors given")
        red = self._reduction(call_name, opts, tensors[0].dtype)
        staging = self._staging(device)
        items = staging.add(tensors, read=True, write=True)
        nbytes = 0
        for t in tensors:
            nbytes += t.numel() * t.element_size()

        def body(call: alg.Call) -> None:
            hosts = self._host(items)
            if len(hosts) == 1:
                self._allreduce_flat(call, hosts[0], red)
                return
            total = sum(h.numel() for h in hosts)
            flat = call.scratch.get("coalesced", total, hosts[0].dtype)
            torch.cat(hosts, out=flat)
            self._allreduce_flat(call, flat, red)
            offset = 0
            for h in hosts:
                h.copy_(flat[offset : offset + h.numel()])
                offset += h.numel()

        return self._launch(OpCode.ALLREDUCE, staging, nbytes, body, list(tensors), opts=opts)

    # ------------------------------------------------------------ broadcast

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        """``(tensors, opts=None)`` or ``(tensor, root, timeout=None)``."""
        (tensors,), opts = normalize("broadcast", args, kwargs, self._rank)
        root = opts.rootRank if opts is not None else 0
        is_root = self._rank == root
        device = self._validate(
            "broadcast", tensors, same_dtype=False, written=() if is_root else tensors
        )
        self._check_root("broadcast", root)
        staging = self._staging(device)
        items = staging.add(tensors, read=is_root, write=not is_root)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)

        def body(call: alg.Call) -> None:
            if call.world > 1:
                for h in self._host(items):
                    alg.broadcast(call, h, root)

        return self._launch(OpCode.BROADCAST, staging, nbytes, body, list(tensors), opts=opts)

    def _check_root(self, call: str, root: int) -> None:
        if not 0 <= root < self._size:
            raise ValueError(f"{self._where(call)}: root rank {root} outside [0, {self._size})")

    # ------------------------------------------------------------ allgather

    def allgather(self, *args: Any, **kwargs: Any) -> Any:
        """``(output_tensors, input_tensors, opts=None)`` or
        ``(output_tensors, input_tensor, timeout=None)``."""
        (output_tensors, input_tensors), opts = normalize("allgather", args, kwargs, self._rank)
        where = self._where("allgather")
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise ValueError(f"{where}: expected one input tensor and one output list")
        inp, outs = input_tensors[0], output_tensors[0]
        device = self._validate("allgather", [inp, *outs], written=outs)
        if len(outs) != self._size:
            raise ValueError(
                f"{where}: output list has {len(outs)} tensors, world size is {self._size}"
            )
        for o in outs:
            if o.numel() != inp.numel():
                raise ValueError(
                    f"{where}: output tensor of {o.numel()} elements for an input of {inp.numel()}"
                )
        staging = self._staging(device)
        src = staging.add([inp], read=True, write=False)
        dst = staging.add(outs, read=False, write=True)

        def body(call: alg.Call) -> None:
            chunks = self._host(dst)
            chunks[self._rank].copy_(self._host(src)[0])
            if call.world > 1:
                alg.allgather_ring(call, chunks)

        nbytes = inp.numel() * inp.element_size() * self._size
        return self._launch(OpCode.ALLGATHER, staging, nbytes, body, output_tensors, opts=opts)

    def _allgather_into(
        self, call_name: str, output: torch.Tensor, inp: torch.Tensor, opts: Any
    ) -> Any:
        where = self._where(call_name)
        device = self._validate(call_name, [output, inp], written=[output])
        if output.numel() != inp.numel() * self._size:
            raise ValueError(
                f"{where}: output has {output.numel()} elements, expected "
                f"{self._size} x {inp.numel()}"
            )
        staging = self._staging(device)
        src = staging.add([inp], read=True, write=False)
        dst = staging.add([output], read=False, write=True)
        n = inp.numel()

        def body(call: alg.Call) -> None:
            flat = self._host(dst)[0]
            chunks = [flat[i * n : (i + 1) * n] for i in range(self._size)]
            chunks[self._rank].copy_(self._host(src)[0])
            if call.world > 1:
                alg.allgather_ring(call, chunks)

        nbytes = output.numel() * output.element_size()
        return self._launch(OpCode.ALLGATHER, staging, nbytes, body, [output], opts=opts)

    def all_gather_single(self, *args: Any, **kwargs: Any) -> Any:
        """``(output, input, opts=None)``."""
        (output, inp), opts = normalize("all_gather_single", args, kwargs, self._rank)
        return self._allgather_into("all_gather_single", output, inp, opts)

    def _allgather_base(self, *args: Any, **kwargs: Any) -> Any:
        """``(output, input, opts=None)``."""
        (output, inp), opts = normalize("_allgather_base", args, kwargs, self._rank)
        return self._allgather_into("_allgather_base", output, inp, opts)

    # ------------------------------------------------------------ barrier

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        """``(opts=None)`` or ``(timeout=None)``."""
        _, opts = normalize("barrier", args, kwargs, self._rank)
        self._validate("barrier", [])
        staging = self._staging(torch.device("cpu"))

        def body(call: alg.Call) -> None:
            if call.world > 1:
                alg.barrier(call)

        return self._launch(OpCode.BARRIER, staging, 0, body, [], opts=opts)

    # ------------------------------------------------------------ lifecycle

    def _on_failure(self, error: BaseException) -> None:
        """The group's first failure: stop p2p with it, then tell every peer and close."""
        if isinstance(error, EntrenarError):
            self._p2p.abort(error)
        else:
            self._p2p.close()
        self.mesh.abort(error)

    def _on_p2p_failure(self, error: EntrenarError) -> None:
        """A p2p link failed with work pending: the group breaks as for a collective."""
        if self._engine.fail_from_outside(error, "p2p"):
            self._on_failure(error)

    def shutdown(self) -> None:
        """Release threads and sockets (torch's destroy_process_group calls this)."""
        if self._closed:
            return
        self._closed = True
        self._engine.shutdown()
        self._p2p.close()
        self.mesh.close()

    def _close_at_exit(self) -> None:
        """Interpreter exit with the group still up: drop the links first (that
        wakes a comm thread blocked in poll), then stop the threads, so no
        thread of ours is still inside torch when Python finalizes."""
        if self._closed:
            return
        self._closed = True
        self._p2p.close()
        self.mesh.close(hard=True)
        self._engine.shutdown(timeout_s=2.0)

    def abort(self) -> None:
        """Break the group at once: the running collective fails, queued and later
        ones raise; peers see this rank's abort. ``errored()`` then returns the error."""
        error = EntrenarError(f"rank {self._rank}: the process group was aborted (abort())")
        self._engine.abort(error)  # first, so errored() never misses it
        self._p2p.abort(error)
        self.mesh.abort(error)  # wakes a job blocked on the network
        self._engine.shutdown(timeout_s=1.0)

    # ------------------------------------------------------------ health, timeouts

    def errored(self) -> EntrenarError | None:
        """The group's first failure (an exception object), or None while it is healthy.

        After ``abort()``: an error saying the group was aborted. torchft asks
        its inner group this to decide whether to reconfigure.
        """
        return self._engine.error

    def set_timeout(self, timeout: timedelta) -> None:
        """The no-progress timeout of later collectives and p2p calls (whose opts set none).

        Collectives already issued keep the timeout they were issued with.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else -1.0
        if seconds <= 0:
            raise ValueError(
                f"{self._where('set_timeout')}: the timeout must be a positive timedelta, "
                f"got {timeout!r}"
            )
        self._timeout = timeout
        self._timeout_s = seconds
        self._p2p.timeout_s = seconds

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


_LIVE_GROUPS: weakref.WeakSet[EntrenarProcessGroup] = weakref.WeakSet()
_UNSET = timedelta(0)  # torch's unset per-call timeout is -1 ms; 0 means unset too


def _seconds(timeout: timedelta) -> float:
    return max(timeout.total_seconds(), 0.001)


@atexit.register
def _close_live_groups() -> None:
    for pg in list(_LIVE_GROUPS):
        try:
            pg._close_at_exit()
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

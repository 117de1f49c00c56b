"""The flight recorder: each group's last N collectives and p2p ops, dumped as torch's are.

With ``Options.fr_buffer_size`` > 0 (``TORCH_FR_BUFFER_SIZE``) every group
keeps a ring of its latest calls, one small ``Entry`` each, written where a
call is issued (``Runtime.submit``, ``P2PChannel.send``/``recv``) and updated
where it starts and ends (the engine; the p2p completion). Nothing is built
on the hot path but the entry itself: tensor shapes and dtypes are kept as
torch's own objects, the caller's frames as (code, bytecode offset) pairs, and both are
turned into the dump's lists and dicts only when a dump is written.

A dump is what torch 2.13's flight recorder writes (``_dump_fr_trace``,
version ``2.10``): a pickled dict with ``version``, ``pg_config``,
``pg_status``, ``comm_lib_version`` and ``entries`` (each with ``record_id``,
``pg_id``, ``process_group``, ``collective_seq_id``, ``p2p_seq_id``,
``op_id``, ``profiling_name``, ``time_created_ns``, sizes and dtypes,
``state``, the started/completed times, ``retired``, ``timeout_ms``,
``is_p2p``, ``frames``, ``thread_id``, ``thread_name``), so
``torch.distributed.flight_recorder``'s loader reads it. It says what it is:
operation names are ``entrenar:<op>`` (torch's operation vocabulary:
``entrenar:all_reduce``, ``entrenar:send 0->1``), ``pg_config`` entries carry
``"backend": "entrenar"``, and an ``entrenar`` key adds what torch's format
has no place for: each group's failure (its class, message, culprit rank and
the call it happened in). One file per process, every live group's records,
at ``<prefix><global rank>`` (torch's naming).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import pickle
import sys
import threading
import time
import weakref
from typing import Any, NamedTuple, cast

import torch

from .errors import EntrenarError
from .wire import OpCode

VERSION = "2.10"  # torch 2.13's dump format (its loader and analyzer check "major.minor")
BACKEND = "entrenar"
DISTRIBUTION = "entrenar-pg"  # the installed package's name (pyproject.toml)
# Python frames kept per record, from the caller of the process group's
# method: torch.distributed's function and its logging wrapper, then 4 of
# the user's. torch keeps the whole stack; here each frame costs ~0.35 us
# (Python 3.11 builds a frame object for each one walked).
FRAMES = 6

SCHEDULED = "scheduled"
STARTED = "started"
COMPLETED = "completed"

# torch's operation names (the analyzer's vocabulary, types.COLLECTIVES)
_OP_NAMES = {
    OpCode.ALLREDUCE: "all_reduce",
    OpCode.BROADCAST: "broadcast",
    OpCode.ALLGATHER: "all_gather",
    OpCode.BARRIER: "barrier",
    OpCode.REDUCE: "reduce",
    OpCode.REDUCE_SCATTER: "reduce_scatter",
    OpCode.GATHER: "gather",
    OpCode.SCATTER: "scatter",
    OpCode.ALLTOALL: "all_to_all",
    OpCode.CHECK: "contract_check",  # the contract checker's own exchange
    OpCode.SPARSE_ALLREDUCE: "all_reduce",
}
# Indexed by the opcode's value: a dict keyed by the IntEnum hashes it in
# Python (enum's __hash__), ~0.3 us a call here.
PROFILING_NAMES = [""] * (max(OpCode) + 1)
for _op, _name in _OP_NAMES.items():
    PROFILING_NAMES[_op] = f"{BACKEND}:{_name}"


def p2p_name(is_recv: bool, rank: int, peer: int) -> str:
    """A p2p op's profiling name, as NCCL's: ``entrenar:send 0->1``, ``entrenar:recv 1<-0``."""
    if is_recv:
        return f"{BACKEND}:recv {rank}<-{peer}"
    return f"{BACKEND}:send {rank}->{peer}"


_record_ids = itertools.count()  # process-wide, as torch's (the analyzer aligns ranks on it)
_group_ids = itertools.count()
_recorders: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()


class Issued(NamedTuple):
    """What is known of a call when it is issued (built with one C call: ``tuple.__new__``)."""

    record_id: int
    seq: int  # the collective's seq (a p2p op: the last collective's, as NCCL's)
    p2p_seq: int  # 0 for collectives
    op_id: int
    name: str  # the profiling name: "entrenar:all_reduce", "entrenar:send 0->1"
    time_created_ns: int
    inputs: tuple[tuple[Any, Any], ...]  # (torch.Size, torch.dtype) per tensor
    outputs: tuple[tuple[Any, Any], ...]
    timeout_s: float
    is_p2p: bool
    frames: list[Any]  # [code, bytecode offset, code, offset, ...], innermost first
    thread_id: int


class Entry:
    """One recorded call: what was issued, and how far it got."""

    __slots__ = ("issued", "state", "time_started_ns", "time_completed_ns", "retired")

    def __init__(self, issued: Issued) -> None:
        self.issued = issued
        self.state = SCHEDULED
        self.time_started_ns: int | None = None
        self.time_completed_ns: int | None = None
        self.retired = False

    @property
    def seq(self) -> int:
        return self.issued.seq

    def start(self) -> None:
        self.state = STARTED
        self.time_started_ns = time.time_ns()

    def complete(self) -> None:
        self.state = COMPLETED
        self.time_completed_ns = time.time_ns()
        self.retired = True

    def retire(self) -> None:
        """The call ended without completing (failed, refused): its state stays."""
        self.retired = True


def _shapes(tensors: Any) -> tuple[tuple[Any, Any], ...]:
    if len(tensors) == 1:  # the common case, without a generator
        t = tensors[0]
        return ((t.shape, t.dtype),)
    return tuple([(t.shape, t.dtype) for t in tensors])


def _frames(skip: int) -> list[Any]:
    """The caller's Python frames, ``skip`` levels up, innermost first.

    Each is kept as (code, bytecode offset): ``f_lineno`` would walk the
    code's line table on every call; the dump does it once (``_line``).
    """
    out: list[Any] = []
    try:
        f: Any = sys._getframe(skip + 1)
    except ValueError:
        return out
    n = FRAMES
    while f is not None and n:
        out.append(f.f_code)
        out.append(f.f_lasti)
        f = f.f_back
        n -= 1
    return out


def _line(code: Any, offset: int) -> int | None:
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return cast(int | None, line)
    return None


class FlightRecorder:
    """One group's ring of its latest ``capacity`` calls."""

    def __init__(self, capacity: int, rank: int, world: int, name: str, prefix: str) -> None:
        self.capacity = capacity
        self.prefix = prefix  # dump files: prefix + global rank
        self.pg_id = next(_group_ids)
        self.rank = rank  # in the group
        self.world = world
        self.name = name
        self.desc = "undefined"
        self.global_ranks = list(range(world))
        self.last_seq = 0  # the last collective recorded (p2p entries carry it, as NCCL's)
        self._p2p_seqs = itertools.count(1)
        self._ops = itertools.count(1)
        self._slots = itertools.count()  # this ring's own (record ids are process-wide)
        self._ring: list[Entry | None] = [None] * capacity
        self.failure: dict[str, Any] | None = None  # the group's first failure, once it broke
        self._owner: Any = None  # a weak reference to the process group (its name and desc)
        _recorders.add(self)

    def describe(self, group: Any, global_ranks: list[int]) -> None:
        """Name the group as torch does (its name and description are read at dump time)."""
        self._owner = weakref.ref(group)
        self.global_ranks = list(global_ranks)

    def alive(self) -> bool:
        """False once the process group it records has been collected."""
        return self._owner is None or self._owner() is not None

    @property
    def global_rank(self) -> int:
        return self.global_ranks[self.rank]

    # ------------------------------------------------------------ recording

    def collective(self, seq: int, op: OpCode, io: Any, timeout_s: float) -> Entry:
        """Record collective ``seq`` (issued now; ``io`` is the request's tensor groups)."""
        inputs: tuple[tuple[Any, Any], ...] = ()
        outputs: tuple[tuple[Any, Any], ...] = ()
        if io:
            inputs = _shapes(io[0][0])
            if len(io) == 1:
                outputs = inputs
            else:
                outputs = ()
                for group in io[1:]:
                    outputs += _shapes(group[0])
        # frames: 0 _keep, 1 this method, 2 Runtime.submit, 3 the process group's method
        entry = self._keep(seq, 0, PROFILING_NAMES[op], inputs, outputs, timeout_s, False)
        self.last_seq = seq
        return entry

    def p2p(self, is_recv: bool, peer: int, tensor: torch.Tensor, timeout_s: float) -> Entry:
        """Record a send to / recv from ``peer`` (group ranks), posted and started now."""
        sizes = ((tensor.shape, tensor.dtype),)
        name = p2p_name(is_recv, self.rank, peer)
        # frames: 0 _keep, 1 this method, 2 P2PChannel.send/recv, 3 the process group's method
        entry = self._keep(self.last_seq, next(self._p2p_seqs), name, sizes, sizes, timeout_s, True)
        entry.start()
        return entry

    def _keep(
        self,
        seq: int,
        p2p_seq: int,
        name: str,
        inputs: tuple[tuple[Any, Any], ...],
        outputs: tuple[tuple[Any, Any], ...],
        timeout_s: float,
        is_p2p: bool,
    ) -> Entry:
        """A new entry in the ring's next slot (the oldest goes)."""
        issued = (
            next(_record_ids),
            seq,
            p2p_seq,
            next(self._ops),
            name,
            time.time_ns(),
            inputs,
            outputs,
            timeout_s,
            is_p2p,
            _frames(4),  # from the caller of the process group's method
            threading.get_ident(),
        )
        entry = Entry(tuple.__new__(Issued, issued))
        self._ring[next(self._slots) % self.capacity] = entry
        return entry

    def fail(self, error: EntrenarError, at: str) -> None:
        """The group broke: keep its first failure for the dump."""
        self.failure = {
            "error_class": type(error).__name__,
            "message": str(error),
            "culprit": error.culprit,
            "at": at,
        }

    # ------------------------------------------------------------ dumping

    def entries(self) -> list[Entry]:
        """The ring's entries, oldest first."""
        live = [e for e in list(self._ring) if e is not None]
        live.sort(key=lambda e: e.issued.record_id)
        return live

    def identity(self) -> tuple[str, str]:
        """(name, description) as torch names the group (``process_group`` in entries)."""
        group = self._owner() if self._owner is not None else None
        name = self.name
        desc = self.desc
        if group is not None:
            name = getattr(group, "group_name", "") or name
            desc = getattr(group, "group_desc", "") or desc
        return str(name or self.pg_id), str(desc or "undefined")


def _sizes(pairs: tuple[tuple[Any, Any], ...]) -> tuple[list[list[int]], list[str]]:
    sizes = []
    dtypes = []
    for shape, dtype in pairs:
        sizes.append(list(shape))
        dtypes.append(_dtype_name(dtype))
    return sizes, dtypes


def _dtype_name(dtype: torch.dtype) -> str:
    """torch's dump names (c10's ScalarType names: Float, Half, BFloat16, Long, ...)."""
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def _legacy_names() -> dict[torch.dtype, str]:
    names: dict[torch.dtype, str] = {}
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.complex128,
    ):
        # c10's name, through the legacy tensor type name ("torch.FloatTensor")
        legacy = torch.empty(0, dtype=dtype).type()
        names[dtype] = legacy.removeprefix("torch.").removesuffix("Tensor")
    return names


_DTYPE_NAMES = _legacy_names()


def _frame_dicts(frames: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i in range(0, len(frames), 2):
        code = frames[i]
        line = _line(code, frames[i + 1])
        out.append({"name": code.co_name, "filename": code.co_filename, "line": line})
    return out


def _entry_dict(
    rec: FlightRecorder, pg: tuple[str, str], e: Entry, threads: dict[int, str]
) -> dict[str, Any]:
    i = e.issued
    in_sizes, in_dtypes = _sizes(i.inputs)
    out_sizes, out_dtypes = _sizes(i.outputs)
    return {
        "record_id": i.record_id,
        "pg_id": rec.pg_id,
        "process_group": pg,
        "collective_seq_id": i.seq,
        "p2p_seq_id": i.p2p_seq,
        "op_id": i.op_id,
        "profiling_name": i.name,
        "time_created_ns": i.time_created_ns,
        "input_sizes": in_sizes,
        "input_dtypes": in_dtypes,
        "output_sizes": out_sizes,
        "output_dtypes": out_dtypes,
        "state": e.state,
        "time_discovered_started_ns": e.time_started_ns,
        "time_discovered_completed_ns": e.time_completed_ns,
        "retired": e.retired,
        "timeout_ms": int(i.timeout_s * 1000),
        "is_p2p": i.is_p2p,
        "frames": _frame_dicts(i.frames),
        "thread_id": str(i.thread_id),
        "thread_name": threads.get(i.thread_id, ""),
    }


def trace(recorders: list[FlightRecorder] | None = None) -> dict[str, Any]:
    """The dump of ``recorders`` (default: every live group's in this process), as a dict."""
    # Default: the recorders of groups still alive (a destroyed and collected
    # group's name may already belong to a new group: torch reuses them).
    recs = [r for r in _recorders if r.alive()] if recorders is None else list(recorders)
    recs.sort(key=lambda r: r.pg_id)
    threads = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    entries: list[dict[str, Any]] = []
    pg_config: dict[str, dict[str, Any]] = {}
    pg_status: dict[str, dict[str, int]] = {}
    failures: dict[str, Any] = {}
    global_rank = recs[0].global_rank if recs else 0
    for rec in recs:
        pg = rec.identity()
        mine = rec.entries()
        pg_config[pg[0]] = {
            "name": pg[0],
            "desc": pg[1],
            "ranks": str(rec.global_ranks),
            "backend": BACKEND,
        }
        started = [e.seq for e in mine if not e.issued.is_p2p and e.state != SCHEDULED]
        done = [e.seq for e in mine if not e.issued.is_p2p and e.state == COMPLETED]
        pg_status[str(rec.pg_id)] = {
            "last_enqueued_collective": rec.last_seq,
            "last_started_collective": max(started, default=-1),
            "last_completed_collective": max(done, default=-1),
        }
        if rec.failure is not None:
            failures[pg[0]] = rec.failure
        entries += [_entry_dict(rec, pg, e, threads) for e in mine]
    entries.sort(key=lambda d: d["record_id"])
    return {
        "version": VERSION,
        "comm_lib_version": _comm_lib_version(),
        "pg_config": pg_config,
        "pg_status": pg_status,
        "entries": entries,
        BACKEND: {
            "global_rank": global_rank,
            "pid": os.getpid(),
            "time_dumped_ns": time.time_ns(),
            "failures": failures,
        },
    }


def _comm_lib_version() -> str:
    try:
        return f"{BACKEND} {importlib.metadata.version(DISTRIBUTION)}"
    except importlib.metadata.PackageNotFoundError:
        return BACKEND


def write(recorders: list[FlightRecorder] | None = None, path: str | None = None) -> str:
    """Pickle the dump of ``recorders`` (default: every live group's) to ``path``
    (default: the first group's prefix + this process's global rank); return the path.

    Atomic (a temporary file renamed), so a reader never sees half a dump.
    """
    if recorders is None:
        recorders = [r for r in _recorders if r.alive()]
    recs = sorted(recorders, key=lambda r: r.pg_id)
    if not recs:
        raise ValueError("no flight recorder: set TORCH_FR_BUFFER_SIZE > 0 (or fr_buffer_size)")
    if path is None:
        path = f"{recs[0].prefix}{recs[0].global_rank}"
    data = pickle.dumps(trace(recs))
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path

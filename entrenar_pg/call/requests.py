"""The request kinds: one per collective job, data only.

A request is what the process group's argument checks (``api/checks.py``)
make of one call, and what the runtime (``runtime/runtime.py``), the
request kind's job (``runtime/jobs.py``) and the contract checker read.

Every request starts with the same five fields (``Request`` names them): the opcode,
the device of its tensors, the payload bytes (stats and the inline
decision), what the Work's future completes with, and ``io``: the tensors
to stage, in groups, each read and/or written; the job gets one list of
flat host tensors per group, in that order. The rest is the kind's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from ..reduce_ops import Reduction
from ..wire import OpCode

# A group of a request's tensors and how the job uses them: (tensors, read,
# write). A plain tuple: a NamedTuple's __new__ is a Python call, and the
# allreduce path builds one per call.
Stage = tuple[Sequence[torch.Tensor], bool, bool]


class Request(Protocol):
    """What the runtime reads of every request: the fields each kind starts with.

    Each kind repeats them: a NamedTuple inherits no fields, and the kinds
    stay NamedTuples so the allreduce builder makes its request with
    ``tuple.__new__`` (no Python call on the hot path).
    """

    @property
    def op(self) -> OpCode: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def result(self) -> Any: ...
    @property
    def io(self) -> tuple[Stage, ...]: ...


class Allreduce(NamedTuple):
    """Dense allreduce of ``io[0]`` in place (several tensors: one coalesced pass)."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]
    red: Reduction


class SparseAllreduce(NamedTuple):
    """Allreduce of one sparse COO ``tensor`` (entrenar_pg.sparse); nothing staged."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]
    tensor: torch.Tensor


class Broadcast(NamedTuple):
    """``io[0]``: the tensors, read at the root, written elsewhere; one broadcast each."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]
    root: int


class Allgather(NamedTuple):
    """``io[0]``: the input; ``io[1]``: the N chunks (``split`` None), or one
    output cut into N chunks of ``split`` elements."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]
    split: int | None


class AllgatherPacked(NamedTuple):
    """Coalesced all-gather. ``io[0]``: this rank's pieces. ``sizes`` None:
    ``io[1 + p]`` are rank p's destinations; else ``io[1]`` are outputs, each
    N pieces of ``sizes[j]`` elements."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]
    sizes: list[int] | None


class Barrier(NamedTuple):
    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]


class Reduce(NamedTuple):
    """``io[0]``: the one tensor (written at the root only)."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]
    red: Reduction
    root: int


class Rooted(NamedTuple):
    """Gather (``io[0]`` the input, ``io[1]`` the root's outputs) or scatter
    (``io[0]`` the root's inputs, ``io[1]`` the output), by ``op``."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]
    root: int


class Alltoall(NamedTuple):
    """``io[0]`` inputs, ``io[1]`` outputs: N pieces each (``bounds`` None), or
    one tensor each, cut at ``bounds`` (input bounds, output bounds)."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]
    bounds: tuple[list[tuple[int, int]], list[tuple[int, int]]] | None


class ReduceScatter(NamedTuple):
    """``io[0]`` inputs, ``io[1]`` outputs. ``sizes`` None: the inputs are the
    N pieces of the one output; else each input is N pieces of ``sizes[j]``."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]
    red: Reduction
    sizes: list[int] | None


class Custom(NamedTuple):
    """A job of a hook (the contract checker): ``run(call)`` on CPU data of its own."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]
    run: Callable[[Any], None]


_CPU = torch.device("cpu")


def custom(op: OpCode, run: Callable[[Any], None]) -> Custom:
    """A hook's job of its own (CPU, no payload of the caller's)."""
    return Custom(op, _CPU, 0, [], (), run)

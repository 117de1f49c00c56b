"""The request kinds: one per collective job, data only.

A request is what the process group's argument checks (``api/checks.py``)
make of one call, and what the runtime (``runtime/runtime.py``), the
request kind's job (``runtime/jobs.py``) and the contract checker read.

Every request starts with the same five fields, declared once in the base
``Request`` (each kind is a slotted dataclass adding its own): the opcode,
the device of its tensors, the payload bytes (stats and the inline
decision), what the Work's future completes with, and ``io``: the tensors
to stage, in groups, each read and/or written; the job gets one list of
flat host tensors per group, in that order. The rest is the kind's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..reduce_ops import Reduction
from ..wire import OpCode

# A group of a request's tensors and how the job uses them: (tensors, read,
# write). A plain tuple: the long allreduce path builds one per call.
Stage = tuple[Sequence[torch.Tensor], bool, bool]


@dataclass(slots=True)
class Request:
    """The fields every request kind starts with, declared once; each kind
    adds its own after them (positional order: these five, then the kind's)."""

    op: OpCode
    device: torch.device
    nbytes: int
    result: Any
    io: tuple[Stage, ...]


@dataclass(slots=True)
class Allreduce(Request):
    """Dense allreduce of ``io[0]`` in place (several tensors: one coalesced pass)."""

    red: Reduction


@dataclass(slots=True)
class SparseAllreduce(Request):
    """Allreduce of one sparse COO ``tensor`` (entrenar_pg.sparse); nothing staged."""

    tensor: torch.Tensor


@dataclass(slots=True)
class Broadcast(Request):
    """``io[0]``: the tensors, read at the root, written elsewhere; one broadcast each."""

    root: int


@dataclass(slots=True)
class Allgather(Request):
    """``io[0]``: the input; ``io[1]``: the N chunks (``split`` None), or one
    output cut into N chunks of ``split`` elements."""

    split: int | None


@dataclass(slots=True)
class AllgatherPacked(Request):
    """Coalesced all-gather. ``io[0]``: this rank's pieces. ``sizes`` None:
    ``io[1 + p]`` are rank p's destinations; else ``io[1]`` are outputs, each
    N pieces of ``sizes[j]`` elements."""

    sizes: list[int] | None


@dataclass(slots=True)
class Barrier(Request):
    """A barrier: the five shared fields only (nothing staged, no payload)."""


@dataclass(slots=True)
class Reduce(Request):
    """``io[0]``: the one tensor (written at the root only)."""

    red: Reduction
    root: int


@dataclass(slots=True)
class Rooted(Request):
    """Gather (``io[0]`` the input, ``io[1]`` the root's outputs) or scatter
    (``io[0]`` the root's inputs, ``io[1]`` the output), by ``op``."""

    root: int


@dataclass(slots=True)
class Alltoall(Request):
    """``io[0]`` inputs, ``io[1]`` outputs: N pieces each (``bounds`` None), or
    one tensor each, cut at ``bounds`` (input bounds, output bounds)."""

    bounds: tuple[list[tuple[int, int]], list[tuple[int, int]]] | None


@dataclass(slots=True)
class ReduceScatter(Request):
    """``io[0]`` inputs, ``io[1]`` outputs. ``sizes`` None: the inputs are the
    N pieces of the one output; else each input is N pieces of ``sizes[j]``."""

    red: Reduction
    sizes: list[int] | None


@dataclass(slots=True)
class Custom(Request):
    """A job of a hook (the contract checker): ``run(call)`` on CPU data of its own."""

    run: Callable[[Any], None]


_CPU = torch.device("cpu")


def custom(op: OpCode, run: Callable[[Any], None]) -> Custom:
    """A hook's job of its own (CPU, no payload of the caller's)."""
    return Custom(op, _CPU, 0, [], (), run)

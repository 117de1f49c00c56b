"""What every algorithm shares: the call context, byte views, chunk and segment bounds."""

from __future__ import annotations

import operator
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..transport import Mesh, Plan
from ..transport import bytes_of as bytes_of  # re-exported: the algorithms take it from here
from ..wire import Algo, Header, OpCode
from .policy import Choice


class ScratchPool:
    """Per-group reusable host buffers, so the hot path never allocates.

    Only the thread running the group's collectives touches it.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}
        self._plans: dict[tuple[Any, ...], Any] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` ``dtype`` elements (contents undefined)."""
        key = (name, numel, dtype)
        view = self._views.get(key)
        if view is not None:
            return view  # same request as last time: reuse the view (no tensor ops)
        nbytes = numel * _itemsize(dtype)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 64), dtype=torch.uint8)
            self._buffers[name] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != name}
        view = buf[:nbytes].view(dtype)
        if len(self._views) >= _MAX_CACHED_VIEWS:
            self._views.clear()
        self._views[key] = view
        return view

    def plan(self, key: tuple[Any, ...]) -> Any | None:
        """A plan kept by ``keep_plan`` under ``key``, or None."""
        return self._plans.get(key)

    def keep_plan(self, key: tuple[Any, ...], plan: Any) -> None:
        """Keep a plan (and whatever its views point into) for reuse.

        A plan's views address memory directly, so the key must pin down what
        they cover (the buffer's address and size); scratch tensors the plan
        uses must be kept with it (so the memory stays allocated).
        """
        if len(self._plans) >= _MAX_CACHED_PLANS:
            self._plans.clear()
        self._plans[key] = plan

    def clear(self) -> None:
        self._buffers.clear()
        self._views.clear()
        self._plans.clear()


@dataclass(slots=True)
class Call:
    """One collective as seen by one rank: where it runs and how (the policy's
    ``Choice``), and its job's pace (``transport.loop.Pace``: how long the
    loop spins in this thread, how long nothing may move).

    ``team``: the ranks taking part, in order (None: the whole group). An
    algorithm sees ``rank`` and ``world`` as its position in the team and
    the team's size, and builds its plan with ``plan()``, which maps those
    positions to the group's ranks; so ring, direct and tree code runs on a
    host's ranks or on one rank per host unchanged (collectives/hierarchical.py).
    """

    mesh: Mesh
    seq: int
    choice: Choice
    scratch: ScratchPool
    spin_s: float
    timeout_s: float
    team: tuple[int, ...] | None = None

    @property
    def rank(self) -> int:
        """This rank's position in the team (its rank when the team is the group)."""
        return self.mesh.rank if self.team is None else self.team.index(self.mesh.rank)

    @property
    def world(self) -> int:
        """The team's size."""
        return self.mesh.world if self.team is None else len(self.team)

    def group_rank(self, position: int) -> int:
        """The group's rank at ``position`` in the team (itself when the team is the group)."""
        return position if self.team is None else self.team[position]

    def plan(self) -> Plan:
        """An empty plan whose peers are named by their position in the team."""
        return Plan(self.mesh.rank, members=self.team)

    def on(self, team: tuple[int, ...], segment_bytes: int = 0) -> Call:
        """This call, run by ``team`` (ranks of the group, this one among them);
        ``segment_bytes``: a pipelining segment of its own (0: the choice's)."""
        choice = self.choice
        if segment_bytes:
            choice = choice._replace(segment_bytes=segment_bytes)
        return Call(self.mesh, self.seq, choice, self.scratch, self.spin_s, self.timeout_s, team)

    def header(
        self,
        op: OpCode,
        algo: Algo,
        dtype: torch.dtype | None,
        *,
        reduce_op: int = 0,
        numel: int = 0,
        aux: int = 0,
    ) -> Header:
        return Header(self.seq, op, algo, dtype, reduce_op, numel, aux, self.choice.flags)

    def segment_elems(self, dtype: torch.dtype) -> int:
        return self.choice.segment_elems(dtype)

    def what(self, op: OpCode) -> str:
        return f"{_OP_NAMES[op]}#{self.seq}"


def op_name(op: OpCode) -> str:
    """``allreduce`` for OpCode.ALLREDUCE (from a table: Enum.name is slow on the hot path)."""
    return _OP_NAMES[op]


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


_OP_NAMES = {op: op.name.lower() for op in OpCode}
_MAX_CACHED_VIEWS = 256
_MAX_CACHED_PLANS = 64
# Plans of messages up to this size are cached (above it, building the plan is
# noise next to moving the bytes, and a cached plan would pin scratch memory).
PLAN_CACHE_MAX_BYTES = 1 << 20


def sizes_digest(sizes: Sequence[int]) -> int:
    """A header's summary of piece sizes every rank must agree on (CRC-32: the
    same on every rank and Python version, unlike ``hash``)."""
    return zlib.crc32(struct.pack(f"<{len(sizes)}q", *sizes))


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``[0, numel)`` into ``parts`` near-equal ranges; depends only on the arguments."""
    return [(i * numel // parts, (i + 1) * numel // parts) for i in range(parts)]


def segments(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into pieces of at most ``step`` elements (none if empty)."""
    return [(a, min(a + step, end)) for a in range(start, end, step)]


def is_set(flags: list[bool], idx: int) -> Callable[[], bool]:
    """A send's ``ready``: true once ``flags[idx]`` is (the receive it forwards is done)."""
    return partial(operator.getitem, flags, idx)  # type: ignore[return-value]


def setter(flags: list[bool], idx: int) -> Callable[[], None]:
    """A receive's ``done``: set ``flags[idx]``."""
    return partial(operator.setitem, flags, idx, True)

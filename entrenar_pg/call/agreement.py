"""What every rank of one call must agree on, as a peer is told it (``transport/in_flight.py``).

Only fields the header rule checks anyway (the dtype, an element count
that every rank sends alike, the root, the reduce op), so two ranks whose
texts differ are in a mismatch whatever their plans do; and never a field
that may legally differ between ranks (an all-gather's or all-to-all's
piece sizes, a gather's or scatter's pieces, a sparse tensor's entries, a
PREMUL_SUM factor). The thin path (``runtime/thin.py``) describes its
allreduce through ``allreduce`` too, so a rank on either path says the same.
Computed only when a peer asks: never on a call's own path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..reduce_ops import Kind
from . import requests as rq


def allreduce(dtype: torch.dtype, numel: int, kind: Kind) -> str:
    """An allreduce's terms: ``float32, 4096 elements, sum``."""
    return f"{_dtype(dtype)}, {numel} elements, {kind.name.lower()}"


def agreed(req: rq.Request) -> str | None:
    """What every rank's request of this call must agree on (None: nothing
    to compare: the contract checker's job, a sparse allreduce)."""
    describe = _BY_KIND.get(type(req))
    return None if describe is None else describe(req)


def _dtype(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def _tensors(req: rq.Request) -> list[torch.Tensor]:
    """Every tensor of the request, in its stages' order."""
    return [t for tensors, _, _ in req.io for t in tensors]


def _first_dtype(req: rq.Request) -> str:
    tensors = _tensors(req)
    return _dtype(tensors[0].dtype if tensors else None)


def _allreduce(req: rq.Allreduce) -> str:
    tensors = req.io[0][0]
    return allreduce(tensors[0].dtype, sum(t.numel() for t in tensors), req.red.kind)


def _broadcast(req: rq.Broadcast) -> str:
    # One broadcast per tensor, each with its own dtype and size.
    each = ", ".join(f"{_dtype(t.dtype)} x {t.numel()}" for t in req.io[0][0])
    return f"root {req.root}, [{each}]"


def _reduce(req: rq.Reduce) -> str:
    (t,) = req.io[0][0]
    return f"root {req.root}, {allreduce(t.dtype, t.numel(), req.red.kind)}"


def _reduce_scatter(req: rq.ReduceScatter) -> str:
    # Every rank gives the N chunks alike (their sizes are the header's
    # digest), so the total agrees; each rank's own output need not.
    inputs = req.io[0][0]
    return allreduce(inputs[0].dtype, sum(t.numel() for t in inputs), req.red.kind)


def _rooted(req: rq.Rooted) -> str:
    return f"root {req.root}, {_first_dtype(req)}"  # the pieces: the header's, per link


def _barrier(req: rq.Barrier) -> str:
    return "-"


_BY_KIND: dict[type, Callable[[Any], str]] = {
    rq.Allreduce: _allreduce,
    rq.Broadcast: _broadcast,
    rq.Reduce: _reduce,
    rq.ReduceScatter: _reduce_scatter,
    rq.Rooted: _rooted,
    rq.Allgather: _first_dtype,
    rq.AllgatherPacked: _first_dtype,
    rq.Alltoall: _first_dtype,
    rq.Barrier: _barrier,
}

"""C-DDP-001's question for each group: which parameters must be identical across its ranks?

A plain parameter (DDP) is a replica on every rank of the training loop's
group. A DTensor parameter is a replica along each mesh dimension on which
its placement is ``Replicate``: for HSDP (a replicate x shard mesh, FSDP2
placements ``(Replicate(), Shard(0))``) the ranks of one replicate-dimension
group hold the same shard, so their local shards must agree. Along a
``Shard`` dimension the local tensors differ by design and are not compared.
Agreement along every replicate dimension separately implies agreement of
all ranks holding the same shard (they are connected by moves along those
dimensions).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # types replicated on every rank of the home group
_PLAIN_TYPES = frozenset(_PLAIN)  # (tested in C over a model's parameters, every step)


def by_group(
    params: Iterable[torch.Tensor], home: Any
) -> dict[int, tuple[Any, list[torch.Tensor]]]:
    """``{id(group): (group, tensors)}``: the tensors each group's ranks must hold alike.

    ``home`` is the group of plain parameters (the training loop's group).
    """
    params = list(params)
    if _PLAIN_TYPES.issuperset(map(type, params)):  # DDP: one group, every parameter
        return {id(home): (home, params)} if params else {}
    out: dict[int, tuple[Any, list[torch.Tensor]]] = {}

    def add(group: Any, t: torch.Tensor) -> None:
        out.setdefault(id(group), (group, []))[1].append(t)

    dtensor: Any = None
    replicate: Any = None
    for p in params:
        if type(p) is torch.Tensor or type(p) is torch.nn.Parameter:
            add(home, p)
            continue
        if dtensor is None:
            from torch.distributed.tensor import DTensor, Replicate

            dtensor, replicate = DTensor, Replicate
        if not isinstance(p, dtensor):
            add(home, p)
            continue
        local = p.to_local()
        mesh = p.device_mesh
        for dim, placement in enumerate(p.placements):
            if isinstance(placement, replicate):
                add(mesh.get_group(dim) if mesh.ndim > 1 else mesh.get_group(), local)
    return out

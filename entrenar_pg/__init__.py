"""entrenar: a torch.distributed process-group backend over TCP, in Python.

``import entrenar_pg`` (or just importing torch, through the ``torch.backends``
entry point) registers the backend, after which
``torch.distributed.init_process_group("entrenar")`` works unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from ._plugin import BACKEND_NAME, register
from .api.process_group import EntrenarProcessGroup
from .checker import ContractChecker
from .config import Options
from .errors import CollectiveMismatchError, ContractViolation, EntrenarError, PeerConnectionError
from .reduce_ops import tree_sum

__all__ = [
    "BACKEND_NAME",
    "CollectiveMismatchError",
    "ContractChecker",
    "ContractViolation",
    "EntrenarError",
    "EntrenarProcessGroup",
    "Options",
    "PeerConnectionError",
    "get_stats",
    "register",
    "tree_sum",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def get_stats(group: Any = None) -> dict[str, float]:
    """Communication counters of an entrenar group ({} for a group of another backend)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg.stats() if isinstance(pg, EntrenarProcessGroup) else {}


register()

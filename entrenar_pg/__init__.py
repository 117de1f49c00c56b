"""entrenar: a torch.distributed process-group backend over TCP, in Python.

``import entrenar_pg`` (or just importing torch, through the ``torch.backends``
entry point) registers the backend, after which
``torch.distributed.init_process_group("entrenar")`` works unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from . import flight_recorder
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
    "dump_flight_recorder",
    "get_stats",
    "register",
    "tree_sum",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def get_stats(group: Any = None) -> dict[str, float]:
    """Communication counters of an entrenar group ({} for a group of another backend)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg.stats() if isinstance(pg, EntrenarProcessGroup) else {}


def dump_flight_recorder(group: Any = None, path: str | None = None) -> str:
    """Write this process's flight-recorder dump now; return the file's path.

    ``group``: one entrenar group's records (default: every entrenar group in
    this process, as torch's one dump per process). ``path``: default the
    dump prefix (``TORCH_FR_DUMP_TEMP_FILE``, else torch's default) + this
    process's global rank. The groups must record (``TORCH_FR_BUFFER_SIZE`` > 0).
    """
    recorders = None
    if group is not None:
        recorder = getattr(getattr(group, "_runtime", None), "recorder", None)
        if recorder is None:
            raise ValueError(
                f"dump_flight_recorder: {group!r} keeps no flight recorder "
                "(not an entrenar group, or TORCH_FR_BUFFER_SIZE is 0)"
            )
        recorders = [recorder]
    return flight_recorder.write(recorders, path)


register()

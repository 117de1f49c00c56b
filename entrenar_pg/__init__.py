"""entrenar: a torch.distributed process-group backend over TCP, in Python.

``import entrenar_pg`` (or just importing torch, through the ``torch.backends``
entry point) registers the backend, after which
``torch.distributed.init_process_group("entrenar")`` works unchanged.

torch runs this file while ``import torch`` runs (the entry point lives in
``_plugin``), so it imports only ``_plugin`` and the standard library, and
loads its public names on first use (PEP 562): a broken install then breaks
backend "entrenar" with a clear error, never ``import torch``.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from ._plugin import BACKEND_NAME, BackendUnavailableError, register

if TYPE_CHECKING:
    from . import flight_recorder as flight_recorder
    from .api.process_group import EntrenarProcessGroup
    from .checker import ContractChecker
    from .config import Options
    from .errors import (
        CollectiveMismatchError,
        ContractViolation,
        EntrenarError,
        GroupDestroyedError,
        OptionsMismatchError,
        PeerConnectionError,
    )
    from .reduce_ops import tree_sum

# Each public name and the module (relative to this package) that defines it.
_PUBLIC = {
    "CollectiveMismatchError": ".errors",
    "ContractChecker": ".checker",
    "ContractViolation": ".errors",
    "EntrenarError": ".errors",
    "EntrenarProcessGroup": ".api.process_group",
    "GroupDestroyedError": ".errors",
    "Options": ".config",
    "OptionsMismatchError": ".errors",
    "PeerConnectionError": ".errors",
    "flight_recorder": ".flight_recorder",
    "tree_sum": ".reduce_ops",
}

__all__ = [
    "BACKEND_NAME",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "ContractChecker",
    "ContractViolation",
    "EntrenarError",
    "EntrenarProcessGroup",
    "GroupDestroyedError",
    "Options",
    "OptionsMismatchError",
    "PeerConnectionError",
    "dump_flight_recorder",
    "get_stats",
    "register",
    "tree_sum",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    """Load a public name on first use (then it is a plain attribute)."""
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(where, __name__)
    value = module if where == f".{name}" else getattr(module, name)
    globals()[name] = value
    return value


def get_stats(group: Any = None) -> dict[str, float]:
    """Communication counters of an entrenar group ({} for a group of another backend)."""
    import torch.distributed as dist

    from .api.process_group import EntrenarProcessGroup

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg.stats() if isinstance(pg, EntrenarProcessGroup) else {}


def dump_flight_recorder(group: Any = None, path: str | None = None) -> str:
    """Write this process's flight-recorder dump now; return the file's path.

    ``group``: one entrenar group's records (default: every entrenar group in
    this process, as torch's one dump per process). ``path``: default the
    dump prefix (``TORCH_FR_DUMP_TEMP_FILE``, else torch's default) + this
    process's global rank. The groups must record (``TORCH_FR_BUFFER_SIZE`` > 0).
    """
    from . import flight_recorder as flight_recorder

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

"""Backend registration: the only code of ours that runs while ``import torch`` runs.

torch calls the ``torch.backends`` entry point (:func:`entry_point`) near the
end of ``import torch`` and turns any exception from loading or calling it
into a failed ``import torch``, for every program in the environment, whether
it asked for entrenar or not. Loading this module runs the package's
``__init__`` first, so both files import nothing of ours but each other and
nothing outside the standard library at top level (``__init__`` loads its
public names on first use; ``tests/test_wheel.py`` checks both). The backend
itself is imported when torch first asks for a group: if that import fails
(a broken or incomplete install), torch still works and the group request
raises :class:`BackendUnavailableError`, saying what failed, where, and how
to repair it. If ``import torch`` was started by ``import entrenar_pg``, the
package is only half-initialised when torch calls us: one more reason to
import nothing here.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

BACKEND_NAME = "entrenar"
DEVICES = ["cpu", "cuda"]


class BackendUnavailableError(ImportError):
    """Backend "entrenar" was asked for, but the entrenar_pg package does not import."""


def repair_hint(error: BaseException) -> str:
    """The message for a group asked of a package that failed to import with ``error``."""
    where = os.path.dirname(os.path.abspath(__file__))
    return (
        f'backend "{BACKEND_NAME}" is unavailable: the entrenar_pg package failed to import '
        f"({type(error).__name__}: {error}). The entrenar-pg install in {where} is broken "
        "or incomplete. Reinstall it, keeping your torch: "
        "pip install --force-reinstall --no-deps entrenar-pg (from a checkout: "
        "pip install --no-deps -e .); then "
        'python -c "from entrenar_pg import EntrenarProcessGroup" must succeed. '
        "The original error and its traceback are this error's cause."
    )


def create_process_group(dist_opts: Any, backend_options: Any = None) -> Any:
    """torch's creator for backend "entrenar": the backend, imported on first use."""
    try:
        from .api.process_group import create_process_group as create
    except Exception as e:  # a broken install: say so here, not in `import torch`
        raise BackendUnavailableError(repair_hint(e)) from e
    return create(dist_opts, backend_options)


def register() -> None:
    """Register the ``entrenar`` backend with torch.distributed (idempotent)."""
    import torch.distributed as dist

    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, create_process_group, extended_api=True, devices=DEVICES
    )


def entry_point() -> None:
    """Called by torch when it is imported (group ``torch.backends``); never raises,
    since torch's own import depends on it."""
    try:
        register()
    except Exception as e:
        warnings.warn(
            f'entrenar_pg: could not register backend "{BACKEND_NAME}" with '
            f"torch.distributed ({type(e).__name__}: {e}); "
            f'init_process_group("{BACKEND_NAME}") will not find it.',
            RuntimeWarning,
            stacklevel=2,
        )

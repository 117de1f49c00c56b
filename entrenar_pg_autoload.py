"""torch's entry point for entrenar-pg (group ``torch.backends``), outside the package.

torch calls :func:`entry_point` near the end of ``import torch``
(``torch._import_device_backends``) and turns any exception from loading or
calling it into a failed ``import torch``, for every program in the
environment, whether it asked for entrenar or not. Loading a module inside
``entrenar_pg`` would first run the package's ``__init__`` (the backend, the
checker, everything), outside any ``try`` of ours, so the entry point lives in
this top-level module, imports only the standard library at top level, and
imports the package inside a ``try``.

When that import fails (a broken or incomplete install), torch still imports,
the failure is kept in :data:`load_error`, and backend "entrenar" is
registered with :class:`UnavailableBackend`, which raises
:class:`BackendUnavailableError` (what failed, where, how to repair it, and the
original exception as its cause) when a group is asked for.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

# The package may not import, so these repeat entrenar_pg._plugin's values
# (tests/test_wheel.py checks that they agree).
BACKEND_NAME = "entrenar"
DEVICES = ["cpu", "cuda"]

# Why the package failed to import when torch loaded it; None when it loaded.
load_error: Exception | None = None


class BackendUnavailableError(ImportError):
    """Backend "entrenar" was asked for, but the entrenar_pg package does not import."""


def repair_hint(error: BaseException) -> str:
    """The message for a group asked of a package that failed to import with ``error``."""
    where = os.path.dirname(os.path.abspath(__file__))
    return (
        f'backend "{BACKEND_NAME}" is unavailable: the entrenar_pg package failed to import '
        f"when torch loaded it ({type(error).__name__}: {error}). The entrenar-pg install "
        f"in {where} is broken or incomplete. Reinstall it, keeping your torch: "
        "pip install --force-reinstall --no-deps entrenar-pg (from a checkout: "
        'pip install --no-deps -e .); then python -c "import entrenar_pg" must succeed. '
        "The original error and its traceback are this error's cause."
    )


@dataclass(frozen=True, eq=False)
class UnavailableBackend:
    """The creator registered in the package's place when it fails to import."""

    error: Exception

    def __call__(self, dist_opts: Any, backend_options: Any = None) -> Any:
        raise BackendUnavailableError(repair_hint(self.error)) from self.error


def entry_point() -> None:
    """Register backend "entrenar"; never raises (torch's own import depends on it)."""
    global load_error
    try:
        from entrenar_pg import _plugin

        _plugin.register()
        load_error = None
        return
    except Exception as e:  # anything: a failure here would fail `import torch`
        load_error = e
    try:
        import torch.distributed as dist

        dist.Backend.register_backend(
            BACKEND_NAME, UnavailableBackend(load_error), extended_api=True, devices=DEVICES
        )
    except Exception as e:
        # torch.distributed itself cannot take a backend: say so once, here,
        # since init_process_group("entrenar") can only answer "invalid backend".
        warnings.warn(
            f"{repair_hint(load_error)} Registering the placeholder backend failed too: "
            f"{type(e).__name__}: {e}",
            RuntimeWarning,
            stacklevel=2,
        )

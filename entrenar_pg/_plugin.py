"""Backend registration, importable while torch itself is still importing.

torch calls the ``torch.backends`` entry point (``entrenar_pg_autoload``, a
top-level module beside this package, which calls :func:`register`) at the
end of ``import torch``. If that import was started by ``import entrenar_pg``,
the package is only half-initialised at that moment, so this module imports
nothing of ours at top level and the creator imports the backend when torch
first asks for a group.
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "entrenar"
DEVICES = ["cpu", "cuda"]  # entrenar_pg_autoload repeats both (it must load without us)


def create_process_group(dist_opts: Any, backend_options: Any = None) -> Any:
    from .api.process_group import create_process_group as create

    return create(dist_opts, backend_options)


def register() -> None:
    """Register the ``entrenar`` backend with torch.distributed (idempotent).

    Replaces any other creator under the name: the entry point's placeholder
    (``entrenar_pg_autoload.UnavailableBackend``, left when the package did not
    import while torch loaded it) gives way once the package does import.
    """
    import torch.distributed as dist

    plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())
    if plugin is not None and plugin.creator_fn is create_process_group:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, create_process_group, extended_api=True, devices=DEVICES
    )


def entry_point() -> None:
    """The entry point of installs made before ``entrenar_pg_autoload`` (their metadata
    names this function until they are reinstalled); new installs call ``register``
    through ``entrenar_pg_autoload.entry_point``, which survives a broken package."""
    register()

"""Backend registration, importable while torch itself is still importing.

torch calls the ``torch.backends`` entry point (``entry_point`` below) at the
end of ``import torch``. If that import was started by ``import entrenar_pg``,
the package is only half-initialised at that moment, so this module imports
nothing of ours at top level and the creator imports the backend when torch
first asks for a group.
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "entrenar"


def create_process_group(dist_opts: Any, backend_options: Any = None) -> Any:
    from .api.process_group import create_process_group as create

    return create(dist_opts, backend_options)


def register() -> None:
    """Register the ``entrenar`` backend with torch.distributed (idempotent)."""
    import torch.distributed as dist

    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu", "cuda"]
    )


def entry_point() -> None:
    """Called by torch when it is imported (entry point group ``torch.backends``)."""
    register()

"""The optimizer step hooks: what runs before and after every optimizer step in this process.

Unmodified DDP and FSDP scripts never call us at a step boundary, so the
per-step work (the contract checker's C-DDP-001, the run ledger's line) hangs
off torch's *global* optimizer hooks. There is one post-hook for the whole
library, registered once, so the order is fixed: the checker first (its
verdict for this step is then known where a ledger asks for it), the ledger
second (it records it). The pre-hook is the checker's alone: it judges the
previous step's batch, which waits for it (checker/checker.py).

Only the default group is consulted: a step belongs to a training loop, and a
program's training loop runs on its default group. Optimizers registered with
``watch`` (a checker or ledger on another group) have their own hooks and are
skipped here.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch.distributed as dist

_watched: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers with their own hook
_lock = threading.Lock()
_handles: Any = None  # (pre-hook, post-hook)


def watched(optimizer: Any) -> None:
    """``optimizer`` has its own post-hook (``ContractChecker.watch``): skip it here."""
    _watched.add(optimizer)


def install() -> None:
    """Register the global hook (once per process; idempotent)."""
    global _handles
    with _lock:
        if _handles is None:
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )

            _handles = (
                register_optimizer_step_pre_hook(_before_step),
                register_optimizer_step_post_hook(_after_step),
            )


def _default_group(optimizer: Any) -> Any:
    """The default group when ``optimizer``'s steps are ours to hook, else None."""
    if optimizer in _watched or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError):
        return None


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    # The checker judges the previous step's batch here, before this step
    # updates anything (its exchange left the previous step's end).
    checker = getattr(_default_group(optimizer), "checker", None)
    if checker is not None:
        checker.before_optimizer_step(optimizer)


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    pg = _default_group(optimizer)
    if pg is None:
        return
    for listener in (getattr(pg, "checker", None), getattr(pg, "ledger", None)):
        if listener is not None:
            listener.after_optimizer_step(optimizer)

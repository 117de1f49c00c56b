"""The error hierarchy. Every message names this rank, and the peer and call involved."""

from __future__ import annotations


class EntrenarError(RuntimeError):
    """Base of every error entrenar raises for a failed collective."""


class PeerConnectionError(EntrenarError):
    """A peer died, a link broke or a wait timed out: the group is unusable, recreate it."""


class CollectiveMismatchError(EntrenarError):
    """Two ranks issued different collectives (op, dtype, size, algorithm or order)."""


class ContractViolation(EntrenarError):
    """A contract (C-RING-001, C-DDP-001, F-DP-003) failed on some rank."""


# Errors that may cross the wire (through the store's abort record) by name.
ERROR_TYPES: dict[str, type[EntrenarError]] = {
    cls.__name__: cls
    for cls in (EntrenarError, PeerConnectionError, CollectiveMismatchError, ContractViolation)
}

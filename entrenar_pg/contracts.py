"""The contract checker's public names, where they were before the ``checker`` package."""

from __future__ import annotations

from .checker import HASH_NAME, ContractChecker, digest, tensor_bytes

__all__ = ["HASH_NAME", "ContractChecker", "digest", "tensor_bytes"]

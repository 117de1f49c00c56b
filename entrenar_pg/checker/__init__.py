"""The contract checker (``ENTRENAR_CHECK=1``): proves, as it runs, that every collective was right.

- ``kinds``: what each collective promises (a ``Contract`` per opcode) and
  each request kind's slots (its inputs and outputs as the contract sees them);
- ``projection``, ``hashing``: the measurements (random projections, XXH3-64);
- ``records``: one rank's measurements of one call, as int64s;
- ``verdict``: the judgement of a call from every rank's record;
- ``replicas``: which parameters must agree across which group (C-DDP-001);
- ``checker``: ``ContractChecker``, the runtime's hooks, batching and steps.

docs/contracts.md describes every contract, what it can miss and what it costs.
"""

from __future__ import annotations

from .checker import FLUSH_EVERY, ContractChecker
from .hashing import HASH_NAME, digest, tensor_bytes
from .kinds import CONTRACTS, NONFINITE_ID, PARAMETERS_ID, Contract, Rule

__all__ = [
    "CONTRACTS",
    "FLUSH_EVERY",
    "HASH_NAME",
    "NONFINITE_ID",
    "PARAMETERS_ID",
    "Contract",
    "ContractChecker",
    "Rule",
    "digest",
    "tensor_bytes",
]

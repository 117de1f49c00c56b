"""What each collective promises: one ``Contract`` per opcode, one view function per request kind.

A collective either *reduces* (its outputs are the op over the ranks' inputs:
allreduce, reduce_scatter, reduce) or *copies* (its outputs are the ranks'
inputs, moved: all_gather, broadcast, gather, scatter, all_to_all). Either
way a call is described by **slots**: ``inputs[s]`` is what this rank puts
into slot s, ``outputs[s]`` what it holds of slot s afterwards (each a list
of tensors, taken as their concatenation).

- Reducing (``Rule.REDUCED``): slot s of the output is the op over every
  rank's ``inputs[s]``; ``replicated``: every rank holds the whole output
  (allreduce), else only the slot's owner does (reduce_scatter: rank s;
  reduce: the root).
- Copying (``Rule.COPIED``): a rank's ``outputs[p]`` is rank p's
  ``inputs[key]``, where ``key`` is the receiver's rank (``keyed``: scatter,
  all_to_all: rank p sends each rank a different piece) or 0 (the same piece
  to every receiver: all_gather, broadcast, gather).

The checker (checker/checker.py) measures the slots before and after every
job and judges the measurements by these rules (checker/verdict.py), so a
new collective needs a ``Contract`` and a view function, no checking code.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..call import requests as rq
from ..reduce_ops import Reduction
from ..runtime import jobs
from ..wire import OpCode

Slots = dict[int, Sequence[torch.Tensor]]


class Rule(enum.Enum):
    REDUCED = 1  # output slot s = op over every rank's input slot s
    COPIED = 2  # output slot p = rank p's input slot (key)
    FLUSH = 3  # no data to check; a point where every rank judges what is pending


@dataclass(frozen=True, slots=True)
class Contract:
    """One collective's promise, as data: its id, the rule, and the rule's variant."""

    id: str
    rule: Rule
    replicated: bool = False  # REDUCED: every rank holds every slot's output
    scattered: bool = False  # REDUCED: one input slot per rank (slot s is rank s's output)
    keyed: bool = False  # COPIED: sender p's slot for receiver q is its input slot q

    def slots(self, world: int) -> int:
        """How many slots a record describes (the same on every rank)."""
        if self.rule is Rule.COPIED or self.scattered:
            return world
        return 1 if self.rule is Rule.REDUCED else 0


CONTRACTS: dict[OpCode, Contract] = {
    OpCode.ALLREDUCE: Contract("C-RING-001", Rule.REDUCED, replicated=True),
    OpCode.REDUCE_SCATTER: Contract("C-RS-001", Rule.REDUCED, scattered=True),
    OpCode.REDUCE: Contract("C-RED-001", Rule.REDUCED),
    OpCode.ALLGATHER: Contract("C-AG-001", Rule.COPIED),
    OpCode.BROADCAST: Contract("C-BC-001", Rule.COPIED),
    OpCode.GATHER: Contract("C-GA-001", Rule.COPIED),
    OpCode.SCATTER: Contract("C-SC-001", Rule.COPIED, keyed=True),
    OpCode.ALLTOALL: Contract("C-A2A-001", Rule.COPIED, keyed=True),
    OpCode.BARRIER: Contract("", Rule.FLUSH),
}
NONFINITE_ID = "F-DP-003"  # every reducing collective's inputs are finite
PARAMETERS_ID = "C-DDP-001"  # replicas hold the same parameters after each step


@dataclass(frozen=True, slots=True)
class Views:
    """One call's slots on this rank (views of the job's staged host tensors)."""

    inputs: Slots
    outputs: Slots
    red: Reduction | None = None


Hosts = list[list[torch.Tensor]]
ViewFn = Callable[[Any, Hosts, int, int], Views]


def _allreduce(req: rq.Allreduce, hosts: Hosts, rank: int, world: int) -> Views:
    return Views({0: hosts[0]}, {0: hosts[0]}, req.red)


def _reduce_scatter(req: rq.ReduceScatter, hosts: Hosts, rank: int, world: int) -> Views:
    inputs, outs = hosts
    pieces = jobs.reduce_scatter_pieces(req, inputs, world)
    return Views(dict(enumerate(pieces)), {rank: outs}, req.red)


def _reduce(req: rq.Reduce, hosts: Hosts, rank: int, world: int) -> Views:
    return Views({0: hosts[0]}, {0: hosts[0]} if rank == req.root else {}, req.red)


def _broadcast(req: rq.Broadcast, hosts: Hosts, rank: int, world: int) -> Views:
    return Views({0: hosts[0]} if rank == req.root else {}, {req.root: hosts[0]})


def _allgather(req: rq.Allgather, hosts: Hosts, rank: int, world: int) -> Views:
    chunks = jobs.allgather_chunks(req, hosts[1], world)
    return Views({0: hosts[0]}, {p: [c] for p, c in enumerate(chunks)})


def _allgather_packed(req: rq.AllgatherPacked, hosts: Hosts, rank: int, world: int) -> Views:
    return Views({0: hosts[0]}, dict(enumerate(jobs.allgather_dests(req, hosts, world))))


def _rooted(req: rq.Rooted, hosts: Hosts, rank: int, world: int) -> Views:
    is_root = rank == req.root
    if req.op is OpCode.GATHER:
        (inp,), outs = hosts
        return Views({0: [inp]}, {p: [o] for p, o in enumerate(outs)} if is_root else {})
    ins, (out,) = hosts
    return Views({q: [t] for q, t in enumerate(ins)} if is_root else {}, {req.root: [out]})


def _alltoall(req: rq.Alltoall, hosts: Hosts, rank: int, world: int) -> Views:
    ins, outs = jobs.alltoall_pieces(req, hosts[0], hosts[1])
    return Views({q: [t] for q, t in enumerate(ins)}, {p: [t] for p, t in enumerate(outs)})


def _no_data(req: Any, hosts: Hosts, rank: int, world: int) -> Views:
    return Views({}, {})


VIEWS: dict[type, ViewFn] = {
    rq.Allreduce: _allreduce,
    rq.ReduceScatter: _reduce_scatter,
    rq.Reduce: _reduce,
    rq.Broadcast: _broadcast,
    rq.Allgather: _allgather,
    rq.AllgatherPacked: _allgather_packed,
    rq.Rooted: _rooted,
    rq.Alltoall: _alltoall,
    rq.Barrier: _no_data,
}
"""Request kinds the checker sees; the others (the sparse allreduce, the
checker's own jobs) carry no contract."""

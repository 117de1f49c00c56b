"""Collective algorithms. Each builds a transport ``Plan`` and runs it; none touches a socket."""

from .broadcast import broadcast
from .common import Call, ScratchPool, bytes_of, chunk_bounds, segments
from .deterministic import allreduce_tree_ring, reduce_scatter_tree
from .ring import allgather_ring, allreduce_ring, reduce_scatter_ring, ring_pass
from .star import allreduce_star, barrier

__all__ = [
    "Call",
    "ScratchPool",
    "allgather_ring",
    "allreduce_ring",
    "allreduce_star",
    "allreduce_tree_ring",
    "barrier",
    "broadcast",
    "bytes_of",
    "chunk_bounds",
    "reduce_scatter_ring",
    "reduce_scatter_tree",
    "ring_pass",
    "segments",
]

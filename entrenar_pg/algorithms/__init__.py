"""Collective algorithms. Each builds a transport ``Plan`` and runs it; none touches a socket."""

from .broadcast import broadcast
from .common import Call, ScratchPool, bytes_of, chunk_bounds, segments
from .ring import allgather_ring, allreduce_ring, reduce_scatter_ring, ring_pass
from .star import allreduce_star, barrier

__all__ = [
    "Call",
    "ScratchPool",
    "allgather_ring",
    "allreduce_ring",
    "allreduce_star",
    "barrier",
    "broadcast",
    "bytes_of",
    "chunk_bounds",
    "reduce_scatter_ring",
    "ring_pass",
    "segments",
]

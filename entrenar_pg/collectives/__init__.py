"""Collective algorithms (pure plan builders) and the policy that picks them.

Each algorithm builds a transport ``Plan`` and runs it; none touches a socket
or reads the Options: ``policy.choose`` decides, the ``Choice`` travels on the ``Call``.
"""

from .alltoall import alltoall
from .broadcast import broadcast
from .common import Call, ScratchPool, bytes_of, chunk_bounds, op_name, segments, sizes_digest
from .direct import allreduce_direct
from .dissemination import barrier
from .doubling import allreduce_doubling
from .hierarchical import (
    allgather_hosts,
    allreduce_host_leaders,
    allreduce_host_slices,
    reduce_scatter_hosts,
)
from .policy import Choice, choose
from .ring import allgather_ring, allreduce_ring, reduce_scatter_ring, ring_pass
from .rooted import gather, reduce, reduce_star, scatter
from .shm_allreduce import allreduce_shm
from .star import allreduce_star
from .tree import allreduce_tree_ring, reduce_scatter_tree

__all__ = [
    "Call",
    "Choice",
    "ScratchPool",
    "allgather_hosts",
    "allgather_ring",
    "allreduce_direct",
    "allreduce_doubling",
    "allreduce_host_leaders",
    "allreduce_host_slices",
    "allreduce_ring",
    "allreduce_shm",
    "allreduce_star",
    "allreduce_tree_ring",
    "alltoall",
    "barrier",
    "broadcast",
    "bytes_of",
    "choose",
    "chunk_bounds",
    "gather",
    "op_name",
    "reduce",
    "reduce_scatter_hosts",
    "reduce_scatter_ring",
    "reduce_scatter_tree",
    "reduce_star",
    "ring_pass",
    "scatter",
    "segments",
    "sizes_digest",
]

"""Transports: how one rank's bytes reach its peers (see docs/architecture.md).

``plan.py`` (what a collective sends and receives), ``loop.py`` (the one
progress loop), ``control.py`` (the control channel: the abort protocol and
the naming of causes), ``rendezvous.py`` (set-up), ``acceptor.py``
(authenticating incoming connections), ``shm/`` (shared memory between ranks
of one host) and ``mesh.py`` (a group's links, put together).
"""

from .mesh import Mesh
from .plan import Plan, Recv, Send, bytes_of

__all__ = ["Mesh", "Plan", "Recv", "Send", "bytes_of"]

"""Transports: how one rank's bytes reach its peers (see docs/architecture.md).

``plan.py`` (what a collective sends and receives), ``loop.py`` (the one
progress loop), ``abort.py`` (the abort protocol and the naming of causes),
``rendezvous.py`` (set-up and authentication) and ``tcp.py`` (the TCP mesh
that puts them together).
"""

from .plan import Plan, Recv, Send, bytes_of
from .tcp import Mesh

__all__ = ["Mesh", "Plan", "Recv", "Send", "bytes_of"]

"""Point-to-point messages: send / recv / recv_anysource, matched by peer and tag.

``matching``: which recv a message is for (sans-IO, tested on its own);
``channel``: the thread that moves the messages over the mesh's p2p sockets;
``link``: one peer's streams and the messages framed on them; ``ops``: a
send or recv from its staging to its completion; ``connections``: the
links' connections, made on first use; ``inbox``: where arriving payloads
go (the matching's decisions carried out).
"""

from .channel import P2PChannel
from .matching import ANY_SOURCE, Matching

__all__ = ["ANY_SOURCE", "Matching", "P2PChannel"]

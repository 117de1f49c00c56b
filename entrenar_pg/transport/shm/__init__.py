"""Shared memory between the ranks of one host.

``ring.py``: a pair's byte rings (``ShmLink``), driven by the progress loop
like a socket; ``slots.py``: the slot areas of the shm-native allreduce;
``fence.py``: the barrier both use; ``placement.py``: a slot wait's move of
its rank off a core its peer runs on; ``setup.py``: finds the local peers,
maps their memory and builds both (the only module that knows both).
"""

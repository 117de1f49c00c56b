"""The frame header: every collective opens each link it uses with one.

A collective's traffic on a link (one direction between two ranks) is one
frame: a 32-byte struct-packed header, then a payload whose length both sides
derive from the header's fields. The payload moves in segments for pipelining,
but segments carry no header of their own: a receiver checks the header once,
at the start, and a peer whose header disagrees is a desynchronised program.

Layout (little-endian, 32 bytes)::

    magic u16 | version u8 | opcode u8 | algo u8 | dtype u8 | reduce_op u8 | flags u8
    seq u64 | numel u64 | aux i64

Both ends of a link send the same header and compare byte for byte, so a
header describes the link as both ends see it: ``numel`` is the collective's
element count (a gather or scatter piece's), ``aux`` the root of rooted
collectives (a digest of the chunk sizes for reduce-scatter); an all-to-all
link carries ``numel`` elements from the lower rank to the higher and ``aux``
back. Header-only frames (``Plan.confirm_peers``) and
acknowledgements (``Plan.acknowledge``) are this same header.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import torch

MAGIC = 0xE7A1
VERSION = 2  # 2: link-symmetric all-to-all sizes; confirmations and acknowledgements
_HEADER = struct.Struct("<HBBBBBBQQq")
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 32
_SEQ = struct.Struct("<Q")
_SEQ_OFFSET = struct.calcsize("<HBBBBBB")  # after magic, version and the six one-byte fields


def stamp_seq(packed: bytearray, seq: int) -> None:
    """Rewrite only the sequence number of a packed header (a cached plan's next call)."""
    _SEQ.pack_into(packed, _SEQ_OFFSET, seq)


class OpCode(enum.IntEnum):
    """The collective a frame belongs to."""

    ALLREDUCE = 1
    BROADCAST = 2
    ALLGATHER = 3
    BARRIER = 4
    REDUCE = 5
    REDUCE_SCATTER = 6
    GATHER = 7
    SCATTER = 8
    ALLTOALL = 9
    SEND = 10  # a point-to-point message on a group's p2p channel (see p2p_header)
    CHECK = 11  # contract-checker traffic
    SPARSE_ALLREDUCE = 12  # allreduce of sparse COO tensors (entrenar_pg/sparse.py)


class Algo(enum.IntEnum):
    """The algorithm both ends must be running."""

    NONE = 0
    RING = 1
    STAR = 2
    DIRECT = 3  # every rank talks to every rank (alltoall, direct-exchange reduce-scatter)
    CHAIN = 4  # pipelined chain (large broadcast)
    TREE_RING = 5  # deterministic allreduce: direct-exchange reduce-scatter + ring all-gather
    SHM = 6  # allreduce through the slot areas of ranks all on one host (transport/shm/slots.py)
    HOST_SLICES = 7  # host-aware: reduce-scatter in the host, a slice per rank across, all-gather
    HOST_LEADERS = 8  # host-aware: reduce to the host's leader, leaders exchange, broadcast
    DOUBLING = 9  # recursive doubling in the canonical tree's shape (collectives/doubling.py)
    DISSEMINATION = 10  # log2 N rounds, rank r to r + 2^k (barrier; small broadcast on its tree)
    HOST_CHAIN = 11  # large broadcast on several hosts: a chain of one head per host


class Flags(enum.IntFlag):
    NONE = 0
    DETERMINISTIC = 1


# dtype <-> one-byte code. Fixed numbers: they are part of the wire format.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)
DTYPE_CODE: dict[torch.dtype, int] = {dt: i + 1 for i, dt in enumerate(_DTYPES)}
CODE_DTYPE: dict[int, torch.dtype] = {i + 1: dt for i, dt in enumerate(_DTYPES)}


class Header(NamedTuple):
    """What one side of a link says it is doing. Equality means agreement.

    A NamedTuple rather than a frozen dataclass: one is built per collective
    on the hot path, and a frozen dataclass's ``__init__`` costs ~1 us more.
    """

    seq: int
    op: OpCode
    algo: Algo
    dtype: torch.dtype | None
    reduce_op: int = 0
    numel: int = 0
    aux: int = 0
    flags: Flags = Flags.NONE

    def pack(self) -> bytes:
        out = bytearray(HEADER_BYTES)
        self.pack_into(out)
        return bytes(out)

    def pack_into(self, buf: bytearray) -> None:
        """Write the 32 wire bytes into ``buf`` (a plan's reusable header buffer)."""
        code = 0 if self.dtype is None else DTYPE_CODE[self.dtype]
        seq, op, algo, _, reduce_op, numel, aux, flags = self
        _HEADER.pack_into(buf, 0, MAGIC, VERSION, op, algo, code, reduce_op, flags, seq, numel, aux)

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> Header:
        """Parse a header; ValueError if it is not one (wrong magic or version)."""
        magic, version, op, algo, code, red, flags, seq, numel, aux = _HEADER.unpack(raw)
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not an entrenar frame (magic {magic:#x}, version {version})")
        return cls(
            seq=seq,
            op=OpCode(op),
            algo=Algo(algo),
            dtype=CODE_DTYPE.get(code),
            reduce_op=red,
            numel=numel,
            aux=aux,
            flags=Flags(flags),
        )

    def describe(self) -> str:
        dt = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "-"
        return (
            f"{self.op.name.lower()}#{self.seq}(dtype={dt}, numel={self.numel}, "
            f"reduce_op={self.reduce_op}, {_AUX_NAMES.get(self.op, 'aux')}={self.aux}, "
            f"algo={self.algo.name.lower()}"
            f"{', deterministic' if self.flags & Flags.DETERMINISTIC else ''})"
        )


# What ``aux`` means, where it has a meaning (for error messages).
_AUX_NAMES = {
    OpCode.BROADCAST: "root",
    OpCode.REDUCE: "root",
    OpCode.GATHER: "root",
    OpCode.SCATTER: "root",
    OpCode.ALLTOALL: "numel_back",
    OpCode.REDUCE_SCATTER: "sizes_crc",
}


def p2p_header(index: int, dtype: torch.dtype, nbytes: int, tag: int) -> Header:
    """The header of one point-to-point message on a link of the p2p channel.

    ``seq`` is the message's index on its link (0, 1, 2, ... per direction),
    so a receiver that finds a gap knows the stream is corrupt; ``numel`` is
    the payload length in bytes (any dtype can travel; ``dtype`` is None when
    it has no wire code); ``aux`` is the user's tag, matched against recvs.
    """
    return Header(
        seq=index,
        op=OpCode.SEND,
        algo=Algo.DIRECT,
        dtype=dtype if dtype in DTYPE_CODE else None,
        numel=nbytes,
        aux=tag,
    )

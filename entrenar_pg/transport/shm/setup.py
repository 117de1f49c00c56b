"""Shared memory's set-up: which peers share this host, their segments mapped, the links built.

``connect`` is the only code that knows both the byte rings (``ring.py``)
and the slot areas (``slots.py``): it makes this rank's segment, maps each
local peer's, and builds a ``ShmLink`` per pair and, when every rank of the
group is here, the ``SlotArea``. docs/architecture.md, "Shared-memory
transport", has the whole story: what counts as the same host, memory
mapped per rank, wake-ups, failure, leaks.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import platform
import secrets
import socket
import struct
import time
from dataclasses import dataclass

from ...errors import PeerConnectionError
from .ring import BLOCK_BYTES, NONCE_BYTES, ShmLink
from .slots import SlotArea, area_bytes, new_area_nonce

log = logging.getLogger(__name__)

_ORDERED_MACHINES = ("x86_64", "amd64")
_LEN = struct.Struct("<I")
_MAX_SETUP_MSG = 1 << 16


# ---------------------------------------------------------------------- set-up


def host_key() -> str:
    """What two ranks must share to be on one host for shared memory.

    The kernel instance (boot id), the IPC and network namespaces and the user:
    ranks in one container (or on one bare host) agree; ranks in different
    containers or network namespaces do not, even on one machine, and are
    then treated as different hosts (they reach each other over the network
    like ones); another user never shares. A hostname says none of this
    (containers share or fake it). Equal keys are then confirmed by mapping
    the peer's segment and reading its nonce (``connect``).
    """
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("no-boot-id")
    for ns in ("ipc", "net"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            parts.append(f"no-{ns}-ns")
    parts.append(f"uid:{os.getuid()}")
    return "|".join(parts)


@dataclass(slots=True)
class _Segment:
    """This rank's memfd: one ring block per local peer, each starting with a
    nonce, then (``area_offset`` >= 0) the slot area (``slots.py``), with its own."""

    fd: int
    size: int
    offsets: dict[int, int]
    nonces: dict[int, bytes]
    view: memoryview
    area_offset: int
    area_nonce: bytes


def _make_segment(rank: int, peers: list[int], area_size: int = 0) -> _Segment:
    """This rank's segment: a ring block per peer in ``peers``, then a slot
    area of ``area_size`` bytes (none where 0)."""
    with_area = area_size > 0
    rings = BLOCK_BYTES * len(peers)
    size = rings + area_size
    # memfd: no name in any filesystem (nothing in /dev/shm to leak, whatever
    # happens to the processes), reachable only through this fd, which peers
    # open as /proc/<pid>/fd/<n>: the kernel allows that to this user (and
    # root) only, so the segment is as private as a 0600 file.
    fd = os.memfd_create(f"entrenar-r{rank}", os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)  # memfds start 0777; /proc's check comes first, this second
        os.ftruncate(fd, size)
        view = memoryview(mmap.mmap(fd, size))
    except BaseException:
        os.close(fd)
        raise
    offsets: dict[int, int] = {}
    nonces: dict[int, bytes] = {}
    for i, p in enumerate(peers):
        off = offsets[p] = i * BLOCK_BYTES
        nonce = nonces[p] = secrets.token_bytes(NONCE_BYTES)
        view[off : off + NONCE_BYTES] = nonce
    area_nonce = b""
    if with_area:
        area_nonce = secrets.token_bytes(NONCE_BYTES)
        new_area_nonce(view[rings:size], area_nonce)
    return _Segment(fd, size, offsets, nonces, view, rings if with_area else -1, area_nonce)


@dataclass(slots=True)
class _Mapped:
    """A peer's segment as this rank mapped it: the ring block it writes to
    us, and its slot area when it offered one."""

    block: memoryview
    area: memoryview | None


def _map_peer(offer: dict[str, object], area_size: int) -> tuple[_Mapped | None, str]:
    """Map a peer's ring block (and slot area, ``area_size`` bytes) from its
    offer; (them, "") or (None, why not)."""
    try:
        path = f"/proc/{int(offer['pid'])}/fd/{int(offer['fd'])}"  # type: ignore[call-overload]
        offset, size = int(offer["offset"]), int(offer["size"])  # type: ignore[call-overload]
        nonce = bytes.fromhex(str(offer["nonce"]))
        area_offset = int(offer.get("area_offset", -1))  # type: ignore[call-overload]
        area_nonce = bytes.fromhex(str(offer.get("area_nonce", "")))
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except (OSError, KeyError, ValueError, TypeError) as e:
        return None, f"cannot open its segment ({e})"
    try:
        end = offset + BLOCK_BYTES
        if area_offset >= 0:
            end = max(end, area_offset + area_size)
        if os.fstat(fd).st_size < end or size < end:
            return None, "its segment is smaller than announced"
        block = memoryview(mmap.mmap(fd, BLOCK_BYTES, offset=offset))
        area = None
        if area_offset >= 0:
            area = memoryview(mmap.mmap(fd, area_size, offset=area_offset))
    except (OSError, ValueError) as e:
        return None, f"cannot map its segment ({e})"
    finally:
        os.close(fd)
    if bytes(block[:NONCE_BYTES]) != nonce or (
        area is not None and bytes(area[:NONCE_BYTES]) != area_nonce
    ):
        # Another process answers at that pid (another pid namespace): not ours.
        block.release()
        if area is not None:
            area.release()
        return None, "its segment did not carry the nonce it announced (another pid namespace?)"
    return _Mapped(block, area), ""


class _Exchange:
    """Small framed JSON messages over the (non-blocking) data sockets, at set-up only."""

    def __init__(self, rank: int, socks: dict[int, socket.socket], deadline: float) -> None:
        self.rank = rank
        self.socks = socks
        self.deadline = deadline

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise PeerConnectionError(
                f"rank {self.rank}: timed out setting up shared memory with its peers"
            )
        return left

    def all(self, peers: list[int], msgs: dict[int, dict[str, object]]) -> dict[int, dict]:
        """Send each peer its message, then read each peer's (every message is
        far smaller than a socket buffer, so sending all first cannot block)."""
        for p in peers:
            raw = json.dumps(msgs[p]).encode()
            sock = self.socks[p]
            sock.settimeout(self._left())
            try:
                sock.sendall(_LEN.pack(len(raw)) + raw)
            except OSError as e:
                raise PeerConnectionError(
                    f"rank {self.rank}: lost rank {p} while setting up shared memory: {e}"
                ) from e
            finally:
                sock.setblocking(False)
        return {p: self._read(p) for p in peers}

    def _read(self, peer: int) -> dict:
        sock = self.socks[peer]
        try:
            sock.settimeout(self._left())
            (n,) = _LEN.unpack(self._exact(sock, _LEN.size))
            if n > _MAX_SETUP_MSG:
                raise ConnectionError("oversized set-up message")
            sock.settimeout(self._left())
            return dict(json.loads(self._exact(sock, n)))
        except (OSError, ValueError) as e:
            raise PeerConnectionError(
                f"rank {self.rank}: lost rank {peer} while setting up shared memory: {e}"
            ) from e
        finally:
            sock.setblocking(False)

    @staticmethod
    def _exact(sock: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("connection closed")
            buf += chunk
        return bytes(buf)


@dataclass(slots=True)
class ShmPeers:
    """What set-up found: the peers with this rank's host key, the links to
    those whose segments both sides mapped (normally all of them), and the
    slot areas when every rank of the group mapped every other's (the same
    answer on every rank: the policy's ``local``)."""

    local: list[int]
    links: dict[int, ShmLink]
    slots: SlotArea | None = None
    keys: dict[int, str] | None = None  # every rank's host key, this one's included


def offered_key(host_id: str = "") -> str:
    """The host key this rank publishes at set-up (``rendezvous.Rendezvous.exchange``):
    ``host_key`` plus ``Options.host_id`` (which can split a host, never join
    two); empty where shared memory is off (not x86-64: the rings rely on its
    memory order, stores seen in program order, _Fence a full barrier)."""
    key = host_key() if platform.machine().lower() in _ORDERED_MACHINES else ""
    if key and host_id:
        key += f"|id:{host_id}"
    return key


def connect(
    rank: int,
    data: dict[int, socket.socket],
    mode: str,
    timeout_s: float,
    keys: list[str],
    placement: bool = True,
) -> ShmPeers:
    """Shared-memory links to the peers on this host (``mode``: auto or shm;
    tcp: none).

    ``keys``: every rank's host key (``offered_key``), learnt through the
    store at set-up; ``data``: the authenticated data sockets to the ranks
    whose key equals this rank's, made at set-up (the only ones made then).
    Then two rounds over those: offers (pid, fd, offset, nonce of the ring
    block this rank writes to that peer); verdicts (whether the peer mapped
    ours). A pair uses shared memory only when both sides mapped the other's
    block, so both agree. With ``mode == "shm"`` a peer that is not local is
    an error here, at group creation. Each rank's memfd is closed at the end:
    the mappings keep the memory, nothing else names it. ``placement``:
    ``Options.shm_placement``, for the slot area.
    """
    ex = _Exchange(rank, data, time.monotonic() + timeout_s)
    every = dict(enumerate(keys))
    key = keys[rank]
    peers = [p for p in range(len(keys)) if p != rank]
    if mode == "tcp":
        return ShmPeers([], {}, keys=every)
    local = [p for p in peers if key and keys[p] == key]
    assert set(local) <= set(data), f"rank {rank}: no set-up data socket to a local peer"
    if mode == "shm" and not key:
        raise ValueError(
            f"rank {rank}: ENTRENAR_TRANSPORT=shm: shared memory needs x86-64 "
            f"(this machine is {platform.machine()!r}); use auto or tcp"
        )
    if mode == "shm" and len(local) != len(peers):
        remote = [p for p in peers if p not in local]
        raise ValueError(
            f"rank {rank}: ENTRENAR_TRANSPORT=shm: rank(s) {remote} are not on this "
            "host (another machine, container or network namespace, or another user); "
            "use ENTRENAR_TRANSPORT=auto to reach them over TCP"
        )
    if not local:
        return ShmPeers(local, {}, keys=every)
    # Slot areas only where the shm-native allreduce can run: every rank here.
    with_area = len(local) == len(peers)
    # Its size follows the group's size (``slots.area_bytes``): the same on every rank.
    area_size = area_bytes(len(keys)) if with_area else 0
    seg = _make_segment(rank, local, area_size)
    try:
        offers = ex.all(
            local,
            {
                p: {
                    "pid": os.getpid(),
                    "fd": seg.fd,
                    "offset": seg.offsets[p],
                    "size": seg.size,
                    "nonce": seg.nonces[p].hex(),
                    "area_offset": seg.area_offset,
                    "area_nonce": seg.area_nonce.hex(),
                }
                for p in local
            },
        )
        mapped: dict[int, _Mapped] = {}
        why: dict[int, str] = {}
        for p in local:
            got, why[p] = _map_peer(offers[p], area_size)
            if got is not None:
                mapped[p] = got
        verdicts = ex.all(local, {p: {"ok": p in mapped, "why": why[p]} for p in local})
    finally:
        os.close(seg.fd)  # every peer has opened it (or given up): the mappings keep it
    links: dict[int, ShmLink] = {}
    failed: list[str] = []
    for p in local:
        theirs = verdicts[p]
        if p in mapped and theirs.get("ok"):
            out = seg.view[seg.offsets[p] : seg.offsets[p] + BLOCK_BYTES]
            links[p] = ShmLink(p, data[p], out, mapped[p].block)
        else:
            reason = why[p] or f"rank {p} could not map ours: {theirs.get('why', '?')}"
            failed.append(f"rank {p}: {reason}")
            log.warning(
                "rank %d: TCP to rank %d, on this host: no shared memory: %s", rank, p, reason
            )
    if mode == "shm" and failed:
        raise ValueError(
            f"rank {rank}: ENTRENAR_TRANSPORT=shm: no shared memory with " + "; ".join(failed)
        )
    slots = None
    if with_area:
        # A fourth round: whether each rank has shared memory with every
        # other (a pair's failure is known to that pair only): the slot areas
        # are used only when all say yes, so every rank decides alike.
        complete = len(links) == len(peers) and all(mapped[p].area is not None for p in local)
        answers = ex.all(local, {p: {"complete": complete} for p in local})
        if complete and all(answers[p].get("complete") for p in local):
            areas = {p: mapped[p].area for p in local}
            areas[rank] = seg.view[seg.area_offset : seg.area_offset + area_size]
            slots = SlotArea(rank, areas, links, placement)  # type: ignore[arg-type]
    return ShmPeers(local, links, slots, every)

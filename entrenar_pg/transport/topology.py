"""Which ranks of a group share a host: the group's shape, the same on every rank.

Set-up (``shm.connect``) exchanges every rank's host key over the data
sockets: the kernel instance, the IPC and network namespaces, the user and
``Options.host_id`` (``shm.host_key``). Ranks with equal keys are on one
host. Every rank receives every peer's key, so every rank builds this object
from the same list and holds an identical ``Topology``: the algorithm policy
may depend on it (collectives/policy.py), as every rank must choose alike.

Hosts are ordered by their lowest rank and list their ranks in rank order; a
rank's *local rank* is its position on its host and its *counterparts* are
the ranks at that position on every host (host order). An empty key (a
machine where the shared-memory transport is off, so no identity was
offered) makes that rank a host of its own: nothing is assumed shared.

``fast_links`` says whether the cross-host link measured as fast as a link
inside a host (``link_probe.py``, at set-up; the verdict comes through the
store, so it too is the same on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """The group's hosts, as lists of ranks; derived data alongside (see the module)."""

    hosts: tuple[tuple[int, ...], ...]
    host_of: tuple[int, ...]  # host index of each rank
    local_rank: tuple[int, ...]  # position of each rank on its host
    # The cross-host link measured loopback-class (link_probe.py); False unmeasured.
    fast_links: bool = False

    @classmethod
    def from_keys(cls, keys: Sequence[str]) -> Topology:
        """Ranks with equal non-empty ``keys[rank]`` share a host."""
        by_key: dict[str, list[int]] = {}
        hosts: list[list[int]] = []
        for rank, key in enumerate(keys):
            members = by_key.get(key) if key else None
            if members is None:
                members = []
                hosts.append(members)
                if key:
                    by_key[key] = members
            members.append(rank)
        return cls._of(hosts, len(keys))

    @classmethod
    def flat(cls, world: int) -> Topology:
        """One host holding every rank (the shape ``Options.topology="flat"`` assumes)."""
        return cls._of([list(range(world))], world)

    @classmethod
    def _of(cls, hosts: Sequence[Sequence[int]], world: int) -> Topology:
        host_of = [0] * world
        local_rank = [0] * world
        for h, members in enumerate(hosts):
            for i, rank in enumerate(members):
                host_of[rank], local_rank[rank] = h, i
        return cls(tuple(tuple(m) for m in hosts), tuple(host_of), tuple(local_rank))

    @property
    def world(self) -> int:
        return len(self.host_of)

    @property
    def is_uniform(self) -> bool:
        """Every host holds the same number of ranks."""
        return len({len(m) for m in self.hosts}) == 1

    @property
    def shape(self) -> tuple[int, int] | None:
        """(hosts, ranks per host) when uniform, else None."""
        return (len(self.hosts), len(self.hosts[0])) if self.is_uniform else None

    @property
    def is_contiguous(self) -> bool:
        """Host h holds ranks h x L .. h x L + L - 1 (as torchrun places them)."""
        return self.is_uniform and all(
            m == tuple(range(h * len(m), (h + 1) * len(m))) for h, m in enumerate(self.hosts)
        )

    def local_peers(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s host, ``rank`` included, in rank order."""
        return self.hosts[self.host_of[rank]]

    def counterparts(self, rank: int) -> tuple[int, ...]:
        """The rank at ``rank``'s local position on every host, in host order
        (``rank`` included); hosts holding fewer ranks are skipped."""
        i = self.local_rank[rank]
        return tuple(m[i] for m in self.hosts if i < len(m))

    def leaders(self) -> tuple[int, ...]:
        """Each host's lowest rank, in host order."""
        return tuple(m[0] for m in self.hosts)

    def describe(self) -> str:
        """``2 hosts x 2 ranks`` or ``uneven: [[0, 1, 2], [3]]``."""
        shape = self.shape
        if shape is not None:
            return f"{shape[0]} hosts x {shape[1]} ranks"
        return f"uneven: {[list(m) for m in self.hosts]}"

"""Emulated hosts: network namespaces on one bridge, each host's link shaped by tc tbf.

The minimal set-up the 2-rank measurements need, written while the cluster
harness of issue 26 (``benchmarks/netns.py`` over launch/netns_cluster.sh,
branch h-cluster) was not merged; once it is, this module should give way
to it (same topology and tbf). Host i is namespace ``<prefix>-h<i>`` with ``eth0`` at
``10.78.0.<i+1>``, a veth whose other end is port ``p<i>`` of bridge ``br0`` in
namespace ``<prefix>-sw``. With a rate, a token bucket (``tbf``) shapes both
directions of each host's link: ``eth0``'s egress is what the host sends,
the bridge port's egress what it receives. So the L ranks of a host share
its link, as on a real NIC. Needs root and iproute2; everything is deleted
on exit, and processes still inside are killed first.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.78.0"
# Bucket and queue of tbf, as launch/netns_cluster.sh (the cluster harness)
# sets them: a burst above the veth's largest GSO packet (64 KiB), so tbf
# passes those whole, and 20 ms of queue at the rate.
TBF = ("burst", "128kb", "latency", "20ms")


@dataclass(frozen=True)
class Hosts:
    """The namespaces made by ``hosts()``."""

    prefix: str
    count: int

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.ns(i)]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _shape(ns: str, dev: str, rate: str) -> None:
    cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf"]
    subprocess.run([*cmd, "rate", rate, *TBF], check=True, capture_output=True, timeout=30)


def _delete(names: list[str]) -> None:
    for ns in reversed(names):
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@contextlib.contextmanager
def hosts(count: int, rate: str | None, prefix: str | None = None) -> Iterator[Hosts]:
    """``count`` emulated hosts, each link shaped to ``rate`` (tc syntax, e.g. "1gbit")."""
    made = Hosts(prefix or f"enrm{os.getpid()}", count)
    sw = f"{made.prefix}-sw"
    created: list[str] = []
    try:
        _ip("netns", "add", sw)
        created.append(sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i in range(count):
            ns = made.ns(i)
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip(
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                f"p{i}",
                "netns",
                sw,
            )
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{made.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            if rate:
                _shape(ns, "eth0", rate)
                _shape(sw, f"p{i}", rate)
        yield made
    finally:
        _delete(created)

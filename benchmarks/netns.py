"""Emulated hosts: network namespaces on one machine, as launch/netns_cluster.sh builds them.

The topology (a bridge in its own namespace, one namespace per host with
``eth0`` on a veth link to it, addresses 10.77.0.<i+1>, optional tbf shaping
of each link both ways) lives in that one script; this module runs it and
answers the questions around it:

- the driver's side: may this process make namespaces, does the kernel have a
  qdisc (``netem`` is missing from some kernels), run a command on every host
  (:func:`run_on_hosts`), which of a prefix's namespaces are left;
- a process inside a host: its link's byte counters (:func:`link_bytes`) and
  its own open TCP sockets (:func:`tcp_sockets`). ``ip netns exec`` mounts the
  namespace's own sysfs, and ``/proc/self/net`` is the process's namespace, so
  both read this host's view with no help from outside.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from benchmarks.sessions import TIMED_OUT, run_in_session

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "netns_cluster.sh"
HOST_IFNAME = "eth0"  # the script's name for every host's link
HEAD_PORT = 29500  # any port is free on 10.77.0.1: the namespace is new


def namespaces_allowed() -> bool:
    """Whether this process may make network namespaces (root, iproute2, a kernel allowing it)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = f"enrprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def qdisc_available(*spec: str) -> tuple[bool, str]:
    """Whether ``tc qdisc add dev X root <spec>`` works here, and tc's message if not.

    Tried on a veth pair in a scratch namespace (deleted after), so nothing
    outside it is touched.
    """
    ns = f"enrqd{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
        return False, "cannot create a network namespace (needs root and `ip netns`)"
    try:
        subprocess.run(
            ["ip", "-n", ns, "link", "add", "name", "qa", "type", "veth", "peer", "name", "qb"],
            capture_output=True,
            check=True,
        )
        p = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "qa", "root", *spec],
            capture_output=True,
            text=True,
        )
        return p.returncode == 0, p.stderr.strip()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@dataclass(frozen=True)
class Shaping:
    """How every host link is shaped: a tbf ``rate`` both ways, a netem spec on egress."""

    rate: str = ""  # tc units, e.g. "1gbit"; "" leaves the link unshaped
    netem: str = ""  # e.g. "delay 1ms"; needs sch_netem
    tbf_burst: str = "128kb"  # above a 64 KiB GSO packet: tbf passes those whole
    tbf_latency: str = "20ms"  # how long a packet may queue (the queue's length)

    def tbf(self) -> list[str]:
        """The tbf qdisc spec of ``rate``."""
        return ["tbf", "rate", self.rate, "burst", self.tbf_burst, "latency", self.tbf_latency]


def run_on_hosts(
    hosts: int,
    node_cmd: str,
    *,
    prefix: str,
    log_dir: Path,
    timeout_s: float,
    shaping: Shaping = Shaping(),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Build ``hosts`` namespaces, run the bash command ``node_cmd`` in each, tear down.

    ``node_cmd`` sees ``NODE`` (host index), ``NODE_ADDR`` and ``HEAD_ADDR``
    (host 0's address). The script's trap deletes the namespaces however it
    ends; past ``timeout_s`` it is sent SIGTERM (so the trap runs), then
    SIGKILL. Output captured; the caller judges the exit status.
    """
    full_env = dict(os.environ if env is None else env)
    full_env.update(
        NODES=str(hosts),
        NETNS_PREFIX=prefix,
        LOG_DIR=str(log_dir),
        TIMEOUT_S=str(int(timeout_s)),
        NODE_CMD=node_cmd,
        RATE=shaping.rate,
        NETEM=shaping.netem,
        TBF_BURST=shaping.tbf_burst,
        TBF_LATENCY=shaping.tbf_latency,
    )
    done = run_in_session([str(SCRIPT)], timeout_s=timeout_s + 30, env=full_env)
    if done.returncode == TIMED_OUT:
        done.stderr += f"\nnetns: stopped after {timeout_s + 30:.0f} s"
    return done


def namespaces_left(prefix: str) -> list[str]:
    """The namespaces named ``<prefix>-...`` that still exist."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def link_bytes(ifname: str = HOST_IFNAME) -> tuple[int, int]:
    """(sent, received) bytes of this namespace's ``ifname`` since it was created.

    The veth counters count every frame the link carried (Ethernet, IP and TCP
    headers, ACKs, retransmissions), one frame per GSO segment as handed over.
    """
    base = Path("/sys/class/net") / ifname / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def tcp_sockets(pid: str = "self") -> int:
    """How many TCP sockets (IPv4 and IPv6, any state, listeners too) process ``pid`` holds."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        inodes.update(line.split()[9] for line in lines)
    fd_dir = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            count += 1
    return count

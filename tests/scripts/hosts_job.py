"""A job for tests/test_hosts.py: one torchrun per emulated host (2 namespaces x 2 ranks).

Each rank checks, and prints ``HOSTS-OK <rank>`` when all hold:
- the topology is 2 hosts x 2 ranks, torchrun's placement (ranks 2h, 2h+1
  on host h), and shared memory joins exactly the rank on its own host;
- the set-up's probe found the shaped cross-host link slow, and every rank
  holds the same verdict (transport/link_probe.py), so the default options
  run host-aware;
- a host-aware group (the star row for small messages off) picks
  HOST_LEADERS for a small message and HOST_SLICES for a large one; a
  ``topology="flat"`` group does not; default options pick the star for
  the small one (few hosts);
- integer sums are exact on both groups; float sums of the host-aware
  group equal the flat group's within rounding;
- deterministic: the host-aware group's bits equal the flat deterministic
  group's and the canonical tree sum of every rank's input, computed here
  in one process from the same seeds (``tree_sum``); the same for the
  deterministic reduce-scatter, which runs host-aware (HOST_SLICES);
- a broadcast above 1 MiB runs the hosts' chain (HOST_CHAIN: one head per
  host) on the host-aware group and the rank-order chain on the flat one,
  and every rank ends with the root's tensor, from a host's first rank and
  from a rank that is not;
- a partition: host 1's link goes down (rank 3 takes its namespace's eth0
  down, as a failed switch port would) before a large allreduce (the host
  slices: each rank's only cross-host link is to its partner) of a group
  with a 3 s timeout: every rank raises ``PeerConnectionError`` within a few
  seconds of the timeout, naming a rank of the other host as the culprit
  (each side sees the other stop answering); then the link comes back up
  and the job ends normally (``PARTITION_DIR``: a directory every host
  sees, where the ranks leave flags for each other).
"""

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from entrenar_pg import Options, PeerConnectionError, tree_sum
from entrenar_pg.collectives.policy import choose
from entrenar_pg.wire import Algo, OpCode

SIZES = (1000, Options().host_leaders_max_bytes // 4 + 4321)  # float32 elements: small, large

timeout = timedelta(seconds=60)
dist.init_process_group("gloo", timeout=timeout)
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 4, world


def group(**opts: object) -> dist.ProcessGroup:
    return dist.new_group(backend="entrenar", pg_options=Options.from_env(**opts), timeout=timeout)


def backend(g: dist.ProcessGroup):  # type: ignore[no-untyped-def]
    return g._get_backend(torch.device("cpu"))


def inputs(n: int) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(11 + r)) for r in range(world)]


def algo(g: dist.ProcessGroup, nbytes: int, op: OpCode = OpCode.ALLREDUCE) -> Algo:
    rt = backend(g)._runtime
    mesh = rt.mesh
    return choose(op, nbytes, mesh.world, rt.options, mesh.all_local, mesh.topology).algo


# The leaders' path for small messages (few hosts pick the star by default:
# host_star_max_bytes; checked below).
hosts, flat = group(host_star_max_bytes=0), group(topology="flat")
det = group(deterministic=True, host_star_max_bytes=0)
det_flat = group(deterministic=True, topology="flat")
mesh = backend(hosts)._runtime.mesh
assert mesh.topology.hosts == ((0, 1), (2, 3)), mesh.topology
assert sorted(mesh.shm) == [rank ^ 1], (rank, sorted(mesh.shm))
assert mesh.probe is not None and not mesh.probe.fast, mesh.probe
assert not mesh.topology.fast_links
verdicts: list[object] = [None] * world
dist.all_gather_object(verdicts, mesh.probe.encode())
assert verdicts == [mesh.probe.encode()] * world, verdicts
if rank == 0:
    print(f"PROBE {mesh.probe.describe()}", flush=True)
for g in (hosts, det):
    assert [algo(g, n * 4) for n in SIZES] == [Algo.HOST_LEADERS, Algo.HOST_SLICES]
for g in (flat, det_flat):
    assert Algo.HOST_LEADERS not in [algo(g, n * 4) for n in SIZES]
small = choose(OpCode.ALLREDUCE, SIZES[0] * 4, world, Options(), False, mesh.topology).algo
assert small is Algo.STAR, small

for n in SIZES:
    ints = {}
    for name, g in (("hosts", hosts), ("flat", flat)):
        t = torch.arange(n, dtype=torch.int64) * (rank + 1)
        dist.all_reduce(t, group=g)
        ints[name] = t
    assert torch.equal(ints["hosts"], torch.arange(n, dtype=torch.int64) * 10), n
    assert torch.equal(ints["hosts"], ints["flat"])
    floats = {}
    for name, g in (("hosts", hosts), ("flat", flat), ("det", det), ("det_flat", det_flat)):
        t = inputs(n)[rank].clone()
        dist.all_reduce(t, group=g)
        floats[name] = t
    torch.testing.assert_close(floats["hosts"], floats["flat"])
    assert torch.equal(floats["det"], floats["det_flat"]), n
    assert torch.equal(floats["det"], tree_sum(inputs(n))), n

# Deterministic reduce-scatter: host-aware, the flat tree exchange's bits.
assert algo(det, 4000, OpCode.REDUCE_SCATTER) is Algo.HOST_SLICES
assert algo(det_flat, 4000, OpCode.REDUCE_SCATTER) is Algo.DIRECT
for n in SIZES:
    src = inputs(n * world)
    scattered = {}
    for name, g in (("det", det), ("det_flat", det_flat)):
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, src[rank].clone(), group=g)
        scattered[name] = out
    want = tree_sum(src)[rank * n : (rank + 1) * n]
    assert torch.equal(scattered["det"], want), n
    assert torch.equal(scattered["det_flat"], want), n

# Broadcast above 1 MiB: the hosts' chain, from a head (2) and a non-head root (1).
BIG = (1 << 20) // 4 + 4321  # float32 elements
assert algo(hosts, BIG * 4, OpCode.BROADCAST) is Algo.HOST_CHAIN
assert algo(flat, BIG * 4, OpCode.BROADCAST) is Algo.CHAIN
for root in (1, 2):
    for g in (hosts, flat):
        t = torch.arange(BIG, dtype=torch.float32) * (rank + 1)
        dist.broadcast(t, src=root, group=g)
        assert torch.equal(t, torch.arange(BIG, dtype=torch.float32) * (root + 1)), root


# A partition: host 1's link down while every rank is in one allreduce.
PARTITION_S = 3.0  # the group's timeout
flags = Path(os.environ["PARTITION_DIR"])


def await_flags(*names: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not all((flags / n).exists() for n in names):
        assert time.monotonic() < deadline, f"rank {rank}: no flags {names} in {within_s}s"
        time.sleep(0.02)


part = dist.new_group(backend="entrenar", timeout=timedelta(seconds=PARTITION_S))
t = torch.ones(SIZES[1])  # the host slices: shared memory in a host, partners across
assert algo(part, t.nbytes) is Algo.HOST_SLICES
dist.all_reduce(t, group=part)  # its links made, its path warm
assert torch.equal(t, torch.full_like(t, 4.0)), t
# Every rank out of gloo's barrier (one that is still in it when the link
# goes down never issues the allreduce, and is rightly blamed for that),
# then the link down, then the call.
dist.barrier()
(flags / f"ready.{rank}").touch()
if rank == 3:
    await_flags(*(f"ready.{r}" for r in range(world)))
    subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
    (flags / "down").touch()
await_flags("down")
began = time.monotonic()
try:
    dist.all_reduce(t, group=part)
except PeerConnectionError as e:
    took = time.monotonic() - began
    other_host = (2, 3) if rank < 2 else (0, 1)
    assert e.culprit in other_host, (rank, e.culprit, str(e))
    assert took < PARTITION_S + 10, (rank, took, str(e))
    sys.stdout.write(f"PARTITION {rank} {took:.1f}s culprit {e.culprit}: {e}\n")  # one write
    sys.stdout.flush()
    (flags / f"failed.{rank}").touch()
else:
    raise AssertionError(f"rank {rank}: an allreduce completed across a link that is down")
if rank == 3:
    await_flags(*(f"failed.{r}" for r in range(world)))
    subprocess.run(["ip", "link", "set", "eth0", "up"], check=True)
dist.barrier()  # gloo's links, idle while the link was down, carry on

# One write per line: under PYTHONUNBUFFERED (set on CI) print writes the text
# and its newline apart, and two ranks' lines interleaved in the node's log.
sys.stdout.write(f"HOSTS-OK {rank} {mesh.topology.describe()} {os.environ.get('GROUP_RANK')}\n")
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()

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
  from a rank that is not.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from entrenar_pg import Options, tree_sum
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

# One write per line: under PYTHONUNBUFFERED (set on CI) print writes the text
# and its newline apart, and two ranks' lines interleaved in the node's log.
sys.stdout.write(f"HOSTS-OK {rank} {mesh.topology.describe()} {os.environ.get('GROUP_RANK')}\n")
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()

"""DDP training on a model with buffers (BatchNorm) and several gradient buckets.

Run under torchrun. Does not import entrenar_pg: the torch.backends entry point
must register the backend. The first of ``--backends`` is the default group's;
each further one (the reference, gloo) gets a group of every rank from
``new_group``, in the same processes, so one job starts the interpreters once.
Each backend trains its own copy of the model from the same seeds and saves
each rank's final state_dict to OUT/n<members>/<backend>/rank{r}.pt.

``--members n ...`` (default: the job's world size) trains once per group size
n, each backend on the group of the first n ranks (the whole job's are the
groups above): one job checks several group sizes, starting the interpreters
once.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--backends", nargs="+", default=["entrenar"])
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--members", type=int, nargs="+")
args = p.parse_args()

TIMEOUT = timedelta(seconds=60)
dist.init_process_group(args.backends[0], timeout=TIMEOUT)
rank, world = dist.get_rank(), dist.get_world_size()


def groups_of(members: int) -> dict[str, dist.ProcessGroup]:
    """Each backend's group of the first ``members`` ranks; the default group is the whole job's."""
    groups = {}
    for backend in args.backends:
        if backend == args.backends[0] and members == world:
            groups[backend] = dist.group.WORLD
        else:  # new_group is collective over the default group: every rank makes every group
            groups[backend] = dist.new_group(list(range(members)), backend=backend, timeout=TIMEOUT)
    return groups


def train(group: dist.ProcessGroup, out: str) -> None:
    assert dist.get_backend(group) == os.path.basename(out), (dist.get_backend(group), out)
    torch.manual_seed(0)  # same init everywhere; DDP's broadcast makes sure anyway
    model = torch.nn.Sequential(
        torch.nn.Conv1d(4, 16, 3, padding=1),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 32, 256),
        torch.nn.BatchNorm1d(256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    # ~0.2M params in 0.05 MB buckets: several buckets
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard
    for _step in range(args.steps):
        x = torch.randn(8, 4, 32, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ddp.eval()
    ddp(torch.zeros(2, 4, 32))  # an eval forward syncs the BatchNorm buffers from rank 0
    os.makedirs(out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    dist.barrier(group=group)


for members in args.members or [world]:
    groups = groups_of(members)
    if rank < members:
        for backend, group in groups.items():
            train(group, os.path.join(args.out, f"n{members}", backend))
dist.barrier()  # the ranks outside the last group wait for its members to finish
dist.destroy_process_group()

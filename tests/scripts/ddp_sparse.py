"""DDP with a sparse embedding (``nn.Embedding(sparse=True)``) beside dense layers.

Run under torchrun. DDP allreduces the embedding's sparse gradient with a
sparse allreduce (one bucket of its own) and the dense ones in buckets.
The first of ``--backends`` is the default group's; each further one (the
reference, gloo) gets a group of every rank from ``new_group``, in the same
processes, so one job starts the interpreters once. For each backend, saves
to OUT/<backend>/rank{r}.pt: the final state_dict, the embedding's initial
weights, whether its gradient was sparse, a ``dist.all_reduce`` of a sparse
tensor through the public API, and entrenar's stats ({} on gloo, whose run
follows entrenar's: the stats are read before it).
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
p.add_argument("--steps", type=int, default=6)
args = p.parse_args()

dist.init_process_group(args.backends[0], timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
groups = {args.backends[0]: dist.group.WORLD}
for name in args.backends[1:]:
    groups[name] = dist.new_group(backend=name, timeout=timedelta(seconds=60))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(dim=1))


def train(backend: str, group: dist.ProcessGroup) -> None:
    assert dist.get_backend(group) == backend, (dist.get_backend(group), backend)
    torch.manual_seed(0)
    model = Model()
    initial = model.emb.weight.detach().clone()
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)  # SGD takes sparse gradients
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    grad_was_sparse = False
    for _ in range(args.steps):
        ids = torch.randint(0, 50, (6, 4), generator=gen)  # repeated ids: duplicates in the grad
        y = torch.randint(0, 5, (6,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(ids), y)
        opt.zero_grad()
        loss.backward()
        grad_was_sparse = bool(
            model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse
        )
        opt.step()

    # The public API on a sparse tensor (what a user's own code calls).
    g = torch.Generator().manual_seed(7 + rank)
    public = torch.sparse_coo_tensor(
        torch.randint(0, 20, (1, 6), generator=g), torch.randn(6, 3, generator=g), (20, 3)
    )
    dist.all_reduce(public, group=group)

    stats = {}
    if backend == "entrenar":
        import entrenar_pg

        stats = entrenar_pg.get_stats()
    out = os.path.join(args.out, backend)
    os.makedirs(out, exist_ok=True)
    torch.save(
        {
            "model": model.state_dict(),
            "initial": initial,
            "grad_was_sparse": grad_was_sparse,
            "public": public,
            "stats": stats,
            "steps": args.steps,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    dist.barrier(group=group)


for backend, group in groups.items():
    train(backend, group)
dist.destroy_process_group()

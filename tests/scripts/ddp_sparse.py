"""DDP with a sparse embedding (``nn.Embedding(sparse=True)``) beside dense layers.

Run under torchrun. DDP allreduces the embedding's sparse gradient with a
sparse allreduce (one bucket of its own) and the dense ones in buckets.
Saves to OUT/rank{r}.pt: the final state_dict, the embedding's initial
weights, whether its gradient was sparse, a ``dist.all_reduce`` of a sparse
tensor through the public API, and entrenar's stats ({} on gloo).
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--backend", default="entrenar")
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=6)
args = p.parse_args()

dist.init_process_group(args.backend, timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(dim=1))


torch.manual_seed(0)
model = Model()
initial = model.emb.weight.detach().clone()
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.5)  # SGD takes sparse gradients
gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
grad_was_sparse = False
for _ in range(args.steps):
    ids = torch.randint(0, 50, (6, 4), generator=gen)  # repeated ids: duplicates in the grad
    y = torch.randint(0, 5, (6,), generator=gen)
    loss = torch.nn.functional.cross_entropy(ddp(ids), y)
    opt.zero_grad()
    loss.backward()
    grad_was_sparse = bool(model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse)
    opt.step()

# The public API on a sparse tensor (what a user's own code calls).
g = torch.Generator().manual_seed(7 + rank)
public = torch.sparse_coo_tensor(
    torch.randint(0, 20, (1, 6), generator=g), torch.randn(6, 3, generator=g), (20, 3)
)
dist.all_reduce(public)

stats = {}
if args.backend == "entrenar":
    import entrenar_pg

    stats = entrenar_pg.get_stats()
os.makedirs(args.out, exist_ok=True)
torch.save(
    {
        "model": model.state_dict(),
        "initial": initial,
        "grad_was_sparse": grad_was_sparse,
        "public": public,
        "stats": stats,
        "steps": args.steps,
    },
    os.path.join(args.out, f"rank{rank}.pt"),
)
dist.barrier()
dist.destroy_process_group()

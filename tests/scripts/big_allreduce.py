"""A 256 MiB float32 allreduce under torchrun at every group size from 2 to the
job's world size: on the default group, then on new groups of the first
``n`` ranks (one job, so the interpreters start once). Prints
``CHECK <n> <rank> ok|bad`` for each group this rank is in."""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("entrenar", timeout=timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
# new_group is collective over the default group: every rank creates every group.
groups = {n: dist.new_group(list(range(n)), backend="entrenar") for n in range(2, world)}
groups[world] = dist.group.WORLD
for n in sorted(groups, reverse=True):
    if rank >= n:
        continue
    t = torch.full(((256 << 20) // 4,), float(rank + 1))
    dist.all_reduce(t, group=groups[n])
    ok = bool((t == n * (n + 1) / 2).all())
    del t
    sys.stdout.write(f"CHECK {n} {rank} {'ok' if ok else 'bad'}\n")  # one write per line
    sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()

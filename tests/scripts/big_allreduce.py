"""A 256 MiB float32 allreduce under torchrun; prints CHECK <rank> ok|bad."""

from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("entrenar", timeout=timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full(((256 << 20) // 4,), float(rank + 1))
dist.all_reduce(t)
ok = bool((t == world * (world + 1) / 2).all())
print(f"CHECK {rank} {'ok' if ok else 'bad'}", flush=True)
dist.destroy_process_group()

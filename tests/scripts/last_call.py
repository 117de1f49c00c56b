"""The job's last collective disagrees: every process must exit non-zero.

One process per rank (env: RANK, WORLD_SIZE, MASTER_ADDR/PORT, TIMEOUT_S).
argv[1]: ``size`` (the last rank broadcasts one element more) or ``root`` (the
last rank names itself the root). Nothing catches the error: a rank whose
broadcast raises exits with status 1; one whose broadcast returns destroys the
group and exits 0, as a job whose replicas silently differ would.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

mode = sys.argv[1]
dist.init_process_group("entrenar", timeout=timedelta(seconds=float(os.environ["TIMEOUT_S"])))
rank, world = dist.get_rank(), dist.get_world_size()
odd = rank == world - 1
t = torch.ones(8)
dist.all_reduce(t)  # a healthy step first
numel = 9 if odd and mode == "size" else 8
root = rank if odd and mode == "root" else 0
dist.broadcast(torch.full((numel,), float(rank)), src=root)
dist.destroy_process_group()
print(f"rank {rank}: the broadcast returned", flush=True)

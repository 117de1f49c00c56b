"""Failure scenarios, one process per rank (env: RANK, WORLD_SIZE, MASTER_ADDR/PORT).

Prints one line ``RESULT <rank> <ErrorClass> <seconds>`` per surviving rank.
"""

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from short_timeout import init_group

mode = sys.argv[1]
init_group()  # set-up under a generous timeout, then TIMEOUT_S
rank = dist.get_rank()
start = time.monotonic()
try:
    if mode == "kill":
        # Rank 1 dies in the middle of a large allreduce.
        if rank == 1:
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        for _ in range(100):
            dist.all_reduce(torch.ones((64 << 20) // 4))
    elif mode == "mismatch":
        if rank == 0:
            dist.all_reduce(torch.ones(1000))
        else:
            dist.all_gather(
                [torch.empty(1000) for _ in range(dist.get_world_size())], torch.ones(1000)
            )
    print(f"RESULT {rank} none {time.monotonic() - start:.2f}", flush=True)
except Exception as e:
    print(f"RESULT {rank} {type(e).__name__} {time.monotonic() - start:.2f} {e}", flush=True)
os._exit(0)

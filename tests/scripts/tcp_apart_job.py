"""A job for tests/test_tcp_placement.py, one process per rank (env://).

Sets up the default entrenar group over TCP, narrows both ranks' affinity to
one CPU for 200 4 KiB allreduces, gives each rank its own mask back, then
runs ``ITERS`` more and prints ``CPUS <rank> <moves> <cpu after each call,
comma-separated>`` (``moves``: the mesh's TCP placement moves; -1 where the
tree has none).
"""

import ctypes
import os
import sys

import torch
import torch.distributed as dist
from short_timeout import SET_UP_TIMEOUT

dist.init_process_group("entrenar", timeout=SET_UP_TIMEOUT)
dist.barrier()
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
mesh = backend._runtime.mesh  # type: ignore[union-attr]
rank = dist.get_rank()
getcpu = ctypes.CDLL(None).sched_getcpu
allowed = os.sched_getaffinity(0)
t = torch.ones(1024)
os.sched_setaffinity(0, {min(allowed)})  # both ranks on one CPU
for _ in range(200):
    dist.all_reduce(t)
os.sched_setaffinity(0, allowed)  # free again: the scheduler may leave them there
cpus = []
for _ in range(int(os.environ.get("ITERS", "2000"))):
    dist.all_reduce(t)
    cpus.append(getcpu())
moves = getattr(getattr(mesh, "placement", None), "moves", -1)
# One write per line (print writes the newline apart: interleaves under PYTHONUNBUFFERED).
sys.stdout.write(f"CPUS {rank} {moves} {','.join(map(str, cpus))}\n")
sys.stdout.flush()
dist.destroy_process_group()

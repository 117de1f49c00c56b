"""Blame scenarios at N ranks, one process per rank under env:// (rank 0 hosts the store).

``stall``: star allreduces in a loop; the victim rank SIGSTOPs itself mid-loop.
``kill``: allreduces in a loop; the victim rank SIGKILLs itself mid-loop, and
every survivor exits right after its own error (rank 0 takes the store with it).
``p2pkill``: every survivor waits in a recv from the victim (no p2p link
existed: the recv makes the first); the victim SIGKILLs itself.

Each survivor prints one line ``RESULT <rank> <ErrorClass> <culprit> <message>``
(culprit: the error's ``culprit`` attribute, or ``-`` when it has none).
"""

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from short_timeout import init_group

mode, victim = sys.argv[1], int(sys.argv[2])
init_group()  # set-up under a generous timeout, then TIMEOUT_S
rank = dist.get_rank()
sig = signal.SIGSTOP if mode == "stall" else signal.SIGKILL
if rank == victim:
    threading.Timer(0.2, lambda: os.kill(os.getpid(), sig)).start()
try:
    end = time.monotonic() + 60
    if mode == "p2pkill":
        if rank == victim:
            time.sleep(60)
        dist.irecv(torch.empty(4), src=victim).wait()
    while time.monotonic() < end:
        dist.all_reduce(torch.ones(1024))
    print(f"RESULT {rank} none - no error", flush=True)
except Exception as e:
    culprit = getattr(e, "culprit", None)
    text = " ".join(str(e).split())
    who = "-" if culprit is None else culprit
    print(f"RESULT {rank} {type(e).__name__} {who} {text}", flush=True)
os._exit(0)

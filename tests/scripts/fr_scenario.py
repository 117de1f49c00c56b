"""Flight-recorder scenarios at N ranks, one process per rank under env://.

``python fr_scenario.py <mode> <victim> <k>``: a send/recv ring, then 4 KiB
allreduces; at step ``k`` (collective seq k + 2: the barrier is seq 1):

- ``desync``: the victim allreduces 512 floats instead of 1024;
- ``stall``: the victim writes its dump on demand, then SIGSTOPs itself
  (a rank hung in user code; its peers time out);
- ``kill``: the victim SIGKILLs itself (no dump from it).

Every rank records (``TORCH_FR_BUFFER_SIZE``) and dumps on the break
(``TORCH_FR_DUMP_ON_TIMEOUT``, ``TORCH_FR_DUMP_TEMP_FILE``: set by the test).
Each rank that sees the error prints ``RESULT <rank> <ErrorClass> <message>``
(the message on one line: the test shows it when the class is not the one expected).
"""

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from short_timeout import init_group

import entrenar_pg


def all_finished(store: dist.Store, rank: int, world: int, step: int) -> None:
    """Return once every rank has said it finished ``step`` (a store rendezvous)."""
    store.set(f"fr_scenario/finished/{step}/{rank}", "1")
    store.wait([f"fr_scenario/finished/{step}/{r}" for r in range(world)], timedelta(seconds=60))


mode, victim, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
init_group()  # set-up under a generous timeout, then TIMEOUT_S
rank, world = dist.get_rank(), dist.get_world_size()
store = dist.distributed_c10d._get_default_store()
t = torch.ones(1024)
ops = [
    dist.P2POp(dist.isend, t.clone(), (rank + 1) % world),
    dist.P2POp(dist.irecv, torch.empty(1024), (rank - 1) % world),
]
for w in dist.batch_isend_irecv(ops):
    w.wait()
try:
    for step in range(k + 1):
        if step == k and mode == "desync":
            # Every rank finishes the previous allreduce before any issues this
            # one (a rank still inside it when another sees the mismatch fails
            # there, and its records stop before the call the test is about).
            # Met in the store, not by a collective, which would be recorded
            # and shift the seqs; a fixed sleep was too short under load.
            all_finished(store, rank, world, step - 1)
        if step == k and rank == victim:
            if mode == "desync":
                dist.all_reduce(torch.ones(512))
                continue
            if mode == "stall":
                entrenar_pg.dump_flight_recorder()
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
    print(f"RESULT {rank} none", flush=True)
except Exception as e:
    message = " ".join(str(e).split())
    print(f"RESULT {rank} {type(e).__name__} {message}", flush=True)
os._exit(0)

"""One rank of tests/test_profiler.py: DDP and other calls under a default torch.profiler.

Each rank trains a small model in several buckets: one warm-up step (DDP
rebuilds its buckets after it), then 2 steps under the default CPU profiler
(which records this thread only) with ``record_shapes``, exported as a chrome
trace to ``$OUT_DIR/ddp_<rank>.json``. Then async broadcast, all_gather,
reduce_scatter, a blocking barrier and one p2p message, 0 -> 1, under a second
profiler (``ops_<rank>.json``): rank 1 posts its irecv before a barrier, rank
0 sends ``DELAY_S`` after it, so the recv's event must last at least that.
``$OUT_DIR/facts_<rank>.json`` holds what the test checks the traces
against: the bucket sizes DDP used (bytes), each collective's start and
completion as the flight recorder saw them (the test sets
``TORCH_FR_BUFFER_SIZE``), the main thread's id and the delay.
"""

import json
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity

import entrenar_pg.flight_recorder

DELAY_S = 0.05

dist.init_process_group("entrenar", timeout=timedelta(seconds=60))
rank = dist.get_rank()
out = os.environ["OUT_DIR"]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.Linear(128, 8))
# ~33-66 KiB per layer: a cap of 40 KB puts the layers in separate buckets
ddp = DDP(model, bucket_cap_mb=0.04)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
x, y = torch.randn(16, 64), torch.randn(16, 8)


def step() -> None:
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()


step()  # DDP rebuilds its buckets after the first step
with torch.profiler.profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    for _ in range(2):
        step()
prof.export_chrome_trace(os.path.join(out, f"ddp_{rank}.json"))

t = torch.full((1000,), float(rank))
with torch.profiler.profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    works = [
        dist.broadcast(t, 0, async_op=True),
        dist.all_gather([torch.empty(1000), torch.empty(1000)], t, async_op=True),
        dist.reduce_scatter_tensor(torch.empty(500), t, async_op=True),
    ]
    for w in works:
        w.wait()
    message = torch.empty(300, dtype=torch.float64)
    if rank == 1:
        recv = dist.irecv(message, 0)
        dist.barrier()
        recv.wait()
    else:
        dist.barrier()
        time.sleep(DELAY_S)
        dist.isend(message, 1).wait()
prof.export_chrome_trace(os.path.join(out, f"ops_{rank}.json"))

data = ddp._get_ddp_logging_data()
recorded = {
    e["collective_seq_id"]: [e["time_discovered_started_ns"], e["time_discovered_completed_ns"]]
    for e in entrenar_pg.flight_recorder.trace()["entries"]
    if not e["is_p2p"]
}
facts = {
    "bucket_sizes": [int(s) for s in str(data.get("rebuilt_bucket_sizes", "")).split(",") if s],
    "recorded": recorded,
    "main_thread": threading.main_thread().native_id,
    "steps": 2,
    "delay_s": DELAY_S,
}
with open(os.path.join(out, f"facts_{rank}.json"), "w") as f:
    json.dump(facts, f)
dist.destroy_process_group()

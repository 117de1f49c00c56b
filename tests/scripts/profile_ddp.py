"""A DDP step under torch.profiler on entrenar (tests/test_profiler.py).

Each rank trains a small model in several buckets for 3 steps, profiles the
last 2 (with ``profile_all_threads``, so the comm thread's events are kept,
and ``record_shapes``), exports a chrome trace to ``$OUT_DIR/trace_<rank>.json``
and writes ``$OUT_DIR/facts_<rank>.json``: the bucket sizes DDP used (elements)
and the comm thread's native id.
"""

import json
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch._C._profiler import _ExperimentalConfig
from torch.nn.parallel import DistributedDataParallel as DDP

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
config = _ExperimentalConfig(profile_all_threads=True)
with torch.profiler.profile(record_shapes=True, experimental_config=config) as prof:
    for _ in range(2):
        step()
prof.export_chrome_trace(os.path.join(out, f"trace_{rank}.json"))
data = ddp._get_ddp_logging_data()
comm = [t.native_id for t in threading.enumerate() if t.name.startswith("entrenar-r")]
facts = {
    "bucket_sizes": [int(s) for s in str(data.get("rebuilt_bucket_sizes", "")).split(",") if s],
    "per_bucket_limits": data.get("rebuilt_per_bucket_size_limits"),
    "comm_threads": comm,
    "main_thread": threading.main_thread().native_id,
    "steps": 2,
}
with open(os.path.join(out, f"facts_{rank}.json"), "w") as f:
    json.dump(facts, f)
dist.destroy_process_group()

"""An unmodified script under ``torchrun --max-restarts=1``: rank 1 dies in attempt 0.

The restarted attempt must form a fresh group (torchrun reuses the store, so
stale addresses from attempt 0 are still in it) and finish. Prints
``DONE <attempt> <rank> <value>``.
"""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("entrenar", timeout=timedelta(seconds=30))
t = torch.ones(4)
dist.all_reduce(t)
if attempt == 0 and dist.get_rank() == 1:
    os._exit(1)
if attempt == 0:
    time.sleep(10)  # lingers until torchrun stops it
dist.all_reduce(t)
print(f"DONE {attempt} {dist.get_rank()} {t[0].item()}", flush=True)
dist.destroy_process_group()

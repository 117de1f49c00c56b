"""One rank of a job whose last rank sets one ENTRENAR_* variable differently.

``options_disagree.py OUT_DIR VAR=VALUE``: the ranks form two emulated hosts
(``ENTRENAR_HOST_ID``: the first half, the second half); the last rank sets
``VAR=VALUE`` before ``init_process_group`` (``Options.from_env`` runs at
the group's creation), the others keep the job's environment. Each rank
writes what happened, and when, to ``OUT_DIR/rank<r>.json``: the error
creation raised, or, where creation succeeded, what a 16 KiB allreduce did
(before set-up compared the options, a flat rank among host-aware ones
waited there until the group's ``TIMEOUT_S``).
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
os.environ["ENTRENAR_HOST_ID"] = "a" if rank < world // 2 else "b"
if rank == world - 1:
    var, value = sys.argv[2].split("=", 1)
    os.environ[var] = value
outcome: dict[str, object] = {"rank": rank}
t0 = time.monotonic()
try:
    dist.init_process_group("entrenar", timeout=timedelta(seconds=float(os.environ["TIMEOUT_S"])))
    outcome["stage"] = "allreduce"
    t = torch.ones(4096)
    dist.all_reduce(t)
    outcome["sum"] = float(t[0])
except Exception as e:  # the outcome under test
    outcome["error"] = type(e).__name__
    outcome["message"] = str(e)
    outcome["culprit"] = getattr(e, "culprit", None)
outcome.setdefault("stage", "init")
outcome["seconds"] = time.monotonic() - t0
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(outcome))
if dist.is_initialized():
    dist.destroy_process_group()

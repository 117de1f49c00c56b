"""One rank of a job whose last rank sets one option differently.

``options_disagree.py OUT_DIR init VAR=VALUE``: the last rank sets
``VAR=VALUE`` in its environment before ``init_process_group``
(``Options.from_env`` runs at the group's creation).
``options_disagree.py OUT_DIR new_group FIELD=INT``: every rank makes the
default group alike, then a ``new_group`` whose ``pg_options`` are the
environment's (``Options.from_env()``) except on the last rank, which sets
``FIELD=INT`` over them; after it,
an allreduce on the default group (a failed new_group must leave it usable).

The ranks form two emulated hosts (``ENTRENAR_HOST_ID``: the first half, the
second half). Each rank writes what happened, and when, to
``OUT_DIR/rank<r>.json``: the error creation raised, or, where creation
succeeded, what a 16 KiB allreduce on the new group did (before set-up
compared the options, a flat rank among host-aware ones waited there until
the group's ``TIMEOUT_S``).
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from entrenar_pg import Options

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
out, mode, setting = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
name, value = setting.split("=", 1)
os.environ["ENTRENAR_HOST_ID"] = "a" if rank < world // 2 else "b"
last = rank == world - 1
if mode == "init" and last:
    os.environ[name] = value
timeout = timedelta(seconds=float(os.environ["TIMEOUT_S"]))
outcome: dict[str, object] = {"rank": rank}
t0 = time.monotonic()
try:
    if mode == "new_group":
        dist.init_process_group("entrenar", timeout=timeout)
        t0 = time.monotonic()
        options = Options.from_env(**{name: int(value)}) if last else Options.from_env()
        group = dist.new_group(backend="entrenar", pg_options=options, timeout=timeout)
    else:
        dist.init_process_group("entrenar", timeout=timeout)
        group = dist.group.WORLD
    outcome["stage"] = "allreduce"
    t = torch.ones(4096)
    dist.all_reduce(t, group=group)
    outcome["sum"] = float(t[0])
except Exception as e:  # the outcome under test
    outcome["error"] = type(e).__name__
    outcome["message"] = str(e)
    outcome["culprit"] = getattr(e, "culprit", None)
outcome.setdefault("stage", "creation")
outcome["seconds"] = time.monotonic() - t0
if mode == "new_group":  # the default group still works
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    outcome["world_sum"] = float(t[0])
(out / f"rank{rank}.json").write_text(json.dumps(outcome))
if dist.is_initialized():
    dist.destroy_process_group()

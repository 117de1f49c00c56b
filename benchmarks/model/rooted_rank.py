"""One rank of the barrier / broadcast measurement (``rooted_measure.py``), under torchrun.

``python -m benchmarks.model.rooted_rank --config SPEC.json --out DIR`` in an
emulated host's namespace. SPEC: ``{"sizes": [...], "rounds": R, "backends":
[...]}``. The rank joins a gloo default group (control) and one group per
backend (entrenar with its default ``Options``, gloo), checks one broadcast
per size (every element must be the root's), then for ``rounds`` rounds,
backends in rotated order: per op (the barrier, a broadcast from rank 0 of
each size) a control barrier, then the op timed on this rank's monotonic
clock (system-wide: every namespace shares it), and the CPU the rank's
process spent in it (``time.process_time``: every thread, the backend's own
included). ``DIR/rank<R>.json`` holds the (start, end, cpu) triples; the
driver takes a call's time as the last rank's end minus the last rank's start
(from when everyone has arrived). ``load``: the rank's CPU and wall over the
timed rounds, and on rank 0 the machine's (``cluster_load.BlockClock``), from
which the driver takes the cores other processes took meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.cluster_load import BlockClock
from benchmarks.config import FLOAT32_BYTES
from benchmarks.netns_job import write_record
from benchmarks.sizes import rotated

ROOT = 0


def op_names(sizes: list[int]) -> list[str]:
    return ["barrier", *(f"broadcast {s}" for s in sizes)]


def run(spec: dict[str, Any], out_dir: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    ctrl = dist.group.WORLD
    groups = {b: dist.new_group(list(range(world)), backend=b) for b in spec["backends"]}
    sizes = [int(s) for s in spec["sizes"]]
    bufs = {s: torch.zeros(s // FLOAT32_BYTES) for s in sizes}
    for backend, pg in groups.items():  # checked first calls
        for s, buf in bufs.items():
            buf.fill_(float(rank + 1))
            dist.broadcast(buf, ROOT, group=pg)
            if not bool((buf == float(ROOT + 1)).all()):
                raise RuntimeError(f"rank {rank}: {backend} broadcast of {s} B is wrong")
        dist.barrier(group=pg)
    times: dict[str, dict[str, list[list[float]]]] = {b: {} for b in groups}
    clock = BlockClock(reads_machine=rank == 0)  # the others' load over the timed rounds
    start = clock.read()
    for r in range(int(spec["rounds"])):
        for backend in rotated(list(groups), r):
            pg = groups[backend]
            for name in op_names(sizes):
                dist.barrier(group=ctrl)
                c0 = time.process_time()
                t0 = time.monotonic()
                if name == "barrier":
                    dist.barrier(group=pg)
                else:
                    dist.broadcast(bufs[int(name.split()[1])], ROOT, group=pg)
                t1 = time.monotonic()
                cpu = time.process_time() - c0
                times[backend].setdefault(name, []).append([t0, t1, cpu])
    load = BlockClock.block(start, clock.read())
    dist.barrier(group=ctrl)
    write_record(out_dir, rank, {"rank": rank, "times": times, "load": load})
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model.rooted_rank")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    run(json.loads(Path(a.config).read_text()), Path(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

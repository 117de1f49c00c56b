"""A job for tests/test_shm.py, one process per rank (env:// or torchrun).

``loop``: print ``READY <rank> <pid> <slots>`` after the first allreduce
(``slots``: 1 if the group has the slot areas of the shm-native allreduce),
then allreduce ``LOOP_NUMEL`` floats (default 16 Ki: 64 KiB) until an error;
print ``RESULT <rank> <ErrorClass> <culprit> <message>`` and wait to be
killed (the test kills every rank).
``small``: time ``ITERS`` 4 KiB allreduces; print ``MEDIAN <rank> <seconds>``
(median over blocks of 20 calls) and ``OK <rank>``.
``apart``: 64 KiB allreduces with both ranks' affinity narrowed to one CPU,
then ``ITERS`` more with each rank's own mask back; print ``CPUS <rank>
<moves> <cpu after each of those calls, comma-separated> <wall> <process
CPU> <machine busy CPU>`` (``moves``: the slot area's placement moves, -1
where it has none; the last three in seconds over those calls).
"""

import ctypes
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from short_timeout import SET_UP_TIMEOUT

from benchmarks.cluster_load import machine_busy_s

mode = sys.argv[1]
# Set-up under a generous timeout (on a loaded machine the ranks start seconds
# apart: a 3 s one failed a rank's set-up, which then printed nothing), then
# the test's own for the calls it times out.
dist.init_process_group("entrenar", timeout=SET_UP_TIMEOUT)
dist.barrier()
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
backend.set_timeout(timedelta(seconds=float(os.environ.get("ENTRENAR_TEST_TIMEOUT_S", "60"))))
rank, world = dist.get_rank(), dist.get_world_size()
mesh = backend._runtime.mesh  # type: ignore[union-attr]

if mode == "loop":
    t = torch.ones(int(os.environ.get("LOOP_NUMEL", 16 << 10)))
    dist.all_reduce(t)
    print(f"READY {rank} {os.getpid()} {int(mesh.slots is not None)}", flush=True)
    try:
        while True:
            dist.all_reduce(t)
    except Exception as e:
        text = " ".join(str(e).split())
        print(f"RESULT {rank} {type(e).__name__} {getattr(e, 'culprit', '-')} {text}", flush=True)
    time.sleep(600)
elif mode == "small":
    iters = int(os.environ.get("ITERS", "200"))
    t = torch.ones(1024)
    for _ in range(20):
        dist.all_reduce(t)
    blocks = []
    for _ in range(iters // 20):
        t0 = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(t)
        blocks.append((time.perf_counter() - t0) / 20)
    # One write per line (print writes the newline apart: interleaves under PYTHONUNBUFFERED).
    sys.stdout.write(f"MEDIAN {rank} {statistics.median(blocks)}\nOK {rank}\n")
    sys.stdout.flush()
elif mode == "apart":
    getcpu = ctypes.CDLL(None).sched_getcpu
    allowed = os.sched_getaffinity(0)
    t = torch.ones(16 << 10)
    os.sched_setaffinity(0, {min(allowed)})  # both ranks on one CPU
    for _ in range(200):
        dist.all_reduce(t)
    os.sched_setaffinity(0, allowed)  # free again: the scheduler may leave them there
    cpus = []
    start = (time.monotonic(), time.process_time(), machine_busy_s())
    for _ in range(int(os.environ.get("ITERS", "2000"))):
        dist.all_reduce(t)
        cpus.append(getcpu())
    end = (time.monotonic(), time.process_time(), machine_busy_s())
    moves = getattr(getattr(mesh.slots, "placement", None), "moves", -1)
    # The free phase's wall, this process's CPU and the machine's busy CPU
    # (the test subtracts both ranks' CPU: what the rest of the machine took).
    spent = " ".join(f"{b - a:.4f}" for a, b in zip(start, end, strict=True))
    sys.stdout.write(f"CPUS {rank} {moves} {','.join(map(str, cpus))} {spent}\n")
    sys.stdout.flush()
dist.destroy_process_group()

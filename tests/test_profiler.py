"""Collectives in torch.profiler traces (docs/debugging.md).

A real DDP run at N = 2 (tests/scripts/profile_ddp.py) under
``torch.profiler.profile(record_shapes=True, experimental_config=
_ExperimentalConfig(profile_all_threads=True))``: its exported chrome trace
has one ``entrenar:allreduce`` event per bucket per step, each with the
bucket's shape, dtype and bytes, on the group's comm thread (DDP's buckets are
async), not the main thread; and nothing is recorded outside a profiler.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import free_port, rank_env, run_ranks

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "profile_ddp.py"


@pytest.mark.timeout(180)
def test_ddp_buckets_show_in_a_chrome_trace_on_the_comm_thread(tmp_path: Path) -> None:
    port = free_port()
    extra = dict(
        OUT_DIR=str(tmp_path),
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT)],
            env=rank_env(r, 2, port, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, f"rank {r}:\n{out[-2000:]}\n{err[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    for r in range(2):
        facts = json.loads((tmp_path / f"facts_{r}.json").read_text())
        trace = json.loads((tmp_path / f"trace_{r}.json").read_text())
        events = [e for e in trace["traceEvents"] if e.get("name") == "entrenar:allreduce"]
        buckets = facts["bucket_sizes"]
        assert len(buckets) >= 2, facts  # the model is split into several buckets
        assert len(events) == facts["steps"] * len(buckets)
        for e in events:
            dims, types = e["args"]["Input Dims"], e["args"]["Input type"]
            nbytes, seq = (int(v) for v in e["args"]["Concrete Inputs"][1:])
            assert nbytes in buckets  # each event is one bucket: its bytes,
            assert dims[0] == [nbytes // 4] and types[0] == "float"  # shape, dtype
            assert seq > 0
            assert e["tid"] in facts["comm_threads"] and e["tid"] != facts["main_thread"]
            assert e["dur"] > 0
        assert sorted(int(e["args"]["Concrete Inputs"][1]) for e in events) == sorted(
            buckets * facts["steps"]
        )


@pytest.mark.timeout(60)
def test_blocking_calls_are_events_in_the_callers_thread() -> None:
    """Blocking calls on an idle group run in the caller's thread: the default
    profiler (this thread only) shows them, each with its shape."""

    def work(rank: int, g) -> list[tuple[str, list[int]]]:
        t = torch.ones(300)
        if rank != 0:
            g.allreduce([t], blocking(dist.AllreduceOptions())).wait()
            g.broadcast([t], blocking(dist.BroadcastOptions())).wait()
            return []
        # the default profiler records this thread only: the events are here
        with torch.profiler.profile(record_shapes=True) as prof:
            g.allreduce([t], blocking(dist.AllreduceOptions())).wait()
            g.broadcast([t], blocking(dist.BroadcastOptions())).wait()
        return [(e.key, e.input_shapes[0]) for e in prof.events() if e.key.startswith("entrenar:")]

    events = run_ranks(2, work)[0]
    assert events == [("entrenar:allreduce", [300]), ("entrenar:broadcast", [300])]


def blocking(opts: Any) -> Any:
    """Options as torch passes them for async_op=False."""
    opts.asyncOp = False
    return opts

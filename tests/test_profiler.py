"""Collectives and p2p ops in torch.profiler traces (docs/debugging.md).

Every call is one event named as torch names gloo's (``entrenar:all_reduce``,
``entrenar:send 0->1``: the flight recorder's ``profiling_name``), opened on
the caller's thread when the call is made and closed when its work completes,
so a default profiler (which records only the thread it runs in) shows the
async ones too: DDP's buckets among them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import free_port, kill_sessions, rank_env, run_ranks
from preloaded import start_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "profile_ddp.py"
# The profiler's clock and time.time_ns() tick at the same rate; durations
# taken on each may differ by their reading granularity.
CLOCKS_US = 10.0


def run_script(tmp_path: Path) -> None:
    port = free_port()
    extra = dict(
        OUT_DIR=str(tmp_path),
        TORCH_FR_BUFFER_SIZE="1000",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    procs = [
        start_script([str(SCRIPT)], env=rank_env(r, 2, port, **extra), new_session=True)
        for r in range(2)
    ]
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, f"rank {r}:\n{out[-2000:]}\n{err[-3000:]}"
    finally:
        kill_sessions(procs)


def ours(trace_file: Path) -> list[dict[str, Any]]:
    """The exported chrome trace's entrenar events."""
    trace = json.loads(trace_file.read_text())
    return [e for e in trace["traceEvents"] if e.get("name", "").startswith("entrenar:")]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ddp_buckets_and_async_calls_show_in_a_default_chrome_trace(tmp_path: Path) -> None:
    run_script(tmp_path)
    for r in range(2):
        facts = json.loads((tmp_path / f"facts_{r}.json").read_text())
        main = facts["main_thread"]

        # DDP: one all_reduce per bucket per step, on the thread that ran the
        # backward, spanning the bucket's whole transfer.
        events = ours(tmp_path / f"ddp_{r}.json")
        reduces = [e for e in events if e["name"] == "entrenar:all_reduce"]
        buckets = facts["bucket_sizes"]
        assert len(buckets) >= 2, facts  # the model is split into several buckets
        assert len(reduces) == facts["steps"] * len(buckets), [e["name"] for e in events]
        for e in reduces:
            dims, types = e["args"]["Input Dims"], e["args"]["Input type"]
            nbytes, seq = (int(v) for v in e["args"]["Concrete Inputs"][1:])
            assert nbytes in buckets  # each event is one bucket: its bytes,
            assert dims[0] == [nbytes // 4] and types[0] == "float"  # shape, dtype
            assert e["tid"] == main
            # from the call to its completion: at least the job's run, as the
            # flight recorder timed it on the comm thread
            started_ns, completed_ns = facts["recorded"][str(seq)]
            assert e["dur"] >= (completed_ns - started_ns) / 1000 - CLOCKS_US, (e, started_ns)
        assert sorted(int(e["args"]["Concrete Inputs"][1]) for e in reduces) == sorted(
            buckets * facts["steps"]
        )

        # async collectives, a blocking barrier and p2p, each on the main thread
        events = ours(tmp_path / f"ops_{r}.json")
        p2p = "entrenar:send 0->1" if r == 0 else "entrenar:recv 1<-0"
        expected = [
            ("entrenar:broadcast", [[1000]], ["float"]),
            ("entrenar:all_gather", [[1000], [1000], [1000]], ["float"] * 3),
            ("entrenar:reduce_scatter", [[1000], [500]], ["float"] * 2),
            ("entrenar:barrier", [], []),
            (p2p, [[300]], ["double"]),
        ]
        seen = []
        for e in sorted(events, key=lambda e: e["ts"]):
            tensors = [
                i for i, kind in enumerate(e["args"].get("Input type", [])) if kind != "Scalar"
            ]
            dims = [e["args"]["Input Dims"][i] for i in tensors]
            seen.append((e["name"], dims, [e["args"]["Input type"][i] for i in tensors]))
            assert e["tid"] == main, e
        # the receiver posted its recv before a barrier; the sender sent delay_s after it
        assert sorted(seen) == sorted(expected)
        if r == 1:
            (recv,) = [e for e in events if e["name"] == p2p]
            assert recv["dur"] >= facts["delay_s"] * 1e6, recv


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
    assert events == [("entrenar:all_reduce", [300]), ("entrenar:broadcast", [300])]


def blocking(opts: Any) -> Any:
    """Options as torch passes them for async_op=False."""
    opts.asyncOp = False
    return opts

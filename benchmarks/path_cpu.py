"""CPU per blocking 4 KiB allreduce of the call path alone, this tree against another.

``python -m benchmarks.path_cpu --baseline-tree /work/wt/base [--rounds 6]``

A one-rank group (nothing to send: the algorithm is NONE) runs the calls, so
what is timed is the path's own work, the part a change to the runtime or
the thin path adds to or takes from: the thin path (``dist.all_reduce``'s
blocking form) and the long one (the single-argument form, inline in the
caller's thread). Each round runs both trees in fresh processes, one after
the other, alternating which goes first; each process reports its thread's
CPU time per call (``time.thread_time``: another process's load slows the
wall clock, much less this). The result is the median per-round ratio,
beside the rounds' spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from functools import partial

from benchmarks.baseline import copy_baseline_package

_CALLS = 20_000
_BLOCKS = 5  # per process and path: the best block counts (the least disturbed)


def measure() -> dict[str, float]:
    """In a worker: ns of thread CPU per call, per path (the best of ``_BLOCKS``)."""
    import torch
    import torch.distributed as dist

    from entrenar_pg import EntrenarProcessGroup
    from entrenar_pg.runtime.thin import DoneWork

    pg = EntrenarProcessGroup(dist.HashStore(), 0, 1, timeout=timedelta(seconds=30))
    t = torch.ones(1024)  # 4 KiB of float32
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    forms = {"thin": partial(pg.allreduce, [t], opts), "long": partial(pg.allreduce, [t])}
    out = {}
    for name, call in forms.items():
        for _ in range(100):  # warm: the thin path learns SUM on float32, caches fill
            call().wait()
        if isinstance(call(), DoneWork) != (name == "thin"):
            raise SystemExit(f"the {name} form did not take the {name} path")
        best = float("inf")
        for _ in range(_BLOCKS):
            start = time.thread_time_ns()
            for _ in range(_CALLS):
                call().wait()
            best = min(best, (time.thread_time_ns() - start) / _CALLS)
        out[name] = best
    pg.shutdown()
    return out


def _run(root: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": root}
    got = subprocess.run(
        [sys.executable, "-m", "benchmarks.path_cpu", "--worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, float] = json.loads(got.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-tree", help="a tree whose entrenar_pg is the baseline")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure()))
        return
    if not args.baseline_tree:
        ap.error("--baseline-tree is required")
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="entrenar_path_cpu_") as tmp:
        base = copy_baseline_package(args.baseline_tree, tmp)
        # The baseline copy holds only the package: the bench's own modules
        # come from this checkout (PYTHONPATH order).
        roots = {"new": here, "baseline": f"{base}{os.pathsep}{here}"}
        rows: dict[str, list[tuple[float, float]]] = {"thin": [], "long": []}
        for r in range(args.rounds):
            order = ["new", "baseline"] if r % 2 == 0 else ["baseline", "new"]
            got = {side: _run(roots[side]) for side in order}
            for path, pairs in rows.items():
                pairs.append((got["new"][path], got["baseline"][path]))
            print(f"round {r + 1}: {json.dumps(got)}", flush=True)
    load = os.getloadavg()
    print(f"\nthread CPU per call, ns (best block of {_CALLS} calls), load {load[0]:.1f}")
    print("path   new (median)  baseline (median)  new/baseline (median)  rounds (min-max)")
    for path, pairs in rows.items():
        ratios = [n / b for n, b in pairs]
        print(
            f"{path:5}  {statistics.median(n for n, _ in pairs):12.0f}  "
            f"{statistics.median(b for _, b in pairs):17.0f}  "
            f"{statistics.median(ratios):21.3f}  {min(ratios):.3f}-{max(ratios):.3f}"
        )


if __name__ == "__main__":
    main()

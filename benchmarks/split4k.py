"""Where a small blocking ``dist.all_reduce`` on entrenar spends its time (issue 17).

Run from the repository root::

    python -m benchmarks.split4k [--world 2] [--size 4K] [--iters 2000] [--transport tcp]

Two spawned ranks (``--world``) each time ``--iters`` blocking float32 SUM
allreduces of ``--size`` on three process groups, interleaved in blocks:

- ``floor``: benchmarks/floor.py's backend, which moves nothing. A Python
  ``dist.ProcessGroup`` subclass like entrenar's, so ``dist.all_reduce`` on it
  is torch's dispatch into a Python backend (the C++ front end, the trampoline
  into Python, the Work's return and ``wait``) plus an empty method;
  ``floor direct`` calls the same method from Python, without torch: the
  difference is torch's share.
- ``entrenar``, with perf_counter_ns probes around its nested layers (installed
  in the ranks only, by wrapping attributes: entrenar_pg is not edited):
  ``EntrenarProcessGroup.allreduce`` (argument normalization, checks, the
  request) ⊃ ``Runtime.submit`` (staging, seq, Work, job, the executor token)
  ⊃ ``Runtime.run`` (busy-poll and timeout set-up, staging load/store, the job
  table) ⊃ the algorithm (``jobs._ALLREDUCE[algo]``: the transport, including
  the wait for the slowest peer), and ``EntrenarWork.wait``. A call the thin
  path takes (``runtime/thin.py``: the common blocking call) nests instead
  as ``pg.allreduce`` ⊃ ``ThinPath.allreduce`` (checks, seq, the executor
  token, stats) ⊃ the algorithm, and its Work's wait is ``DoneWork.wait``;
  the report shows whichever route the calls took.
- ``entrenar`` without probes, for the probes' own cost.

The report is rank 0's medians per layer and the exclusive time of each
(a layer minus the one nested in it). ``--transport`` sets ENTRENAR_TRANSPORT
for the entrenar group (ignored by an entrenar_pg without ``Options.transport``);
``--cprofile FILE`` also profiles a block of unprobed entrenar calls after
each probed one (rank 0's profile saved to FILE; its 25 top lines printed).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import floor
from benchmarks.sizes import format_bytes, parse_bytes
from benchmarks.spawn import free_port

# Layers, outermost first: each one's time contains the next one's (the long
# path's, and the thin path's: runtime/thin.py).
LAYERS = ("dist.all_reduce", "pg.allreduce", "Runtime.submit", "Runtime.run", "algorithm")
THIN_LAYERS = ("dist.all_reduce", "pg.allreduce", "ThinPath.allreduce", "algorithm")
BLOCK = 100  # iterations per interleaved block


class Probe:
    """Wraps a function (or method) and appends each call's duration in ns to ``ns``."""

    def __init__(self, fn: Callable[..., Any], ns: list[int]) -> None:
        self.fn = fn
        self.ns = ns

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.ns.append(time.perf_counter_ns() - t0)

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        """As a class attribute, bind like the function it wraps."""
        return self if obj is None else types.MethodType(self, obj)


class Probes:
    """entrenar's layers wrapped in :class:`Probe` (this process only), removable.

    Every algorithm of the job table records into one ``algorithm`` list.
    """

    def __init__(self) -> None:
        from entrenar_pg.api import process_group
        from entrenar_pg.call import work
        from entrenar_pg.runtime import engine, jobs, runtime

        self.targets: tuple[tuple[str, Any, str], ...] = (
            ("pg.allreduce", process_group.EntrenarProcessGroup, "allreduce"),
            ("Runtime.submit", runtime.Runtime, "submit"),
            ("Runtime.run", runtime.Runtime, "run"),
            ("Work.wait", work.EntrenarWork, "wait"),
            # Called only when a call is handed to the comm thread instead of
            # running in the caller's: counts the hand-offs.
            ("Engine.submit", engine.Engine, "submit"),
        )
        try:  # a tree without the thin path (a baseline) has none of these
            from entrenar_pg.runtime import thin
        except ImportError:
            pass
        else:
            self.targets += (
                ("ThinPath.allreduce", thin.ThinPath, "allreduce"),
                ("DoneWork.wait", thin.DoneWork, "wait"),
            )
        self.table: dict[Any, Callable[..., None]] = jobs._ALLREDUCE
        self.ns: dict[str, list[int]] = {name: [] for name, _, _ in self.targets}
        self.ns["algorithm"] = []
        self.originals = {name: getattr(owner, attr) for name, owner, attr in self.targets}
        self.algorithms: dict[Any, Callable[..., None]] = dict(self.table)

    def install(self) -> None:
        for name, owner, attr in self.targets:
            setattr(owner, attr, Probe(self.originals[name], self.ns[name]))
        for key, fn in self.algorithms.items():
            self.table[key] = Probe(fn, self.ns["algorithm"])

    def remove(self) -> None:
        for name, owner, attr in self.targets:
            setattr(owner, attr, self.originals[name])
        self.table.update(self.algorithms)

    def clear(self) -> None:
        for ns in self.ns.values():
            ns.clear()


def _timed(call: Callable[[], Any], n: int, out: list[int]) -> None:
    for _ in range(n):
        t0 = time.perf_counter_ns()
        call()
        out.append(time.perf_counter_ns() - t0)


class _AllReduce:
    """``dist.all_reduce(t, group=g)`` as a call with no arguments."""

    def __init__(self, t: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.t, self.group = t, group

    def __call__(self) -> None:
        dist.all_reduce(self.t, group=self.group)


class _Direct:
    """The floor backend's Python method called from Python, without torch's dispatch."""

    def __init__(self, t: torch.Tensor, pg: floor.FloorProcessGroup) -> None:
        self.t, self.pg = t, pg

    def __call__(self) -> None:
        self.pg.allreduce([self.t]).wait()


def rank_main(rank: int, world: int, port: int, args: dict[str, Any], out_path: str) -> None:
    """One rank: groups, interleaved blocks, rank 0 writes the samples as JSON."""
    torch.set_num_threads(1)
    if args["transport"]:
        os.environ["ENTRENAR_TRANSPORT"] = args["transport"]
    import entrenar_pg  # noqa: F401 - registers the backend

    probes = Probes()
    probes.install()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    ranks = list(range(world))
    floor.register()
    floor_pg = dist.new_group(ranks, backend=floor.BACKEND)
    ent = dist.new_group(ranks, backend="entrenar")
    t = torch.zeros(args["size"] // 4, dtype=torch.float32)
    floor_impl = floor.FloorProcessGroup(rank, world)  # the same class, called from Python
    calls: dict[str, Callable[[], Any]] = {
        "floor": _AllReduce(t, floor_pg),
        "floor direct": _Direct(t, floor_impl),
        "entrenar": _AllReduce(t, ent),
    }
    samples: dict[str, list[int]] = {name: [] for name in (*calls, "entrenar (no probes)")}
    # Every rank runs the profiled block (the calls are collective); rank 0 records it.
    profiler = cProfile.Profile() if args["cprofile"] else None
    if profiler is not None:
        samples["entrenar (cProfile)"] = []
    for _ in range(10):
        dist.all_reduce(t, group=ent)  # warm-up: connections, the policy's cache
    probes.clear()
    blocks = -(-args["iters"] // BLOCK)
    for _ in range(blocks):
        for name, call in calls.items():
            dist.barrier()
            if name == "entrenar":
                _timed(call, BLOCK, samples[name])
                # The same calls without the probes, right after: their cost.
                probes.remove()
                dist.barrier()
                _timed(call, BLOCK, samples["entrenar (no probes)"])
                if profiler is not None:  # a block of its own: cProfile slows every call
                    dist.barrier()
                    profiler.enable()
                    _timed(call, BLOCK, samples["entrenar (cProfile)"])
                    profiler.disable()
                probes.install()
            else:
                _timed(call, BLOCK, samples[name])
    dist.barrier()
    if rank == 0:
        result: dict[str, Any] = {
            "samples_ns": samples,
            "probes_ns": probes.ns,
        }
        if profiler is not None:  # rank 0's; the others profiled only to keep in step
            buf = io.StringIO()
            pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
            profiler.dump_stats(args["cprofile"])
            result["cprofile_top"] = buf.getvalue()
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def _median_us(ns: Sequence[int]) -> float:
    return statistics.median(ns) / 1e3 if ns else float("nan")


def _exclusive_us(outer: Sequence[int], inner: Sequence[int] | None) -> float:
    """Median over calls of (outer - inner), paired call by call (medians do not subtract)."""
    if inner is None:
        return _median_us(outer)
    if len(outer) != len(inner):  # not one inner per outer call: medians are all there is
        return _median_us(outer) - _median_us(inner)
    return _median_us([a - b for a, b in zip(outer, inner, strict=True)])


def report(result: dict[str, Any]) -> list[str]:
    """Rank 0's medians: the reference rows, then entrenar's layers and their exclusive time."""
    s, p = result["samples_ns"], result["probes_ns"]
    med = {name: _median_us(v) for name, v in s.items()}
    lines = ["median per call on rank 0 (us):"]
    for name, v in med.items():
        lines.append(f"  {name:<24} {v:9.1f}")
    torch_share = med["floor"] - med["floor direct"]
    lines.append(
        f"  torch's dispatch into a Python backend (floor - floor direct): {torch_share:.1f}"
    )
    # The thin path's layers when it took most calls (each call runs one route).
    thin = len(p.get("DoneWork.wait", [])) > len(p.get("Work.wait", []))
    layers = THIN_LAYERS if thin else LAYERS
    waited = "DoneWork.wait" if thin else "Work.wait"
    ns = {"dist.all_reduce": s["entrenar"], **{name: p.get(name, []) for name in layers[1:]}}
    wait = _median_us(p.get(waited, []))
    lines.append(
        "entrenar's layers (median of each; exclusive: median over calls of the layer minus "
        "the next inner one):"
    )
    for outer, inner in zip(layers, (*layers[1:], None), strict=True):
        excl = _exclusive_us(ns[outer], ns[inner] if inner else None)
        lines.append(f"  {outer:<18} {_median_us(ns[outer]):9.1f}   exclusive {excl:9.1f}")
    lines.append(f"  {waited:<18} {wait:9.1f}   (part of dist.all_reduce's exclusive time)")
    handed = len(p.get("Engine.submit", []))
    lines.append(
        f"calls handed to the comm thread (not run in the caller's): {handed} of "
        f"{len(s['entrenar'])}"
    )
    lines.append(
        f"probes' cost: entrenar {med['entrenar']:.1f} with, "
        f"{med['entrenar (no probes)']:.1f} without"
    )
    if "cprofile_top" in result:
        lines += ["", result["cprofile_top"]]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.split4k", description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--size", default="4K")
    p.add_argument("--iters", type=int, default=2000, help="timed calls per variant")
    p.add_argument("--transport", default="", help="ENTRENAR_TRANSPORT for the entrenar group")
    p.add_argument("--cprofile", default="", metavar="FILE", help="profile extra unprobed calls")
    p.add_argument("--json", default="", metavar="FILE", help="also write rank 0's samples here")
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    args = {
        "size": parse_bytes(a.size),
        "iters": a.iters,
        "transport": a.transport,
        "cprofile": a.cprofile,
    }
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="entrenar_split_") as tmp:
        out = os.path.join(tmp, "rank0.json")
        procs = [
            ctx.Process(target=rank_main, args=(r, a.world, port, args, out))
            for r in range(a.world)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + a.timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if any(proc.exitcode != 0 for proc in procs) or not os.path.exists(out):
            print(f"split4k failed: exit codes {[pr.exitcode for pr in procs]}", file=sys.stderr)
            return 1
        result = json.loads(Path(out).read_text())
    transport = a.transport or os.environ.get("ENTRENAR_TRANSPORT", "") or "default"
    print(
        f"{format_bytes(args['size'])} float32 SUM, N={a.world}, {a.iters} calls each, "
        f"transport {transport}, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}"
    )
    print("\n".join(report(result)))
    if a.json:
        Path(a.json).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

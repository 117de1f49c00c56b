"""Count the Python calls one blocking 4 KiB allreduce makes (issue 25, item 6).

``python -m benchmarks.calls [--transports shm,tcp] [--repeats 3] [--json PATH]``

Two ranks run as threads of this process, each with its own entrenar group
(``Options(transport=...)``, real shared memory or real loopback TCP). After a
warm-up (plans, byte views, policy answers cached) rank 0 counts, with
``sys.setprofile`` on its own thread, every profiler event of one
``dist.all_reduce`` of 1024 float32 (4 KiB): ``call`` events (Python
functions entered; generated code such as a dataclass's ``__init__`` is
filed under the file that called it) and, separately, ``c_call`` events (builtins and C
methods called from Python). Each is filed under the file of the code that
ran (for ``c_call``, the Python code that made the call): ``ours`` (under
``entrenar_pg/``), ``torch``, or ``other``.

Which thread does the work: a blocking call on an idle group runs in the
caller's thread (the thin path, ``runtime/thin.py``, or ``Runtime.submit``'s
inline path), but a call that hops to the group's comm thread would hide
its work there. So the same profiler is
installed with ``threading.setprofile`` while the groups are made (every
thread they start inherits it) and whatever those threads run while rank 0's
call is counted lands in ``other_threads``. Those threads belong to both
ranks, so a non-zero figure there is an upper bound on rank 0's share; zero
means the call never left the caller's thread.

What makes the count the same each time: the peer is let in first. Rank 1
starts its all_reduce, rank 0 waits until rank 1's group has issued it (its
sequence number moved) and ``--peer-lead`` seconds more (its part is then in
the ring or the socket) and makes its own call, which then sends and
receives in its first attempt and never enters the busy-poll loop, whose
turns depend on timing. That is the common call's path. A rank that arrives
first also pays the calls of its wait (the busy-poll turns, the shared-memory
slot waits): ``caller_first`` counts that case too (rank 0 leading by the
same lead), for information only, as it varies from run to run. Each transport is counted
``--repeats`` times; ``deterministic`` says whether every count agreed.

Thread ranks, not processes, because they start in a second and the path
is the same code: the same counter in two torchrun processes (every Python
thread of rank 0 profiled) gave the same counts (docs/benchmarks.md).

No garbage collection runs while a call is counted (one is made just
before): a collection's finalizers are earlier work's calls, not this one's.

The counts are of events, not time: the profiler slows the call down, the
count does not depend on it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

import entrenar_pg
from entrenar_pg import EntrenarProcessGroup, Options

SIZE_BYTES = 4 << 10
WORLD = 2
WARMUP = 5
TRANSPORTS = ("shm", "tcp")
OURS_ROOT = str(Path(entrenar_pg.__file__).resolve().parent)
TORCH_ROOT = str(Path(torch.__file__).resolve().parent)


def origin(filename: str) -> str:
    """``ours``, ``torch`` or ``other``: whose code a file is."""
    if filename.startswith(OURS_ROOT):
        return "ours"
    if filename.startswith(TORCH_ROOT):
        return "torch"
    return "other"


def short_name(filename: str) -> str:
    """A file under entrenar_pg/ or torch/ relative to that package; any other as given."""
    for root in (OURS_ROOT, TORCH_ROOT):
        if filename.startswith(root):
            return filename[len(root) + 1 :]
    return filename


@dataclass
class CallCount:
    """The profiler events seen while one call is counted (``open``)."""

    caller: int = 0  # the counted thread's ident
    open: bool = False
    calls: Counter[str] = field(default_factory=Counter)  # origin -> call events
    c_calls: Counter[str] = field(default_factory=Counter)  # origin -> c_call events
    files: Counter[str] = field(default_factory=Counter)  # our file -> call events
    functions: Counter[str] = field(default_factory=Counter)  # "file:qualname" -> calls
    other_threads: int = 0  # call + c_call events on any other profiled thread

    def event(self, frame: FrameType, what: str, arg: Any) -> None:
        """The profile function (``sys.setprofile`` / ``threading.setprofile``)."""
        if not self.open or what not in ("call", "c_call"):
            return
        if threading.get_ident() != self.caller:
            self.other_threads += 1
            return
        filename = frame.f_code.co_filename
        if filename.startswith("<") and frame.f_back is not None:
            # Generated code (a dataclass's __init__ is compiled from "<string>"):
            # the file that called it owns it.
            filename = frame.f_back.f_code.co_filename
        who = origin(filename)
        if what == "c_call":
            self.c_calls[who] += 1
            return
        self.calls[who] += 1
        if who == "ours":
            self.files[short_name(filename)] += 1
        self.functions[f"{short_name(filename)}:{frame.f_code.co_qualname}"] += 1

    def summary(self) -> dict[str, Any]:
        """The JSON-able counts."""
        return {
            "calls": {k: self.calls[k] for k in ("ours", "torch", "other")},
            "c_calls": {k: self.c_calls[k] for k in ("ours", "torch", "other")},
            "our_files": len(self.files),
            "per_file": dict(self.files.most_common()),
            "top_functions": dict(self.functions.most_common(30)),
            "other_threads": self.other_threads,
        }


def make_pair(transport: str, counter: CallCount, timeout_s: float) -> list[EntrenarProcessGroup]:
    """Two entrenar groups (ranks 0 and 1) over ``transport``, made on threads that
    carry ``counter``'s profile function, so every thread the groups start has it."""
    store = dist.HashStore()
    groups: list[Any] = [None] * WORLD
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            groups[rank] = EntrenarProcessGroup(
                dist.PrefixStore(f"calls-{transport}", store),
                rank,
                WORLD,
                timeout=timedelta(seconds=timeout_s),
                options=Options(transport=transport),
            )
        except BaseException as e:  # reported below
            errors.append(e)

    threading.setprofile(counter.event)
    try:
        threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 5)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    if errors or any(g is None for g in groups):
        for g in groups:
            if g is not None:
                g.shutdown()
        raise RuntimeError(f"making the {transport} groups failed: {errors or 'a hang'}")
    return groups


class Pair:
    """Two thread ranks of one transport, ready to have rank 0's calls counted."""

    def __init__(self, transport: str, timeout_s: float = 30.0) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self.counter = CallCount()
        self.groups = make_pair(transport, self.counter, timeout_s)
        self.tensors = [torch.ones(SIZE_BYTES // 4) for _ in range(WORLD)]

    def _both(self, rank0: Any, rank1: Any) -> None:
        """Run rank 0's and rank 1's steps on two threads; a hang or error raises."""
        errors: list[BaseException] = []

        def guarded(step: Any) -> None:
            try:
                step()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=guarded, args=(s,), daemon=True) for s in (rank0, rank1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s)
        if any(t.is_alive() for t in threads):
            for g in self.groups:
                g.abort()
            raise RuntimeError(f"{self.transport}: an allreduce hung past {self.timeout_s}s")
        if errors:
            raise errors[0]

    def _allreduce(self, rank: int) -> None:
        dist.all_reduce(self.tensors[rank], group=self.groups[rank])

    def warm_up(self, iters: int = WARMUP) -> None:
        for _ in range(iters):
            self._both(partial(self._allreduce, 0), partial(self._allreduce, 1))

    def _late_allreduce(self, rank: int, delay_s: float) -> None:
        time.sleep(delay_s)
        self._allreduce(rank)

    def count(self, peer_lead_s: float = 0.05) -> dict[str, Any]:
        """Rank 0's events for one blocking allreduce, the peer having arrived
        ``peer_lead_s`` first; a negative lead makes rank 0 the first, by ``-peer_lead_s``
        (it then also counts its waiting, which depends on timing)."""
        counter = self.counter
        result: dict[str, Any] = {}

        peer = self.groups[1]._runtime  # our own group: its sequence counter
        issued = peer.seq
        deadline = time.monotonic() + self.timeout_s

        def rank0() -> None:
            # The peer first: it has taken its sequence number (its send follows
            # at once), then the lead covers its send.
            while peer_lead_s > 0 and peer.seq == issued and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(max(0.0, peer_lead_s))
            counter.__init__()  # type: ignore[misc]  # fresh counts, same object
            counter.caller = threading.get_ident()
            # A garbage collection inside the counted call would run finalizers
            # of earlier work (another test's, in a suite) on this thread and
            # count them: collect now, none while counting.
            collecting = gc.isenabled()
            gc.collect()
            gc.disable()
            try:
                sys.setprofile(counter.event)
                counter.open = True
                dist.all_reduce(self.tensors[0], group=self.groups[0])
            finally:
                counter.open = False
                sys.setprofile(None)
                if collecting:
                    gc.enable()
            result.update(counter.summary())

        self._both(rank0, partial(self._late_allreduce, 1, max(0.0, -peer_lead_s)))
        return result

    def close(self) -> None:
        for g in self.groups:
            g.shutdown()


def count_transport(transport: str, repeats: int, peer_lead_s: float) -> dict[str, Any]:
    """Count ``repeats`` times on one warmed-up pair; the first count plus agreement."""
    pair = Pair(transport)
    try:
        pair.warm_up()
        counts = [pair.count(peer_lead_s) for _ in range(repeats)]
        caller_first = [pair.count(-peer_lead_s)["calls"] for _ in range(repeats)]
    finally:
        pair.close()
    first = counts[0]
    first["repeats"] = [c["calls"] for c in counts]
    first["deterministic"] = all(c["calls"] == first["calls"] for c in counts)
    first["caller_first"] = caller_first
    return first


def count_all(
    transports: Sequence[str] = TRANSPORTS, repeats: int = 3, peer_lead_s: float = 0.05
) -> dict[str, Any]:
    """Every transport's counts, with the conditions that produced them."""
    torch.set_num_threads(1)
    return {
        "conditions": {
            "world_size": WORLD,
            "size_bytes": SIZE_BYTES,
            "dtype": "float32",
            "ranks": "threads of one process; rank 0's thread counted",
            "warmup_calls": WARMUP,
            "peer_lead_s": peer_lead_s,
            "entrenar_pg": OURS_ROOT,
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "transports": {t: count_transport(t, repeats, peer_lead_s) for t in transports},
    }


def table_lines(result: dict[str, Any]) -> list[str]:
    """The counts as a text table (one row per transport), then the per-file counts."""
    lines = [
        "Python calls per 4 KiB allreduce, N=2, rank 0, blocking, warmed-up idle group",
        f"{'transport':<10}{'ours':>6}{'torch':>7}{'other':>7}{'files':>7}"
        f"{'c_ours':>8}{'c_torch':>8}{'c_other':>8}{'threads':>9}  same each time"
        "  (ours, rank 0 first)",
    ]
    for name, r in result["transports"].items():
        c, cc = r["calls"], r["c_calls"]
        lines.append(
            f"{name:<10}{c['ours']:>6}{c['torch']:>7}{c['other']:>7}{r['our_files']:>7}"
            f"{cc['ours']:>8}{cc['torch']:>8}{cc['other']:>8}{r['other_threads']:>9}"
            f"  {'yes' if r['deterministic'] else 'no: ' + str(r['repeats'])}"
            f"  ({', '.join(str(c['ours']) for c in r['caller_first'])})"
        )
    lines.append("(files: entrenar_pg files entered; c_*: builtin/C calls made from that code;")
    lines.append(" threads: events on the groups' other threads meanwhile)")
    for name, r in result["transports"].items():
        lines.append(f"\n{name}: calls per entrenar_pg file")
        lines.extend(f"  {n:>4}  {f}" for f, n in r["per_file"].items())
    return lines


def summary_row(r: dict[str, Any]) -> dict[str, Any]:
    """One transport's headline figures (what ``python -m benchmarks.bench`` keeps)."""
    return {
        "ours": r["calls"]["ours"],
        "torch": r["calls"]["torch"],
        "other": r["calls"]["other"],
        "our_files": r["our_files"],
        "other_threads": r["other_threads"],
        "deterministic": r["deterministic"],
        "ours_caller_first": [c["ours"] for c in r["caller_first"]],
    }


def count_in_subprocess(import_root: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run this counter as its own process, importing ``entrenar_pg`` from
    ``import_root`` (a checkout, or a ``--baseline-tree`` copy); the benchmarks
    come from this checkout. Returns ``count_all``'s result; raises
    ``RuntimeError`` (with the output's tail) when the run fails.

    Its own process, so the benchmark's process never carries a profiler, and
    run from an empty directory, so the working directory shadows no package.
    """
    here = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys([import_root, here])))
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="entrenar_calls_") as tmp:
        out = Path(tmp) / "calls.json"
        cmd = [sys.executable, "-m", "benchmarks.calls", "--repeats", "2", "--json", str(out)]
        try:
            p = subprocess.run(
                cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"the call counter ran past {timeout_s:.0f} s") from e
        if p.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the call counter failed ({p.returncode}): {p.stderr[-1500:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.calls", description=__doc__)
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma list of shm,tcp")
    p.add_argument("--repeats", type=int, default=3, help="counts per transport (default 3)")
    p.add_argument(
        "--peer-lead", type=float, default=0.05, help="seconds rank 1 goes first (default 0.05)"
    )
    p.add_argument("--top", action="store_true", help="also print the top functions")
    p.add_argument("--json", default="", metavar="PATH", help="write the counts as JSON here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    transports = tuple(t.strip() for t in a.transports.split(",") if t.strip())
    result = count_all(transports, a.repeats, a.peer_lead)
    print("\n".join(table_lines(result)))
    if a.top:
        for name, r in result["transports"].items():
            print(f"\n{name}: top functions")
            print("\n".join(f"  {n:>4}  {f}" for f, n in r["top_functions"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

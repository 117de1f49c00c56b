"""Where the contract checker's CPU goes in a DDP step, by part (docs/contracts.md, "Costs").

    python -m benchmarks.contracts_parts STEPS

Runs ``benchmarks.contracts_cost gpt 2 STEPS`` (checks off and on, alternating
step by step; run it from the repository root) with each part of the checker
timed by ``time.thread_time`` around it, in whichever thread runs it, and
prints per rank the thread CPU per checked step of each part, from the fifth
step on (the warm-up's one-off costs left out), and how many of the step's
batches ran in the comm thread (a hand-off) or in the training loop's thread.
A part's figure includes the timers of the parts inside it (a few us each).
To compare trees, run it from each tree's root with ``PYTHONPATH=$PWD``,
alternating; for a tree without this file, run this file by its path from
that tree's root (the ranks import that tree's checker and benchmark).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing as mp

WARM_STEPS = 5  # post-hooks before the tallies start


@dataclass(slots=True)
class Tally:
    """Thread CPU and calls per part; reset once the warm-up steps are over."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    batches: Counter[str] = field(default_factory=Counter)  # by the thread that ran them
    warm: bool = False

    def steps(self) -> int:
        return max(self.calls["post-hook"], 1)


@dataclass(slots=True)
class Timed:
    """``fn`` with its thread CPU added to ``tally`` under ``label`` (a method too: it
    binds as a function does)."""

    fn: Any
    label: str
    tally: Tally

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else types.MethodType(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tally = self.tally
        if self.label == "post-hook" and not tally.warm and tally.calls["post-hook"] >= WARM_STEPS:
            tally.seconds.clear()
            tally.calls.clear()
            tally.batches.clear()
            tally.warm = True
        start = time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            label = self.label
            tally.seconds[label] = tally.seconds.get(label, 0.0) + time.thread_time() - start
            tally.calls[label] += 1


@dataclass(slots=True)
class Where:
    """A job's ``__call__`` that counts which thread ran it."""

    fn: Any
    tally: Tally

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else types.MethodType(self, obj)

    def __call__(self, job: Any, call: Any) -> Any:
        self.tally.batches[threading.current_thread().name.split("-")[0]] += 1
        return self.fn(job, call)


def _time(owner: Any, name: str, label: str, tally: Tally) -> None:
    fn = getattr(owner, name, None)
    if fn is not None:  # (parts another tree lacks are left out)
        setattr(owner, name, Timed(fn, label, tally))


def worker(rank: int, world: int, port: int, steps: int) -> None:
    from benchmarks import contracts_cost
    from entrenar_pg.checker import checker, projection, records, verdict

    tally = Tally()
    cls = checker.ContractChecker
    for owner, name, label in (
        (cls, "before", "before"),
        (cls, "after", "after"),
        (cls, "before_optimizer_step", "pre-hook"),
        (cls, "_step", "post-hook"),
        (checker, "digest_sized", "parameter hash"),
        (checker, "exchange", "exchange"),
        (verdict.Judge, "collective", "verdicts"),
        (records, "_float_inputs", "inputs measured"),
        (records, "finish", "outputs measured"),
        (projection, "read_floats", "kept reads"),
    ):
        _time(owner, name, label, tally)
    batch = checker._Batch
    batch.__call__ = Where(batch.__call__, tally)  # type: ignore[method-assign,assignment]
    contracts_cost.gpt_worker(rank, world, port, steps)
    n = tally.steps()
    lines = [f"rank {rank}: thread CPU per checked step ({n} steps)"]
    for label in sorted(tally.seconds):
        per_call = tally.calls[label] / n
        lines.append(
            f"  {label:18s} {tally.seconds[label] / n * 1e6:8.1f} us  ({per_call:.2f} calls)"
        )
    lines.append(f"  batches run by thread: {dict(tally.batches)}")
    print("\n".join(lines), flush=True)  # one write: the ranks' lines do not interleave


def main(argv: list[str]) -> None:
    steps = int(argv[0])
    sys.path.insert(0, os.getcwd())
    port = 20000 + os.getpid() % 20000
    mp.spawn(worker, args=(2, port, steps), nprocs=2)


if __name__ == "__main__":
    main(sys.argv[1:])

"""One process of ``benchmarks/scale.py``: some of a job's ranks as threads, each with its group.

Run as ``python -m benchmarks.scale_ranks '<spec JSON>'`` by the launcher.
Each rank (one thread) connects its own store client (as a rank process
would), then, once every rank of the job is ready (a count in the store,
so no rank's set-up time includes another process's interpreter start):

1. creates its group (``EntrenarProcessGroup`` or ``ProcessGroupGloo``) and
   allreduces 4 KiB once, timing each: the set-up a job sees before its
   first result;
2. checks the sum (every element must be 1 + 2 + ... + N);
3. waits while the process counts descriptors (``benchmarks.sockets``): the
   process's sockets and descriptors, and the sockets each entrenar group
   holds (gloo's are C++ objects: only the process's count, divided);
4. with ``calls`` > 0, once every rank of the job is counted: ``calls`` more
   4 KiB allreduces, timed per rank, the process's CPU over them measured
   (every rank of the process in the loop: the job's small-message time and
   work, ``--backends entrenar-star,entrenar-doubling`` side by side);
5. once every rank of the job is done, destroys its group (timed), and the
   process counts again (what destroying left open).

Backends: ``gloo``, ``entrenar`` (its ``Options`` from the environment) and
``entrenar-<algorithm>`` (``Options.algorithm`` forced: ``entrenar-star``).

The result is one JSON line on stdout, prefixed ``RESULT_PREFIX``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.sockets import held_sockets, open_fds, socket_fds
from entrenar_pg.config import ALGORITHMS

RESULT_PREFIX = "SCALE-RESULT "
ENTRENAR = "entrenar"
GLOO = "gloo"
BACKENDS = (ENTRENAR, GLOO)
# entrenar with Options.algorithm forced: "entrenar-" + one of these
FORCED = tuple(a for a in ALGORITHMS if a != "auto")
FLOATS = 1024  # 4 KiB of float32
# Store keys (a fresh store per job): the last rank to count in releases the rest.
READY, GO = "ready", "go"
COUNTED, DESTROY = "counted", "destroy"
LOOP, LOOP_DONE = "loop", "loop-done"


def is_entrenar(backend: str) -> bool:
    """Whether ``backend`` names entrenar (plain, or with its algorithm forced)."""
    return backend == ENTRENAR or backend.startswith(ENTRENAR + "-")


def known(backend: str) -> bool:
    """Whether ``backend`` is one this benchmark runs."""
    return backend in BACKENDS or backend in {f"{ENTRENAR}-{a}" for a in FORCED}


@dataclass(frozen=True)
class Spec:
    """What one process runs: which ranks of which job, against which store."""

    backend: str
    world: int
    ranks: tuple[int, ...]
    store_port: int
    timeout_s: float
    transport: str  # entrenar's Options.transport ("" = its default)
    # Emulated hosts: ranks split into this many contiguous blocks, each with
    # its own Options.host_id (1: the machine's own identity, one host).
    hosts: int = 1
    calls: int = 0  # timed 4 KiB allreduces after the count (0: none)
    deterministic: bool = False  # entrenar's Options.deterministic

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> Spec:
        d = json.loads(text)
        d["ranks"] = tuple(d["ranks"])
        return Spec(**d)


@dataclass
class RankResult:
    """One rank's figures (times in seconds, from ``time.monotonic``: one clock per machine)."""

    rank: int
    start: float = 0.0  # group creation began
    create_s: float = 0.0  # creation returned
    first_allreduce_s: float = 0.0  # the first 4 KiB allreduce, after creation
    destroy_s: float = 0.0
    calls_s: float = 0.0  # the ``calls`` timed allreduces, wall time on this rank
    allreduce_ok: bool = False
    held_sockets: int | None = None  # the sockets its group holds (entrenar only)
    error: str = ""

    @property
    def setup_s(self) -> float:
        return self.create_s + self.first_allreduce_s


@dataclass
class ProcessResult:
    """One process's figures: its ranks', and its descriptors around set-up and destroy."""

    backend: str
    world: int
    ranks: list[RankResult] = field(default_factory=list)
    fds_before: int = 0  # every descriptor, the ranks' store clients connected
    fds_after_setup: int = 0
    new_fds: int = 0  # descriptors beyond those before set-up (sockets, memfd mappings, ...)
    # CPU seconds (user + system, every thread) the process spent from before
    # its ranks started to every one of them holding its first result: the
    # set-up's work, which wall times on a machine with fewer cores than
    # ranks do not show (there they measure the whole job's work / 2 cores).
    setup_cpu_s: float = 0.0
    calls_cpu_s: float = 0.0  # CPU of the process over its ranks' timed allreduces
    sockets_after_setup: int = 0  # sockets beyond those before set-up
    sockets_shared: int = 0  # sockets held by more than one rank's group (must be 0)
    sockets_unheld: int = 0  # new sockets no group holds (entrenar: a leak)
    # Beyond those before set-up, once every group is destroyed and dropped.
    sockets_after_destroy: int = 0
    fds_after_destroy: int = 0
    error: str = ""

    def to_json(self) -> str:
        d = asdict(self)
        for r, rank in zip(d["ranks"], self.ranks, strict=True):
            r["setup_s"] = rank.setup_s
        return json.dumps(d)


def _store(port: int, timeout_s: float) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _create(spec: Spec, store: dist.Store, rank: int) -> Any:
    timeout = timedelta(seconds=spec.timeout_s)
    if spec.backend == GLOO:
        return dist.ProcessGroupGloo(store, rank, spec.world, timeout)
    from entrenar_pg import EntrenarProcessGroup, Options

    # As init_process_group would: the environment's ENTRENAR_* settings, then
    # --transport and the emulated host (--hosts).
    options = Options.from_env()
    if spec.backend != ENTRENAR:
        options = dataclasses.replace(options, algorithm=spec.backend[len(ENTRENAR) + 1 :])
    if spec.transport:
        options = dataclasses.replace(options, transport=spec.transport)
    if spec.deterministic:
        options = dataclasses.replace(options, deterministic=True)
    if spec.hosts > 1:
        # topology="hosts": host-aware although the emulated hosts share
        # loopback (the link probe would take the flat path on it).
        host = rank * spec.hosts // spec.world
        options = dataclasses.replace(options, host_id=f"scale-host-{host}", topology="hosts")
    return EntrenarProcessGroup(store, rank, spec.world, timeout=timeout, options=options)


def _count_in(store: dist.Store, counter: str, release: str, world: int) -> None:
    """Add this rank to ``counter``; the last one sets ``release``; wait for it."""
    if store.add(counter, 1) == world:
        store.set(release, "1")
    store.wait([release])


class _Rank:
    """One rank's thread: set up, check, wait to be counted, destroy."""

    def __init__(self, spec: Spec, rank: int, counted: threading.Barrier) -> None:
        self.spec = spec
        self.result = RankResult(rank)
        self.store = _store(spec.store_port, spec.timeout_s)
        self.group: Any = None
        # Passed twice: set-up done, then counting done; with timed calls,
        # twice more: every rank of the process in the loop, then out of it.
        self._counted = counted

    def run(self) -> None:
        r = self.result
        try:
            _count_in(self.store, READY, GO, self.spec.world)
            r.start = time.monotonic()
            self.group = _create(self.spec, self.store, r.rank)
            r.create_s = time.monotonic() - r.start
            t = torch.full((FLOATS,), float(r.rank + 1))
            t0 = time.monotonic()
            self.group.allreduce([t]).wait()
            r.first_allreduce_s = time.monotonic() - t0
            want = self.spec.world * (self.spec.world + 1) / 2  # exact in float32 to N = 4096
            r.allreduce_ok = bool((t == want).all())
            if not r.allreduce_ok:
                r.error = f"rank {r.rank}: allreduce gave {t[:4].tolist()}..., want {want}"
            self._counted.wait()  # set-up done: the process counts
            self._counted.wait()  # counted
            if self.spec.calls:
                self._timed_calls(t)
            _count_in(self.store, COUNTED, DESTROY, self.spec.world)
            t0 = time.monotonic()
            self.group.shutdown()
            r.destroy_s = time.monotonic() - t0
            self.group = None  # as destroy_process_group drops torch's reference
        except BaseException as e:  # reported in the result; the others must not wait
            r.error = r.error or f"rank {r.rank}: {type(e).__name__}: {e}"
            self._counted.abort()

    def _timed_calls(self, t: torch.Tensor) -> None:
        """``spec.calls`` allreduces of ``t``, every rank of the job started together."""
        _count_in(self.store, LOOP, LOOP_DONE, self.spec.world)
        self._counted.wait()  # the process measures its CPU from here
        t0 = time.monotonic()
        for _ in range(self.spec.calls):
            self.group.allreduce([t]).wait()
        self.result.calls_s = time.monotonic() - t0
        self._counted.wait()  # ... to here


def run(spec: Spec) -> ProcessResult:
    """Run ``spec``'s ranks as threads of this process; see the module docstring."""
    torch.set_num_threads(1)  # many ranks share two cores
    out = ProcessResult(spec.backend, spec.world)
    counted = threading.Barrier(len(spec.ranks) + 1, timeout=spec.timeout_s * 2)
    ranks = [_Rank(spec, r, counted) for r in spec.ranks]
    fds_before = open_fds()
    before = {fd for fd, what in fds_before.items() if what.startswith("socket:")}
    out.fds_before = len(fds_before)
    threads = [threading.Thread(target=x.run, name=f"rank{x.result.rank}") for x in ranks]
    cpu0 = _cpu_s()
    for t in threads:
        t.start()
    try:
        counted.wait()
        out.setup_cpu_s = _cpu_s() - cpu0
        _count_after_setup(spec, ranks, before, out)
        counted.wait()
        if spec.calls:
            counted.wait()
            cpu0 = _cpu_s()
            counted.wait()
            out.calls_cpu_s = _cpu_s() - cpu0
    except threading.BrokenBarrierError:
        out.error = "a rank failed (see its error)"
    for t in threads:
        t.join(spec.timeout_s * 2)
    if any(t.is_alive() for t in threads):
        out.error = out.error or "a rank thread did not end"
    gc.collect()  # a group's cycles hold its mappings (and their descriptors) until collected
    out.sockets_after_destroy = len(socket_fds() - before)
    out.fds_after_destroy = len(set(open_fds()) - set(fds_before))
    out.ranks = [x.result for x in ranks]
    return out


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _count_after_setup(
    spec: Spec, ranks: list[_Rank], before: set[int], out: ProcessResult
) -> None:
    fds = open_fds()
    new = {fd for fd, what in fds.items() if what.startswith("socket:")} - before
    out.fds_after_setup = len(fds)
    out.new_fds = len(fds) - out.fds_before
    out.sockets_after_setup = len(new)
    if not is_entrenar(spec.backend):
        return
    held = [held_sockets(x.group) & new for x in ranks]
    for x, h in zip(ranks, held, strict=True):
        x.result.held_sockets = len(h)
    union: set[int] = set().union(*held)
    out.sockets_shared = sum(len(h) for h in held) - len(union)
    out.sockets_unheld = len(new - union)


def main(argv: list[str]) -> int:
    spec = Spec.from_json(argv[0])
    result = run(spec)
    print(RESULT_PREFIX + result.to_json(), flush=True)
    failed = result.error or any(r.error for r in result.ranks)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The parent's side of a measurement: spawn the ranks (or ``mpiexec``), wait, collect."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.deepspeed_peer import remove_segments
from benchmarks.sizes import plan_for
from benchmarks.turns import Turns, new_turns
from benchmarks.workers import rank_main

log = logging.getLogger(__name__)

EXIT_GRACE_S = 20.0  # how long ranks may take to exit once all have written their results


class BenchError(RuntimeError):
    """A benchmark run failed (a rank died, timed out, or produced bad results)."""


def _kill_all(procs: Iterable[mp.process.BaseProcess]) -> None:
    """Terminate, then kill, every still-running child process."""
    procs = list(procs)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


@contextlib.contextmanager
def _first_on_sys_path(path: str | None) -> Iterator[None]:
    """Put ``path`` first on ``sys.path`` for the duration (nothing if None).

    A spawned child takes the parent's ``sys.path`` as it was at ``start()``
    and installs it before it imports anything (its ``__main__``, the bench's
    modules, torch, whose ``torch.backends`` entry point imports ``entrenar_pg``), so a
    package found first there is the one every import in the child resolves to.
    The parent's own modules are already imported and stay as they are.
    """
    if path is None:
        yield
        return
    sys.path.insert(0, path)
    try:
        yield
    finally:
        sys.path.remove(path)


def run_world(world: int, cfg: BenchConfig, import_root: str | None = None) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks, wait (bounded by ``cfg.timeout_s``), return each rank's result.

    ``import_root``: a directory the workers search first for ``entrenar_pg``.
    """
    return run_jobs(world, cfg, [import_root])[0]


def run_jobs(
    world: int, cfg: BenchConfig, import_roots: Sequence[str | None]
) -> list[list[dict[str, Any]]]:
    """One job of ``world`` ranks per entry of ``import_roots`` (a directory
    its workers search first for ``entrenar_pg``; None: this checkout's),
    all alive at once; two jobs take turns block by block (``turns.py``).
    Waits (bounded by ``cfg.timeout_s`` per job); returns each job's ranks' results."""
    ctx = mp.get_context("spawn")
    if len(import_roots) > 2:
        raise ValueError("at most two jobs take turns")
    turns: Sequence[Turns | None] = (
        new_turns(ctx, cfg.timeout_s) if len(import_roots) == 2 else [None]
    )
    ports = [free_port() for _ in import_roots]
    with tempfile.TemporaryDirectory(prefix="entrenar_bench_") as tmp:
        paths = [
            [os.path.join(tmp, f"job{j}-rank{r}.json") for r in range(world)]
            for j in range(len(import_roots))
        ]
        procs = [
            ctx.Process(
                target=rank_main,
                args=(r, world, ports[j], cfg.to_json(), paths[j][r], turns[j]),
                name=f"bench-job{j}-rank{r}" if len(import_roots) > 1 else f"bench-rank{r}",
            )
            for j in range(len(import_roots))
            for r in range(world)
        ]
        try:
            for j, root in enumerate(import_roots):
                with _first_on_sys_path(root):
                    for p in procs[j * world : (j + 1) * world]:
                        p.start()
            _wait_for(procs, [x for job in paths for x in job], world, cfg, len(import_roots))
            return [[json.loads(Path(path).read_text()) for path in job] for job in paths]
        finally:
            _kill_all(procs)
            if "deepspeed" in cfg.algos:
                for port in ports:
                    left = remove_segments(port, world)
                    if left:
                        log.info(
                            "world size %d: removed %d segments DeepSpeed left in /dev/shm"
                            " (%s ...)",
                            world,
                            len(left),
                            left[0],
                        )


def _wait_for(
    procs: Sequence[mp.process.BaseProcess],
    paths: Sequence[str],
    world: int,
    cfg: BenchConfig,
    jobs: int,
) -> None:
    """Until every rank exited (or wrote its result and hung in teardown);
    BenchError on a failed rank or past ``cfg.timeout_s`` per job."""
    deadline = time.monotonic() + cfg.timeout_s * jobs
    done_at: float | None = None
    while any(p.exitcode is None for p in procs):
        _raise_failed(procs, world)
        now = time.monotonic()
        if done_at is None and all(os.path.exists(x) for x in paths):
            done_at = now  # every rank wrote its result; only teardown is left
        if done_at is not None and now > done_at + EXIT_GRACE_S:
            log.warning("world size %d: ranks hung in teardown; killed them", world)
            return
        if now > deadline:
            raise BenchError(f"world size {world}: timed out after {cfg.timeout_s * jobs:.0f} s")
        time.sleep(0.05)
    _raise_failed(procs, world)  # every rank exited between two looks, some failing


def _raise_failed(procs: Sequence[mp.process.BaseProcess], world: int) -> None:
    """BenchError naming the first rank that exited with an error, if any."""
    failed = [p for p in procs if p.exitcode not in (None, 0)]
    if failed:
        raise BenchError(
            f"world size {world}: {failed[0].name} exited with {failed[0].exitcode}"
            " (its traceback is above on stderr)"
        )


def run_mpi(world: int, cfg: BenchConfig, mpiexec: str, tcp: bool) -> dict[str, Any]:
    """Time MPI allreduce with the same plan (not interleaved: a separate mpiexec run)."""
    plan = ",".join(
        f"{s}:{p.rounds}:{p.per_block}:{max(p.warmup, 1)}"
        for s in cfg.sizes
        for p in [plan_for(s, cfg)]
    )
    env = dict(os.environ)
    if tcp:
        # MPICH: treat every rank as remote, so ch4 uses its netmod (libfabric tcp) on loopback.
        env.update(
            {
                "MPIR_CVAR_NOLOCAL": "1",
                "MPIR_CVAR_CH4_NETMOD": "ofi",
                "FI_PROVIDER": "tcp",
                "FI_TCP_IFACE": "lo",
            }
        )
    cmd = [
        mpiexec,
        "-n",
        str(world),
        sys.executable,
        str(Path(__file__).with_name("mpi.py")),  # by path: no torch, no entrenar_pg
        "--plan",
        plan,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=cfg.timeout_s, check=False
    )
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {proc.stderr[-2000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise BenchError(f"MPI run printed no JSON: {proc.stdout[-2000:]}")
    return dict(json.loads(lines[-1]))


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

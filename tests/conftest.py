"""Shared test harness: N ranks as threads over real loopback TCP, and process launchers."""

from __future__ import annotations

import gc
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import preloaded
import pytest
import torch
import torch.distributed as dist
import zygote

import entrenar_pg
from benchmarks import sessions
from benchmarks.netns import namespaces_allowed
from benchmarks.sessions import TIMED_OUT
from entrenar_pg import EntrenarProcessGroup, Options

REPO = Path(__file__).resolve().parents[1]


def make_groups(
    world: int,
    options: Options | Sequence[Options] | None = None,
    timeout_s: float = 20.0,
) -> list[EntrenarProcessGroup]:
    """Create ``world`` entrenar groups in this process, one per rank (real sockets; the
    transport is the options' own: ``auto`` gives these same-host ranks shared memory).

    ``options``: one for every rank, or a sequence of one per rank.
    """
    store = dist.HashStore()
    per_rank = list(options) if isinstance(options, Sequence) else [options or Options()] * world
    assert len(per_rank) == world, "one Options per rank"
    groups: list[Any] = [None] * world
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            groups[rank] = EntrenarProcessGroup(
                dist.PrefixStore("t", store),
                rank,
                world,
                timeout=timedelta(seconds=timeout_s),
                options=per_rank[rank],
            )
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    if errors:
        for g in groups:
            if g is not None:
                g.shutdown()
        raise errors[0]
    assert all(g is not None for g in groups), "group creation hung"
    return groups


def run_ranks(
    world: int,
    fn: Callable[[int, EntrenarProcessGroup], Any],
    *,
    options: Options | None = None,
    timeout_s: float = 60.0,
    groups: list[EntrenarProcessGroup] | None = None,
    release: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, group)`` on ``world`` threads at once; return the results in rank order.

    Raises the first exception any rank raised; a rank still running after
    ``timeout_s`` fails the test (a hang is a failure). Groups it made are
    shut down after; given ``groups`` are left to the caller, or ended by
    ``release`` ("abort" or "shutdown") whatever happened.
    """
    if release not in (None, "abort", "shutdown"):
        raise ValueError(f"run_ranks: release must be 'abort' or 'shutdown', got {release!r}")
    own = groups is None
    gs = make_groups(world, options) if groups is None else groups
    results: list[Any] = [None] * world
    errors: dict[int, BaseException] = {}

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank, gs[rank])
        except BaseException as e:
            errors[rank] = e

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            for g in gs:
                g.abort()
            pytest.fail(f"rank(s) {hung} still running after {timeout_s}s: a hang")
        if errors:
            raise errors[min(errors)]
        return results
    finally:
        end = "shutdown" if own else release
        if end is not None:
            for g in gs:
                getattr(g, end)()


def each_rank(
    groups: list[EntrenarProcessGroup],
    ranks: Sequence[int],
    fn: Callable[[int, EntrenarProcessGroup], Any],
    *,
    timeout_s: float = 30.0,
    meanwhile: Callable[[], None] | None = None,
) -> dict[int, Any]:
    """``fn(rank, group)`` on a thread for each of ``ranks`` (the others do
    nothing), ``meanwhile()`` once they started; each rank's result or the
    exception it raised (the failure tests' outcome). A rank still running
    after ``timeout_s`` fails the test (a hang is a failure)."""
    got: dict[int, Any] = {}

    def target(rank: int) -> None:
        try:
            got[rank] = fn(rank, groups[rank])
        except BaseException as e:  # an outcome, for the test to judge
            got[rank] = e

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    if meanwhile is not None:
        meanwhile()
    for t in threads:
        t.join(timeout_s)
    hung = [r for r, t in zip(ranks, threads, strict=True) if t.is_alive()]
    if hung:
        pytest.fail(f"rank(s) {hung} still running after {timeout_s}s: a hang")
    return got


def allreduce_errors(
    groups: list[EntrenarProcessGroup],
    ranks: Sequence[int],
    numel: int,
    meanwhile: Callable[[], None] | None = None,
) -> dict[int, BaseException]:
    """An allreduce of ``numel`` ones on ``ranks`` only (``each_rank``); the
    error each rank raised, by rank."""
    got = each_rank(
        groups, ranks, lambda r, g: g.allreduce([torch.ones(numel)]).wait(), meanwhile=meanwhile
    )
    return {r: v for r, v in got.items() if isinstance(v, BaseException)}


def kill_sessions(procs: Iterable[Any]) -> None:
    """SIGKILL every process of ``procs`` still running, with its process group
    (each was started in a session of its own), and reap it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


# Ports for the tests' own listeners (a job's store, slurmctld) come from below
# the kernel's ephemeral range, from a block of this xdist worker's own. A port
# that ``bind(0)`` picked lies in the ephemeral range, where an outgoing
# connection of a test running beside this one may take it between the pick and
# the listener's bind (EADDRINUSE: seen once, in a fresh clone's run); the
# blocks keep the workers' picks apart.
_PORTS_FROM = 10_000
_PORT_BLOCK = 2_000
_PORT_RANDOM = random.Random()  # its own: tests that seed ``random`` do not fix the picks


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port() -> int:
    """A port no socket is bound to now, below the kernel's ephemeral range, in
    this xdist worker's block (a random one); the kernel's pick if none is free."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = _PORTS_FROM + (int(worker) if worker.isdigit() else 0) * _PORT_BLOCK
    high = min(low + _PORT_BLOCK, _ephemeral_low())
    for port in _PORT_RANDOM.sample(range(low, high), k=min(64, max(high - low, 0))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # bound, or lingering (TIME_WAIT): another
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """The environment env:// reads for one rank of a job whose store rank 0
    hosts on 127.0.0.1:``port`` (as a launcher without torchrun would set it)."""
    return dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        **extra,
    )


def torchrun(
    script: str | Path,
    nproc: int,
    *args: str,
    timeout_s: float = 240,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under torchrun --standalone with ``nproc`` workers; output captured.

    torchrun's workers are forked from a process that imported torch
    (``tests/zygote.py``: ~2 s less CPU each) instead of fresh interpreters.
    Not so the trainer on gloo (test_trainer_dist's own helper): there the DDP model, freed
    as ``main()`` returns right after ``destroy_process_group``, drops gloo's
    group, whose destructor joins its run loop with the GIL held while the loop,
    freeing its last work's tensors, waits for the GIL (py-spy's stacks; 2-4 of
    16 forked trainer runs hung, 0 of 32 fresh). The scripts here that run gloo
    keep their groups past their last collective, and forked they finished
    every time (ddp_check 48 of 48, ddp_sparse and lightning_fit 8 of 8 each,
    allreduce_vs_gloo 12 of 12, compile_scenarios 3 of 3).
    """
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    full_env.update(zygote.job_env())
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *(extra or []),
        str(zygote.STAND_IN),
        str(script),
        *args,
    ]
    done = run_in_session(cmd, timeout_s=timeout_s, env=full_env)
    if done.returncode == TIMED_OUT:
        raise subprocess.TimeoutExpired(cmd, timeout_s, done.stdout, done.stderr)
    return done


# gloo (the reference, not the subject) now and then aborts in its own
# teardown after a script finished, seen under the parallel suite's load:
# tests that run gloo jobs rerun such a job once, and it must then pass.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def run_session(
    cmd: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session, output captured; a hang or (with ``check``)
    a non-zero exit fails the test. On timeout the whole session is stopped:
    SIGTERM first (so a launch script's trap tears down what it built), then
    SIGKILL, so no process outlives the test."""
    done = run_in_session(cmd, timeout_s=timeout, env=env)
    if done.returncode == TIMED_OUT:
        pytest.fail(
            f"timed out after {timeout}s: {' '.join(cmd)}\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    if check and done.returncode != 0:
        pytest.fail(
            f"exit status {done.returncode}: {' '.join(cmd)}\n"
            f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-6000:]}"
        )
    return done


def run_in_session(
    cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """benchmarks.sessions.run_in_session; a Python command (torchrun's launcher, a
    script) starts from preloaded's fork server, without importing torch again."""
    if cmd[0] != sys.executable:
        return sessions.run_in_session(cmd, timeout_s=timeout_s, env=env)
    full_env = dict(os.environ) if env is None else env
    return preloaded.run_in_session(cmd[1:], timeout_s=timeout_s, env=full_env, cwd=REPO)


def pytest_configure() -> None:
    """Bytecode caches on, for this run and every process it starts (before
    xdist starts its workers). Some images set PYTHONDONTWRITEBYTECODE (this
    one and its CI do); then each of the suite's ~70 fresh interpreters
    (torchrun's ranks, the launch scripts, the benchmarks' jobs) compiles our
    modules again, and every xdist worker rewrites every test module. The
    caches go where Python puts them, in ``__pycache__/`` beside the sources
    (ignored by git)."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def pytest_collection_finish() -> None:
    """What collection imported (torch, dynamo, Lightning, torchft, DeepSpeed and
    the test modules: about a million objects that live as long as the
    worker) out of the collector's reach (``gc.freeze``), so the worker's full
    collections walk only what the tests make (each walk of the frozen set
    costs about 0.1 s of CPU, and a worker does dozens). Its collections still
    free every cycle a test leaves."""
    gc.freeze()


def pytest_unconfigure() -> None:
    """The same at the end, for exit: the interpreter's last collections skip
    what is alive then (about 1.4 s of CPU in each of the run's four
    processes, the main one and three xdist workers, when the run has nothing
    left to overlap it with). The modules are still torn down, and atexit
    handlers and finalizers still run."""
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long tests first: slow-marked ones and xdist groups (a module-scoped
    job), each kept in its file's order, then the rest. xdist hands tests out
    in this order, so the long ones start while the short ones are left to fill
    the workers' last minutes, instead of one long test running alone at the
    end. (A group's tests keep one key, so they stay together.)"""
    items.sort(key=lambda item: not item.get_closest_marker("slow") and not is_grouped(item))


def is_grouped(item: pytest.Item) -> bool:
    return item.get_closest_marker("xdist_group") is not None


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    # Ranks share two cores: intra-op threads would only fight each other.
    torch.set_num_threads(1)


assert entrenar_pg.BACKEND_NAME == "entrenar"


# Whether this process may make network namespaces (root, iproute2, a kernel allowing it).
netns_allowed = namespaces_allowed

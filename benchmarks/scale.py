"""Connections and set-up against the number of ranks (issue 26, item 4).

``python -m benchmarks.scale --ranks 8,16,32,64,128,256 --procs 8`` runs,
for each N and backend, a job of N ranks spread over P processes (each
process hosts N/P ranks as threads, each rank with its own group and its own
store client, as in a job of one rank per process), against one TCPStore
served by this launcher. Every rank creates its group, allreduces 4 KiB
(checking the sum) and destroys it (``benchmarks/scale_ranks.py``). Reported
per N: sockets per rank, set-up time per rank, the job's set-up wall time,
descriptors per process, and how each grows against N; and where a job would
stop at the common soft limit of 1,024 descriptors.

The launcher raises its soft ``RLIMIT_NOFILE`` to the hard limit first (the
rank processes inherit it), so a full mesh can reach N = 256 whatever the
soft limit was; the limit found is reported.

Backends run interleaved (for each N, each repeat, every backend in turn), so
a loaded machine slows them alike. Outputs go to ``--out`` (``runs/scale``):
``scale.json``, ``results.md``, ``scale.png``; the table also on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from benchmarks.machine import git_revision, machine_info
from benchmarks.scale_ranks import BACKENDS, FORCED, RESULT_PREFIX, Spec, known
from benchmarks.scale_report import summarize, write_outputs
from benchmarks.sockets import fd_soft_limit, raise_fd_limit

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "entrenar-scale/1"
# A job's processes get this long beyond the groups' own timeout, so a rank
# that times out reports why before the launcher kills it.
JOB_GRACE_S = 60.0
# A process is given at most this share of the descriptor limit (the rest:
# the interpreter, torch, and the estimate's error).
FD_SHARE = 0.8


class ScaleError(RuntimeError):
    """A job failed: a process exited non-zero, timed out, or a rank reported an error."""


@dataclass(frozen=True)
class ScaleConfig:
    ranks: tuple[int, ...]
    procs: int
    backends: tuple[str, ...]
    repeats: int
    timeout_s: float  # every group's timeout (set-up, collectives); a job gets JOB_GRACE_S more
    transport: str
    out: Path
    hosts: int = 1  # emulated hosts (Options.host_id per contiguous block of ranks)
    calls: int = 0  # timed 4 KiB allreduces per rank after set-up (0: none)
    deterministic: bool = False  # entrenar's Options.deterministic


def split(world: int, procs: int) -> list[tuple[int, ...]]:
    """Ranks 0..world-1 in ``min(procs, world)`` contiguous blocks, as even as possible."""
    n = min(procs, world)
    return [tuple(range(p * world // n, (p + 1) * world // n)) for p in range(n)]


def procs_for(world: int, cfg: ScaleConfig, fds_per_rank: float | None, limit: int) -> int:
    """How many processes carry ``world`` ranks: ``cfg.procs``, or more when that many
    ranks per process would hold more descriptors than ``FD_SHARE`` of ``limit``.

    ``fds_per_rank``: measured at this backend's previous N, scaled here as
    if it grew like N (None: no measure yet; ``cfg.procs``). Ranks are
    threads, so one process holds the descriptors of all of its ranks: a
    full mesh at N = 256 is ~1,300 per rank, 41,000 for 32 ranks.
    """
    if fds_per_rank is None:
        return min(cfg.procs, world)
    per_proc = max(int(FD_SHARE * limit // max(fds_per_rank, 1.0)), 1)
    return min(max(cfg.procs, -(-world // per_proc)), world)


def run_job(backend: str, world: int, procs: int, cfg: ScaleConfig) -> list[dict[str, Any]]:
    """Run one job (``world`` ranks over ``procs`` processes); each process's result."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    running: list[tuple[subprocess.Popen[bytes], Any, Any]] = []
    try:
        for ranks in split(world, procs):
            spec = Spec(backend, world, ranks, store.port, cfg.timeout_s, cfg.transport)
            spec = dataclasses.replace(
                spec, hosts=cfg.hosts, calls=cfg.calls, deterministic=cfg.deterministic
            )
            stdout = tempfile.TemporaryFile()
            stderr = tempfile.TemporaryFile()
            cmd = [sys.executable, "-m", "benchmarks.scale_ranks", spec.to_json()]
            p = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, start_new_session=True
            )
            running.append((p, stdout, stderr))
        deadline = time.monotonic() + cfg.timeout_s + JOB_GRACE_S
        for p, _, _ in running:
            p.wait(max(deadline - time.monotonic(), 0.1))
        return [_collect(backend, world, p, out, err) for p, out, err in running]
    except subprocess.TimeoutExpired:
        tails = "".join(_tail(err) for _, _, err in running)
        raise ScaleError(
            f"{backend} N={world}: not done within {cfg.timeout_s + JOB_GRACE_S:.0f}s\n{tails}"
        ) from None
    finally:
        for p, out, err in running:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            out.close()
            err.close()
        del store


def _tail(f: Any, n: int = 3000) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")[-n:]


def _collect(backend: str, world: int, p: subprocess.Popen[bytes], out: Any, err: Any) -> Any:
    out.seek(0)
    lines = [
        ln[len(RESULT_PREFIX) :]
        for ln in out.read().decode(errors="replace").splitlines()
        if ln.startswith(RESULT_PREFIX)
    ]
    if not lines:
        raise ScaleError(
            f"{backend} N={world}: a process exited {p.returncode} with no result\n{_tail(err)}"
        )
    result = json.loads(lines[-1])
    errors = [result["error"]] if result["error"] else []
    errors += [r["error"] for r in result["ranks"] if r["error"]]
    if p.returncode != 0 or errors:
        raise ScaleError(
            f"{backend} N={world}: exit {p.returncode}: {'; '.join(errors[:5])}\n{_tail(err)}"
        )
    return result


def run(cfg: ScaleConfig) -> dict[str, Any]:
    """Every job of ``cfg``, interleaved; the summary and every process's raw result."""
    soft_before, soft = raise_fd_limit()
    _, hard = fd_soft_limit()
    jobs: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    fds_seen: dict[str, tuple[int, float]] = {}  # backend -> (N, descriptors per rank)
    for world in cfg.ranks:
        procs = procs_for(world, cfg, _estimate(fds_seen, world), soft)  # one for every job of N
        for rep in range(cfg.repeats):
            order = cfg.backends if rep % 2 == 0 else cfg.backends[::-1]
            for backend in order:
                t0 = time.monotonic()
                try:
                    processes = run_job(backend, world, procs, cfg)
                except ScaleError as e:  # recorded; the other jobs still run
                    log.error("%s", e)
                    failures.append(
                        {"backend": backend, "world": world, "repeat": rep, "error": str(e)}
                    )
                    continue
                took = time.monotonic() - t0
                log.info("%s N=%d over %d processes: %.1f s", backend, world, procs, took)
                jobs.append(
                    {"backend": backend, "world": world, "repeat": rep, "processes": processes}
                )
                fds_seen[backend] = (world, max(p["new_fds"] / len(p["ranks"]) for p in processes))
    return _result(cfg, jobs, failures, soft_before, soft, hard)


def _estimate(fds_seen: dict[str, tuple[int, float]], world: int) -> float | None:
    """Descriptors per rank at ``world``: the most any backend held at its last N, grown like N.

    The most of any backend, so that every backend of one N runs over the
    same processes (ranks per process change the threads' contention).
    """
    if not fds_seen:
        return None
    return max(fds * world / n for n, fds in fds_seen.values())


def _result(
    cfg: ScaleConfig,
    jobs: list[dict[str, Any]],
    failures: list[dict[str, Any]],
    soft_before: int,
    soft: int,
    hard: int,
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "config": {
            "ranks": list(cfg.ranks),
            "procs": cfg.procs,
            "backends": list(cfg.backends),
            "repeats": cfg.repeats,
            "timeout_s": cfg.timeout_s,
            "transport": cfg.transport or "default",
            "hosts": cfg.hosts,
            "allreduce_bytes": 4096,
            "calls": cfg.calls,
            "deterministic": cfg.deterministic,
        },
        "fd_limit": {"soft_found": soft_before, "soft_used": soft, "hard": hard},
        "machine": machine_info(),
        "git": git_revision(REPO),
        "loadavg": list(os.getloadavg()),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "summary": summarize(jobs, cfg.calls),
        "failures": failures,
        "jobs": jobs,
    }


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str] | None = None) -> ScaleConfig:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--ranks", type=_int_list, default=(8, 16, 32, 64, 128, 256))
    ap.add_argument(
        "--procs",
        type=int,
        default=8,
        help="processes the ranks are spread over (at least; more where descriptors need it)",
    )
    ap.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help=f"{', '.join(BACKENDS)}, or entrenar-ALGO (ALGO: {', '.join(FORCED)}; "
        "Options.algorithm forced)",
    )
    ap.add_argument(
        "--calls",
        type=int,
        default=0,
        help="after set-up, this many more 4 KiB allreduces per rank, timed (wall per call, "
        "the job's CPU per call)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="jobs per backend and N")
    ap.add_argument("--timeout", type=float, default=300.0, help="every group's timeout (s)")
    ap.add_argument(
        "--transport", default="", help="entrenar's ENTRENAR_TRANSPORT (default: its own, auto)"
    )
    ap.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="emulated hosts: ranks in this many contiguous blocks, each its own host_id",
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="entrenar's Options.deterministic (with entrenar-ring: the tree ring at 4 KiB)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "scale")
    a = ap.parse_args(argv)
    backends = tuple(b for b in a.backends.split(",") if b)
    bad = [b for b in backends if not known(b)]
    if bad or not backends:
        ap.error(f"--backends: {bad or 'none'}; choose from {', '.join(BACKENDS)}, entrenar-ALGO")
    if not a.ranks or min(a.ranks) < 2 or a.procs < 1 or a.repeats < 1 or a.hosts < 1:
        ap.error("--ranks must be 2 or more each; --procs, --repeats and --hosts at least 1")
    if a.calls < 0:
        ap.error("--calls must be 0 or more")
    return ScaleConfig(
        a.ranks,
        a.procs,
        backends,
        a.repeats,
        a.timeout,
        a.transport,
        a.out,
        a.hosts,
        a.calls,
        a.deterministic,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = parse_args(argv)
    result = run(cfg)
    for line in write_outputs(result, cfg.out):
        print(line)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""torchft recovery: a replica group SIGKILLed mid-training, torchft's gloo group vs ours.

Run ``python -m benchmarks.torchft_recovery`` from the repository root (needs
torchft: ``pip install torch==2.13.0 torchft==0.2.0``). For each backend
(``gloo``: torchft's ``ProcessGroupGloo``; ``entrenar``:
``entrenar_pg.torchft.ProcessGroupEntrenar``) it runs the same scenario:

1. a torchft lighthouse (in this process) and two replica groups of one rank
   each (``replica_0``, ``replica_1``, separate processes), each with a torchft
   ``Manager``, a small CPU model, SGD with momentum, gradients averaged
   through ``Manager.allreduce`` (torchft 0.2.0's own DDP wrapper asserts when
   a Work's ``wait()`` raises) and healing through torchft's ``PGTransport``
   (the state dict sent with ``send``/``recv`` on the inner group);
2. ``replica_1`` SIGKILLs itself in the first step after it committed
   ``steps_before`` steps that both replicas are in, just before its allreduce (so
   the survivor's allreduce is waiting on it: the inner group's failure path,
   not only the lighthouse's heartbeat timeout), and a replacement
   ``replica_1`` is started at once;
3. the survivor keeps stepping; the replacement joins, heals (receives the
   survivor's state) and steps with it until it committed ``--steps-after``.

Reported per backend: kill → the survivor's step whose allreduce failed
(the inner group's detection), kill → the survivor's next committed step
(bounded below by the lighthouse's heartbeat timeout, ``HEARTBEAT_TIMEOUT_MS``:
the quorum without the dead replica forms only once its heartbeats stop),
kill → the replacement's first committed step (process start, imports and Manager
set-up included: a supervisor restarting a replica pays them too), and
whether the two replicas' states were bit-identical at every common step
(SHA-256 of every parameter and momentum buffer). ``run_scenario`` is what
``tests/test_torchft.py`` runs and checks.

Each replica is this module run with ``--replica ID``: it appends one JSON
line per step to its log (time, step, committed, participants, state hash).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("gloo", "entrenar")

# Every torchft and group timeout of the scenario: bounded, short enough that
# a stuck run fails fast, long enough for a loaded 2-core machine.
OP_TIMEOUT = timedelta(seconds=10)
QUORUM_TIMEOUT = timedelta(seconds=30)
# Lighthouse: a replica missing heartbeats this long leaves the quorum.
HEARTBEAT_TIMEOUT_MS = 1000
STEP_PAUSE_S = 0.05  # per step: two replicas and a replacement share two cores


# ---------------------------------------------------------------- one replica


def state_hash(model: Any, optimizer: Any) -> str:
    """SHA-256 of every parameter and momentum buffer, in a fixed order."""
    import torch

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if isinstance(buf, torch.Tensor):
            h.update(buf.contiguous().numpy().tobytes())
    return h.hexdigest()


def replica_main(args: argparse.Namespace) -> None:
    """One replica group of one rank: train until the stop file appears."""
    import torch
    from torch import nn
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper

    torch.set_num_threads(1)
    if args.backend == "entrenar":
        from entrenar_pg.torchft import ProcessGroupEntrenar

        pg: Any = ProcessGroupEntrenar(timeout=OP_TIMEOUT)
    else:
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=OP_TIMEOUT)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=OP_TIMEOUT
    )
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=args.replica,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
        timeout=OP_TIMEOUT,
        quorum_timeout=QUORUM_TIMEOUT,
        connect_timeout=OP_TIMEOUT,
        heartbeat_interval=timedelta(milliseconds=100),
        checkpoint_transport=PGTransport(pg, timeout=OP_TIMEOUT, device=torch.device("cpu")),
    )
    optimizer = OptimizerWrapper(manager, inner)
    params = list(model.parameters())
    replica_index = int(args.replica.rsplit("_", 1)[-1])
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 (one line per step, kept open)
    up = {"t": time.time(), "event": "manager up", "backend": pg.getBackendName()}
    log.write(json.dumps(up) + "\n")
    deadline = time.monotonic() + args.max_seconds
    commits = 0
    try:
        while not Path(args.stop).exists() and time.monotonic() < deadline:
            optimizer.zero_grad()  # starts the step's quorum
            step = manager.current_step()
            if 0 <= args.die_after_commits <= commits and manager.num_participants() > 1:
                # Die inside a step both replicas are in, before this replica's
                # allreduce: the survivor's allreduce is waiting on it.
                log.write(json.dumps({"t": time.time(), "event": "killed"}) + "\n")
                os.kill(os.getpid(), signal.SIGKILL)
            gen = torch.Generator().manual_seed(1000 * replica_index + step)
            x = torch.randn(16, 32, generator=gen)
            y = torch.randn(16, 8, generator=gen)
            nn.functional.mse_loss(model(x), y).backward()
            # All gradients in one allreduce (a flat copy; Manager.allreduce
            # averages over the participants and swallows a failed Work's error
            # into manager.errored(), so should_commit() says no).
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            manager.allreduce(flat).wait()
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n
            failure = manager.errored()  # the allreduce's error, if it failed
            before = manager.current_step()
            optimizer.step()  # should_commit(): the optimizer steps only if True
            committed = manager.current_step() > before
            commits += committed
            record = {
                "t": time.time(),
                "step": manager.current_step(),
                "committed": committed,
                "participants": manager.num_participants(),
                "hash": state_hash(model, inner),
                "error": None if failure is None else repr(failure.original_exception)[:300],
                # the inner group this step ran on (torchft's configure replaces it)
                "inner": type(pg._pg).__name__ if pg._pg is not None else None,
            }
            log.write(json.dumps(record) + "\n")
            time.sleep(STEP_PAUSE_S)
    finally:
        log.close()
        manager.shutdown(wait=False)
        pg.shutdown()


# ---------------------------------------------------------------- the scenario


@dataclass
class Outcome:
    """What one backend's run measured."""

    backend: str
    survivor_recovery_s: float  # kill -> the survivor's next committed step
    # kill -> the survivor's step whose allreduce failed (None: it never waited on the dead one)
    survivor_failed_s: float | None
    replacement_recovery_s: float  # kill -> the replacement's first committed step
    # the replacement's Manager up -> its first committed step (quorum, the new
    # groups' configure, healing: what the backend takes part in; the rest of
    # replacement_recovery_s is the new process's start and imports)
    replacement_join_s: float
    common_steps: list[int] = field(default_factory=list)  # committed by both after healing
    mismatched_steps: list[int] = field(default_factory=list)  # hashes differ
    steps_before_kill: int = 0
    logs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def read_log(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """A replica's step records (or, with ``event``, the records of that event)."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if event is not None:
        return [r for r in records if r.get("event") == event]
    return [r for r in records if "step" in r]


def committed_steps(records: list[dict[str, Any]]) -> int:
    return sum(1 for r in records if r["committed"])


def _spawn(  # type: ignore[no-untyped-def]
    backend: str, replica: str, lighthouse: str, log: Path, stop: Path, max_s: float, die_after=-1
):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.torchft_recovery",
        "--replica",
        replica,
        "--backend",
        backend,
        "--lighthouse",
        lighthouse,
        "--log",
        str(log),
        "--stop",
        str(stop),
        "--max-seconds",
        str(max_s),
        "--die-after-commits",
        str(die_after),
    ]
    err = open(log.with_suffix(".stderr"), "w")  # noqa: SIM115 (the child writes it)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=err, stderr=subprocess.STDOUT)


def _wait_until(cond: Any, deadline: float, what: str, procs: list[Any]) -> None:
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a replica exited early (status {p.returncode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached in time")
        time.sleep(0.05)


def run_scenario(
    backend: str,
    workdir: Path,
    *,
    steps_before: int = 5,
    steps_after: int = 5,
    budget_s: float = 120.0,
) -> Outcome:
    """Run the kill-and-replace scenario once with ``backend``; see the module docstring."""
    from torchft.coordination import LighthouseServer

    workdir.mkdir(parents=True, exist_ok=True)
    stop = workdir / "stop"
    stop.unlink(missing_ok=True)
    logs = {name: workdir / f"{backend}-{name}.jsonl" for name in ("r0", "r1", "r1b")}
    for path in logs.values():
        path.unlink(missing_ok=True)
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=2000,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    deadline = time.monotonic() + budget_s
    procs: list[Any] = []
    try:
        addr = lighthouse.address()
        r0 = _spawn(backend, "replica_0", addr, logs["r0"], stop, budget_s)
        r1 = _spawn(backend, "replica_1", addr, logs["r1"], stop, budget_s, steps_before)
        procs = [r0]
        # replica_1 SIGKILLs itself in its first step after steps_before
        # commits that both replicas are in, before its allreduce (replica_main).
        _wait_until(
            lambda: r1.poll() is not None,
            deadline,
            f"{backend}: replica_1 dying after {steps_before} commits",
            procs,
        )
        killed = read_log(logs["r1"], "killed")
        if r1.returncode != -signal.SIGKILL or not killed:
            raise RuntimeError(f"{backend}: replica_1 exited with {r1.returncode}, not killed")
        killed_at = killed[0]["t"]
        before = read_log(logs["r0"])
        r1b = _spawn(backend, "replica_1", addr, logs["r1b"], stop, budget_s)
        procs = [r0, r1b]
        _wait_until(
            lambda: committed_steps(read_log(logs["r1b"])) >= steps_after,
            deadline,
            f"{backend}: the replacement committing {steps_after} steps",
            procs,
        )
        stop.touch()
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        stop.touch()
        for p in [*procs]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        lighthouse.shutdown()

    survivor = read_log(logs["r0"])
    replacement = read_log(logs["r1b"])
    after_kill = [r for r in survivor if r["t"] > killed_at and r["committed"]]
    first_new = [r for r in replacement if r["committed"]]
    failed = [r for r in survivor if r["t"] > killed_at and r["error"]]
    if not after_kill or not first_new:
        raise RuntimeError(f"{backend}: no committed step after the kill")
    by_step = {r["step"]: r["hash"] for r in survivor if r["committed"]}
    common = sorted(r["step"] for r in first_new if r["step"] in by_step)
    mismatched = [
        r["step"] for r in first_new if r["step"] in by_step and by_step[r["step"]] != r["hash"]
    ]
    # Before the kill too: the two original replicas agree at every common step.
    first_r1 = {r["step"]: r["hash"] for r in read_log(logs["r1"]) if r["committed"]}
    mismatched += [s for s, h in first_r1.items() if s in by_step and by_step[s] != h]
    return Outcome(
        backend=backend,
        survivor_recovery_s=after_kill[0]["t"] - killed_at,
        survivor_failed_s=failed[0]["t"] - killed_at if failed else None,
        replacement_recovery_s=first_new[0]["t"] - killed_at,
        replacement_join_s=first_new[0]["t"] - read_log(logs["r1b"], "manager up")[0]["t"],
        common_steps=common,
        mismatched_steps=sorted(set(mismatched)),
        steps_before_kill=committed_steps(before),
        logs={"r0": survivor, "r1": read_log(logs["r1"]), "r1b": replacement},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica", help="run as this replica (internal)")
    parser.add_argument("--backend", choices=BACKENDS, default="entrenar")
    parser.add_argument("--lighthouse")
    parser.add_argument("--log")
    parser.add_argument("--stop")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--die-after-commits", type=int, default=-1, help="(internal)")
    parser.add_argument("--runs", type=int, default=3, help="runs per backend (interleaved)")
    parser.add_argument("--workdir", default="/tmp/torchft_recovery")
    args = parser.parse_args()
    if args.replica:
        replica_main(args)
        return
    rows: dict[str, list[Outcome]] = {b: [] for b in BACKENDS}
    for i in range(args.runs):
        for backend in BACKENDS:
            out = run_scenario(backend, Path(args.workdir) / f"run{i}")
            rows[backend].append(out)
            print(
                f"run {i} {backend:8s} survivor's failed step {_seconds(out.survivor_failed_s)}, "
                f"next commit {out.survivor_recovery_s:6.2f}s  "
                f"replacement {out.replacement_recovery_s:6.2f}s "
                f"(of which joining {out.replacement_join_s:5.2f}s)  common steps "
                f"{len(out.common_steps)}  mismatched {out.mismatched_steps}",
                flush=True,
            )
    print(
        "\nseconds, median (min-max): kill -> survivor's failed step | kill -> survivor's next "
        "commit | kill -> replacement's first commit | replacement's Manager up -> first commit"
    )
    for backend, outs in rows.items():
        cells = [
            _spread([getattr(o, name) for o in outs if getattr(o, name) is not None])
            for name in (
                "survivor_failed_s",
                "survivor_recovery_s",
                "replacement_recovery_s",
                "replacement_join_s",
            )
        ]
        print(f"{backend:8s}  " + " | ".join(cells))


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.3f}s"


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    v = sorted(values)
    return f"{v[len(v) // 2]:5.2f} ({v[0]:.2f}-{v[-1]:.2f})"


if __name__ == "__main__":
    main()

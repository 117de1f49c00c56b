"""The trainer's world-size invariance on emulated hosts: the same bits at N = 1, 2, 4 and H x L.

Run ``python -m benchmarks.cluster_trainer`` as root from the repository root.
The same deterministic training run (trainer/train.py ``--deterministic``, the
smallest model, ``--micro-batches M``; one command line for every run) goes
at N = 1, 2 and 4 on this host (one ``torchrun --standalone``) and at
N = H x L on H emulated hosts of L ranks (launch/netns_cluster.sh: a network
namespace per host on one bridge, ``--rate`` shaping every host link; one
torchrun per host, ranks L*h .. L*h+L-1 on host h). Every rank runs through
``benchmarks/cluster_trainer_rank.py``, which counts the collective headers
it sends by (op, algorithm).

It checks, and exits 1 unless all hold:

- every run's final parameter hash (SHA-256 of the state_dict, the end
  record of ``metrics.jsonl``) and final loss equal the N = 1 run's, and
  the replicas agree in each run;
- on the emulated hosts every rank sent ``HOST_SLICES`` allreduce headers
  (the gradients; the end's small checks go ``HOST_LEADERS`` or, on few
  hosts, the flat star): the host-aware path ran, not the flat one;
- no namespace of the run is left behind.

Outputs (``--out``, default ``runs/cluster-trainer``): one directory per
run (metrics, node logs), ``results.json`` and the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import netns
from benchmarks.cluster_trainer_rank import MARK
from benchmarks.sessions import run_in_session

RANK_SCRIPT = netns.REPO / "benchmarks" / "cluster_trainer_rank.py"
# The smallest model the trainer offers, a step in milliseconds (the test
# suite's TINY recipe, tests/test_trainer_dist.py); the steps and M are flags.
TINY = [
    "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
    "--batch-size", "4", "--corpus-bytes", "200000", "--eval-batches", "2",
    "--eval-every", "0", "--sample-bytes", "0", "--no-plot", "--no-progress",
    "--warmup-steps", "2", "--lr", "3e-3", "--min-lr", "3e-4", "--dropout", "0.1",
    "--threads", "1", "--deterministic",
]  # fmt: skip
HOST_AWARE = ("ALLREDUCE/HOST_SLICES", "ALLREDUCE/HOST_LEADERS")
GRADIENTS = HOST_AWARE[0]
_ALGOS = re.compile(rf"{MARK} (\d+) (\d+) (\{{[^{{}}]*\}})")


@dataclass
class Run:
    """One training run: where, its end record's figures, the headers each rank sent."""

    layout: str  # "1 host x N" or "H hosts x L"
    world: int
    returncode: int
    steps: int = 0
    param_hash: str = ""
    final_loss: float = float("nan")
    replicas_agree: bool = False
    sent: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> op/algo -> headers

    def host_aware(self) -> bool:
        """Every rank sent host-aware gradient allreduces (``HOST_SLICES``: the
        gradients are above ``host_leaders_max_bytes``)."""
        ranks = set(range(self.world))
        return set(self.sent) == ranks and all(self.sent[r].get(GRADIENTS, 0) > 0 for r in ranks)


def trainer_args(steps: int, micro_batches: int, out_dir: Path, backend: str) -> list[str]:
    """The one training command line (only the output directory differs per run)."""
    return [
        *TINY, "--backend", backend,
        "--micro-batches", str(micro_batches), "--steps", str(steps),
        "--lr-decay-steps", str(steps), "--out-dir", str(out_dir),
    ]  # fmt: skip


def rank_environment() -> dict[str, str]:
    """This tree first on every rank's path, one intra-op thread, unbuffered output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        x for x in (str(netns.REPO), env.get("PYTHONPATH", "")) if x
    )
    return env


def finish(run: Run, out_dir: Path, output: str) -> Run:
    """Fill ``run`` from the rank lines in ``output`` and the end record in ``out_dir``."""
    for rank, _, counts in _ALGOS.findall(output):
        run.sent[int(rank)] = json.loads(counts)
    metrics = out_dir / "metrics.jsonl"
    if metrics.exists():
        ends = [
            r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "end"
        ]
        if ends:
            end = ends[-1]
            run.steps = int(end["step"])
            run.param_hash = str(end["param_hash"])
            run.final_loss = float(end["final_loss"])
            run.replicas_agree = bool(end["replicas_agree"])
    return run


def run_one_host(
    world: int, steps: int, micro_batches: int, out: Path, timeout_s: float, backend: str
) -> Run:
    """The run at ``world`` ranks on this host (one standalone torchrun)."""
    out_dir = out / f"n{world}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}", str(RANK_SCRIPT),
        *trainer_args(steps, micro_batches, out_dir, backend),
    ]  # fmt: skip
    done = run_in_session(cmd, timeout_s=timeout_s, env=rank_environment())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "torchrun.log").write_text(done.stdout + done.stderr)
    run = Run(f"1 host x {world}", world, done.returncode)
    return finish(run, out_dir, done.stdout)


def run_hosts(
    hosts: int,
    local: int,
    steps: int,
    micro_batches: int,
    out: Path,
    timeout_s: float,
    shaping: netns.Shaping,
    backend: str,
) -> Run:
    """The run at ``hosts`` x ``local`` ranks, one torchrun per emulated host."""
    out_dir = out / f"{hosts}x{local}"
    args = " ".join(trainer_args(steps, micro_batches, out_dir, backend))
    env = rank_environment()
    # ENTRENAR_TOPOLOGY=hosts: the host-aware path whatever the link probe
    # finds (unshaped, it would take the flat one), as the verdict checks it.
    node_cmd = (
        f"ENTRENAR_IFNAME={netns.HOST_IFNAME} GLOO_SOCKET_IFNAME={netns.HOST_IFNAME} "
        f"ENTRENAR_TOPOLOGY=hosts "
        f"exec {sys.executable} -m torch.distributed.run --nnodes={hosts} "
        f"--nproc_per_node={local} --node_rank=$NODE --master_addr=$HEAD_ADDR "
        f"--master_port={netns.HEAD_PORT} {RANK_SCRIPT} {args}"
    )
    prefix = f"enrtr{os.getpid() % 100000}"
    logs = out_dir / "logs"
    done = netns.run_on_hosts(
        hosts, node_cmd, prefix=prefix, log_dir=logs, timeout_s=timeout_s, shaping=shaping, env=env
    )
    left = netns.namespaces_left(prefix)
    if left:
        raise SystemExit(f"cluster_trainer: namespaces left behind: {left}")
    output = "".join(p.read_text() for p in sorted(logs.glob("node*.log")))
    run = Run(f"{hosts} hosts x {local}", hosts * local, done.returncode)
    return finish(run, out_dir, output)


def table(runs: list[Run]) -> list[str]:
    """The report: one row per run against the first (N = 1)."""
    ref = runs[0]
    lines = [
        "| layout | N | steps | sha256(params) | final loss | same bits as N=1 | "
        "HOST_SLICES, HOST_LEADERS headers per rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        # The fewest over ranks of each kind's first headers (one per call).
        counts = [min((s.get(k, 0) for s in run.sent.values()), default=0) for k in HOST_AWARE]
        headers = ", ".join(map(str, counts))
        same = "yes" if run.param_hash and run.param_hash == ref.param_hash else "NO"
        lines.append(
            f"| {run.layout} | {run.world} | {run.steps} | {run.param_hash[:16]} | "
            f"{run.final_loss:.10g} | {same} | {headers} |"
        )
    return lines


def verdict(runs: list[Run], steps: int) -> list[str]:
    """What failed, empty when every check holds."""
    ref = runs[0]
    bad = []
    for run in runs:
        if run.returncode != 0 or run.steps != steps or not run.replicas_agree:
            status = f"status {run.returncode}, {run.steps} steps, agree {run.replicas_agree}"
            bad.append(f"{run.layout}: {status}")
        elif (run.param_hash, run.final_loss) != (ref.param_hash, ref.final_loss):
            bad.append(f"{run.layout}: other bits than N=1 ({run.param_hash[:16]})")
        if " hosts " in run.layout and not run.host_aware():
            bad.append(f"{run.layout}: not every rank ran the host-aware allreduces: {run.sent}")
    return bad


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster_trainer",
        description="The trainer's final bits at N = 1, 2, 4 on one host and H x L emulated hosts.",
    )
    p.add_argument("--worlds", default="1,2,4", help="one-host world sizes (default 1,2,4)")
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts (default 4)")
    p.add_argument("--local", type=int, default=2, help="ranks per host (default 2)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (default 6)")
    p.add_argument("--micro-batches", type=int, default=8, help="M, a power of two (default 8)")
    p.add_argument("--rate", default="", help="every host link's rate, both ways (e.g. 1gbit)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    p.add_argument(
        "--backend", default="entrenar", help="the trainer's backend (gloo: a control that differs)"
    )
    p.add_argument("--out", default="runs/cluster-trainer", help="output directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not netns.namespaces_allowed():
        print("cluster_trainer: cannot create network namespaces (needs root)", file=sys.stderr)
        return 77
    out = Path(a.out).resolve()
    runs = [
        run_one_host(int(n), a.steps, a.micro_batches, out, a.timeout, a.backend)
        for n in a.worlds.split(",")
    ]
    shaping = netns.Shaping(rate=a.rate)
    runs.append(
        run_hosts(a.hosts, a.local, a.steps, a.micro_batches, out, a.timeout, shaping, a.backend)
    )
    lines = table(runs)
    bad = verdict(runs, a.steps)
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"args": vars(a), "runs": [asdict(r) for r in runs], "failed": bad}
    (out / "results.json").write_text(json.dumps(record, indent=1))
    print("\n".join(lines))
    for line in bad:
        print(f"FAILED {line}", file=sys.stderr)
    print("same bits everywhere" if not bad else "cluster_trainer: FAILED", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

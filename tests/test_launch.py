"""The launchers in launch/: syntax and structure of every file, and real runs of
local.sh, multinode.sh (two "nodes" on loopback) and netns_cluster.sh (two
network namespaces joined by veth links; skipped where namespaces cannot be
created). The Slurm script on a real Slurm cluster: test_launch_slurm.py; the
Kubeflow manifests: test_launch_k8s.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import _PORT_BLOCK, _PORTS_FROM, free_port, netns_allowed, run_session

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"
BACKEND = os.environ.get("TRAINER_TEST_BACKEND", "entrenar")

TINY = [
    "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
    "--batch-size", "4", "--corpus-bytes", "200000", "--eval-batches", "2",
    "--eval-every", "0", "--sample-bytes", "0", "--no-plot", "--no-progress",
    "--threads", "1", "--steps", "4", "--checkpoint-dir", "none",
]  # fmt: skip


run = run_session

# The scripts run `$PYTHON -m torch.distributed.run`: this interpreter's torchrun,
# so the tests pass when run as venv/bin/python -m pytest with the venv's bin/
# not on PATH.
LAUNCH_ENV = dict(os.environ, PYTHON=sys.executable)


def end_record(metrics: Path) -> dict:
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert recs and recs[-1].get("event") == "end", recs[-1:]
    return recs[-1]


# torch's elastic agents race on their store at exit (pytorch/pytorch#69520,
# open): an agent still in the exit barrier when the agent that hosts the
# store has exited logs "Error waiting on exit barrier" and a traceback, after
# every worker succeeded, and exits 0. Seen on a loaded machine; torch's, not
# the job's.
_EXIT_BARRIER = re.compile(
    r"(\S*/elastic/agent/server/api\.py:\d+\]) Error waiting on exit barrier"
)


def without_exit_barrier_race(log: str) -> str:
    """``log`` without that one logged error (every line of it carries the
    logger's ``file:line]`` tag); every other line, any other traceback, kept."""
    tags = {m.group(1) for m in _EXIT_BARRIER.finditer(log)}
    return "\n".join(line for line in log.splitlines() if not any(t in line for t in tags))


def test_free_ports_come_from_below_the_ephemeral_range_in_this_workers_block() -> None:
    """The launch tests' ports (a job's store, slurmctld) are picked outside the
    range the kernel hands outgoing connections, in a block per xdist worker,
    so a test beside this one cannot take the port before the listener binds
    it (it did once: EADDRINUSE on a ``bind(0)`` pick)."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ranges.exists():
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range")
    ephemeral = int(ranges.read_text().split()[0])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = _PORTS_FROM + (int(worker) if worker.isdigit() else 0) * _PORT_BLOCK
    ports = [free_port() for _ in range(20)]
    assert all(low <= p < min(low + _PORT_BLOCK, ephemeral) for p in ports), (low, ports)
    assert len(set(ports)) > 1, ports  # random picks, not one port for every job
    for p in set(ports):  # each one free: a listener can take it
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
            s.listen()


def test_only_torchs_exit_barrier_race_is_left_out_of_a_node_log() -> None:
    """The race's block (as a loaded run logged it) goes; a job's traceback,
    or the agent's other lines, stay."""
    tag = "E1126 07:26:52.456 25586 torch/distributed/elastic/agent/server/api.py:1008]"
    race = [
        f"{tag} Error waiting on exit barrier. Elapsed: 0.0076 seconds",
        f"{tag} Traceback (most recent call last):",
        f'{tag}   File "torch/distributed/elastic/agent/server/api.py", line 994, in _exit_barrier',
        f"{tag} torch.distributed.DistNetworkError: Failed to recv, got 0 bytes.",
    ]
    job = [
        "I1126 07:26:40.1 25586 site-packages/torch/distributed/elastic/agent/server/api.py:900] "
        "Local worker group finished",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "trainer/train.py", line 1, in <module>',
    ]
    assert without_exit_barrier_race("\n".join(race + job)) == "\n".join(job)
    assert "Traceback" not in without_exit_barrier_race("\n".join(race))
    assert without_exit_barrier_race("\n".join(job)) == "\n".join(job)


# -- static checks -------------------------------------------------------------------------

SCRIPTS = ["local.sh", "multinode.sh", "netns_cluster.sh", "slurm/train.sbatch"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_parse_and_are_executable(name):
    path = LAUNCH / name
    assert os.access(path, os.X_OK), f"{path} is not executable"
    assert path.read_text().startswith("#!/usr/bin/env bash\n")
    run(["bash", "-n", str(path)], timeout=20)
    if shutil.which("shellcheck"):
        run(["shellcheck", "-S", "warning", str(path)], timeout=20)


def _srun_commands(text: str) -> list[str]:
    """Every `srun ...` command of a script, continuation lines joined."""
    joined = text.replace("\\\n", " ")
    return [
        " ".join(line.split()) for line in joined.splitlines() if line.strip().startswith("srun ")
    ]


def test_slurm_script_recipes_and_defaults():
    """Both recipes (a task per rank; a torchrun per node with c10d) rendezvous on
    the allocation's first node; the defaults fit a small node and a fresh clone.
    tests/test_launch_slurm.py runs it on a real Slurm cluster."""
    text = (LAUNCH / "slurm" / "train.sbatch").read_text()
    sbatch = dict(
        line.removeprefix("#SBATCH --").split("=", 1)
        for line in text.splitlines()
        if line.startswith("#SBATCH --")
    )
    assert sbatch["cpus-per-task"] == "1" and int(sbatch["ntasks-per-node"]) >= 2
    assert "/" not in sbatch["output"], "Slurm does not create --output's directory"
    assert "time" not in sbatch, "a --time above the partition's maximum pends forever"
    assert 'head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in text
    assert 'export MASTER_ADDR="$head_node"' in text
    tasks, torchrun = _srun_commands(text)
    assert tasks.startswith("srun --kill-on-bad-exit=1 ")
    assert "RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID exec" in tasks
    assert 'export WORLD_SIZE="$SLURM_NTASKS"' in text
    assert "trainer/train.py" in tasks
    assert torchrun.startswith("srun --kill-on-bad-exit=1 ") and " torchrun " in torchrun
    for flag in ("--rdzv-backend=c10d", '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"'):
        assert flag in torchrun
    assert '--rdzv-id="$SLURM_JOB_ID"' in torchrun and "trainer/train.py" in torchrun
    assert 'trainer_args=(--backend entrenar --out-dir "runs/slurm-$SLURM_JOB_ID")' in text


def test_multinode_script_uses_c10d_rendezvous():
    text = (LAUNCH / "multinode.sh").read_text()
    for flag in ("--rdzv-backend=c10d", '--rdzv-endpoint="$RDZV_HOST:$rdzv_port"', "--node-rank"):
        assert flag in text
    assert "ENTRENAR_IFNAME" in text and "ENTRENAR_HOST" in text


def test_dockerfile_pins_torch_and_installs_the_package():
    text = (LAUNCH / "k8s" / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("RUN")]
    torch_line = next(line for line in lines if "torch" in line)
    assert "torch==2.13.0" in torch_line and "download.pytorch.org/whl/cpu" in torch_line
    assert any("pip install" in line and '".[train]"' in line for line in lines)
    assert lines.index(torch_line) < next(i for i, v in enumerate(lines) if ".[train]" in v)
    for path in ("pyproject.toml", "entrenar_pg", "trainer"):
        assert f"COPY {path}" in text


# -- real launches ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_local_sh_trains(tmp_path):
    out = tmp_path / "run"
    run(
        [str(LAUNCH / "local.sh"), "2", "--backend", BACKEND, *TINY, "--out-dir", str(out)],
        timeout=80,
        env=LAUNCH_ENV,
    )
    end = end_record(out / "metrics.jsonl")
    assert end["world_size"] == 2 and end["step"] == 4 and end["replicas_agree"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_multinode_sh_two_nodes_on_loopback(tmp_path):
    """Two torchruns joined by the c10d rendezvous, as on two hosts."""
    out = tmp_path / "run"
    port = str(free_port())
    procs = []
    for node in (0, 1):
        env = dict(
            LAUNCH_ENV,
            RDZV_HOST="127.0.0.1",
            RDZV_PORT=port,
            NNODES="2",
            NODE_RANK=str(node),
            NPROC="1",
            RDZV_ID=f"test-{uuid.uuid4().hex[:8]}" if node == 0 else "",
        )
        procs.append(env)
    procs[1]["RDZV_ID"] = procs[0]["RDZV_ID"]
    cmd = [str(LAUNCH / "multinode.sh"), "--backend", BACKEND, *TINY, "--out-dir", str(out)]
    ps = [
        subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for env in procs
    ]
    logs = []
    try:
        for p in ps:
            logs.append(p.communicate(timeout=80)[0])
    finally:
        for p in ps:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert [p.returncode for p in ps] == [0, 0], "\n".join(x[-4000:] for x in logs)
    end = end_record(out / "metrics.jsonl")
    assert end["world_size"] == 2 and end["replicas_agree"] and end["step"] == 4


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_netns_cluster_two_hosts_over_veth(tmp_path):
    if not netns_allowed():
        pytest.skip("cannot create network namespaces here (needs root and `ip netns`)")
    prefix = f"enrt{os.getpid() % 100000}"
    out = tmp_path / "run"
    env = dict(
        LAUNCH_ENV,
        NODES="2",
        NPROC="1",
        NETNS_PREFIX=prefix,
        LOG_DIR=str(tmp_path / "logs"),
        TIMEOUT_S="90",
    )
    proc = run(
        [str(LAUNCH / "netns_cluster.sh"), "--backend", BACKEND, *TINY, "--out-dir", str(out)],
        timeout=110,
        env=env,
        check=False,
    )
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in left, f"namespaces not torn down: {left}"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    end = end_record(out / "metrics.jsonl")
    assert end["world_size"] == 2 and end["replicas_agree"] and end["step"] == 4
    # each node ran in its own namespace with its own address on the bridge
    for i in (0, 1):
        log = without_exit_barrier_race((tmp_path / "logs" / f"node{i}.log").read_text())
        assert "Traceback" not in log, log[-3000:]
    assert "rendezvous 10.77.0.1:" in proc.stderr

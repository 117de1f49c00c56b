"""launch/slurm/train.sbatch on a real Slurm cluster: one node (this host),
munged, slurmctld and slurmd started by the fixture from a slurm.conf in a temp
dir and stopped after the module. The script is submitted with plain `sbatch`
from a fresh-clone-like directory (no runs/), with its own defaults.

Needs Debian's slurm-wlm and munge (.ci/run installs them) and root (slurmd
runs job steps as the submitting user); skips with the reason otherwise."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import free_port
from test_launch import TINY, end_record

# xdist_group: one worker runs this module, so its module-scoped Slurm cluster runs once.
pytestmark = pytest.mark.xdist_group("slurm")

REPO = Path(__file__).resolve().parent.parent
SBATCH_SCRIPT = "launch/slurm/train.sbatch"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE", "PREEMPTED",
}  # fmt: skip
INHERITED_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PET_", "TORCHELASTIC_")
TORCH_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE", "GROUP_RANK")  # fmt: skip
# Per-run arguments for the trainer: TINY without its checkpoint opt-out, so the
# job also writes its checkpoint under runs/slurm-<id>/ as a user's would.
TRAIN_ARGS = TINY[: TINY.index("--checkpoint-dir")]


def unavailable_reason() -> str | None:
    missing = [b for b in BINARIES if shutil.which(b, path=SEARCH_PATH) is None]
    if missing:
        why = os.environ.get("ENTRENAR_SLURM_UNAVAILABLE") or (
            f"{', '.join(missing)} not found (apt-get install slurm-wlm munge; .ci/run does)"
        )
        return f"slurm-wlm not installed: {why}"
    if os.geteuid() != 0:
        return "the test cluster needs root (slurmd, SlurmUser=root)"
    if usable_cpus() < 2:
        return "the launcher's default job (2 tasks x 1 CPU) needs a node with 2 CPUs"
    return None


def usable_cpus() -> int:
    """CPUs this process may run on: the node's CPUs in slurm.conf (configuring
    more than slurmd finds would drain the node)."""
    return len(os.sched_getaffinity(0))


def _node_name() -> str:
    """This host's short name when it resolves (as on a real cluster), else localhost."""
    name = socket.gethostname().split(".")[0]
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return "localhost"


@dataclass
class SlurmCluster:
    """A one-node Slurm cluster whose every file lives under ``root``."""

    root: Path
    node: str
    cpus: int
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        # SLURM_CONF points every Slurm tool (and, inherited, every job) at this
        # cluster; the interpreter running the tests comes first on PATH, so the
        # job's python3 and torchrun are this one.
        # Anything left from an outer Slurm job or torch launch is dropped: sbatch
        # would hand it to the job.
        path = os.pathsep.join([str(Path(sys.executable).parent), SEARCH_PATH])
        env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_PREFIXES)}
        for name in TORCH_LAUNCH_ENV:
            env.pop(name, None)
        return dict(env, SLURM_CONF=str(self.conf), PATH=path)

    def slurm(self, *args: str, timeout: float = 30, cwd: Path | None = None, check: bool = True):
        p = subprocess.run(
            list(args), env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
        if check and p.returncode != 0:
            pytest.fail(
                f"{' '.join(args)}: exit {p.returncode}\n{p.stdout}\n{p.stderr}\n{self.logs()}"
            )
        return p

    def write_config(self) -> None:
        for d in ("state", "spool", "log", "munge"):
            (self.root / d).mkdir(exist_ok=True)
        # munged insists: key readable by its owner only, socket dir searchable by all.
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "munge").chmod(0o755)
        (self.root / "plugstack.conf").write_text("")
        r = self.root
        self.conf.write_text(
            f"""\
ClusterName=entrenartest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
PlugStackConfig={r}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# A request no node can satisfy is rejected at submission instead of pending
# forever (what a small site should set; the default is NO).
EnforcePartLimits=ALL
ReturnToService=2
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )

    def start(self) -> None:
        self.write_config()
        r = self.root
        # --force: munged refuses a socket under a directory others cannot
        # search, and pytest's temp root is 0700 (only root talks to it here).
        self._daemon(
            "munged",
            "munged", "--foreground", "--force",
            f"--socket={r}/munge/munge.socket", f"--key-file={r}/munge/munge.key",
            f"--pid-file={r}/munge/munged.pid", f"--log-file={r}/log/munged.log",
            f"--seed-file={r}/munge/munged.seed",
        )  # fmt: skip
        self._wait(lambda: (r / "munge" / "munge.socket").exists(), 15, "munged socket")
        self._daemon("slurmctld", "slurmctld", "-D", "-f", str(self.conf))
        self._wait(
            lambda: "UP" in self.slurm("scontrol", "ping", check=False, timeout=10).stdout,
            30,
            "slurmctld to answer `scontrol ping`",
        )
        self._daemon("slurmd", "slurmd", "-D", "-N", self.node, "-f", str(self.conf))
        self._wait(
            lambda: self.slurm("sinfo", "-h", "-o", "%t", check=False).stdout.strip() == "idle",
            30,
            "the node to be idle in sinfo",
        )

    def _daemon(self, name: str, *argv: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - closed with the process
        exe = shutil.which(argv[0], path=SEARCH_PATH)
        assert exe, argv[0]
        self.daemons[name] = subprocess.Popen(
            [exe, *argv[1:]], env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        log.close()

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in self.daemons.items() if p.poll() is not None}
            if dead:
                pytest.fail(
                    f"Slurm daemon(s) exited {dead} while waiting for {what}\n{self.logs()}"
                )
            if ready():
                return
            time.sleep(0.2)
        pytest.fail(f"timed out after {timeout_s}s waiting for {what}\n{self.logs()}")

    def logs(self, tail: int = 25) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {path.name} ---\n" + "\n".join(lines))
        return "\n".join(out)

    def job(self, job_id: int) -> dict[str, str]:
        line = self.slurm("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_job(self, job_id: int, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            if time.monotonic() > deadline:
                self.slurm("scancel", str(job_id), check=False)
                pytest.fail(
                    f"job {job_id} still {info.get('JobState')} (Reason={info.get('Reason')}) "
                    f"after {timeout_s}s\n{self.logs()}"
                )
            time.sleep(0.5)

    def queued(self) -> list[str]:
        return self.slurm("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()

    def stop(self) -> None:
        """Cancel every job, stop the daemons, then kill anything still carrying this
        cluster's SLURM_CONF (job steps outlive a stopped slurmd)."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            ids = self.queued()
            if ids:
                self.slurm("scancel", *ids, check=False, timeout=10)
                deadline = time.monotonic() + 20
                while self.queued() and time.monotonic() < deadline:
                    time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.daemons.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for pid in self._leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _leftover_pids(self) -> list[int]:
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                continue
        return pids


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(
        root=tmp_path_factory.mktemp("slurm"), node=_node_name(), cpus=usable_cpus()
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def fresh_clone(tmp_path) -> Path:
    """A directory laid out like a fresh clone: the code, and no runs/."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("entrenar_pg", "trainer", "launch", "pyproject.toml"):
        (clone / name).symlink_to(REPO / name)
    return clone


def submit(cluster: SlurmCluster, clone: Path, *sbatch_args: str, env: dict | None = None) -> int:
    p = subprocess.run(
        ["sbatch", "--parsable", *sbatch_args, SBATCH_SCRIPT, *TRAIN_ARGS],
        cwd=clone, env=dict(cluster.env, **(env or {})), capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert p.returncode == 0, f"sbatch refused the job: {p.stderr}\n{cluster.logs()}"
    return int(p.stdout.strip().split(";")[0])


def check_job_trained(cluster: SlurmCluster, clone: Path, job_id: int, world: int) -> str:
    """The job completed, both ranks trained on entrenar and agree; returns its output."""
    info = cluster.wait_job(job_id, timeout_s=150)
    out_file = clone / f"slurm-entrenar-{job_id}.out"
    output = out_file.read_text() if out_file.exists() else "(no output file)"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"job {job_id}: {info['JobState']} exit {info['ExitCode']} Reason={info['Reason']}\n"
        f"{output[-4000:]}\n{cluster.logs()}"
    )
    end = end_record(clone / "runs" / f"slurm-{job_id}" / "metrics.jsonl")
    assert end["world_size"] == world and end["backend"] == "entrenar", end
    assert end["replicas_agree"] is True and end["step"] == 4, end
    assert (clone / "runs" / f"slurm-{job_id}" / "ckpt").is_dir(), "no checkpoint under runs/"
    # MASTER_ADDR is the allocation's first node, as Slurm names it.
    first = cluster.slurm("scontrol", "show", "hostnames", info["NodeList"]).stdout.split()[0]
    m = re.search(r"(?:MASTER_ADDR=|rendezvous )(\S+?)(?::(\d+))?(?:\s|$)", output)
    assert m, output[-3000:]
    assert m.group(1) == first == cluster.node, (m.group(1), first, cluster.node)
    return output


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sbatch_from_fresh_clone_two_tasks(slurm_cluster, fresh_clone):
    """`sbatch launch/slurm/train.sbatch` as a new user types it: its own defaults
    (2 tasks x 1 CPU, output in the submit dir), one Slurm task per rank."""
    job_id = submit(slurm_cluster, fresh_clone)
    output = check_job_trained(slurm_cluster, fresh_clone, job_id, world=2)
    assert "tasks: 2 ranks" in output
    assert slurm_cluster.job(job_id)["NumTasks"] == "2"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sbatch_torchrun_per_node(slurm_cluster, fresh_clone):
    """The other recipe: one torchrun per node, c10d rendezvous on the first node."""
    job_id = submit(
        slurm_cluster, fresh_clone, "--ntasks-per-node=1", "--cpus-per-task=2",
        env={"LAUNCH_MODE": "torchrun", "NPROC_PER_NODE": "2"},
    )  # fmt: skip
    output = check_job_trained(slurm_cluster, fresh_clone, job_id, world=2)
    assert "torchrun: 1 nodes x 2 ranks" in output


@pytest.mark.timeout(60)
def test_sbatch_torchrun_mode_refuses_several_tasks_per_node(slurm_cluster, fresh_clone):
    job_id = submit(slurm_cluster, fresh_clone, env={"LAUNCH_MODE": "torchrun"})
    info = slurm_cluster.wait_job(job_id, timeout_s=40)
    assert info["JobState"] == "FAILED", info
    output = (fresh_clone / f"slurm-entrenar-{job_id}.out").read_text()
    assert "allocate --ntasks-per-node=1 (got 2 tasks on 1 nodes)" in output, output
    assert not (fresh_clone / "runs").exists()

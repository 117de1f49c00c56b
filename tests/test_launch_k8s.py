"""The Kubeflow manifests in launch/k8s/, as far as they can be proven without a
cluster: each follows its operator's conventions, and its container command,
with exactly the environment the operator injects into each pod, trains on
entrenar across two network namespaces standing in for the pods.

- Trainer v2 (trainjob.yaml, TrainJob on the torch-distributed runtime): the
  torch plugin sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the Indexed
  Job's completion index, also JOB_COMPLETION_INDEX), PET_MASTER_ADDR (node 0's
  pod) and PET_MASTER_PORT=29500 (kubeflow/trainer pkg/runtime/framework/plugins/torch).
- Training Operator v1 (pytorchjob.yaml, PyTorchJob): MASTER_ADDR (the Master's
  service), MASTER_PORT (the `pytorchjob-port` container port), WORLD_SIZE,
  RANK, and since 1.7 PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT and
  PYTHONUNBUFFERED (training-operator v1.9.0 pkg/controller.v1/pytorch/envvar.go).

What stands in for the cluster: pod i is network namespace i of
launch/netns_cluster.sh (10.77.0.<i+1>, so the master's address is its
namespace IP where a cluster would give a DNS name); the image is this checkout
(PYTHONPATH, the Dockerfile's ENV); the pod's own /tmp and each volume's
mountPath are directories under the test's tmp_path (paths in the command are
rewritten to them); the command starts in an empty directory (the runtime's
workingDir). Kubernetes expands $(VAR) in command/args from the container's env,
and so does this test (expand_k8s)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import netns_allowed, run_session
from test_launch import TINY, end_record, without_exit_barrier_race

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "launch" / "k8s"
HEAD_ADDR = "10.77.0.1"  # netns_cluster.sh's node 0 (checked against its output)
# TINY without its checkpoint opt-out: the manifests' checkpoint paths are used.
TRAIN_ARGS = TINY[: TINY.index("--checkpoint-dir")]
V2_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
               "PET_MASTER_PORT"}  # fmt: skip
V1_DEFAULT_PORT = 23456  # training-operator: PyTorchJobDefaultPort


@dataclass(frozen=True)
class Pod:
    """One pod as the operator would create it: its container's command (after
    Kubernetes' $(VAR) expansion), its env, and its volume mounts."""

    name: str
    argv: list[str]
    env: dict[str, str]
    mounts: dict[str, str]  # mountPath -> volume name


def load(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def expand_k8s(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command/args: $(NAME) from the container's env
    (left as is when NAME is not defined there), $$ for a literal $."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, text)


def container_env(container: dict) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        assert "value" in item, f"{item['name']}: only literal values are emulated"
        env[item["name"]] = str(item["value"])
    return env


def make_pod(name: str, container: dict, injected: dict[str, str]) -> Pod:
    own = container_env(container)
    clash = set(own) & set(injected)
    assert not clash, f"{name}: the manifest sets what the operator injects: {clash}"
    env = {**own, **injected}
    argv = [expand_k8s(a, env) for a in container.get("command", []) + container.get("args", [])]
    unresolved = [a for a in argv if "$(" in a]
    assert not unresolved, f"{name}: no such variable in the pod's env: {unresolved}"
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    return Pod(name, argv, env, mounts)


def pytorch_container(replica_spec: dict) -> dict:
    """The container the v1 operator configures: the one named `pytorch`."""
    (container,) = [
        c for c in replica_spec["template"]["spec"]["containers"] if c["name"] == "pytorch"
    ]
    return container


def pytorchjob_pods(doc: dict, master_addr: str) -> list[Pod]:
    """The pods of a v1 PyTorchJob, Master first, with the operator's env."""
    specs = doc["spec"]["pytorchReplicaSpecs"]
    job = doc["metadata"]["name"]
    total = sum(int(s["replicas"]) for s in specs.values())
    nproc = doc["spec"].get("nprocPerNode")
    world = total * (int(nproc) if nproc and str(nproc).isdigit() else 1)
    master = pytorch_container(specs["Master"])
    ports = {p.get("name"): p["containerPort"] for p in master.get("ports", [])}
    port = str(ports.get("pytorchjob-port", V1_DEFAULT_PORT))
    pods = []
    for rtype, offset in (("Master", 0), ("Worker", 1)):
        spec = specs.get(rtype)
        for index in range(int(spec["replicas"]) if spec else 0):
            container = pytorch_container(spec)
            rank = str(index + offset)
            injected = {
                "PYTHONUNBUFFERED": "1",
                "MASTER_PORT": port, "PET_MASTER_PORT": port,
                "MASTER_ADDR": master_addr, "PET_MASTER_ADDR": master_addr,
                "WORLD_SIZE": str(world), "RANK": rank, "PET_NODE_RANK": rank,
                "PET_NNODES": str(total),
            }  # fmt: skip
            if nproc is not None:
                injected["PET_NPROC_PER_NODE"] = str(nproc)
            pods.append(make_pod(f"{job}-{rtype.lower()}-{index}", container, injected))
    return pods


def trainjob_pods(doc: dict, master_addr: str) -> list[Pod]:
    """The pods of a v2 TrainJob on torch-distributed (one container, `node`)."""
    trainer = doc["spec"]["trainer"]
    job = doc["metadata"]["name"]
    nodes = int(trainer["numNodes"])
    container = {**trainer, "name": "node"}  # the runtime's container, overridden
    pods = []
    for index in range(nodes):
        injected = {
            "PET_NNODES": str(nodes),
            "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
            "PET_NODE_RANK": str(index),
            "JOB_COMPLETION_INDEX": str(index),
            "PET_MASTER_ADDR": master_addr,
            "PET_MASTER_PORT": "29500",
        }
        pods.append(make_pod(f"{job}-node-0-{index}", container, injected))
    return pods


def image_env() -> dict[str, str]:
    """The Dockerfile's ENV, plus what stands in for the image's /app and
    interpreter: this checkout on PYTHONPATH and this Python first on PATH."""
    text = (K8S / "Dockerfile").read_text().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(kv.split("=", 1) for kv in shlex.split(line[4:]))
    env["PATH"] = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    env["PYTHONPATH"] = str(REPO)
    return env


def in_pod_fs(value: str, paths: dict[str, Path]) -> str:
    """``value`` with each of the pod's paths (/tmp, volume mounts) rewritten to
    the directory that stands in for it (also after an `=`, as in --flag=/path)."""
    for pod_path, host_dir in paths.items():
        value = re.sub(rf"(^|=){re.escape(pod_path)}(?=/|$)", rf"\g<1>{host_dir}", value)
    return value


def run_pods(pods: list[Pod], root: Path) -> dict[str, Path]:
    """Run every pod's command in its own network namespace; returns each pod's
    /tmp stand-in. Volumes are shared by all pods (ReadWriteMany)."""
    scripts = root / "pods"
    scripts.mkdir()
    tmps = {}
    for i, pod in enumerate(pods):
        home = root / pod.name
        (home / "tmp").mkdir(parents=True)
        (home / "workdir").mkdir()
        paths = {"/tmp": home / "tmp"}
        for mount_path, volume in pod.mounts.items():
            paths[mount_path] = root / "volumes" / volume
            paths[mount_path].mkdir(parents=True, exist_ok=True)
        # Only the manifest's values name pod paths; the image's own (PYTHONPATH:
        # this checkout, which may itself live under /tmp) and HOME are real.
        pod_env = {k: in_pod_fs(v, paths) for k, v in pod.env.items()}
        env = {**image_env(), "HOME": str(home), **pod_env}
        argv = [in_pod_fs(a, paths) for a in pod.argv] + TRAIN_ARGS
        assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
        (scripts / f"pod{i}.sh").write_text(
            f"cd {shlex.quote(str(home / 'workdir'))} && "
            f"exec env -i {assignments} {shlex.join(argv)}\n"
        )
        tmps[pod.name] = home / "tmp"
    proc = run_session(
        [str(REPO / "launch" / "netns_cluster.sh"), str(scripts)],
        timeout=170,
        env={
            **image_env(),
            "NODES": str(len(pods)),
            "NETNS_PREFIX": f"enrk{os.getpid() % 100000}",
            "LOG_DIR": str(root / "logs"),
            "TIMEOUT_S": "150",
            "NODE_CMD": 'exec bash "$1/pod$NODE.sh"',
        },
        check=False,
    )
    logs = "\n".join(
        f"--- {p.name} ---\n{without_exit_barrier_race(p.read_text())[-3000:]}"
        for p in sorted((root / "logs").glob("*"))
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    assert f"head {HEAD_ADDR}," in proc.stderr, proc.stderr
    assert "Traceback" not in logs, logs
    return tmps


def needs_netns() -> None:
    if not netns_allowed():
        pytest.skip("cannot create network namespaces here (needs root and `ip netns`)")


# -- conventions ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_trainjob_follows_trainer_v2_conventions():
    doc = load("trainjob.yaml")
    assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and doc["kind"] == "TrainJob"
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    assert doc["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = doc["spec"]["trainer"]
    assert trainer["image"] and isinstance(trainer["numNodes"], int) and trainer["numNodes"] >= 2
    assert isinstance(trainer["numProcPerNode"], int)
    assert not V2_RESERVED & set(container_env(trainer)), "the Trainer rejects reserved env"
    argv = trainer["command"] + trainer["args"]
    assert argv[:3] == ["torchrun", "-m", "trainer.train"], argv
    # The plugin's PET_* must reach torchrun: flags would override them.
    for flag in ("--nnodes", "--nproc", "--node", "--master", "--rdzv", "--standalone"):
        assert not any(a.startswith(flag) for a in argv), (flag, argv)
    assert "--backend=entrenar" in argv
    limits = trainer["resourcesPerNode"]["limits"]
    assert int(limits["cpu"]) >= trainer["numProcPerNode"]
    out = next(a.split("=", 1)[1] for a in argv if a.startswith("--out-dir="))
    assert out.startswith("/tmp/"), "the runtime's UID 1000 can write /tmp, not /app"


@pytest.mark.timeout(30)
def test_pytorchjob_follows_training_operator_v1_conventions():
    doc = load("pytorchjob.yaml")
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    assert "nprocPerNode" not in doc["spec"], "WORLD_SIZE would count processes, not pods"
    pods = pytorchjob_pods(doc, master_addr="entrenar-train-master-0")
    assert [p.name for p in pods] == ["entrenar-train-master-0", "entrenar-train-worker-0"]
    for rank, pod in enumerate(pods):
        argv = pod.argv
        assert argv[0] == "torchrun" and argv[argv.index("-m") + 1] == "trainer.train"
        assert f"--node-rank={rank}" in argv and "--nnodes=2" in argv
        assert "--master-addr=entrenar-train-master-0" in argv
        assert f"--master-port={V1_DEFAULT_PORT}" in argv
        assert "--backend=entrenar" in argv and "--resume" in argv
        ckpt = next(a.split("=", 1)[1] for a in argv if a.startswith("--checkpoint-dir="))
        assert any(ckpt.startswith(m + "/") for m in pod.mounts), "checkpoints on the volume"
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in specs["Master"]["template"]["spec"]["volumes"]
        }
        assert set(pod.mounts.values()) <= set(claims)
    assert specs["Worker"]["template"] == specs["Master"]["template"]


def test_expand_k8s_follows_kubernetes():
    env = {"A": "1", "B": "x y"}
    assert expand_k8s("--n=$(A) $(B)", env) == "--n=1 x y"
    assert expand_k8s("$(C)-$$(A)-$$", env) == "$(C)-$(A)-$"
    assert expand_k8s("${A} $A", env) == "${A} $A"  # no shell syntax in Kubernetes


# -- runs ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_trainjob_command_trains_in_two_pods(tmp_path):
    needs_netns()
    doc = load("trainjob.yaml")
    pods = trainjob_pods(doc, master_addr=HEAD_ADDR)
    tmps = run_pods(pods, tmp_path)
    trainer = doc["spec"]["trainer"]
    # Rank 0 runs on node 0 and writes the metrics to its own /tmp.
    end = end_record(tmps[pods[0].name] / "entrenar-run" / "metrics.jsonl")
    assert end["world_size"] == trainer["numNodes"] * trainer["numProcPerNode"], end
    assert end["backend"] == "entrenar" and end["replicas_agree"] is True and end["step"] == 4
    assert not (tmps[pods[1].name] / "entrenar-run" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_pytorchjob_command_trains_in_two_pods(tmp_path):
    needs_netns()
    doc = load("pytorchjob.yaml")
    pods = pytorchjob_pods(doc, master_addr=HEAD_ADDR)
    run_pods(pods, tmp_path)
    run_dir = tmp_path / "volumes" / "ckpt" / "run"
    end = end_record(run_dir / "metrics.jsonl")
    nproc = int(pods[0].env["NPROC_PER_NODE"])
    assert end["world_size"] == len(pods) * nproc, end
    assert end["backend"] == "entrenar" and end["replicas_agree"] is True and end["step"] == 4
    assert (run_dir / "ckpt").is_dir(), "the checkpoint goes to the shared volume"

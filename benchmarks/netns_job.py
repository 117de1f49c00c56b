"""A torchrun job on emulated hosts: one torchrun per host namespace, a JSON record per rank.

Both measurements on emulated hosts run through here, so they share the
hosts (``netns.run_on_hosts``: launch/netns_cluster.sh's topology and tbf),
how ranks are started and what they are given: the emulated cluster
(``benchmarks/cluster.py``, ranks ``benchmarks/cluster_rank.py``) and the cost
model's link measurements (``benchmarks/model/measure.py``, ranks
``benchmarks/model/rank.py``). A rank module takes ``--config FILE --out DIR``
and ends with :func:`write_record`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import netns
from benchmarks.cluster_config import ClusterConfig
from benchmarks.spawn import BenchError

log = logging.getLogger("benchmarks.netns_job")


def node_command(hosts: int, local: int, module: str, config: Path, out_dir: Path) -> str:
    """The bash command netns_cluster.sh runs in every host: one torchrun of ``local`` ranks."""
    return (
        f"exec {sys.executable} -m torch.distributed.run --nnodes={hosts} "
        f"--nproc_per_node={local} --node_rank=$NODE --master_addr=$HEAD_ADDR "
        f"--master_port={netns.HEAD_PORT} -m {module} --config {config} --out {out_dir}"
    )


def rank_environment() -> dict[str, str]:
    """The driver's environment plus what every rank needs: this tree first on the
    path, both backends on the host's link, one intra-op thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        x for x in (str(netns.REPO), env.get("PYTHONPATH", "")) if x
    )
    env.update(
        ENTRENAR_IFNAME=netns.HOST_IFNAME,
        GLOO_SOCKET_IFNAME=netns.HOST_IFNAME,
        OMP_NUM_THREADS="1",
    )
    return env


def shaping_of(cfg: ClusterConfig) -> netns.Shaping:
    """The links' shaping for ``cfg``."""
    return netns.Shaping(rate=cfg.rate or "", netem=f"delay {cfg.delay}" if cfg.delay else "")


def run_ranks(
    cfg: ClusterConfig, module: str, config: dict[str, Any], prefix: str
) -> list[dict[str, Any]]:
    """Build ``cfg``'s hosts (namespaces ``<prefix>-*``, links shaped as it says), run
    ``python -m module --config <config as JSON>`` as ``cfg.local`` ranks on each
    (all within ``cfg.timeout_s``), tear down; every rank's record, by rank."""
    with tempfile.TemporaryDirectory(prefix=f"entrenar_{prefix}_") as tmp:
        work = Path(tmp)
        cfg_path = work / "config.json"
        cfg_path.write_text(json.dumps(config))
        ranks_dir = work / "ranks"
        ranks_dir.mkdir()
        proc = netns.run_on_hosts(
            cfg.hosts,
            node_command(cfg.hosts, cfg.local, module, cfg_path, ranks_dir),
            prefix=prefix,
            log_dir=work / "logs",
            timeout_s=cfg.timeout_s,
            shaping=shaping_of(cfg),
            env=rank_environment(),
        )
        left = netns.namespaces_left(prefix)
        if left:
            log.warning("namespaces left behind: %s", left)
        if proc.returncode != 0:
            logs = "".join(
                f"\n--- {p.name} ---\n{p.read_text()[-3000:]}"
                for p in sorted((work / "logs").glob("node*.log"))
            )
            raise BenchError(f"the job exited {proc.returncode}: {proc.stderr[-3000:]}{logs}")
        return [json.loads((ranks_dir / f"rank{r}.json").read_text()) for r in range(cfg.world)]


def write_record(out_dir: Path, rank: int, record: dict[str, Any]) -> None:
    """A rank's record as ``out_dir/rank<R>.json``, whole or not at all."""
    path = out_dir / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)

"""One rank of an emulated-cluster job (``benchmarks/cluster.py``), started by torchrun.

Run as ``python -m torch.distributed.run ... -m benchmarks.cluster_rank --config F
--out DIR`` inside a host's namespace. The rank creates a gloo default group
(control), then one group per variant, and sweeps the sizes with the
variants interleaved (the order rotates each round) as ``benchmarks/workers.py``
does, with its pieces: the checked first call (every element must be
1 + 2 + ... + N), the warm-up, the per-call timing. It writes
``DIR/rank<R>.json``.

Link bytes. Each block (one variant, one size, one round) is fenced so that
every host leader (local rank 0, the one process per host that reads the
counters) sees exactly that block's traffic on its link::

    barrier; leader reads eth0 counters; barrier; the block; barrier; leader reads

The second barrier keeps every rank from sending block traffic before all
leaders have read; the third makes every rank have its result (so every byte
of the block has crossed its links) before the leaders read again. What the
fence itself adds (two barriers on the control group) is measured by empty
blocks fenced the same way, and the driver subtracts it.

Sockets. After creating each variant's group and one checked allreduce on it
(which completes any connection made lazily), the rank counts its TCP
sockets; the increase is that group's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import netns, netns_job
from benchmarks.cluster_config import ClusterConfig, resolve_variants
from benchmarks.cluster_load import BlockClock
from benchmarks.config import FLOAT32_BYTES, Variant
from benchmarks.sizes import plan_for, rotated
from benchmarks.workers import Contestant, _GroupAllreduce, _new_group, _time_allreduce, _verify

SOCKET_PROBE_ELEMS = 1024


class Fence:
    """The barriers around a block, and the host leader's counter reads."""

    def __init__(self, ctrl: dist.ProcessGroup, leader: bool) -> None:
        self.ctrl = ctrl
        self.leader = leader

    def open(self) -> tuple[int, int] | None:
        """Fence a block's start; the leader's (sent, received) counters, else None."""
        dist.barrier(group=self.ctrl)
        start = netns.link_bytes() if self.leader else None
        dist.barrier(group=self.ctrl)
        return start

    def close(self, start: tuple[int, int] | None) -> dict[str, int] | None:
        """Fence a block's end; the leader's bytes sent and received since ``start``."""
        dist.barrier(group=self.ctrl)
        if start is None:
            return None
        tx, rx = netns.link_bytes()
        return {"tx": tx - start[0], "rx": rx - start[1]}


@dataclasses.dataclass
class RankRecord:
    """What one rank reports (JSON)."""

    rank: int
    host: int
    local_rank: int
    times: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # "variant|size"
    verified: list[str] = dataclasses.field(default_factory=list)  # "variant|size" checked
    sockets: dict[str, int] = dataclasses.field(default_factory=dict)  # per variant
    links: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # leader only
    calibration: list[dict[str, int]] = dataclasses.field(default_factory=list)  # leader only
    # Per block, in order: wall, this rank's CPU, and on rank 0 the machine's busy CPU
    # (benchmarks/cluster_load.py: the others' load the cost model reads).
    load: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    variant_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # The policy's agreed fields as this entrenar_pg sets them by default (what
    # the cost model's check asks the policy with for this run's rows).
    policy_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    entrenar_pg_file: str = ""
    # Wall-clock seconds since the process started at the end of each phase.
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


def _make_groups(
    variants: Sequence[Variant], rank: int, world: int, ctrl: dist.ProcessGroup, rec: RankRecord
) -> dict[str, Contestant]:
    """One group per variant (collective: every rank, same order); records its sockets."""
    groups: dict[str, Contestant] = {}
    probe = torch.zeros(SOCKET_PROBE_ELEMS, dtype=torch.float32)
    before = netns.tcp_sockets()
    for v in variants:
        pg = _new_group(v, world)
        who = _GroupAllreduce(pg)
        _verify(probe, who, rank, world, v.name)
        if rank == 0 and v.backend == "entrenar":
            rec.notes.append(f"{v.name}: {_link_probe(pg)}")
        dist.barrier(group=ctrl)
        now = netns.tcp_sockets()
        rec.sockets[v.name] = now - before
        before = now
        groups[v.name] = who
    return groups


def _link_probe(pg: dist.ProcessGroup) -> str:
    """What the group's set-up probe found (entrenar_pg/transport/link_probe.py)."""
    backend: Any = pg._get_backend(torch.device("cpu"))
    verdict = getattr(backend._runtime.mesh, "probe", None)  # None: not probed, or an older tree
    return "no link probe" if verdict is None else f"link probe: {verdict.describe()}"


def _calibrate(fence: Fence, blocks: int, rec: RankRecord) -> None:
    """Empty fenced blocks: the fence's own bytes."""
    for _ in range(blocks):
        link = fence.close(fence.open())
        if link is not None:
            rec.calibration.append(link)


def _sweep(
    cfg: ClusterConfig,
    rank: int,
    groups: dict[str, Contestant],
    fence: Fence,
    rec: RankRecord,
) -> None:
    """Every size: ``rounds`` rounds of fenced blocks, one per variant, order rotated."""
    names = list(groups)
    clock = BlockClock(reads_machine=rank == 0)
    for size in cfg.sizes:
        plan = plan_for(size, cfg.plan_config())
        t = torch.zeros(size // FLOAT32_BYTES, dtype=torch.float32)
        for r in range(plan.rounds):
            for name in rotated(names, r):
                key = f"{name}|{size}"
                who = groups[name]
                start = fence.open()
                began = clock.read()
                calls, warm = 0, plan.warmup
                if r == 0:
                    _verify(t, who, rank, cfg.world, name)
                    rec.verified.append(key)
                    calls, warm = 1, max(warm, 1)
                rec.times.setdefault(key, []).extend(_time_allreduce(t, who, warm, plan.per_block))
                calls += warm + plan.per_block
                link = fence.close(start)
                load = BlockClock.block(began, clock.read())
                rec.load.append({"variant": name, "bytes": size, **load})
                if link is not None:
                    rec.links.append({"variant": name, "bytes": size, "calls": calls, **link})
        del t


def _since_start() -> float:
    """Seconds since this process started (its start time from /proc, in clock ticks)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


def run(cfg: ClusterConfig, out_dir: Path, variants: Sequence[Variant] | None = None) -> None:
    """This rank's whole job; writes ``out_dir/rank<R>.json``.

    ``variants``: these groups instead of ``cfg.variants``' names (the cost
    model's link measurements, ``benchmarks/model/rank.py``)."""
    import entrenar_pg
    from entrenar_pg import Options
    from entrenar_pg import config as entrenar_config

    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank, local_world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    if world != cfg.world or local_world != cfg.local:
        raise RuntimeError(
            f"rank {rank}: torchrun gave WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local_world}; "
            f"the config says {cfg.hosts} hosts x {cfg.local}"
        )
    torch.set_num_threads(1)
    rec = RankRecord(rank=rank, host=int(env["GROUP_RANK"]), local_rank=local_rank)
    rec.entrenar_pg_file = str(entrenar_pg.__file__)
    if variants is None:
        variants, rec.notes = resolve_variants(
            cfg.variants, {f.name for f in dataclasses.fields(Options)}
        )
    rec.variant_options = {v.name: v.options for v in variants}
    if hasattr(entrenar_config, "AGREED_FIELDS"):  # none in a tree before them
        from entrenar_pg.transport import options_agreement

        rec.policy_defaults = json.loads(options_agreement.encode(Options()))
    rec.phases["imports"] = _since_start()
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.op_timeout_s))
    ctrl = dist.group.WORLD
    assert ctrl is not None
    rec.phases["init"] = _since_start()
    fence = Fence(ctrl, leader=local_rank == 0)
    groups = _make_groups(variants, rank, world, ctrl, rec)
    rec.phases["groups"] = _since_start()
    _calibrate(fence, cfg.calibration_blocks, rec)
    _sweep(cfg, rank, groups, fence, rec)
    _calibrate(fence, cfg.calibration_blocks, rec)
    rec.phases["sweep"] = _since_start()
    netns_job.write_record(out_dir, rank, dataclasses.asdict(rec))
    dist.barrier(group=ctrl)
    dist.destroy_process_group()


def run_or_exit(
    cfg: ClusterConfig, out_dir: Path, variants: Sequence[Variant] | None = None
) -> None:
    """:func:`run`; a failure exits 1 at once (torchrun stops the others)."""
    try:
        run(cfg, out_dir, variants)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # a cleanup that waits on dead peers would only delay the driver


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point under torchrun."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster_rank")
    p.add_argument("--config", required=True, help="ClusterConfig JSON file")
    p.add_argument("--out", required=True, help="directory for rank<R>.json")
    a = p.parse_args(argv)
    run_or_exit(ClusterConfig.from_json(json.loads(Path(a.config).read_text())), Path(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

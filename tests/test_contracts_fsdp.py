"""FSDP2 and HSDP (torch's ``fully_shard``) under the checker, in real processes.

ENTRENAR_CHECK=1, entrenar backend, CPU, spawned ranks, a tiny model, 4 steps.
- FSDP2 at N = 2: a clean run raises nothing, every step's reduce-scatters,
  all-gathers and allreduces are judged by the step's end, and its weights
  equal an unchecked run's; a reduce-scatter output (a gradient shard) or an
  all-gather output (a gathered parameter) corrupted on one rank at step k
  raises ContractViolation on every rank at step k, naming that rank and the
  collective.
- HSDP at N = 4 (2 replicas x 2 shards): the ranks holding the same shard
  compare it after every step (C-DDP-001 along the replicate dimension); one
  replica's shard perturbed after step k is caught at step k.
- DDP at N = 3 with a checked subgroup of ranks 0 and 2 (a metrics group):
  the ranks check different sets of groups, and still make the same jobs.
"""

from __future__ import annotations

import os
import re
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from test_api_collectives import spawn_ranks

K = 3  # the faulty step
STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


class StepFault:
    """Test double of a faulty algorithm: corrupts ``victim``'s output of the first
    ``kind`` job of step ``at`` (the job is wrapped in ``jobs.JOBS``)."""

    def __init__(self, job: Any, at: int, victim: int, how: str) -> None:
        self.job, self.at, self.victim, self.how = job, at, victim, how
        self.step = 0
        self.done = False

    def __call__(self, ctx: Any, req: Any, hosts: list[list[torch.Tensor]]) -> None:
        self.job(ctx, req, hosts)
        if self.done or self.step != self.at or ctx.rank != self.victim:
            return
        (out,) = hosts[1][:1]
        if not out.numel():
            return
        self.done = True
        if self.how == "gross":  # a gradient shard element far off
            out[0] += 1000.0
        else:  # one bit of one gathered parameter
            out.view(torch.int32)[out.numel() // 2] ^= 1


def _train(
    mesh: Any, rank: int, fault: StepFault | None, perturb: int | None
) -> tuple[int, str, list[dict[str, int]], list[torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pg = dist.distributed_c10d._get_default_group()
    verdicts: list[dict[str, int]] = []
    step = 0
    try:
        for step in range(1, STEPS + 1):
            if fault is not None:
                fault.step = step
            g = torch.Generator().manual_seed(10 * step + rank)
            loss = (
                (model(torch.randn(8, 16, generator=g)) - torch.randn(8, 4, generator=g)) ** 2
            ).mean()
            loss.backward()
            if perturb is not None and step == K and rank == perturb:
                with (
                    torch.no_grad()
                ):  # one replica's shard moves (the hook after this step sees it)
                    model[0].weight.to_local().view(-1)[0] += 1e-6
            opt.step()
            opt.zero_grad()
            if pg.checker is not None:
                verdicts.append(pg.checker.take_verdicts())
    except ContractViolationType as e:
        return step, str(e), verdicts, []
    return (
        -1,
        "no violation",
        verdicts,
        [p.full_tensor().detach().clone() for p in model.parameters()],
    )


ContractViolationType: Any = None


def _worker(rank: int, world: int, scenario: str, out_dir: str) -> None:
    global ContractViolationType
    os.environ["ENTRENAR_CHECK"] = "1"
    from torch.distributed.device_mesh import init_device_mesh

    import entrenar_pg
    from entrenar_pg.call import requests as rq
    from entrenar_pg.runtime import jobs

    ContractViolationType = entrenar_pg.ContractViolation
    warnings.filterwarnings("ignore")
    dist.init_process_group("entrenar", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    pg = dist.distributed_c10d._get_default_group()
    lines = []
    if scenario == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        at, msg, verdicts, _ = _train(mesh, rank, None, perturb=3)
        lines += [f"at={at}", "msg=" + msg.replace(chr(10), " ")]
        lines.append(f"verdicts={verdicts}")
    else:
        mesh = init_device_mesh("cpu", (world,))
        if scenario == "clean+ag":  # clean, unchecked and checked; then the all-gather fault
            checker = pg.checker
            pg.checker = None  # the same training, unchecked, for the weights
            _, _, _, ref = _train(mesh, rank, None, None)
            pg.checker = checker
            at, msg, verdicts, params = _train(mesh, rank, None, None)
            lines += [f"clean_at={at}", f"clean_verdicts={verdicts}"]
            same = all(torch.equal(p, q) for p, q in zip(params, ref, strict=True))
            lines.append(f"same_weights={same and len(params) == len(ref) > 0}")
            fault = StepFault(jobs.JOBS[rq.Allgather], K, 0, "bit")
            jobs.JOBS[rq.Allgather] = fault
        else:
            fault = StepFault(jobs.JOBS[rq.ReduceScatter], K, 1, "gross")
            jobs.JOBS[rq.ReduceScatter] = fault
        at, msg, verdicts, params = _train(mesh, rank, fault, None)
        lines += [f"at={at}", "msg=" + msg.replace(chr(10), " ")]
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines))
    if "no violation" in "".join(lines):
        dist.destroy_process_group()
    os._exit(0)  # after a violation the group is broken: skip teardown


def _run(tmp_path: Any, world: int, scenario: str) -> list[dict[str, str]]:
    spawn_ranks(world, _worker, scenario, str(tmp_path), timeout_s=100)
    out = []
    for r in range(world):
        text = (tmp_path / f"rank{r}.txt").read_text()
        out.append(dict(line.split("=", 1) for line in text.splitlines()))
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp2_clean_then_gathered_parameter_corrupted(tmp_path: Any) -> None:
    """Clean: nothing raised, every step judged, the weights of an unchecked run.
    Then one bit of a gathered parameter on rank 0 at step K: caught at K by the hash."""
    for rank, got in enumerate(_run(tmp_path, 2, "clean+ag")):
        assert got["clean_at"] == "-1" and got["same_weights"] == "True", got
        verdicts = eval(got["clean_verdicts"])  # a list of dicts written by the rank
        assert len(verdicts) == STEPS
        for step, v in enumerate(verdicts, 1):
            # every step: its all-gathers and reduce-scatters judged by the step's end
            assert v.get("C-AG-001", 0) >= 2 and v.get("C-RS-001", 0) >= 2, (rank, step, v)
            assert v.get("F-DP-003", 0) >= 2, (rank, step, v)
        # the checker counts the process's steps: the clean run's STEPS came first
        _caught(got, rank, "C-AG-001", "allgather", 0, STEPS + K)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp2_gradient_shard_corrupted(tmp_path: Any) -> None:
    """A reduce-scatter output (rank 1's gradient shard) far off at step K: caught at K."""
    for rank, got in enumerate(_run(tmp_path, 2, "rs")):
        _caught(got, rank, "C-RS-001", "reduce_scatter", 1, K)


def _caught(
    got: dict[str, str], rank: int, contract: str, collective: str, victim: int, step: int
) -> None:
    msg = got["msg"]
    assert got["at"] == str(K), (rank, got)  # raised by the training loop's step K
    assert re.search(rf"{contract} violated at {collective} #\d+ \(", msg), msg
    assert f"of optimizer step {step};" in msg, msg
    assert f"[offending rank(s): [{victim}]]" in msg, msg


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hsdp_replicas_compared_after_every_step(tmp_path: Any) -> None:
    """Rank 3 perturbs its shard at step K: ranks 1 and 3 (the same shard) disagree."""
    for rank, got in enumerate(_run(tmp_path, 4, "hsdp")):
        msg = got["msg"]
        assert got["at"] == str(K), (rank, got)
        verdicts = eval(got["verdicts"])
        assert len(verdicts) == K - 1
        for v in verdicts:  # the clean steps: each compared the replicas
            assert v.get("C-DDP-001", 0) >= 1 and v.get("C-RS-001", 0) >= 1, v
        if rank in (1, 3):  # the replicate group holding the perturbed shard
            assert f"C-DDP-001 violated after optimizer step {K}" in msg, msg
            assert "diverged" in msg, msg


# ----------------------------------------------------------------------------- DDP + a subgroup


class SubgroupFault:
    """Test double of a faulty algorithm: corrupts the last rank's output of the
    subgroup's allreduce (the group of two) after optimizer step ``at``."""

    def __init__(self, job: Any, at: int | None) -> None:
        self.job, self.at = job, at
        self.step = 0

    def __call__(self, ctx: Any, req: Any, hosts: list[list[torch.Tensor]]) -> None:
        self.job(ctx, req, hosts)
        if self.step == self.at and ctx.world == 2 and ctx.rank == 1:
            hosts[0][0].add_(1000.0)


def _subgroup_worker(rank: int, world: int, fault_at: int | None, out_dir: str) -> None:
    """DDP on the checked default group, and the losses averaged in a checked
    subgroup of the first and the last rank after each step (a metrics group):
    the ranks check different sets of groups."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["ENTRENAR_CHECK"] = "1"
    import entrenar_pg
    from entrenar_pg.call import requests as rq
    from entrenar_pg.runtime import jobs

    warnings.filterwarnings("ignore")
    dist.init_process_group("entrenar", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    metrics = dist.new_group([0, world - 1])  # entrenar and checked, as the default group
    member = rank in (0, world - 1)
    fault = SubgroupFault(jobs.JOBS[rq.Allreduce], fault_at)
    jobs.JOBS[rq.Allreduce] = fault
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    at, msg = -1, "no violation"
    try:
        for step in range(1, STEPS + 1):
            fault.step = step
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            ((model(x) - y) ** 2).mean().backward()
            at = step
            opt.step()
            opt.zero_grad()
            if member:
                loss = torch.ones(1)
                dist.all_reduce(loss, group=metrics)
        at = -1
    except entrenar_pg.ContractViolation as e:
        msg = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"at={at}\nmsg={msg.replace(chr(10), ' ')}")
    if at == -1:
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault_at", [None, K])
def test_ddp_with_a_checked_subgroup_of_some_ranks(tmp_path: Any, fault_at: int | None) -> None:
    """Rank 1 checks only the default group, ranks 0 and 2 a subgroup too. Clean:
    no rank raises. Before the fix rank 0 judged each step in a job of its own
    while rank 1 deferred it to its next job, and the default group failed with
    a CollectiveMismatchError at the first step. With the subgroup's allreduce
    corrupted on rank 2 after step K: judged at step K + 1 in the subgroup, and
    every rank halts there, rank 1 told by the default group's exchange (which
    every rank makes at the step from the second step on: the first step's
    exchange tells every rank that some rank checks another group)."""
    spawn_ranks(3, _subgroup_worker, fault_at, str(tmp_path), timeout_s=120)
    got = [
        dict(line.split("=", 1) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines())
        for r in range(3)
    ]
    if fault_at is None:
        assert [g["at"] for g in got] == ["-1"] * 3, got
        return
    for rank, g in enumerate(got):
        assert g["at"] == str(K + 1), (rank, g)
        if rank == 1:  # the reporters, by global rank
            assert (
                f"violated at optimizer step {K + 1} in another group of rank(s) [0, 2]"
                in (g["msg"])
            ), g
        else:  # two ranks' outputs differ: either may be the wrong one
            assert "C-RING-001 violated at allreduce" in g["msg"], g
            assert "[offending rank(s): [0, 1]]" in g["msg"], g

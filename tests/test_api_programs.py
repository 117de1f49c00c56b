"""Real PyTorch programs on entrenar, unchanged but for the backend name.

FSDP2 (``fully_shard``) training of a small transformer, pipeline parallelism
(``torch.distributed.pipelining``: GPipe and 1F1B over send/recv), DDP with a
subgroup for metrics, and the rest of torch's distributed stack that rides on
process groups: DeviceMesh (1-D and 2-D), DTensor, functional collectives,
tensor parallelism, ``torch.compile`` of a collective, object collectives on
subgroups, DDP communication hooks. Each runs in spawned processes with
``init_process_group("entrenar")`` and is checked against gloo on the same
inputs, or against a single-process run.

``test_torch_limits`` pins down what torch itself does not let a Python
backend do (docs/api.md lists them); if a torch upgrade lifts one, it fails
and the table must be updated.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from test_api_collectives import spawn_ranks


def _init(rank: int, world: int, backend: str = "entrenar") -> None:
    import entrenar_pg  # noqa: F401  (registers the backend)

    warnings.filterwarnings("ignore")
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))


# ----------------------------------------------------------------------------- FSDP2


def _transformer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
    )
    return nn.Sequential(nn.TransformerEncoder(layer, num_layers=2), nn.Linear(32, 8))


def _fsdp_train(mesh: Any, rank: int, steps: int = 4) -> tuple[list[float], list[torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    model = _transformer()
    for block in model[0].layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + 10 * step + rank)
        x, y = torch.randn(4, 6, 32, generator=g), torch.randn(4, 6, 8, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = [p.full_tensor().detach() for p in model.parameters()]
    return losses, params


def _fsdp_worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    _init(rank, world)
    mesh = init_device_mesh("cpu", (world,))
    assert dist.get_backend(mesh.get_group()) == "entrenar"
    losses, params = _fsdp_train(mesh, rank)
    gloo_mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    ref_losses, ref_params = _fsdp_train(gloo_mesh, rank)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q)
    assert losses[-1] < losses[0] + 1.0  # it trained (and not into NaN)
    if world == 4:  # HSDP: replicate x shard on a 2-D mesh; same averaged gradients
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hsdp_losses, hsdp_params = _fsdp_train(hsdp, rank)
        torch.testing.assert_close(torch.tensor(hsdp_losses), torch.tensor(ref_losses))
        for p, q in zip(hsdp_params, ref_params, strict=True):
            torch.testing.assert_close(p, q)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_training_matches_gloo(world: int) -> None:
    spawn_ranks(world, _fsdp_worker, timeout_s=100)


# ----------------------------------------------------------------------------- pipelining


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _pipeline_worker(rank: int, world: int) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    _init(rank, world)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target, reduction="sum")

    ref = _mlp()
    ref_out = ref(x)
    ref_loss = loss_fn(ref_out, y)
    ref_loss.backward()
    ref_part = ref[:3] if rank == 0 else ref[3:]
    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        model = _mlp()
        part = model[:3] if rank == 0 else model[3:]
        stage = PipelineStage(part, rank, world, torch.device("cpu"))
        schedule = schedule_cls(stage, n_microbatches=4, loss_fn=loss_fn, scale_grads=False)
        if rank == 0:
            schedule.step(x)
        else:
            losses: list[torch.Tensor] = []
            out = schedule.step(target=y, losses=losses)
            torch.testing.assert_close(out, ref_out)
            torch.testing.assert_close(sum(losses), ref_loss)
        for p, q in zip(part.parameters(), ref_part.parameters(), strict=True):
            assert p.grad is not None
            torch.testing.assert_close(p.grad, q.grad, msg=f"{schedule_cls.__name__} gradient")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pipelining_gpipe_and_1f1b_match_single_process() -> None:
    spawn_ranks(2, _pipeline_worker, timeout_s=100)


# ----------------------------------------------------------------------------- DDP + subgroup


def _ddp_run(
    pg: Any, metrics_pg: Any, rank: int, steps: int = 5
) -> tuple[torch.Tensor, list[float]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 1)), process_group=pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    metrics = []
    for step in range(steps):
        g = torch.Generator().manual_seed(7 * step + rank)
        x, y = torch.randn(16, 10, generator=g), torch.randn(16, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if metrics_pg is not None:  # ranks of the metrics subgroup average their losses
            m = loss.detach().reshape(1)
            dist.all_reduce(m, op=dist.ReduceOp.AVG, group=metrics_pg)
            metrics.append(m.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, metrics


def _ddp_worker(rank: int, world: int) -> None:
    _init(rank, world)
    metrics_ranks = [0, world - 1]
    ent_metrics = dist.new_group(metrics_ranks)  # entrenar, like the default group
    gloo = dist.new_group(backend="gloo")
    gloo_metrics = dist.new_group(metrics_ranks, backend="gloo")
    member = rank in metrics_ranks
    params, metrics = _ddp_run(None, ent_metrics if member else None, rank)
    ref_params, ref_metrics = _ddp_run(gloo, gloo_metrics if member else None, rank)
    torch.testing.assert_close(params, ref_params)
    torch.testing.assert_close(torch.tensor(metrics), torch.tensor(ref_metrics))
    everyone = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(everyone, params)
    for other in everyone:  # DDP keeps the replicas identical
        assert torch.equal(other, params)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_with_subgroup_metrics_matches_gloo() -> None:
    spawn_ranks(3, _ddp_worker, timeout_s=100)


# ----------------------------------------------------------------------------- torch stack


def _integration_worker(rank: int, world: int) -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _get_split_source, _resolve_process_group
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _init(rank, world)
    pg = dist.distributed_c10d._get_default_group()
    # group names resolve back to the group (functional collectives rely on it)
    sub = dist.new_group([0, 1])
    assert _resolve_process_group(pg.group_name) is pg
    if rank in (0, 1):
        assert _resolve_process_group(sub.group_name) is sub and sub.group_name != pg.group_name

    # DeviceMesh 1-D and 2-D, DTensor
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    assert dist.get_backend(mesh2.get_group("tp")) == "entrenar"
    full = torch.arange(float(4 * world * 2)).reshape(4 * world, 2)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(dt.full_tensor(), full)
    assert torch.equal(dt.redistribute(mesh, [Replicate()]).to_local(), full)
    sq = torch.arange(float(world * world * 4)).reshape(2 * world, 2 * world)
    s1 = distribute_tensor(sq, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])
    assert torch.equal(s1.full_tensor(), sq)
    dt2 = distribute_tensor(full, mesh2, [Shard(0), Shard(1)])
    assert torch.equal(dt2.full_tensor(), full)

    # functional collectives (the C++ paths that resolve the group by name)
    t = torch.arange(4.0) + rank
    total = sum(torch.arange(4.0) + r for r in range(world))
    assert torch.equal(funcol.all_reduce(t, "sum", pg).wait(), total)
    gathered = funcol.all_gather_tensor(t, 0, pg).wait()
    assert torch.equal(gathered, torch.cat([torch.arange(4.0) + r for r in range(world)]))
    rs = funcol.reduce_scatter_tensor(torch.arange(2.0 * world), "sum", 0, pg).wait()
    assert torch.equal(rs, torch.arange(2.0 * world)[2 * rank : 2 * rank + 2] * world)
    assert torch.equal(funcol.broadcast(t, 1, pg).wait(), torch.arange(4.0) + 1)
    a2a = funcol.all_to_all_single(torch.arange(2.0 * world) + 10 * rank, None, None, pg).wait()
    assert torch.equal(
        a2a,
        torch.tensor([10.0 * p + off for p in range(world) for off in (2 * rank, 2 * rank + 1)]),
    )

    # tensor parallelism
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ref.load_state_dict(model.state_dict())
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    out = model(x)
    out.sum().backward()
    r = ref(x)
    r.sum().backward()
    torch.testing.assert_close(out, r)
    torch.testing.assert_close(model[0].weight.grad.full_tensor(), ref[0].weight.grad)

    # torch.compile of a function with a collective (dynamo -> functional collectives)
    def f(v: torch.Tensor) -> torch.Tensor:
        w = v * 2
        dist.all_reduce(w)
        return w + 1

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(
        compiled(torch.ones(3) * (rank + 1)), torch.full((3,), float(world * (world + 1) + 1))
    )

    # new_subgroups, object collectives on a subgroup
    cur, subgroups = dist.new_subgroups(group_size=2)
    assert len(subgroups) == world // 2 and dist.get_world_size(cur) == 2
    got: list[Any] = [None, None]
    dist.all_gather_object(got, rank, group=cur)
    assert got == [rank - rank % 2, rank - rank % 2 + 1]

    # DDP communication hooks: default ones and PowerSGD (whose hook waits, in a
    # future callback on the comm thread, for a second allreduce)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    hooks: list[tuple[Any, Any]] = [
        (None, default_hooks.allreduce_hook),
        (None, default_hooks.fp16_compress_hook),
        (
            psgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
            psgd.powerSGD_hook,
        ),
    ]
    for state, hook in hooks:
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)))
        ddp.register_comm_hook(state, hook)
        for _ in range(4):  # PowerSGD compresses from iteration 2 on
            ddp(torch.randn(4, 8) + rank).sum().backward()
        grad = ddp.module[0].weight.grad.reshape(-1).clone()
        allg = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(allg, grad)
        assert all(torch.equal(a, grad) for a in allg), hook.__name__

    # what init_process_group(device_id=cuda:N) does to a group, short of a GPU
    pg.bound_device_id = torch.device("cuda", 0)
    assert pg.bound_device_id is None and _get_split_source(pg) is None
    assert pg._get_backend(torch.device("cuda", 0)).supports_splitting is False
    extra = dist.new_group([0, 1])  # still a fresh group, not a split
    if rank in (0, 1):
        one = torch.ones(1)
        dist.all_reduce(one, group=extra)
        assert one.item() == 2
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_torch_stack_on_entrenar() -> None:
    spawn_ranks(4, _integration_worker, timeout_s=130)


# ----------------------------------------------------------------------------- limits


def _limits_worker(rank: int, world: int) -> None:
    _init(rank, world)
    pg = dist.distributed_c10d._get_default_group()
    # 1. torch's monitored_barrier refuses every backend but gloo; the method itself works.
    with pytest.raises(ValueError, match="only implemented for GLOO"):
        dist.monitored_barrier()
    pg.monitored_barrier(timedelta(seconds=30))
    # 2. split_group needs an accelerator-bound default group (gloo on CPU: the same).
    with pytest.raises(RuntimeError, match="not safe to split|does not support splitting"):
        dist.split_group(split_ranks=[[0], [1]])
    # 3. torch.ops.c10d.* dispatcher ops go to C++ getBackend(), which a Python
    #    process group (a ProcessGroup subclass; torch has no Python Backend) lacks.
    with pytest.raises(RuntimeError, match="No backend type associated"):
        torch.ops.c10d.broadcast_([torch.ones(1)], pg.boxed(), 0, 0)
    # 4. the bf16 compression hook insists on a torch built with CUDA and NCCL
    #    (DDP asks the build, not the group: on such a build entrenar's DDP takes it).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(nn.Linear(2, 2))
    if torch.version.cuda is None or not dist.is_nccl_available():
        with pytest.raises(TypeError, match="NCCL"):
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_torch_limits() -> None:
    spawn_ranks(2, _limits_worker, timeout_s=70)

"""What deterministic mode and the contract checker cost (docs/contracts.md, "Costs").

    python -m benchmarks.contracts_cost allreduce N MIB REPEATS
    python -m benchmarks.contracts_cost ddp N STEPS WIDTH BATCH
    python -m benchmarks.contracts_cost gpt N STEPS

``allreduce``: ring vs deterministic ring vs ring + checker at one size, one
entrenar group each, interleaved (rotating order) so drift hits all alike. A
sample is one blocking allreduce: wall time is the maximum over ranks, CPU
time (process CPU, all threads) the mean over ranks. Prints medians and
ratios to the first variant.

``ddp``: DDP training steps (3-layer MLP, 512 -> WIDTH -> WIDTH -> 512, AdamW)
on two entrenar groups, checks off and on, alternating step by step; same
model, same data. Prints step medians, their ratio, the checker's own
counters (wall and CPU seconds per measured step, and the CPU per step over
all steps with the warm-up's one-off costs), its hash, and the load average
before and after (how quiet the machine was). ``gpt``: the same with the
benchmark's DDP model and batch (``benchmarks.ddp_model.make_model``: the
trainer's GPT); run it from the repository root.

Ranks are processes (mp.spawn) over loopback, one torch thread each; a gloo
group carries the timing side traffic.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _setup(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import entrenar_pg  # noqa: F401  (registers the backend)

    dist.init_process_group("gloo", rank=rank, world_size=world)


def _sample(t0: float, c0: float, world: int) -> tuple[float, float]:
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dc = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    dist.all_reduce(dc, op=dist.ReduceOp.SUM)
    return dt.item(), dc.item() / world


def allreduce_worker(rank: int, world: int, port: int, mib: int, repeats: int) -> None:
    from entrenar_pg import Options

    _setup(rank, world, port)
    variants = {
        "ring": Options(algorithm="ring"),
        "det-ring": Options(algorithm="ring", deterministic=True),
        "ring+check": Options(algorithm="ring", check=True),
    }
    groups = {n: dist.new_group(backend="entrenar", pg_options=o) for n, o in variants.items()}
    x = torch.randn((mib << 20) // 4)
    names = list(variants)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats + 2):
        for n in names[i % len(names) :] + names[: i % len(names)]:
            t = x.clone()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            dist.all_reduce(t, group=groups[n])
            w, c = _sample(t0, c0, world)
            if i >= 2:  # warm-up: connections, scratch buffers
                wall[n].append(w)
                cpu[n].append(c)
    if rank == 0:
        w0, c0 = statistics.median(wall[names[0]]), statistics.median(cpu[names[0]])
        for n in names:
            w, c = statistics.median(wall[n]), statistics.median(cpu[n])
            print(
                f"N={world} {mib} MiB {n:10s} wall {w * 1e3:8.1f} ms ({w / w0:.3f}x)  "
                f"cpu/rank {c * 1e3:7.1f} ms ({c / c0:.3f}x)",
                flush=True,
            )
    dist.destroy_process_group()


def ddp_worker(rank: int, world: int, port: int, steps: int, width: int, batch: int) -> None:
    _setup(rank, world, port)
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(512, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 512),
    )
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 512, generator=g), torch.randn(batch, 512, generator=g)
    n_params = sum(p.numel() for p in base.parameters())
    label = f"MLP {n_params / 1e6:.2f}M params, batch {batch}"
    _ddp_ab(rank, world, steps, base, torch.nn.functional.mse_loss, x, y, label)


def gpt_worker(rank: int, world: int, port: int, steps: int) -> None:
    """The benchmark's DDP model (the trainer's GPT) and batch, as ``benchmarks.bench`` runs it."""
    _setup(rank, world, port)
    sys.path.insert(0, os.getcwd())
    from benchmarks.ddp_model import make_model

    torch.manual_seed(0)
    spec = make_model()
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, spec.vocab_size, (spec.batch, spec.seq_len), generator=gen)
    y = torch.randint(0, spec.vocab_size, (spec.batch, spec.seq_len), generator=gen)
    n_params = sum(p.numel() for p in spec.model.parameters())

    label = f"{spec.name} {n_params / 1e6:.2f}M params"
    _ddp_ab(rank, world, steps, spec.model, None, x, y, label, spec_loss=spec.loss)


def _ddp_ab(
    rank: int,
    world: int,
    steps: int,
    base: Any,
    loss_fn: Any,
    x: Any,
    y: Any,
    label: str,
    spec_loss: Any = None,
) -> None:
    """Checks off and on, one DDP model each on its own group, alternating step by step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from entrenar_pg import Options
    from entrenar_pg.checker import HASH_NAME

    models: dict[str, Any] = {}
    optims: dict[str, torch.optim.Optimizer] = {}
    checker: Any = None
    for name, opts in (("off", Options()), ("check", Options(check=True))):
        group = dist.new_group(backend="entrenar", pg_options=opts)
        models[name] = DDP(copy.deepcopy(base), process_group=group)
        optims[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
        if opts.check:
            checker = group.checker
            checker.watch(optims[name])  # not the default group: name the optimizer
    wall: dict[str, list[float]] = {n: [] for n in models}
    cpu: dict[str, list[float]] = {n: [] for n in models}
    load = os.getloadavg()[0]  # other work on the machine: say how quiet it was
    warm = (0.0, 0.0, 0)  # the checker's counters when the measured steps begin
    for i in range(steps + 3):
        if i == 3:  # warm-up done: its one-off costs (vectors, threads) are not per step
            warm = (checker.seconds, checker.cpu_seconds, checker.steps_checked)
        for name in ("off", "check") if i % 2 else ("check", "off"):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            optims[name].zero_grad(set_to_none=True)
            if spec_loss is not None:
                spec_loss(models[name], x, y).backward()
            else:
                loss_fn(models[name](x), y).backward()
            optims[name].step()
            w, c = _sample(t0, c0, world)
            if i >= 3:
                wall[name].append(w)
                cpu[name].append(c)
    if rank == 0:
        off, on = statistics.median(wall["off"]), statistics.median(wall["check"])
        coff, con = statistics.median(cpu["off"]), statistics.median(cpu["check"])
        per = max(checker.steps_checked, 1)
        measured = max(checker.steps_checked - warm[2], 1)
        print(
            f"N={world} {label}: "
            f"step off {off * 1e3:.2f} ms, check {on * 1e3:.2f} ms ({on / off:.3f}x); "
            f"cpu/rank {coff * 1e3:.1f} -> "
            f"{con * 1e3:.1f} ms ({con / coff:.3f}x); checker per measured step: wall "
            f"{(checker.seconds - warm[0]) / measured * 1e3:.2f} ms, cpu "
            f"{(checker.cpu_seconds - warm[1]) / measured * 1e3:.2f} ms (over all steps, "
            f"warm-up included: cpu {checker.cpu_seconds / per * 1e3:.2f} ms; "
            f"{checker.allreduces_checked} allreduces, {checker.steps_checked} steps; "
            f"hash {HASH_NAME}); load average {load:.2f} -> {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    what, world, args = argv[0], int(argv[1]), [int(a) for a in argv[2:]]
    port = 20000 + os.getpid() % 20000
    worker = {"allreduce": allreduce_worker, "ddp": ddp_worker, "gpt": gpt_worker}[what]
    mp.spawn(worker, args=(world, port, *args), nprocs=world)


if __name__ == "__main__":
    main(sys.argv[1:])

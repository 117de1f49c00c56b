"""Linear regression over 1, 2, 4, 8 workers: a scaling analysis with bitwise checks.

Runbook::

    python trainer/linreg.py                       # entrenar, deterministic, N = 1 2 4 8
    python trainer/linreg.py --backend gloo        # same recipe over gloo
    python trainer/linreg.py --no-deterministic    # plain DDP (averages per-rank means)
    python trainer/linreg.py --world-sizes 1 2 --steps 50 --json out.json

The program starts the workers itself (torch.multiprocessing, one process per
worker, 127.0.0.1; forked on Linux, the parent touches no tensors before),
once per world size, and prints one row per world size:
final mean squared error on the whole data set, SHA-256 of the final weights,
wall time, and whether the weights are bit-identical to the first row's.

The problem: ``X`` (``--samples`` x ``--features``, float32, standard normal) and
``y = X w* + b* + 0.1 noise``, all generated from ``--seed`` on every worker (so
nothing is sent but gradients). One SGD step uses a fixed global batch of ``M``
(``--micro-batches``) micro-batches of ``--batch-size`` rows taken in order from
the data (wrapping around); worker ``r`` of ``N`` owns micro-batches
``r*M/N .. (r+1)*M/N - 1``.

Deterministic mode (default): each worker computes one gradient per
micro-batch, sums them in the canonical pairwise tree, the workers sum those
with one ``all_reduce`` (entrenar with ``Options(deterministic=True)``, passed
as ``pg_options``, sums across ranks in the same tree), and the sum is scaled
by ``1/M``. With ``M`` and ``N`` powers of two that is the same floating-point
expression for every ``N``, so the weights are bit-identical across world
sizes. Over gloo the cross-rank sum order is gloo's own, so expect differences
in the last bits at some ``N``.

``--no-deterministic``: the usual DistributedDataParallel recipe: each worker
takes the mean over all its rows at once and DDP averages across workers;
mathematically the same step, numerically different per ``N``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: use this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.common import (
    free_port,
    group_options,
    is_power_of_two,
    load_backend,
    param_hash,
    tree_sum,
)


@dataclass(frozen=True, kw_only=True)
class LinRegConfig:
    backend: str = "entrenar"
    world_sizes: tuple[int, ...] = (1, 2, 4, 8)
    deterministic: bool = True
    steps: int = 100
    samples: int = 8192
    features: int = 32
    micro_batches: int = 8
    batch_size: int = 64
    lr: float = 0.1
    seed: int = 0
    json: str = ""
    start_method: str = "fork" if sys.platform == "linux" else "spawn"


def make_data(cfg: LinRegConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.samples, cfg.features, generator=g)
    w_true = torch.randn(cfg.features, 1, generator=g)
    b_true = torch.randn(1, generator=g)
    y = x @ w_true + b_true + 0.1 * torch.randn(cfg.samples, 1, generator=g)
    return x, y


def rows(cfg: LinRegConfig, step: int, micro: int, count: int = 1) -> torch.Tensor:
    """Row indices of ``count`` consecutive global micro-batches from ``micro`` at ``step``."""
    start = (step * cfg.micro_batches + micro) * cfg.batch_size
    return torch.arange(start, start + count * cfg.batch_size) % cfg.samples


def worker(rank: int, world: int, port: int, cfg: LinRegConfig, out_path: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    load_backend(cfg.backend)
    pg_options = group_options(cfg.backend, cfg.deterministic)
    dist.init_process_group(cfg.backend, rank=rank, world_size=world, pg_options=pg_options)
    try:
        x, y = make_data(cfg)
        torch.manual_seed(cfg.seed + 1)
        model = nn.Linear(cfg.features, 1)
        per = cfg.micro_batches // world
        mine = range(rank * per, (rank + 1) * per)
        ddp = None if cfg.deterministic else DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        params = list(model.parameters())
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(cfg.steps):
            if ddp is None:
                grads = []
                for j in mine:
                    idx = rows(cfg, step, j)
                    loss = torch.mean((model(x[idx]) - y[idx]) ** 2)
                    gs = torch.autograd.grad(loss, params)
                    grads.append(torch.cat([g.reshape(-1) for g in gs]))
                flat = tree_sum(grads)
                dist.all_reduce(flat)
                flat.mul_(1.0 / cfg.micro_batches)  # power of two: exact
                off = 0
                for p in params:
                    p.grad = flat[off : off + p.numel()].view_as(p)
                    off += p.numel()
            else:
                idx = rows(cfg, step, mine.start, per)
                loss = torch.mean((ddp(x[idx]) - y[idx]) ** 2)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        wall = time.perf_counter() - t0
        if rank == 0:
            with torch.no_grad():
                mse = float(torch.mean((model(x) - y) ** 2))
            result = {"world_size": world, "mse": mse, "hash": param_hash(model), "wall_s": wall}
            Path(out_path).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(cfg: LinRegConfig) -> list[dict[str, object]]:
    """Train once per world size; the rows of the table (as dicts)."""
    results: list[dict[str, object]] = []
    # Imported here, once, so that forked workers find them loaded: the
    # backend, and torch._inductor, which use_deterministic_algorithms imports
    # (about 1 s of CPU per worker otherwise, 15 workers for N = 1 2 4 8).
    load_backend(cfg.backend)
    if cfg.deterministic:
        import torch._inductor.config  # noqa: F401
    with tempfile.TemporaryDirectory(prefix="linreg-") as tmp:
        for n in cfg.world_sizes:
            out = os.path.join(tmp, f"n{n}.json")
            mp.start_processes(
                worker,
                args=(n, free_port(), cfg, out),
                nprocs=n,
                join=True,
                start_method=cfg.start_method,
            )
            results.append(json.loads(Path(out).read_text()))
    ref = results[0]["hash"]
    for r in results:
        r["identical"] = r["hash"] == ref
    return results


def format_table(cfg: LinRegConfig, results: list[dict[str, object]]) -> str:
    mode = "deterministic tree + allreduce" if cfg.deterministic else "DDP"
    lines = [
        f"linear regression: {cfg.samples} x {cfg.features}, {cfg.steps} SGD steps, "
        f"global batch {cfg.micro_batches} x {cfg.batch_size}, backend {cfg.backend}, {mode}",
        f"{'N':>3}  {'final MSE':>22}  {'sha256(weights)':<16}  {'wall s':>7}  same bits as N="
        f"{results[0]['world_size']}",
    ]
    for r in results:
        lines.append(
            f"{r['world_size']:>3}  {r['mse']:>22.17g}  {str(r['hash'])[:16]:<16}  "
            f"{r['wall_s']:>7.2f}  {'yes' if r['identical'] else 'NO'}"
        )
    same = all(r["identical"] for r in results)
    lines.append(f"bit-identical across world sizes: {'yes' if same else 'no'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> LinRegConfig:
    d = LinRegConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default=d.backend, choices=("entrenar", "gloo"))
    p.add_argument("--world-sizes", type=int, nargs="+", default=list(d.world_sizes))
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--samples", type=int, default=d.samples)
    p.add_argument("--features", type=int, default=d.features)
    p.add_argument("--micro-batches", type=int, default=d.micro_batches)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default="", help="also write the table's rows to this JSON file")
    p.add_argument(
        "--start-method",
        default=d.start_method,
        choices=("fork", "spawn", "forkserver"),
        help="how workers start: fork (Linux default) skips re-importing torch in each",
    )
    a = p.parse_args(argv)
    cfg = LinRegConfig(
        backend=a.backend,
        world_sizes=tuple(a.world_sizes),
        deterministic=a.deterministic,
        steps=a.steps,
        samples=a.samples,
        features=a.features,
        micro_batches=a.micro_batches,
        batch_size=a.batch_size,
        lr=a.lr,
        seed=a.seed,
        json=a.json,
        start_method=a.start_method,
    )
    for n in cfg.world_sizes:
        if cfg.micro_batches % n:
            p.error(f"--micro-batches {cfg.micro_batches} is not divisible by world size {n}")
        if cfg.deterministic and not (is_power_of_two(n) and is_power_of_two(cfg.micro_batches)):
            p.error("deterministic mode needs power-of-two world sizes and --micro-batches")
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    results = run(cfg)
    print(format_table(cfg, results), flush=True)
    if cfg.json:
        Path(cfg.json).write_text(json.dumps({"config": asdict(cfg), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

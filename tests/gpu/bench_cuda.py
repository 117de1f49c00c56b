"""Timing on CUDA tensors: entrenar vs gloo, allreduce 4 KiB .. 256 MiB and a DDP step.

Run under torchrun (ranks may share one GPU: rank r uses cuda:(LOCAL_RANK % count)):

    torchrun --standalone --nproc_per_node=2 tests/gpu/bench_cuda.py
    torchrun --standalone --nproc_per_node=4 tests/gpu/bench_cuda.py --json /tmp/bench4.json

One process group per backend (the default group is gloo; entrenar is a
``new_group``), interleaved size by size, so drift of the machine hits both.
A sample is one ``all_reduce`` of a CUDA tensor: issued with the tensor's
producer on the current stream, then ``work.wait()`` and
``torch.cuda.synchronize()`` (the result is on the device); reported is the
maximum over ranks of each iteration, then the median over iterations.
busbw = bytes / time * 2(n-1)/n (nccl-tests). The DDP step is forward +
backward (+ DDP's bucketed allreduces) + SGD step of a small GPT, timed the
same way. 1 GB = 1e9 bytes. Rank 0 prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import entrenar_pg  # noqa: E402,F401  (registers the backend)
from benchmarks.sizes import parse_sizes  # noqa: E402
from trainer.model import GPT, GPTConfig  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device, iters: int, warmup: int, group: Any) -> float:
    """Median over iterations of the max-over-ranks duration of ``fn()`` (seconds)."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(iters):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # a CPU tensor on the gloo group
    return statistics.median(t.tolist())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4K:256M:x4", help="bytes, e.g. 4K:256M:x4 or 1M,16M")
    p.add_argument("--backends", default="entrenar,gloo")
    p.add_argument("--budget-mb", type=float, default=2048, help="bytes moved per size and backend")
    p.add_argument("--max-iters", type=int, default=50)
    p.add_argument("--ddp-steps", type=int, default=20)
    p.add_argument("--json", default="", help="also write the results here (rank 0)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cpu":  # only to smoke-test this script on a machine without a GPU
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctl = dist.group.WORLD  # gloo: barriers and the CPU max-reduction of timings
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    groups = {b: (ctl if b == "gloo" else dist.new_group(backend=b)) for b in backends}

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict[str, Any] = {
        "world": world,
        "device": name,
        "torch": torch.__version__,
        "allreduce": [],
        "ddp": {},
    }
    for nbytes in parse_sizes(args.sizes):
        x = torch.ones(nbytes // 4, device=device)
        iters = int(min(args.max_iters, max(3, args.budget_mb * 2**20 // nbytes)))
        row: dict[str, Any] = {"bytes": nbytes, "iters": iters}
        for name, g in groups.items():

            def one(g: Any = g, x: torch.Tensor = x) -> None:
                x.mul_(1.0)  # a producer kernel on the current stream before every call
                dist.all_reduce(x, group=g, async_op=True).wait()

            t = timed(one, device, iters, warmup=min(3, iters), group=ctl)
            row[name] = {"median_s": t, "busbw_GBps": nbytes / t * 2 * (world - 1) / world / 1e9}
        results["allreduce"].append(row)
        del x

    cfg = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256, dropout=0.0)
    for name, g in groups.items():
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        ids = [device.index] if device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids, process_group=g)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (16, cfg.block_size), device=device)

        def step(ddp: Any = ddp, opt: Any = opt, x: torch.Tensor = x) -> None:
            _, loss = ddp(x, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        t = timed(step, device, args.ddp_steps, warmup=3, group=ctl)
        nparams = sum(q.numel() for q in model.parameters())
        results["ddp"][name] = {"median_s": t, "params": nparams}
        del ddp, model, opt

    if rank == 0:
        names = list(groups)
        print(
            f"allreduce on {device.type} tensors, world {world}, {results['device']}, "
            f"torch {results['torch']}  (median of max-over-ranks; busbw GB/s)"
        )
        print(f"{'bytes':>12} " + " ".join(f"{n + ' ms':>14} {n + ' GB/s':>14}" for n in names))
        for row in results["allreduce"]:
            cells = " ".join(
                f"{row[n]['median_s'] * 1e3:14.3f} {row[n]['busbw_GBps']:14.3f}" for n in names
            )
            print(f"{row['bytes']:>12} {cells}")
        nparams = next(iter(results["ddp"].values()))["params"]
        print(f"\nDDP step (GPT, {nparams} parameters, batch 16x{cfg.block_size}):")
        for n in names:
            print(f"  {n:>10}: {results['ddp'][n]['median_s'] * 1e3:.2f} ms")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    dist.barrier(group=ctl)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A plain CUDA DDP training script (torchrun worker for tests/gpu/test_cuda.py).

What a user writes, nothing entrenar-specific but the backend name:
``model.cuda(device)``, ``DDP(model, device_ids=[device])``, an optimizer, a
loop. Every rank uses ``cuda:(LOCAL_RANK % device_count)``, so 2-4 ranks can
share one GPU. Writes ``<out>/rank<r>.pt``: the final parameters (on CPU), the
losses, and entrenar's counters.

    torchrun --standalone --nproc_per_node=2 tests/gpu/ddp_worker.py \\
        --backend entrenar --out /tmp/ddp-entrenar
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for trainer/

import entrenar_pg  # noqa: E402  (registers the backend; the entry point would too)
from trainer.model import GPT, GPTConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="entrenar")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bucket-cap-mb", type=float, default=0.1)  # several buckets per step
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--compile", action="store_true", help="train torch.compile(ddp)")
    p.add_argument("--profile", action="store_true", help="under torch.profiler (CPU and CUDA)")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cpu":  # only to smoke-test this script on a machine without a GPU
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.deterministic:
        # Bitwise-reproducible kernels (CUBLAS_WORKSPACE_CONFIG is set by the test).
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    cfg = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64, dropout=0.0)
    # A rank-dependent initialisation: DDP's initial broadcast must fix it.
    torch.manual_seed(args.seed + 1000 * rank)
    model = GPT(cfg).to(device)  # .cuda(device) on the GPU
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    # torch.compile over DDP: DDP's reducer calls the process group from C++
    # while the tracer is active (docs/api.md); its optimizer splits the graph
    # at bucket boundaries.
    step_model = torch.compile(ddp) if args.compile else ddp
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities) if args.profile else None
    if profiler is not None:
        profiler.start()

    gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
    losses = []
    for _ in range(args.steps):
        data = torch.randint(0, 256, (args.batch, cfg.block_size + 1), generator=gen)
        x = data[:, :-1].contiguous().to(device, non_blocking=True)
        y = data[:, 1:].contiguous().to(device, non_blocking=True)
        _, loss = step_model(x, y)
        assert loss is not None
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    events: dict[str, int] = {}
    if profiler is not None:
        profiler.stop()
        for e in profiler.events():
            if ":" in e.name and e.name.split(":")[0] in ("entrenar", "gloo"):
                events[e.name] = events.get(e.name, 0) + 1

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    stats = entrenar_pg.get_stats() if args.backend == "entrenar" else {}
    torch.save(
        {
            "state": state,
            "losses": [float(v) for v in losses],
            "stats": stats,
            "device": str(device),
            "world": world,
            "profiled_collectives": events,
        },
        out / f"rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

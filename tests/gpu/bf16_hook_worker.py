"""torchrun worker: DDP on CUDA with torch's bf16 compression hook, over entrenar.

DDP accepts ``bf16_compress_hook`` only on a torch built with CUDA and NCCL
(it checks the build, not the group's backend; ``test_torch_limits``). On
such a build the hook's bf16 allreduce goes through entrenar: each rank
prints one line, and fails unless its gradient equals every rank's and is
within 1 % (of the largest) of the same step's plain fp32 allreduce
(bf16 keeps 8 bits of mantissa: 2^-8 = 0.4 %).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def grad_after_one_step(
    hook: Callable[..., Any] | None, device: torch.device, rank: int
) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Linear(256, 64).to(device)
    ddp = DDP(model, device_ids=[device])
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    torch.manual_seed(1 + rank)
    ddp(torch.randn(32, 256, device=device)).square().sum().backward()
    assert model.weight.grad is not None
    return model.weight.grad.detach().clone()


def main() -> None:
    dist.init_process_group("entrenar")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    fp32 = grad_after_one_step(None, device, rank)
    bf16 = grad_after_one_step(default_hooks.bf16_compress_hook, device, rank)
    top, bottom = bf16.clone(), bf16.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(bottom, op=dist.ReduceOp.MIN)
    same = torch.equal(top, bottom)
    rel = float((bf16 - fp32).abs().max() / fp32.abs().max())
    print(f"rank {rank}: bf16 hook: equal on every rank {same}, off fp32 by {rel:.2e}", flush=True)
    dist.destroy_process_group()
    assert same and rel < 1e-2, (same, rel)


if __name__ == "__main__":
    main()

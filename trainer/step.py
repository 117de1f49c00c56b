"""One optimizer step's gradients: the global batch, this rank's micro-batches, both modes.

The global batch is ``M`` micro-batches of ``B`` sequences of ``T`` bytes; rank
``r`` of ``N`` computes micro-batches ``r*M/N .. (r+1)*M/N - 1`` (trainer/data.py).
Before each micro-batch's forward the torch RNG is seeded from (seed, step,
micro-batch index), so dropout does not depend on the rank that computes it.
Both modes leave the step's mean gradient in ``p.grad`` and return the step's
mean loss over all ``M`` micro-batches.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.common import tree_sum
from trainer.data import Corpus, SampleStream, micro_batch_windows, windows_to_batch

MicroBatch = tuple[int, torch.Tensor, torch.Tensor]  # (global index j, inputs, targets)


@dataclass(frozen=True)
class GlobalBatch:
    """The step's shape: ``micro_batches`` (M) x ``batch_size`` (B) x ``block_size`` (T)."""

    micro_batches: int
    batch_size: int
    block_size: int
    mine: range  # this rank's global micro-batch indices

    @property
    def samples(self) -> int:
        return self.micro_batches * self.batch_size

    @property
    def tokens(self) -> int:
        return self.micro_batches * self.batch_size * self.block_size


def micro_seed(seed: int, step: int, micro: int) -> int:
    """RNG seed of global micro-batch ``micro`` of step ``step`` (rank-independent)."""
    return (seed * 0x9E3779B1 + step * 0x85EBCA77 + micro * 0xC2B2AE3D) % (1 << 63)


def load_micro_batches(
    corpus: Corpus,
    stream: SampleStream,
    samples_consumed: int,
    batch: GlobalBatch,
    device: torch.device,
) -> list[MicroBatch]:
    """This rank's micro-batches of the step that starts at ``samples_consumed``, on ``device``."""
    out = []
    for j in batch.mine:
        windows = micro_batch_windows(stream, samples_consumed, j, batch.batch_size)
        x, y = windows_to_batch(corpus.train, windows, batch.block_size)
        out.append((j, x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
    return out


def accumulated_gradients(
    ddp: DDP, micro_batches: list[MicroBatch], *, seed: int, step: int, total_micro_batches: int
) -> float:
    """DDP: accumulate under ``no_sync``; the last backward overlaps DDP's allreduce."""
    device = micro_batches[0][1].device
    loss_sum = torch.zeros((), device=device)
    for i, (j, x, y) in enumerate(micro_batches):
        torch.manual_seed(micro_seed(seed, step, j))
        sync = i == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            _, loss = ddp(x, y)
            (loss / len(micro_batches)).backward()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum)
    return float(loss_sum) / total_micro_batches


def deterministic_gradients(
    ddp: DDP,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    micro_batches: list[MicroBatch],
    *,
    seed: int,
    step: int,
    total_micro_batches: int,
) -> tuple[float, float]:
    """One gradient per micro-batch, summed in the canonical tree, one allreduce, exact 1/M.

    Returns the step's loss and the wall time of the allreduce. With ``M`` and
    the world size powers of two the sum is the same tree over all ``M``
    micro-batches whatever the world size (the backend must sum across ranks
    in the same tree: entrenar with ``Options(deterministic=True)``).
    """
    grads, losses = [], []
    for j, x, y in micro_batches:
        torch.manual_seed(micro_seed(seed, step, j))
        with ddp.no_sync():
            _, loss = ddp(x, y)
            loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]))  # type: ignore[union-attr]
        losses.append(loss.detach().reshape(1))
        optimizer.zero_grad(set_to_none=True)
    buf = torch.cat([tree_sum(grads), tree_sum(losses)])
    t_ar = time.perf_counter()
    dist.all_reduce(buf)
    allreduce_wall = time.perf_counter() - t_ar
    buf.mul_(1.0 / total_micro_batches)
    offset = 0
    for p in params:
        p.grad = buf[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return float(buf[-1]), allreduce_wall

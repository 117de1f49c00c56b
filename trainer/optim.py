"""AdamW with weight decay on matrices only, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from trainer.config import TrainConfig


class CosineWithWarmup:
    """LR multiplier: linear warm-up to 1, cosine decay to ``min_ratio`` at ``decay_steps``.

    A callable object (not a lambda) so LambdaLR's state_dict can save it.
    """

    def __init__(self, warmup: int, decay_steps: int, min_ratio: float) -> None:
        self.warmup = warmup
        self.decay_steps = decay_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if step >= self.decay_steps:
            return self.min_ratio
        progress = (step - self.warmup) / max(1, self.decay_steps - self.warmup)
        return self.min_ratio + 0.5 * (1.0 - self.min_ratio) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    cfg: TrainConfig, model: nn.Module
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (decay on matrices, not biases/norms) and its warm-up + cosine schedule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.99),
    )
    schedule = CosineWithWarmup(
        cfg.warmup_steps, cfg.lr_decay_steps or cfg.steps, cfg.min_lr / cfg.lr
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

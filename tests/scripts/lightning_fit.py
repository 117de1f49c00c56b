"""A small Lightning 2.x ``Trainer.fit`` on CPU under torchrun, over a given backend.

Usage: torchrun --nproc_per_node=2 lightning_fit.py --out DIR [--backends entrenar gloo]

Lightning sees torchrun's environment (TorchElasticEnvironment) and launches
nothing itself. The same fit runs once per backend in the same processes (the
default group is destroyed in between), which spares a second start-up and
Lightning import: most of the test's time. ``self.log(..., sync_dist=True)`` with the default
``reduce_fx="mean"`` and ``on_epoch=True`` syncs the metric's
``cumulated_batch_size``, an int64 tensor, with ``ReduceOp.AVG`` on every
backend but gloo (Lightning rewrites AVG as SUM-then-divide only for a backend
named "gloo"). The batch sizes passed to ``self.log`` differ per rank so that
the int64 average has a remainder to truncate. Each rank writes its
``callback_metrics``, ``logged_metrics`` and final weights to
DIR/<backend>/rank<R>.pt.
"""

from __future__ import annotations

import argparse
import os
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, float conversion, ...)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        rank = self.global_rank
        # float, mean (cumulated_batch_size: int64 AVG), on step and on epoch
        self.log("loss", loss, on_step=True, on_epoch=True, sync_dist=True, batch_size=3 + rank)
        # int64 value, mean: Lightning converts the value to float, the batch
        # size counter stays int64 and is averaged across ranks
        self.log(
            "rank_mean",
            torch.tensor(10 * rank + idx, dtype=torch.int64),
            on_step=False,
            on_epoch=True,
            sync_dist=True,
            batch_size=2 + 3 * rank,
        )
        # int64 and float values, sum
        self.log(
            "steps_sum",
            torch.tensor(1, dtype=torch.int64),
            on_step=False,
            on_epoch=True,
            sync_dist=True,
            reduce_fx="sum",
        )
        self.log(
            "loss_sum", loss.detach(), on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum"
        )
        return loss

    def validation_step(self, batch: list[torch.Tensor], idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True, batch_size=5 - self.global_rank)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(backend: str, out: Path) -> None:
    torch.manual_seed(0)
    # 48 samples: 3 training steps of 8 per rank, so the int64 batch-size
    # counters (3 x (2 + 3 x rank)) sum to an odd number across the 2 ranks
    x = torch.randn(48, 4)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(48, 1)
    data = TensorDataset(x, y)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=1,
        strategy=DDPStrategy(process_group_backend=backend, timeout=timedelta(seconds=60)),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Tiny()
    trainer.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=16))
    used = torch.distributed.get_backend()
    assert used == backend, f"fit ran on {used}, not {backend}"
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "callback_metrics": {k: v.clone() for k, v in trainer.callback_metrics.items()},
            "logged_metrics": {k: v.clone() for k, v in trainer.logged_metrics.items()},
            "state": {k: v.clone() for k, v in model.state_dict().items()},
        },
        out / f"rank{trainer.global_rank}.pt",
    )
    torch.distributed.destroy_process_group()
    print(f"DONE {backend} rank {trainer.global_rank}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backends", nargs="+", default=["entrenar", "gloo"])
    args = ap.parse_args()
    for backend in args.backends:
        fit(backend, Path(args.out) / backend)


if __name__ == "__main__":
    main()

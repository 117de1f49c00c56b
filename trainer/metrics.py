"""What rank 0 reports: ``metrics.jsonl`` (one JSON object per step), the tqdm bar, the PNG.

A run's metrics file holds a ``start`` record per attempt, one record per
optimizer step and an ``end`` record; a resumed run appends, and may redo
steps, so readers keep the last record per step (``read_metrics``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.common import comm_stats
from trainer.config import TrainConfig


class StepReporter:
    """Writes each step's record and moves the progress bar (rank 0; a no-op elsewhere).

    The allreduce time of a step is the backend's own counter's increase when it
    has one (entrenar), else ``allreduce_wall`` (the trainer's timing of its
    one deterministic-mode allreduce), else unknown.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        metrics: MetricsWriter,
        *,
        master: bool,
        world: int,
        restart_count: int,
        first_step: int,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.world = world
        self.restart_count = restart_count
        self.bar = None
        if master and cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=cfg.steps,
                initial=first_step,
                unit="step",
                dynamic_ncols=True,
                mininterval=0.5,
            )
        self.last_val: float | None = None
        self.stats_prev = comm_stats()

    def step(
        self,
        *,
        step: int,
        loss: float,
        val_loss: float | None,
        lr: float,
        grad_norm: float | None,
        step_s: float,
        tokens: int,
        allreduce_wall: float | None,
    ) -> None:
        if val_loss is not None:
            self.last_val = val_loss
        stats = comm_stats()
        ar_ms = None
        if "allreduce_seconds" in stats:
            ar_ms = 1e3 * (
                stats["allreduce_seconds"] - self.stats_prev.get("allreduce_seconds", 0.0)
            )
        elif allreduce_wall is not None:
            ar_ms = 1e3 * allreduce_wall
        self.stats_prev = stats
        tok_s = tokens / step_s
        self.metrics.write(
            {
                "step": step,
                "loss": loss,
                "val_loss": val_loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "step_s": step_s,
                "tokens_per_s": tok_s,
                "allreduce_ms": ar_ms,
                "comm": stats,
                "world_size": self.world,
                "backend": self.cfg.backend,
                "restart_count": self.restart_count,
            }
        )
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                loss=f"{loss:.3f}",
                val=f"{self.last_val:.3f}" if self.last_val is not None else "-",
                tok_s=f"{tok_s:,.0f}",
                ar_ms=f"{ar_ms:.1f}" if ar_ms is not None else "-",
                refresh=False,
            )

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsWriter:
    """JSONL on rank 0 (flushed per line, so a killed run keeps what it logged)."""

    def __init__(self, path: Path, enabled: bool, append: bool) -> None:
        self.path = path
        self.f = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record, sort_keys=True) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The metrics file's step records, the last one per step (a resumed run redoes steps)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def plot_metrics(metrics_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    steps = [r["step"] for r in recs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [r["loss"] for r in recs], label="train", lw=1)
    val = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    if val:
        ax1.plot(*zip(*val, strict=True), "o-", label="validation")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (nats/byte)")
    ax1.set_title("loss")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.plot(steps, [r["tokens_per_s"] for r in recs], lw=1)
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s (all ranks)")
    ax2.set_title("throughput")
    ax2.grid(alpha=0.3)
    last = recs[-1] if recs else {}
    fig.suptitle(f"backend={last.get('backend')} world_size={last.get('world_size')}")
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)

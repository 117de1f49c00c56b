"""The trainer's configuration: one frozen dataclass; every field is a command-line flag.

``parse_args`` builds the parser from the fields (name, type, default, help),
so ``python trainer/train.py --help`` lists exactly what ``TrainConfig`` holds.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.common import BACKENDS
from trainer.model import GPTConfig


def _opt(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # distributed
    backend: str = _opt("entrenar", "process-group backend")
    device: str = _opt("auto", "auto: CUDA if available (local ranks take GPUs in turn), else cpu")
    deterministic: bool = _opt(False, "bitwise reproducible, world-size invariant (see docstring)")
    threads: int = _opt(
        0, "intra-op threads per process; 0: cores / local procs; 1 if deterministic"
    )
    timeout_s: float = _opt(600.0, "process-group timeout")
    # optimisation
    steps: int = _opt(500, "optimizer steps (total, counting resumed ones)")
    batch_size: int = _opt(16, "sequences per micro-batch")
    grad_accum: int = _opt(1, "micro-batches per rank per step (when micro_batches is 0)")
    micro_batches: int = _opt(0, "global micro-batches per step M (fixed: world-size invariance)")
    lr: float = _opt(2e-3, "peak learning rate")
    min_lr: float = _opt(2e-4, "floor of the cosine schedule")
    warmup_steps: int = _opt(20, "linear warm-up steps")
    lr_decay_steps: int = _opt(0, "cosine horizon; 0: steps")
    weight_decay: float = _opt(0.1, "AdamW weight decay of matrices (not biases/norms)")
    grad_clip: float = _opt(1.0, "max global gradient norm; 0 disables")
    seed: int = _opt(1337, "seeds init, data order and dropout")
    # model
    block_size: int = _opt(128, "context length in bytes")
    n_layer: int = _opt(4, "transformer blocks")
    n_head: int = _opt(4, "attention heads")
    n_embd: int = _opt(128, "model width")
    dropout: float = _opt(0.0, "dropout probability")
    # data
    corpus_bytes: int = _opt(8_000_000, "cap on the corpus (train + val)")
    val_every_file: int = _opt(20, "every n-th source file is validation")
    eval_every: int = _opt(50, "validation every n steps (and at the end); 0: only at the end")
    eval_batches: int = _opt(8, "validation micro-batches (split across ranks)")
    # outputs
    out_dir: str = _opt("runs/train", "metrics.jsonl, loss.png, sample.txt, ckpt/")
    metrics: str = _opt("", "JSONL path; default <out_dir>/metrics.jsonl")
    checkpoint_dir: str = _opt("", "default <out_dir>/ckpt; 'none' disables checkpoints")
    checkpoint_every: int = _opt(100, "steps between checkpoints (and one at the end); 0: end only")
    resume: bool = _opt(False, "resume from <checkpoint_dir>/latest.pt if it exists")
    ledger: str = _opt("", "run ledger JSONL (entrenar: one chained line per step); '': none")
    progress: bool = _opt(True, "tqdm bar on rank 0")
    plot: bool = _opt(True, "loss/throughput PNG at the end")
    sample_bytes: int = _opt(300, "bytes of text generated at the end; 0: none")
    # fault injection (tests): rank fail_rank calls os._exit(1) when the step counter
    # reaches fail_at_step (fail_at_step steps done), on the first attempt only
    fail_at_step: int = _opt(-1, "test hook: exit when the step counter reaches this")
    fail_rank: int = _opt(1, "test hook: the rank that exits")
    # (tests) every rank flips one bit of the weights right after this step's update
    flip_bit_at_step: int = _opt(-1, "test hook: corrupt one weight bit at this step")

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        for name in ("steps", "batch_size", "grad_accum", "corpus_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("micro_batches", "warmup_steps", "lr_decay_steps", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if not 0 < self.min_lr <= self.lr:
            raise ValueError("need 0 < --min-lr <= --lr")

    @property
    def metrics_path(self) -> Path:
        return Path(self.metrics) if self.metrics else Path(self.out_dir) / "metrics.jsonl"

    @property
    def ckpt_dir(self) -> Path | None:
        if self.checkpoint_dir == "none":
            return None
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.out_dir) / "ckpt"

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
        )


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(
        description="Byte-level GPT on the Python stdlib source over torch.distributed.",
        epilog="Runbook: the module docstring of trainer/train.py and docs/trainer.md.",
    )
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        doc = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=doc)
        else:
            typ = {"int": int, "float": float, "str": str}[str(f.type)]
            choices = {"backend": BACKENDS, "device": ("auto", "cpu", "cuda")}.get(f.name)
            p.add_argument(
                flag,
                type=typ,
                default=f.default,
                choices=choices,
                help=f"{doc} (default: {f.default})",
            )
    return TrainConfig(**vars(p.parse_args(argv)))

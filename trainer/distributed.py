"""This process's place in the job (torchrun's environment), its device and threads,
the process group, and the end-of-run check that every replica holds the same weights.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer import checkpoint as ckpt
from trainer.common import free_port, group_options, load_backend, param_hash
from trainer.config import TrainConfig


@dataclass(frozen=True)
class Process:
    """Where this process runs: torchrun's ranks and restart count, the device, the threads."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    restart_count: int
    device: torch.device
    threads: int

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_env_for_single_process() -> None:
    """Let ``python trainer/train.py`` run without torchrun (world size 1)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))


def set_threads_and_determinism(cfg: TrainConfig, local_world: int) -> int:
    """Torch's intra-op threads (one when deterministic) and deterministic kernels; the count."""
    if cfg.deterministic:
        # cuBLAS reads this from the environment (deterministic GEMMs); not an entrenar option.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        threads = 1
    else:
        threads = cfg.threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before any parallel work
        torch.set_num_interop_threads(1)
    return threads


def pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise ValueError("--device cuda, but torch sees no CUDA device")
        # More ranks than GPUs share them round-robin: entrenar stages CUDA
        # tensors through host memory, so two ranks on one GPU is a valid job
        # (NCCL alone refuses it, with its own error).
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
        return device
    if cfg.backend == "nccl":
        raise ValueError("--backend nccl needs CUDA devices")
    return torch.device("cpu")


def start_process(cfg: TrainConfig) -> Process:
    """Read torchrun's environment (or make a world of one), set threads, pick the device."""
    setup_env_for_single_process()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = set_threads_and_determinism(cfg, local_world)
    return Process(
        rank=int(os.environ["RANK"]),
        world=int(os.environ["WORLD_SIZE"]),
        local_rank=local_rank,
        local_world=local_world,
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        device=pick_device(cfg, local_rank),
        threads=threads,
    )


def start_process_group(cfg: TrainConfig, proc: Process) -> None:
    """``init_process_group`` with the trainer's options (entrenar: determinism, the ledger)."""
    load_backend(cfg.backend)
    # An ordinary init: entrenar namespaces its store keys by torchrun's restart
    # count itself, so a restarted attempt never reads a dead attempt's addresses.
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    # entrenar's deterministic reductions are an option of the group, passed here.
    pg_options = group_options(cfg.backend, cfg.deterministic, cfg.ledger)
    resuming = cfg.resume and ckpt.latest_checkpoint(cfg.ckpt_dir) is not None
    if cfg.ledger and proc.master and not resuming:
        # A fresh run starts a fresh chain; a resumed one appends to its ledger.
        Path(cfg.ledger).unlink(missing_ok=True)
    dist.init_process_group(backend=cfg.backend, timeout=timeout, pg_options=pg_options)


def replicas_agree(model: nn.Module, device: torch.device) -> tuple[str, bool]:
    """This rank's parameter hash, and whether every rank's equals rank 0's (collective)."""
    final_hash = param_hash(model)
    ref = torch.tensor(
        [int(final_hash[i : i + 14], 16) for i in range(0, 56, 14)], dtype=torch.int64
    ).to(device)
    mine = ref.clone()
    dist.broadcast(ref, src=0)
    mismatch = torch.tensor([0.0 if torch.equal(ref, mine) else 1.0], device=device)
    dist.all_reduce(mismatch)
    return final_hash, float(mismatch) == 0.0

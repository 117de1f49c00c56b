"""DeepSpeed's same-host shared-memory allreduce as a contestant (the ``deepspeed-shm`` column).

DeepSpeed 0.19.8's ``deepspeed.comm.inference_all_reduce`` runs its CPU comm op
(csrc/cpu/comm/shm.cpp: one 66 MiB segment per rank in /dev/shm, spinning on
flags) when every rank is on one host, which it learns from ``LOCAL_SIZE`` (a
torchrun job has it as ``LOCAL_WORLD_SIZE``); otherwise, or when the op did not
build, it silently falls back to ``torch.distributed.all_reduce``, so
:class:`DeepSpeedShm` checks that the op is the one that runs. It names its
segments after ``MASTER_ADDR`` and ``MASTER_PORT`` and never unlinks them:
:func:`remove_segments` does, after the job.

A benchmark peer only, installed by ``benchmarks/install_peers.sh`` (torch
pinned by a constraints file); entrenar neither imports nor needs it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import torch

ADDR = "127.0.0.1"
SEGMENT_PREFIX = "deepspeed_allreduce_buffer"  # SHM_BUFFER_NAME in csrc/cpu/comm/shm.cpp
WANT_VERSION = "0.19.8"
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def deepspeed_available() -> tuple[bool, str]:
    """Whether deepspeed is installed (cheap: no import), and why not.

    Whether its SHM op builds and runs is learnt in the ranks (:class:`DeepSpeedShm`).
    """
    if importlib.util.find_spec("deepspeed") is None:
        return False, "deepspeed not installed (bash benchmarks/install_peers.sh)"
    version = importlib.metadata.version("deepspeed")
    if version != WANT_VERSION:
        return False, f"deepspeed {version} installed, the bench is written for {WANT_VERSION}"
    return True, ""


class DeepSpeedShm:
    """``deepspeed.comm.inference_all_reduce`` (float32 SUM) over the whole world.

    Built on every rank after the default (gloo) group exists: DeepSpeed wraps
    that group and maps its peers' segments (collective: every rank, together).
    """

    def __init__(self, rank: int) -> None:
        # A torchrun rank's environment is there (workers.torchrun_env); DeepSpeed
        # reads LOCAL_SIZE, not LOCAL_WORLD_SIZE, to decide that all ranks share
        # this host, and MASTER_ADDR/MASTER_PORT to name its segments.
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise RuntimeError(f"rank {rank}: DeepSpeedShm needs torchrun's {missing}")
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed
        import deepspeed.comm as ds_comm

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        ops = getattr(torch.ops, "deepspeed", None)
        if ops is None or not hasattr(ops, "inference_all_reduce_"):
            raise RuntimeError(
                f"rank {rank}: DeepSpeed's CPU SHM op did not load; inference_all_reduce "
                "would run torch.distributed.all_reduce (gloo) instead"
            )
        level = getattr(ds_comm.comm.cdb, "shm_vector_kernel_level", 0)
        if level < 1:
            raise RuntimeError(
                f"rank {rank}: DeepSpeed's SHM op needs AVX2 for float32 (kernel level "
                f"{level}); inference_all_reduce would fall back to gloo"
            )
        self._comm = ds_comm
        self.version = deepspeed.__version__

    def all_reduce(self, t: torch.Tensor) -> None:
        """In-place float32 SUM over every rank (the op is SUM whatever is asked)."""
        self._comm.inference_all_reduce(t)


def remove_segments(
    port: int, world: int, shm_dir: str = "/dev/shm", addr: str = ADDR
) -> list[str]:
    """Unlink the segments a DeepSpeed job on ``addr``:``port`` (its
    ``MASTER_ADDR`` and ``MASTER_PORT``) left behind; returns their names."""
    prefix = f"{SEGMENT_PREFIX}_{os.getuid()}_{addr}_{port}_"
    removed = []
    for rank in range(world):
        path = Path(shm_dir) / f"{prefix}{rank}"
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path.name)
    return removed

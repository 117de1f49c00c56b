"""Atomic, world-size-independent checkpoints.

A checkpoint is one file, ``<dir>/latest.pt``, written by rank 0 only:

- ``model``: the unwrapped module's state_dict (no ``module.`` prefix),
- ``optimizer``, ``scheduler``: their state_dicts (DDP replicates both, so
  rank 0's are everyone's),
- ``rng``: torch CPU (and CUDA, when used) and Python ``random`` states,
- ``step`` and ``samples_consumed``: the data position (see trainer/data.py),
  a global count, so a run saved at N workers resumes at any other N,
- ``model_config``, ``train_config``, ``corpus_sha256``, ``world_size``,
  ``param_hash``: to refuse a mismatched resume and to audit.

Atomicity: the payload is written to a temporary file in the same directory,
flushed and fsync'ed, then renamed over ``latest.pt`` with ``os.replace``
(atomic on POSIX), and the directory is fsync'ed. A crash at any point leaves
either the previous checkpoint or the new one, never a torn file. Loading uses
``torch.load(weights_only=True)``: the payload is tensors, numbers, strings,
lists, tuples and dicts only.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "latest.pt"
FORMAT_VERSION = 1


def checkpoint_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / CHECKPOINT_NAME


def latest_checkpoint(directory: str | os.PathLike[str] | None) -> Path | None:
    """``<directory>/latest.pt`` if it exists, else None."""
    if not directory:
        return None
    p = checkpoint_path(directory)
    return p if p.is_file() else None


def save_atomic(payload: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temp file next to ``path``, fsync, then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: not an entrenar trainer checkpoint (format {FORMAT_VERSION})")
    return payload


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    # weights_only loading gives lists where random.getstate() had tuples.
    random.setstate((py[0], tuple(py[1]), py[2]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)

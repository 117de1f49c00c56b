"""Atomic, world-size-independent checkpoints.

A checkpoint is one file, ``<dir>/latest.pt``, written by rank 0 only:

- ``model``: the unwrapped module's state_dict (no ``module.`` prefix),
- ``optimizer``, ``scheduler``: their state_dicts (DDP replicates both, so
  rank 0's are everyone's),
- ``rng``: torch CPU (and CUDA, when used) and Python ``random`` states,
- ``step`` and ``samples_consumed``: the data position (see trainer/data.py),
  a global count, so a run saved at N workers resumes at any other N,
- ``model_config``, ``train_config``, ``corpus_sha256``, ``world_size``,
  ``micro_batches``, ``param_hash``: to refuse a mismatched resume and to audit,
- ``ledger_parameters``: the optimizer's parameters in the run ledger's
  order, what ``python -m entrenar_pg.ledger verify --checkpoint`` hashes.

``training_state`` builds this payload and ``restore`` loads it back.

Atomicity: the payload is written to a temporary file in the same directory,
flushed and fsync'ed, then renamed over ``latest.pt`` with ``os.replace``
(atomic on POSIX), and the directory is fsync'ed. A crash at any point leaves
either the previous checkpoint or the new one, never a torn file. Loading uses
``torch.load(weights_only=True)``: the payload is tensors, numbers, strings,
lists, tuples and dicts only.

Stale temporary files: a writer killed mid-write (SIGKILL, OOM, a node lost)
leaves its ``.latest.pt.XXXXXXXX.tmp`` behind, as large as a checkpoint, and
every such death adds one. ``remove_stale_temp_files`` deletes them; the
trainer calls it once at start, on rank 0 only, because rank 0 is the only rank
that ever writes a checkpoint (the other ranks never touch the directory, so
ranks starting at once cannot race each other over it). It removes only
regular files named exactly like ``save_atomic``'s temporaries (mkstemp's
8-character suffix) directly in the checkpoint directory, and never a file a
live writer still holds: ``save_atomic`` keeps an exclusive ``flock`` on its
temporary from creation to the rename, the cleaner takes the lock without
waiting and skips the file when it cannot. So another job that shares the
directory and is saving right now keeps its file, and a dead writer's lock is
gone with the process (the kernel drops it), so its file goes. On file systems
without ``flock`` (some network mounts) both sides fall back safely: the writer
saves unlocked and the cleaner, unable to prove a file dead, keeps it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainer.common import optimizer_parameters, param_hash

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


def _temp_prefix(name: str) -> str:
    return f".{name}."


_TEMP_SUFFIX = ".tmp"


def _temp_name_pattern(name: str) -> re.Pattern[str]:
    """``save_atomic``'s temporary names for ``name``: mkstemp's 8 random characters."""
    return re.compile(re.escape(_temp_prefix(name)) + r"[a-z0-9_]{8}" + re.escape(_TEMP_SUFFIX))


def _try_lock(fd: int, *, wait: bool) -> bool:
    """Exclusive ``flock`` on ``fd``. False if another holder has it (only when not
    waiting) or if the file system has no flock (ENOLCK, EINVAL, EOPNOTSUPP)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    return True


def _locked_temp_file(directory: Path, name: str) -> tuple[int, str]:
    """A new temporary file for ``name`` in ``directory``, locked while we write it.

    A cleaner may have locked and unlinked the file between ``mkstemp`` and our
    ``flock`` (it cannot tell a file not yet locked from a dead writer's);
    then the file has no link left and we take a fresh one.
    """
    while True:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(name), suffix=_TEMP_SUFFIX, dir=directory)
        _try_lock(fd, wait=True)
        if os.fstat(fd).st_nlink > 0:
            return fd, tmp
        os.close(fd)


def save_atomic(payload: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a locked temp file next to ``path``, fsync, then ``os.replace``.

    The temporary stays locked until it has been renamed (the lock is released
    when its descriptor closes), so ``remove_stale_temp_files`` never takes it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _locked_temp_file(path.parent, path.name)
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


def remove_stale_temp_files(
    directory: str | os.PathLike[str], name: str = CHECKPOINT_NAME
) -> list[Path]:
    """Delete the temporaries dead ``save_atomic`` writers left in ``directory``.

    Only regular files directly in ``directory`` whose names match
    ``.<name>.XXXXXXXX.tmp``, and only when their exclusive lock can be taken
    at once (no live writer holds it). Returns the paths removed; a missing
    directory is no error. Call it from the one rank that writes checkpoints.
    """
    pattern = _temp_name_pattern(name)
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not pattern.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # renamed or removed meanwhile, or not ours to open
        try:
            if not _try_lock(fd, wait=False):
                continue  # a live writer holds it (or no flock here: keep it)
            try:
                still_named = os.stat(entry.path, follow_symlinks=False)
            except FileNotFoundError:
                continue  # its writer renamed it into place before we locked
            opened = os.fstat(fd)
            if (still_named.st_dev, still_named.st_ino) != (opened.st_dev, opened.st_ino):
                continue
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        finally:
            os.close(fd)
    return removed


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


def training_state(
    *,
    step: int,
    samples_consumed: int,
    world_size: int,
    micro_batches: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    device: torch.device,
    model_config: dict[str, Any],
    train_config: dict[str, Any],
    corpus_sha256: str,
) -> dict[str, Any]:
    """The trainer's checkpoint payload (the module docstring lists its fields)."""
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "samples_consumed": samples_consumed,
        "world_size": world_size,
        "micro_batches": micro_batches,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(device),
        "model_config": model_config,
        "train_config": train_config,
        "corpus_sha256": corpus_sha256,
        "param_hash": param_hash(model),
        # what `python -m entrenar_pg.ledger verify --checkpoint` hashes
        "ledger_parameters": optimizer_parameters(optimizer),
    }


def restore(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    device: torch.device,
    model_config: dict[str, Any],
    corpus_sha256: str,
) -> dict[str, Any]:
    """Load a checkpoint into the model, optimizer, scheduler and RNGs; the payload.

    Refuses (``ValueError``) a checkpoint of another model or another corpus.
    """
    state = load(path)
    if state["model_config"] != model_config:
        raise ValueError(f"{path}: model config {state['model_config']} != {model_config}")
    if state["corpus_sha256"] != corpus_sha256:
        raise ValueError(f"{path}: made on a different corpus (--corpus-bytes?)")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"], device)
    return state

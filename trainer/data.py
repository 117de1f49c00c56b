"""The corpus (the Python standard library's own source) and the batch schedule.

Corpus
    Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, skipping
    ``site-packages``/``dist-packages`` (installed packages are not the stdlib),
    ``__pycache__`` and the test suites (``test``, ``tests``, ``idle_test``:
    half the bytes and mostly fixtures). Files are taken in sorted order of their
    relative path and concatenated, each preceded by a ``# file: <path>`` line,
    until ``max_bytes`` is reached (the last file is cut). Every
    ``val_every``-th file goes to the validation split, the rest to training
    (when the cap leaves fewer than ``val_every`` files, the last
    ``1/val_every`` of the bytes is the validation split instead).
    Nothing is downloaded; the same Python installation gives the same bytes,
    and the SHA-256 of both splits identifies the corpus in checkpoints.

Samples and batches
    A sample is a window of ``block_size + 1`` bytes starting at a multiple of
    ``block_size`` (input = the first ``block_size`` bytes, target = the last
    ``block_size``). The training stream is the sequence of all windows,
    shuffled once per epoch with a permutation seeded by ``(seed, epoch)``, epochs
    concatenated. A step consumes ``M * B`` consecutive stream entries: global
    micro-batch ``j`` (``0 <= j < M``) is entries ``[pos + j*B, pos + (j+1)*B)``,
    where ``pos`` is the number of samples consumed before the step. Rank ``r``
    of ``N`` computes micro-batches ``r*M/N .. (r+1)*M/N - 1``.

    So the assignment is deterministic (a function of seed, position, M, B, N),
    disjoint (each stream entry belongs to exactly one micro-batch, each
    micro-batch to exactly one rank) and complete (the ranks together cover the
    step's entries, and consecutive steps cover the stream without gaps; each
    epoch visits every window exactly once). The data position is one number,
    ``samples_consumed``, independent of the world size.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path | str | None = None) -> list[str]:
    """Sorted relative paths (``/``-separated) of the corpus's ``*.py`` files."""
    root = Path(root) if root is not None else stdlib_root()
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                out.append(rel.replace(os.sep, "/"))
    out.sort()
    return out


@dataclass(frozen=True)
class Corpus:
    """Training and validation bytes as uint8 tensors."""

    train: torch.Tensor
    val: torch.Tensor
    root: str
    n_files: int
    sha256: str

    @property
    def n_bytes(self) -> int:
        return int(self.train.numel() + self.val.numel())


def build_corpus(
    max_bytes: int = 8_000_000, val_every: int = 20, root: Path | str | None = None
) -> Corpus:
    """Read the stdlib sources into a :class:`Corpus` (see the module docstring)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every}")
    root = Path(root) if root is not None else stdlib_root()
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    total = 0
    n_files = 0
    for i, rel in enumerate(list_source_files(root)):
        if total >= max_bytes:
            break
        text = b"# file: " + rel.encode() + b"\n" + (root / rel).read_bytes() + b"\n"
        text = text[: max_bytes - total]
        (val_parts if i % val_every == val_every - 1 else train_parts).append(text)
        total += len(text)
        n_files += 1
    train = b"".join(train_parts)
    val = b"".join(val_parts)
    if not val:  # fewer than val_every files under the cap: hold out the tail instead
        cut = len(train) - len(train) // val_every
        train, val = train[:cut], train[cut:]
    digest = hashlib.sha256()
    digest.update(len(train).to_bytes(8, "little"))
    digest.update(train)
    digest.update(val)
    return Corpus(
        train=_as_tensor(train),
        val=_as_tensor(val),
        root=str(root),
        n_files=n_files,
        sha256=digest.hexdigest(),
    )


def _as_tensor(b: bytes) -> torch.Tensor:
    if not b:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def num_windows(data: torch.Tensor, block_size: int) -> int:
    """How many ``block_size + 1`` windows start at multiples of ``block_size``."""
    return max(0, (data.numel() - 1) // block_size)


def windows_to_batch(
    data: torch.Tensor, windows: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (int64, shape (len(windows), block_size)) for window indices."""
    rows = [data[w * block_size : w * block_size + block_size + 1] for w in windows]
    chunk = torch.stack(rows).long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


class SampleStream:
    """The shuffled, epoch-concatenated stream of training window indices."""

    def __init__(self, n_windows: int, seed: int) -> None:
        if n_windows < 1:
            raise ValueError("the training split has no complete window; raise --corpus-bytes")
        self.n_windows = n_windows
        self.seed = seed
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (1 << 63))
            self._perm = torch.randperm(self.n_windows, generator=g).tolist()
            self._perm_epoch = epoch
        return self._perm

    def __getitem__(self, k: int) -> int:
        epoch, pos = divmod(k, self.n_windows)
        return self._permutation(epoch)[pos]

    def take(self, start: int, count: int) -> list[int]:
        return [self[k] for k in range(start, start + count)]


def rank_micro_batches(rank: int, world_size: int, micro_batches: int) -> range:
    """The contiguous global micro-batch indices rank ``rank`` computes."""
    if micro_batches % world_size:
        raise ValueError(
            f"the global micro-batch count ({micro_batches}) must be divisible by the "
            f"world size ({world_size})"
        )
    per = micro_batches // world_size
    return range(rank * per, (rank + 1) * per)


def micro_batch_windows(
    stream: SampleStream, samples_consumed: int, micro: int, batch_size: int
) -> list[int]:
    """Windows of global micro-batch ``micro`` of the step that starts at ``samples_consumed``."""
    return stream.take(samples_consumed + micro * batch_size, batch_size)


def val_windows(val: torch.Tensor, block_size: int, count: int) -> list[int]:
    """``count`` fixed validation windows spread evenly over the split (fewer if it is short)."""
    n = num_windows(val, block_size)
    if n == 0 or count <= 0:
        return []
    if count >= n:
        return list(range(n))
    return [(i * n) // count for i in range(count)]

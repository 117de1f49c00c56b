"""Message sizes and how each is sampled: parsing, formatting, the per-size plan, the order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.config import FLOAT32_BYTES, BenchConfig, GiB, KiB, MiB


@dataclass(frozen=True)
class Plan:
    """How one message size is sampled: ``rounds`` interleaved blocks of ``per_block`` samples."""

    rounds: int
    per_block: int
    warmup: int

    @property
    def samples(self) -> int:
        """Timed iterations per variant."""
        return self.rounds * self.per_block


_SUFFIXES = {
    "": 1,
    "B": 1,
    "K": KiB,
    "KB": KiB,
    "KIB": KiB,
    "M": MiB,
    "MB": MiB,
    "MIB": MiB,
    "G": GiB,
    "GB": GiB,
    "GIB": GiB,
}


def parse_bytes(text: str) -> int:
    """Parse ``4096``, ``4K``, ``4KiB``, ``256M``, ``1G`` (binary units) into bytes."""
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    suffix = t[len(digits) :]
    if not digits or suffix not in _SUFFIXES:
        raise ValueError(f"bad size {text!r}")
    return int(float(digits) * _SUFFIXES[suffix])


def parse_sizes(text: str) -> tuple[int, ...]:
    """Parse a comma list of sizes and/or ``START:END[:xFACTOR]`` geometric ranges.

    Every size is rounded up to a whole number of float32 elements; the result is
    sorted and de-duplicated.
    """
    sizes: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if ":" in item:
            parts = item.split(":")
            start, end = parse_bytes(parts[0]), parse_bytes(parts[1])
            factor = int(parts[2].lstrip("xX")) if len(parts) > 2 else 4
            if factor < 2 or start <= 0:
                raise ValueError(f"bad size range {item!r}")
            s = start
            while s <= end:
                sizes.add(s)
                s *= factor
        else:
            sizes.add(parse_bytes(item))
    if not sizes:
        raise ValueError("no sizes given")
    return tuple(sorted(-(-s // FLOAT32_BYTES) * FLOAT32_BYTES for s in sizes))


def format_bytes(n: int) -> str:
    """``4096`` -> ``4 KiB``; ``64 << 20`` -> ``64 MiB``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def plan_for(size: int, cfg: BenchConfig) -> Plan:
    """Samples for one size: ``budget_bytes / size`` clamped to ``[min_repeats, repeats]``.

    Bounds the total time (large messages get few samples), spreads them over at
    most ``rounds`` interleaved blocks, and picks the warm-up per block (small
    messages are sensitive to cold threads, large ones are not), unless
    ``cfg.warmup`` names it (``--warmup``: through ``dist.all_reduce`` the first
    ~10 small calls after a block's barrier are still in their post-idle
    transient; docs/benchmarks.md, "N = 2 after a barrier").
    """
    want = max(cfg.min_repeats, min(cfg.repeats, cfg.budget_bytes // max(size, 1)))
    rounds = max(1, min(cfg.rounds, want))
    per_block = -(-want // rounds)
    warmup = 2 if size <= 64 * KiB else 1 if size <= 16 * MiB else 0
    if cfg.warmup >= 0:
        warmup = cfg.warmup
    return Plan(rounds=rounds, per_block=per_block, warmup=warmup)


def ddp_per_block(cfg: BenchConfig) -> int:
    """Timed DDP steps per block (``workers._ddp``: ``ddp_steps`` over at most ``ddp_rounds``)."""
    rounds = max(1, min(cfg.ddp_rounds, cfg.ddp_steps))
    return -(-cfg.ddp_steps // rounds)


def rotated(items: Sequence[str], shift: int) -> list[str]:
    """``items`` rotated left by ``shift`` (the order of round ``shift``)."""
    if not items:
        return []
    k = shift % len(items)
    return list(items[k:]) + list(items[:k])

"""Benchmark: entrenar vs gloo (vs raw TCP, vs MPI) allreduce, and a DDP training step.

Run ``python -m benchmarks.bench`` from the repository root (``--help`` for the
flags; ``--quick`` is the sub-minute smoke run CI uses). One multi-process run
per world size creates one process group per variant (gloo, entrenar
ring/star/auto/deterministic) plus a raw-socket pair and interleaves them,
rotating the order each round (A B C, B C A, C A B, ...), so slow drift of a
shared machine hits every variant alike.

Definitions (nccl-tests): a sample is one blocking ``all_reduce`` call timed with
``perf_counter`` on every rank; the reported sample is the *maximum over ranks*
of that iteration's duration (when the slowest rank had its result; per-rank
durations need no clock sync). median, min and max are over samples; warm-up
iterations are excluded. algbw = bytes / median time; allreduce busbw =
algbw * 2(n-1)/n. Raw TCP: two processes each send *and* receive ``bytes`` at
once on one TCP_NODELAY socket with default buffers; GB/s is bytes / time, each
way (comparable with the busbw of an allreduce at n = 2, which moves the same
bytes each way). 1 GB = 1e9 bytes.

Before/after (``--baseline-tree DIR``): every world size runs
``--baseline-rounds`` pairs of runs, one whose workers import this checkout's
``entrenar_pg`` and one whose workers import a copy of ``DIR/entrenar_pg``
(A B B A ...); the second's entrenar variants are named ``<variant>@baseline``,
gloo, raw TCP and the floor pool the samples of both, and the report adds
``new / baseline`` median-time ratios. Everything else in a worker (this
module, ``trainer.model``, torch) is the same in both.

Outputs (``--out DIR``): ``bench.json``, ``results.md`` (markdown tables),
``allreduce_busbw.png``, ``allreduce_latency.png``; a text table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import platform
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import floor

log = logging.getLogger("benchmarks.bench")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
FLOAT32_BYTES = 4

RAW = "raw-tcp"
MPI_SHM = "mpi"
MPI_TCP = "mpi-tcp"
GLOO = "gloo"
BASELINE = "@baseline"  # suffix of the variants run on the --baseline-tree's entrenar_pg
EXIT_GRACE_S = 20.0  # how long ranks may take to exit once all have written their results


@dataclass(frozen=True)
class Variant:
    """One process group under test: a backend plus entrenar ``Options`` keyword arguments."""

    name: str
    backend: str
    options: dict[str, Any] = field(default_factory=dict)


# Allreduce sweep variants, keyed by the short names --algos takes.
SWEEP_VARIANTS: dict[str, Variant] = {
    "gloo": Variant(GLOO, "gloo"),
    "ring": Variant("entrenar-ring", "entrenar", {"algorithm": "ring"}),
    "star": Variant("entrenar-star", "entrenar", {"algorithm": "star"}),
    "direct": Variant("entrenar-direct", "entrenar", {"algorithm": "direct"}),
    "inline": Variant(
        "entrenar-auto-inline", "entrenar", {"algorithm": "auto", "inline_max_bytes": 262144}
    ),
    "auto": Variant("entrenar-auto", "entrenar", {"algorithm": "auto"}),
    "det": Variant("entrenar-det", "entrenar", {"algorithm": "auto", "deterministic": True}),
}

FLOOR = "floor (no comm)"

# DDP step variants (the entrenar ones when entrenar is available). The floor
# is a reference, not a contestant: a backend that moves nothing
# (benchmarks/floor.py), so a step's distance above it is what
# communication costs.
DDP_VARIANTS: tuple[Variant, ...] = (
    Variant(GLOO, "gloo"),
    Variant("entrenar", "entrenar", {"algorithm": "auto"}),
    Variant("entrenar-check", "entrenar", {"algorithm": "auto", "check": True}),
    # The opt-in that runs DDP's async bucket allreduces in the autograd thread
    # (no comm-thread hand-off; see Options.inline_max_bytes for its hazard).
    Variant("entrenar-inline", "entrenar", {"algorithm": "auto", "inline_max_bytes": 64 << 20}),
    Variant(FLOOR, floor.BACKEND),
)

DEFAULT_SIZES = "4K:256M:x4"
QUICK_SIZES = "4K,64K,1M,4M"


@dataclass(frozen=True)
class BenchConfig:
    """Everything a benchmark run needs; plain data so it can be sent to spawned workers."""

    world_sizes: tuple[int, ...] = (2, 4)
    sizes: tuple[int, ...] = ()
    algos: tuple[str, ...] = tuple(SWEEP_VARIANTS)
    repeats: int = 50
    min_repeats: int = 5
    rounds: int = 5
    budget_bytes: int = 2 * GiB
    raw: bool = True
    raw_min_bytes: int = 1 * MiB
    mpi: bool = True
    ddp: bool = True
    ddp_steps: int = 120
    ddp_rounds: int = 12
    timeout_s: float = 900.0
    op_timeout_s: float = 120.0
    quick: bool = False
    entrenar: bool = True
    baseline_tree: str = ""
    baseline_rounds: int = 2
    out: str = "bench_out"

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchConfig:
        """Inverse of :meth:`to_json`."""
        kw = dict(data)
        for name in ("world_sizes", "sizes", "algos"):
            kw[name] = tuple(kw[name])
        return cls(**kw)


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


# ---------------------------------------------------------------------------
# Pure helpers (unit-testable, no processes)
# ---------------------------------------------------------------------------

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
    messages are sensitive to cold threads, large ones are not).
    """
    want = max(cfg.min_repeats, min(cfg.repeats, cfg.budget_bytes // max(size, 1)))
    rounds = max(1, min(cfg.rounds, want))
    per_block = -(-want // rounds)
    warmup = 2 if size <= 64 * KiB else 1 if size <= 16 * MiB else 0
    return Plan(rounds=rounds, per_block=per_block, warmup=warmup)


def busbw_factor(world_size: int) -> float:
    """nccl-tests allreduce bus-bandwidth factor 2(n-1)/n."""
    return 2.0 * (world_size - 1) / world_size


def summarize(samples: Sequence[float]) -> dict[str, float | int]:
    """median/min/max/mean of a list of durations in seconds."""
    return {
        "n": len(samples),
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "mean_s": statistics.fmean(samples),
    }


def combine_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per-iteration maximum over ranks (all ranks time the same iterations)."""
    lengths = {len(x) for x in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks report different sample counts: {sorted(lengths)}")
    return [max(col) for col in zip(*per_rank, strict=True)]


def rotated(items: Sequence[str], shift: int) -> list[str]:
    """``items`` rotated left by ``shift`` (the order of round ``shift``)."""
    if not items:
        return []
    k = shift % len(items)
    return list(items[k:]) + list(items[:k])


def entrenar_available() -> tuple[bool, str]:
    """Whether the ``entrenar`` backend is importable and registered (and why not)."""
    try:
        import entrenar_pg  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return False, f"import entrenar_pg failed: {e!r}"
    if "entrenar" not in dist.Backend.backend_list:
        return False, "import entrenar_pg did not register backend 'entrenar'"
    return True, ""


def mpi_available() -> tuple[str | None, str]:
    """Path of ``mpiexec`` if it and mpi4py are usable, else ``(None, reason)``."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None, "mpi4py not importable (pip install mpich mpi4py)"
    exe = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    if exe is None:
        return None, "mpiexec not found on PATH"
    return exe, ""


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------
# The DDP model
# ---------------------------------------------------------------------------


@dataclass
class ModelSpec:
    """A model for the DDP step plus how to feed it."""

    name: str
    model: nn.Module
    vocab_size: int
    batch: int
    seq_len: int
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class _TinyTransformer(nn.Module):
    """Stand-in GPT-like model used when ``trainer.model`` is not importable."""

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab)."""
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.blocks(self.tok(idx) + self.pos[:, :t], mask=mask, is_causal=True)
        return self.head(h)  # type: ignore[no-any-return]


def _logits_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a model whose forward returns logits."""
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss of ``trainer.model.GPT``, whose ``forward(idx, targets)`` returns ``(logits, loss)``."""
    _, loss = model(x, y)
    return loss  # type: ignore[no-any-return]


DDP_BATCH = 8  # sequences per rank per step


def _make_trainer_model() -> ModelSpec:
    """The trainer's GPT with its default ``GPTConfig`` (raises if ``trainer.model`` is absent)."""
    from trainer.model import GPT, GPTConfig

    cfg = GPTConfig()
    name = (
        f"trainer.model.GPT (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, "
        f"block_size={cfg.block_size})"
    )
    return ModelSpec(name, GPT(cfg), cfg.vocab_size, DDP_BATCH, cfg.block_size, _gpt_loss)


def _make_model() -> ModelSpec:
    """The trainer's GPT when importable, else the tiny stand-in transformer."""
    try:
        return _make_trainer_model()
    except ImportError as e:
        log.debug("trainer.model not importable (%r); using the stand-in transformer", e)
    return ModelSpec(
        "stand-in transformer (2 x 128)", _TinyTransformer(), 256, DDP_BATCH, 64, _logits_loss
    )


# ---------------------------------------------------------------------------
# Worker side (one process per rank)
# ---------------------------------------------------------------------------


def _new_group(variant: Variant, world: int) -> dist.ProcessGroup:
    """Create the process group for ``variant`` (collective: every rank, same order)."""
    ranks = list(range(world))
    if variant.backend == "gloo":
        return dist.new_group(ranks, backend="gloo")
    if variant.backend == floor.BACKEND:
        floor.register()
        return dist.new_group(ranks, backend=floor.BACKEND)
    from entrenar_pg import Options

    return dist.new_group(ranks, backend="entrenar", pg_options=Options.from_env(**variant.options))


class _RawPair:
    """A TCP_NODELAY socket between ranks 0 and 1 (others hold none) for the raw reference."""

    def __init__(self, rank: int, ctrl: dist.ProcessGroup, timeout_s: float) -> None:
        self.sock: socket.socket | None = None
        port = [0]
        listener = None
        if rank == 0:
            listener = socket.create_server(("127.0.0.1", 0))
            listener.settimeout(timeout_s)
            port[0] = listener.getsockname()[1]
        dist.broadcast_object_list(port, src=0, group=ctrl)
        if rank == 1:
            self.sock = socket.create_connection(("127.0.0.1", port[0]), timeout=timeout_s)
        elif listener is not None:
            self.sock, _ = listener.accept()
            listener.close()
        self.timeout_s = timeout_s
        self.sel = selectors.DefaultSelector()
        if self.sock is not None:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.setblocking(False)
            self.sel.register(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def exchange(self, send: memoryview, recv: memoryview) -> float:
        """Send ``send`` while receiving ``len(recv)`` bytes; seconds until both are done.

        One thread, non-blocking socket, epoll: no thread wake-ups in the measurement,
        so it shows what the kernel's loopback path gives a single Python thread.
        """
        assert self.sock is not None
        sock, sel = self.sock, self.sel
        n_send, n_recv = len(send), len(recv)
        sent = got = 0
        mask = selectors.EVENT_READ | selectors.EVENT_WRITE
        sel.modify(sock, mask)
        t0 = time.perf_counter()
        while sent < n_send or got < n_recv:
            want = (selectors.EVENT_READ if got < n_recv else 0) | (
                selectors.EVENT_WRITE if sent < n_send else 0
            )
            if want != mask:
                mask = want
                sel.modify(sock, mask)
            ready = sel.select(self.timeout_s)
            if not ready:
                raise TimeoutError(f"raw TCP exchange stalled for {self.timeout_s:.0f} s")
            events = ready[0][1]
            if events & selectors.EVENT_WRITE:
                try:
                    sent += sock.send(send[sent:])
                except BlockingIOError:
                    pass
            if events & selectors.EVENT_READ:
                try:
                    k = sock.recv_into(recv[got:])
                except BlockingIOError:
                    k = -1
                if k == 0:
                    raise ConnectionError("raw TCP peer closed")
                got += max(k, 0)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Close the socket, if any."""
        self.sel.close()
        if self.sock is not None:
            self.sock.close()


def _verify(t: torch.Tensor, group: dist.ProcessGroup, rank: int, world: int, name: str) -> None:
    """One checked allreduce (also a warm-up): every element must be sum(1..world)."""
    t.fill_(rank + 1)
    dist.all_reduce(t, group=group)
    want = world * (world + 1) / 2
    if not bool(torch.all(t == want)):
        bad = t[t != want]
        raise AssertionError(
            f"{name}: allreduce of {t.numel()} floats wrong on rank {rank}: "
            f"{bad.numel()} elements != {want} (e.g. {bad[:4].tolist()})"
        )
    t.zero_()


def _time_allreduce(t: torch.Tensor, group: dist.ProcessGroup, warmup: int, n: int) -> list[float]:
    """``warmup`` untimed then ``n`` timed blocking allreduces; per-call seconds."""
    for _ in range(warmup):
        dist.all_reduce(t, group=group)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        dist.all_reduce(t, group=group)
        out.append(time.perf_counter() - t0)
    return out


def _sweep(
    rank: int,
    world: int,
    cfg: BenchConfig,
    ctrl: dist.ProcessGroup,
    groups: dict[str, dist.ProcessGroup],
    raw: _RawPair | None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The interleaved allreduce sweep; returns ``{"variant|size": samples}`` and raw samples."""
    times: dict[str, list[float]] = {}
    raw_times: dict[str, list[float]] = {}
    for size in cfg.sizes:
        plan = plan_for(size, cfg)
        t = torch.zeros(size // FLOAT32_BYTES, dtype=torch.float32)
        names = list(groups)
        use_raw = raw is not None and size >= cfg.raw_min_bytes
        if use_raw:
            names.append(RAW)
            send = memoryview(t.numpy().view("uint8"))  # type: ignore[arg-type]
            recv = memoryview(bytearray(size))
        for r in range(plan.rounds):
            for name in rotated(names, r):
                dist.barrier(group=ctrl)
                if name == RAW:
                    assert raw is not None
                    if raw.sock is not None:
                        if r == 0:
                            raw.exchange(send, recv)
                        samples = [raw.exchange(send, recv) for _ in range(plan.per_block)]
                        raw_times.setdefault(str(size), []).extend(samples)
                    continue
                group = groups[name]
                warm = plan.warmup
                if r == 0:
                    _verify(t, group, rank, world, name)
                    warm = max(warm, 1)
                samples = _time_allreduce(t, group, warm, plan.per_block)
                times.setdefault(f"{name}|{size}", []).extend(samples)
        del t
        if use_raw:
            del send, recv
    return times, raw_times


def _ddp(
    rank: int,
    world: int,
    cfg: BenchConfig,
    ctrl: dist.ProcessGroup,
    variants: Sequence[Variant],
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Interleaved DDP training steps per variant; returns step-time samples and model info."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    spec = _make_model()
    n_params = sum(p.numel() for p in spec.model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, spec.vocab_size, (spec.batch, spec.seq_len), generator=gen)
    y = torch.randint(0, spec.vocab_size, (spec.batch, spec.seq_len), generator=gen)
    models: dict[str, nn.Module] = {}
    optims: dict[str, torch.optim.Optimizer] = {}
    check_active: dict[str, bool | None] = {}
    checkers: dict[str, Any] = {}
    for v in variants:
        group = _new_group(v, world)
        m = DDP(copy.deepcopy(spec.model), process_group=group)
        models[v.name] = m
        optims[v.name] = torch.optim.AdamW(m.parameters(), lr=1e-3)
        if v.options.get("check"):
            check_active[v.name] = _checker_active(group)
            checker = getattr(group, "checker", None)
            if checker is not None and hasattr(checker, "watch"):
                # C-DDP-001 on a group that is not the default one needs the optimizer named.
                checker.watch(optims[v.name])
                checkers[v.name] = checker

    def step(name: str) -> None:
        optims[name].zero_grad(set_to_none=True)
        spec.loss(models[name], x, y).backward()
        optims[name].step()

    rounds = max(1, min(cfg.ddp_rounds, cfg.ddp_steps))
    per_block = -(-cfg.ddp_steps // rounds)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for name in rotated([v.name for v in variants], r):
            dist.barrier(group=ctrl)
            step(name)  # warm-up (the first one also builds DDP's buckets)
            for _ in range(per_block):
                t0 = time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - t0)
    info = {
        "model": spec.name,
        "params": n_params,
        "batch_per_rank": spec.batch,
        "seq_len": spec.seq_len,
        "tokens_per_step": spec.batch * spec.seq_len * world,
        "check_active": check_active,
        "checker_stats": {name: _checker_stats(c) for name, c in checkers.items()},
    }
    return times, info


def _checker_active(group: dist.ProcessGroup) -> bool | None:
    """Whether an entrenar group runs its contract checker (None: not an entrenar group)."""
    from entrenar_pg import EntrenarProcessGroup

    if not isinstance(group, EntrenarProcessGroup):
        return None
    return group.checker is not None


def _checker_stats(checker: Any) -> dict[str, float]:
    """The contract checker's counters (what it checked, seconds it spent), where it has them."""
    names = ("allreduces_checked", "steps_checked", "seconds")
    return {n: float(getattr(checker, n)) for n in names if hasattr(checker, n)}


def _worker(rank: int, world: int, port: int, cfg_json: dict[str, Any], out_path: str) -> None:
    """One rank of a world-size run: sweep, raw reference, DDP; writes its samples as JSON."""
    cfg = BenchConfig.from_json(cfg_json)
    torch.set_num_threads(1)
    variants = [SWEEP_VARIANTS[a] for a in cfg.algos]
    entrenar_file = ""
    if cfg.entrenar:
        import entrenar_pg  # registers the backend

        entrenar_file = str(entrenar_pg.__file__)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg.op_timeout_s),
    )
    raw: _RawPair | None = None
    try:
        ctrl = dist.group.WORLD
        assert ctrl is not None
        groups = {v.name: _new_group(v, world) for v in variants}
        if cfg.raw and world >= 2:
            raw = _RawPair(rank, ctrl, cfg.op_timeout_s)
        times, raw_times = _sweep(rank, world, cfg, ctrl, groups, raw)
        ddp_times: dict[str, list[float]] = {}
        ddp_info: dict[str, Any] = {}
        if cfg.ddp:
            ddp_variants = [v for v in DDP_VARIANTS if v.backend != "entrenar" or cfg.entrenar]
            ddp_times, ddp_info = _ddp(rank, world, cfg, ctrl, ddp_variants)
        dist.barrier(group=ctrl)
        result = {
            "rank": rank,
            "allreduce": times,
            "raw": raw_times,
            "ddp": ddp_times,
            "ddp_info": ddp_info,
            "entrenar_pg_file": entrenar_file,
        }
        tmp_path = out_path + ".tmp"
        Path(tmp_path).write_text(json.dumps(result))
        os.replace(tmp_path, out_path)  # the parent treats the file's appearance as "done"
    except BaseException:
        # Fail fast: a cleanup that waits on dead peers would only delay the parent.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if raw is not None:
        raw.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Parent side: spawning, MPI, combining
# ---------------------------------------------------------------------------


class BenchError(RuntimeError):
    """A benchmark run failed (a rank died, timed out, or produced bad results)."""


def _kill_all(procs: Iterable[mp.process.BaseProcess]) -> None:
    """Terminate, then kill, every still-running child process."""
    procs = list(procs)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


@contextlib.contextmanager
def _first_on_sys_path(path: str | None) -> Iterator[None]:
    """Put ``path`` first on ``sys.path`` for the duration (nothing if None).

    A spawned child takes the parent's ``sys.path`` as it was at ``start()``
    and installs it before it imports anything (its ``__main__``, this module,
    torch, whose ``torch.backends`` entry point imports ``entrenar_pg``), so a
    package found first there is the one every import in the child resolves to.
    The parent's own modules are already imported and stay as they are.
    """
    if path is None:
        yield
        return
    sys.path.insert(0, path)
    try:
        yield
    finally:
        sys.path.remove(path)


def run_world(world: int, cfg: BenchConfig, import_root: str | None = None) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks, wait (bounded by ``cfg.timeout_s``), return each rank's result.

    ``import_root``: a directory the workers search first for ``entrenar_pg``.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="entrenar_bench_") as tmp:
        paths = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world, port, cfg.to_json(), paths[r]),
                name=f"bench-rank{r}",
            )
            for r in range(world)
        ]
        try:
            with _first_on_sys_path(import_root):
                for p in procs:
                    p.start()
            deadline = time.monotonic() + cfg.timeout_s
            done_at: float | None = None
            while any(p.exitcode is None for p in procs):
                failed = [p for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise BenchError(
                        f"world size {world}: {failed[0].name} exited with {failed[0].exitcode}"
                        " (its traceback is above on stderr)"
                    )
                now = time.monotonic()
                if done_at is None and all(os.path.exists(x) for x in paths):
                    done_at = now  # every rank wrote its result; only teardown is left
                if done_at is not None and now > done_at + EXIT_GRACE_S:
                    log.warning("world size %d: ranks hung in teardown; killed them", world)
                    break
                if now > deadline:
                    raise BenchError(f"world size {world}: timed out after {cfg.timeout_s:.0f} s")
                time.sleep(0.05)
            return [json.loads(Path(path).read_text()) for path in paths]
        finally:
            _kill_all(procs)


def run_mpi(world: int, cfg: BenchConfig, mpiexec: str, tcp: bool) -> dict[str, Any]:
    """Time MPI allreduce with the same plan (not interleaved: a separate mpiexec run)."""
    plan = ",".join(
        f"{s}:{p.rounds}:{p.per_block}:{max(p.warmup, 1)}"
        for s in cfg.sizes
        for p in [plan_for(s, cfg)]
    )
    env = dict(os.environ)
    if tcp:
        # MPICH: treat every rank as remote, so ch4 uses its netmod (libfabric tcp) on loopback.
        env.update(
            {
                "MPIR_CVAR_NOLOCAL": "1",
                "MPIR_CVAR_CH4_NETMOD": "ofi",
                "FI_PROVIDER": "tcp",
                "FI_TCP_IFACE": "lo",
            }
        )
    cmd = [
        mpiexec,
        "-n",
        str(world),
        sys.executable,
        str(Path(__file__).with_name("mpi.py")),  # by path: no torch, no entrenar_pg
        "--plan",
        plan,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=cfg.timeout_s, check=False
    )
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {proc.stderr[-2000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise BenchError(f"MPI run printed no JSON: {proc.stdout[-2000:]}")
    return dict(json.loads(lines[-1]))


def _row(world: int, variant: str, size: int, samples: Sequence[float]) -> dict[str, Any]:
    """One allreduce result row with nccl-tests bandwidths."""
    row: dict[str, Any] = {"world_size": world, "variant": variant, "size_bytes": size}
    row.update(summarize(samples))
    algbw = size / row["median_s"] / 1e9
    row["algbw_GBps"] = algbw
    row["busbw_GBps"] = algbw * busbw_factor(world)
    row["samples_s"] = list(samples)
    return row


def _add_ratios(rows: list[dict[str, Any]], raw: dict[tuple[int, int], float]) -> None:
    """Add time and busbw ratios to gloo (same world size and size) and busbw / raw TCP."""
    gloo = {(r["world_size"], r["size_bytes"]): r for r in rows if r["variant"] == GLOO}
    for r in rows:
        key = (r["world_size"], r["size_bytes"])
        g = gloo.get(key)
        r["time_vs_gloo"] = r["median_s"] / g["median_s"] if g else None
        r["busbw_vs_gloo"] = r["busbw_GBps"] / g["busbw_GBps"] if g else None
        raw_gbps = raw.get(key)
        r["busbw_vs_raw"] = r["busbw_GBps"] / raw_gbps if raw_gbps else None


def combine_world(
    world: int, ranks: Sequence[dict[str, Any]], order: Sequence[str]
) -> dict[str, Any]:
    """Merge the per-rank samples of one world size into rows (by size, then ``order``)."""
    rows: list[dict[str, Any]] = []

    def sort_key(key: str) -> tuple[int, int]:
        name, size = key.split("|")
        return int(size), order.index(name) if name in order else len(order)

    keys = sorted(ranks[0]["allreduce"], key=sort_key)
    for key in keys:
        name, size = key.split("|")
        samples = combine_ranks([r["allreduce"][key] for r in ranks])
        rows.append(_row(world, name, int(size), samples))
    raw_rows = []
    for size_s in sorted(ranks[0]["raw"], key=int):
        samples = combine_ranks([r["raw"][size_s] for r in ranks if size_s in r["raw"]])
        row: dict[str, Any] = {"world_size": world, "size_bytes": int(size_s)}
        row.update(summarize(samples))
        row["GBps_each_way"] = int(size_s) / row["median_s"] / 1e9
        raw_rows.append(row)
    ddp_rows = []
    info = ranks[0]["ddp_info"]
    for name in ranks[0]["ddp"]:
        samples = combine_ranks([r["ddp"][name] for r in ranks])
        row = {"world_size": world, "variant": name, **info, **summarize(samples)}
        row["tokens_per_s"] = info["tokens_per_step"] / row["median_s"]
        ddp_rows.append(row)
    g = next((r for r in ddp_rows if r["variant"] == GLOO), None)
    floor = next((r for r in ddp_rows if r["variant"] == FLOOR), None)
    for row in ddp_rows:
        row["step_vs_gloo"] = row["median_s"] / g["median_s"] if g else None
        # What communication adds to a step (the floor moves nothing).
        row["above_floor_s"] = row["median_s"] - floor["median_s"] if floor else None
    return {"allreduce": rows, "raw_tcp": raw_rows, "ddp": ddp_rows}


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, kernel, python and torch versions."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hostname": platform.node(),
    }


def git_revision(repo: Path | None = None) -> str:
    """``<short sha>[+dirty]`` of ``repo`` (default: this module's checkout), or ``""``."""
    repo = repo or Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return ""
    return sha + ("+dirty" if dirty else "")


# ---------------------------------------------------------------------------
# Before/after: this checkout's entrenar_pg against another tree's
# ---------------------------------------------------------------------------

# Every variant whose samples depend on which entrenar_pg the workers import.
ENTRENAR_VARIANT_NAMES = frozenset(
    v.name for v in (*SWEEP_VARIANTS.values(), *DDP_VARIANTS) if v.backend == "entrenar"
)


def copy_baseline_package(tree: str, dest: str) -> str:
    """Copy ``tree/entrenar_pg`` (no bytecode) under ``dest``; returns the import root.

    A copy, not the tree itself on ``sys.path``: only the package under test
    comes from the baseline (this module and ``trainer.model`` stay the
    checkout's), and the baseline tree is only read, never written (bytecode).
    """
    src = Path(tree) / "entrenar_pg"
    if not (src / "__init__.py").is_file():
        raise BenchError(f"--baseline-tree {tree}: no entrenar_pg package there")
    shutil.copytree(src, Path(dest) / "entrenar_pg", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def mark_baseline(rank_result: dict[str, Any]) -> dict[str, Any]:
    """A worker's result with its entrenar variants renamed ``<name>@baseline``."""

    def rename(name: str) -> str:
        return name + BASELINE if name in ENTRENAR_VARIANT_NAMES else name

    def rename_keys(d: dict[str, Any]) -> dict[str, Any]:
        return {rename(k): v for k, v in d.items()}

    out = dict(rank_result)
    out["allreduce"] = {
        f"{rename(name)}|{size}": v
        for key, v in rank_result["allreduce"].items()
        for name, size in [key.split("|")]
    }
    out["ddp"] = rename_keys(rank_result["ddp"])
    info = dict(rank_result["ddp_info"])
    for k in ("check_active", "checker_stats"):
        if k in info:
            info[k] = rename_keys(info[k])
    out["ddp_info"] = info
    return out


def merge_runs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One rank's results of two runs as one: the samples of each key concatenated."""
    out = copy.deepcopy(a)
    for section in ("allreduce", "raw", "ddp"):
        for key, samples in b[section].items():
            out[section].setdefault(key, []).extend(samples)
    for k in ("check_active", "checker_stats"):
        if k in b["ddp_info"]:
            out["ddp_info"].setdefault(k, {}).update(b["ddp_info"][k])
    return out


def run_world_vs_baseline(
    world: int, cfg: BenchConfig, baseline_root: str
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """``cfg.baseline_rounds`` pairs of runs (this checkout, baseline; A B B A ...), merged.

    Returns each rank's merged result and the ``entrenar_pg`` file each side's
    rank 0 imported, checked: the baseline runs must have imported the copy
    under ``baseline_root``, the others must not have.
    """
    root = Path(baseline_root).resolve()
    merged: list[dict[str, Any]] = []
    files: dict[str, str] = {}
    for r in range(cfg.baseline_rounds):
        for is_base in (False, True) if r % 2 == 0 else (True, False):
            side = "baseline" if is_base else "new"
            log.info("world size %d: round %d, %s entrenar_pg ...", world, r + 1, side)
            ranks = run_world(world, cfg, baseline_root if is_base else None)
            for rank, res in enumerate(ranks):
                got = Path(res["entrenar_pg_file"]).resolve()
                if got.is_relative_to(root) != is_base:
                    raise BenchError(
                        f"world size {world}: rank {rank} of a {side} run imported "
                        f"entrenar_pg from {got} (baseline copy: {root})"
                    )
            files[side] = ranks[0]["entrenar_pg_file"]
            if is_base:
                ranks = [mark_baseline(x) for x in ranks]
            merged = (
                [merge_runs(a, b) for a, b in zip(merged, ranks, strict=True)] if merged else ranks
            )
    return merged, files


def add_baseline_ratios(rows: list[dict[str, Any]], key: tuple[str, ...]) -> None:
    """``time_vs_baseline`` (median time of X over X@baseline, same ``key`` fields) on X's rows."""
    by_key = {(r["variant"], *(r[k] for k in key)): r for r in rows}
    for r in rows:
        base = by_key.get((r["variant"] + BASELINE, *(r[k] for k in key)))
        if base is not None:
            r["time_vs_baseline"] = r["median_s"] / base["median_s"]


def _measure_worlds(
    cfg: BenchConfig, result: dict[str, Any], mpiexec: str | None, baseline_root: str | None
) -> None:
    """Every world size's runs (and MPI runs), their rows appended to ``result``."""
    notes = result["meta"]["notes"]
    order = [SWEEP_VARIANTS[a].name for a in cfg.algos]
    if baseline_root is not None:
        order = [x for name in order for x in (name, name + BASELINE)]
    for world in cfg.world_sizes:
        log.info("world size %d: %d sizes x %d variants ...", world, len(cfg.sizes), len(order))
        if baseline_root is None:
            ranks = run_world(world, cfg)
        else:
            ranks, files = run_world_vs_baseline(world, cfg, baseline_root)
            result["meta"]["baseline"].setdefault("entrenar_pg_file", {})[world] = files
        part = combine_world(world, ranks, order)
        for k in ("allreduce", "raw_tcp", "ddp"):
            result[k].extend(part[k])
        if mpiexec is not None:
            for name, tcp in ((MPI_SHM, False), (MPI_TCP, True)):
                log.info("world size %d: %s ...", world, name)
                try:
                    mres = run_mpi(world, cfg, mpiexec, tcp)
                except (BenchError, subprocess.TimeoutExpired) as e:
                    notes.append(f"{name} N={world} failed: {e}")
                    continue
                result["meta"].setdefault("mpi_library", mres["library"])
                for size_s, samples in mres["times"].items():
                    result["mpi"].append(_row(world, name, int(size_s), samples))


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the whole benchmark described by ``cfg``; returns the JSON-able result."""
    started = time.time()
    notes: list[str] = []
    algos = list(cfg.algos)
    ok, why = entrenar_available()
    if not ok and any(SWEEP_VARIANTS[a].backend == "entrenar" for a in algos):
        notes.append(f"entrenar variants skipped: {why}")
        algos = [a for a in algos if SWEEP_VARIANTS[a].backend != "entrenar"]
    cfg = dataclasses.replace(cfg, algos=tuple(algos), entrenar=ok)
    mpiexec, mpi_why = mpi_available() if cfg.mpi else (None, "disabled (--no-mpi)")
    if mpiexec is None:
        notes.append(f"MPI column skipped: {mpi_why}")
    result: dict[str, Any] = {
        "meta": {
            "machine": machine_info(),
            "git": git_revision(),
            "loadavg_start": list(os.getloadavg()),
            "config": cfg.to_json(),
            "variants": [SWEEP_VARIANTS[a].name for a in algos],
            "variant_options": {SWEEP_VARIANTS[a].name: SWEEP_VARIANTS[a].options for a in algos},
            "timing": "per iteration, max over ranks of each rank's blocking all_reduce time; "
            "median/min/max over samples; warm-up excluded; variants interleaved",
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "notes": notes,
        },
        "allreduce": [],
        "raw_tcp": [],
        "mpi": [],
        "ddp": [],
    }
    if cfg.baseline_tree:
        if not ok:
            raise BenchError(f"--baseline-tree needs the entrenar backend here: {why}")
        result["meta"]["baseline"] = {
            "tree": str(Path(cfg.baseline_tree).resolve()),
            "git": git_revision(Path(cfg.baseline_tree)),
        }
        with tempfile.TemporaryDirectory(prefix="entrenar_baseline_") as tmp:
            _measure_worlds(cfg, result, mpiexec, copy_baseline_package(cfg.baseline_tree, tmp))
        add_baseline_ratios(result["allreduce"], ("world_size", "size_bytes"))
        add_baseline_ratios(result["ddp"], ("world_size",))
    else:
        _measure_worlds(cfg, result, mpiexec, None)
    for r in result["ddp"]:
        active = r.get("check_active", {}).get(r["variant"], True)
        if r["variant"].removesuffix(BASELINE).endswith("-check") and not active:
            notes.append(
                f"DDP N={r['world_size']} {r['variant']}: Options(check=True) was set but the "
                f"group has no active contract checker (check_active={active}); the row "
                "measures the plain backend"
            )
    raw = {(r["world_size"], r["size_bytes"]): r["GBps_each_way"] for r in result["raw_tcp"]}
    _add_ratios(result["allreduce"], raw)
    _add_ratios(result["mpi"], raw)
    for r in result["mpi"]:
        r["time_vs_gloo"] = _ratio_to(result["allreduce"], r)
    result["meta"]["elapsed_s"] = time.time() - started
    result["meta"]["loadavg_end"] = list(os.getloadavg())
    return result


def _ratio_to(rows: Sequence[dict[str, Any]], r: dict[str, Any]) -> float | None:
    """``r``'s median time over gloo's at the same world size and message size."""
    for g in rows:
        if (
            g["variant"] == GLOO
            and g["world_size"] == r["world_size"]
            and g["size_bytes"] == r["size_bytes"]
        ):
            return float(r["median_s"] / g["median_s"])
    return None


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def _fmt_time(s: float) -> str:
    """Seconds as a short µs/ms/s string."""
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def allreduce_table(result: dict[str, Any], world: int, markdown: bool = False) -> list[str]:
    """Rows (size x variant, raw TCP and MPI included) of one world size as text lines."""
    header = [
        "size",
        "variant",
        "median",
        "min",
        "max",
        "n",
        "algbw GB/s",
        "busbw GB/s",
        "time/gloo",
        "busbw/gloo",
        "busbw/raw",
    ]
    body: list[list[str]] = []
    rows = [r for r in result["allreduce"] + result["mpi"] if r["world_size"] == world]
    raws = {r["size_bytes"]: r for r in result["raw_tcp"] if r["world_size"] == world}
    for size in sorted({r["size_bytes"] for r in rows}):
        for r in (x for x in rows if x["size_bytes"] == size):
            body.append(
                [
                    format_bytes(size),
                    r["variant"],
                    _fmt_time(r["median_s"]),
                    _fmt_time(r["min_s"]),
                    _fmt_time(r["max_s"]),
                    str(r["n"]),
                    f"{r['algbw_GBps']:.3f}",
                    f"{r['busbw_GBps']:.3f}",
                    _fmt_ratio(r.get("time_vs_gloo")),
                    _fmt_ratio(r.get("busbw_vs_gloo")),
                    _fmt_ratio(r.get("busbw_vs_raw")),
                ]
            )
        if size in raws:
            w = raws[size]
            body.append(
                [
                    format_bytes(size),
                    RAW,
                    _fmt_time(w["median_s"]),
                    _fmt_time(w["min_s"]),
                    _fmt_time(w["max_s"]),
                    str(w["n"]),
                    f"{w['GBps_each_way']:.3f}",
                    f"{w['GBps_each_way']:.3f}",
                    "-",
                    "-",
                    "1.00",
                ]
            )
    return _render(header, body, markdown)


def summary_tables(result: dict[str, Any], world: int, markdown: bool = False) -> list[str]:
    """Two compact size x variant tables: median time (x gloo) and busbw GB/s (x raw TCP)."""
    rows = [r for r in result["allreduce"] + result["mpi"] if r["world_size"] == world]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    cell = {(r["variant"], r["size_bytes"]): r for r in rows}
    raws = {r["size_bytes"]: r for r in result["raw_tcp"] if r["world_size"] == world}
    sizes = sorted({r["size_bytes"] for r in rows})
    t_body, b_body = [], []
    for size in sizes:
        t_row, b_row = [format_bytes(size)], [format_bytes(size)]
        for name in names:
            r = cell.get((name, size))
            if r is None:
                t_row.append("-")
                b_row.append("-")
                continue
            ratio = r.get("time_vs_gloo")
            extra = "" if name == GLOO or ratio is None else f" ({ratio:.2f}x)"
            t_row.append(_fmt_time(r["median_s"]) + extra)
            vs_raw = r.get("busbw_vs_raw")
            b_row.append(f"{r['busbw_GBps']:.3f}" + ("" if vs_raw is None else f" ({vs_raw:.2f})"))
        b_row.append(f"{raws[size]['GBps_each_way']:.3f}" if size in raws else "-")
        t_body.append(t_row)
        b_body.append(b_row)
    lines = [f"N={world} median time per allreduce (time / gloo):", ""]
    lines += _render(["size", *names], t_body, markdown)
    lines += ["", f"N={world} busbw GB/s (busbw / raw TCP each way):", ""]
    lines += _render(["size", *names, RAW], b_body, markdown)
    return lines


def ddp_table(result: dict[str, Any], markdown: bool = False) -> list[str]:
    """DDP step rows as text lines."""
    header = ["N", "variant", "step median", "min", "max", "n", "tokens/s", "step/gloo", "- floor"]
    body = [
        [
            str(r["world_size"]),
            r["variant"],
            _fmt_time(r["median_s"]),
            _fmt_time(r["min_s"]),
            _fmt_time(r["max_s"]),
            str(r["n"]),
            f"{r['tokens_per_s']:.0f}",
            _fmt_ratio(r["step_vs_gloo"]),
            "-" if r.get("above_floor_s") is None else _fmt_time(r["above_floor_s"]),
        ]
        for r in result["ddp"]
    ]
    return _render(header, body, markdown)


def baseline_table(result: dict[str, Any], markdown: bool = False) -> list[str]:
    """Every entrenar variant against its ``@baseline`` twin (allreduce sizes, DDP step)."""
    header = ["N", "what", "variant", "new", "baseline", "new/baseline", "new/gloo", "base/gloo"]
    body = []
    pairs = [(r, format_bytes(r["size_bytes"])) for r in result["allreduce"]]
    pairs += [(r, "DDP step") for r in result["ddp"]]
    rows = {(r["world_size"], what, r["variant"]): r for r, what in pairs}
    for r, what in pairs:
        if "time_vs_baseline" not in r:
            continue
        base = rows[(r["world_size"], what, r["variant"] + BASELINE)]
        gloo_key = "time_vs_gloo" if "time_vs_gloo" in r else "step_vs_gloo"
        body.append(
            [
                str(r["world_size"]),
                what,
                r["variant"],
                _fmt_time(r["median_s"]),
                _fmt_time(base["median_s"]),
                f"{r['time_vs_baseline']:.3f}",
                _fmt_ratio(r.get(gloo_key)),
                _fmt_ratio(base.get(gloo_key)),
            ]
        )
    return _render(header, body, markdown)


def _render(header: list[str], body: list[list[str]], markdown: bool) -> list[str]:
    """A padded text table, or a markdown one."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return lines + ["| " + " | ".join(row) + " |" for row in body]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [
        fmt.format(*row) for row in body
    ]


def report_lines(result: dict[str, Any], markdown: bool = False) -> list[str]:
    """The full report (every world size, DDP, notes) as lines."""
    meta = result["meta"]
    m = meta["machine"]
    lines = [
        f"machine: {m['nproc']} CPUs, {m['cpu']}, kernel {m['kernel']}, torch {m['torch']}, "
        f"git {meta.get('git') or '?'}, {meta['started']}",
        f"timing: {meta['timing']}",
    ]
    if "loadavg_end" in meta:
        lines.append(
            "load average (1/5/15 min) at start "
            + "/".join(f"{x:.1f}" for x in meta["loadavg_start"])
            + ", at end "
            + "/".join(f"{x:.1f}" for x in meta["loadavg_end"])
            + f" on {m['nproc']} CPUs (other processes share this machine)"
        )
    if meta.get("mpi_library"):
        lines.append(
            f"MPI: {meta['mpi_library']} ({MPI_SHM}: default shared memory; {MPI_TCP}: "
            "MPIR_CVAR_NOLOCAL=1, libfabric tcp on lo; separate runs, not interleaved)"
        )
    for world in meta["config"]["world_sizes"]:
        lines += ["", f"allreduce float32, N={world}:", ""]
        lines += allreduce_table(result, world, markdown)
        lines += [""] + summary_tables(result, world, markdown)
    if result["ddp"]:
        d = result["ddp"][0]
        lines += [
            "",
            f"DDP step ({d['model']}, {d['params']} params, batch {d['batch_per_rank']}"
            f" x seq {d['seq_len']} per rank):",
            "",
        ]
        lines += ddp_table(result, markdown)
        for r in result["ddp"]:
            st = r.get("checker_stats", {}).get(r["variant"])
            if st and st.get("steps_checked"):
                lines.append(
                    f"N={r['world_size']} {r['variant']}: rank 0's checker covered "
                    f"{st.get('allreduces_checked', 0):.0f} allreduces and "
                    f"{st['steps_checked']:.0f} optimizer steps, "
                    f"{1e3 * st.get('seconds', 0.0) / st['steps_checked']:.2f} ms per step"
                )
    if "baseline" in meta:
        b = meta["baseline"]
        lines += [
            "",
            f"this checkout (git {meta.get('git') or '?'}) vs baseline {b['tree']} "
            f"(git {b['git'] or '?'}): median time, new/baseline below 1 = new is faster; "
            f"{meta['config']['baseline_rounds']} rounds of paired runs (A B B A ...)",
            "",
        ]
        lines += baseline_table(result, markdown)
        for world, files in b.get("entrenar_pg_file", {}).items():
            lines.append(
                f"N={world} workers imported entrenar_pg from {files.get('new')} (new) and "
                f"{files.get('baseline')} (baseline copy)"
            )
    for note in meta["notes"]:
        lines.append(f"note: {note}")
    return lines


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    """busbw-vs-size and latency-vs-size PNGs (one panel per world size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = result["meta"]["config"]["world_sizes"]
    paths = []
    for metric, ylabel, fname in (
        ("busbw_GBps", "busbw (GB/s)", "allreduce_busbw.png"),
        ("median_s", "latency (s, median)", "allreduce_latency.png"),
    ):
        fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
        for ax, world in zip(axes[0], worlds, strict=True):
            rows = [r for r in result["allreduce"] + result["mpi"] if r["world_size"] == world]
            for name in dict.fromkeys(r["variant"] for r in rows):
                pts = sorted((r["size_bytes"], r[metric]) for r in rows if r["variant"] == name)
                style = ":" if name.startswith("mpi") else "-"
                ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, label=name)
            raw = sorted(
                (r["size_bytes"], r["GBps_each_way"] if metric == "busbw_GBps" else r["median_s"])
                for r in result["raw_tcp"]
                if r["world_size"] == world
            )
            if raw:
                ax.plot(*zip(*raw, strict=True), "--", color="black", label=RAW)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"allreduce float32, N={world}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    """bench.json, results.md and the PNGs under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "bench.json"
    jpath.write_text(json.dumps(result, indent=1))
    mpath = out / "results.md"
    mpath.write_text("\n".join(report_lines(result, markdown=True)) + "\n")
    return [jpath, mpath, *write_plots(result, out)]


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    """Turn command-line flags into a :class:`BenchConfig`."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description="Allreduce sweep and DDP step: entrenar vs gloo vs raw TCP (vs MPI).",
    )
    p.add_argument("--world-sizes", default=None, help="comma list (default 2,4; --quick: 2)")
    p.add_argument(
        "--sizes",
        default=None,
        help=f"sizes and START:END:xF ranges (default {DEFAULT_SIZES}; --quick: {QUICK_SIZES})",
    )
    p.add_argument(
        "--algos",
        default=",".join(SWEEP_VARIANTS),
        help=f"variants from {','.join(SWEEP_VARIANTS)} (default all)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="max timed samples per variant and size (default 50; --quick 8)",
    )
    p.add_argument("--rounds", type=int, default=None, help="interleaving rounds (default 5)")
    p.add_argument(
        "--budget",
        default=None,
        help="bytes per variant and size, bounds the samples (default 2G; --quick 64M)",
    )
    p.add_argument("--ddp-steps", type=int, default=None, help="timed DDP steps per variant")
    p.add_argument("--no-ddp", action="store_true", help="skip the DDP step benchmark")
    p.add_argument("--no-raw", action="store_true", help="skip the raw TCP reference")
    p.add_argument("--no-mpi", action="store_true", help="skip the MPI column")
    p.add_argument("--quick", action="store_true", help="smoke run, under a minute")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds allowed per world size (default 900; --quick 100)",
    )
    p.add_argument(
        "--baseline-tree",
        default="",
        metavar="DIR",
        help="also run every entrenar variant on DIR/entrenar_pg (a copy), as <variant>@baseline,"
        " and report new/baseline ratios",
    )
    p.add_argument(
        "--baseline-rounds",
        type=int,
        default=2,
        help="with --baseline-tree: pairs of runs per world size, order A B B A ... (default 2)",
    )
    p.add_argument("--out", default="bench_out", help="output directory")
    a = p.parse_args(argv)
    algos = tuple(x.strip() for x in a.algos.split(",") if x.strip())
    unknown = [x for x in algos if x not in SWEEP_VARIANTS]
    if unknown:
        p.error(f"unknown --algos {unknown}; choose from {list(SWEEP_VARIANTS)}")
    q = a.quick
    worlds = a.world_sizes or ("2" if q else "2,4")
    cfg = BenchConfig(
        world_sizes=tuple(int(x) for x in worlds.split(",")),
        sizes=parse_sizes(a.sizes or (QUICK_SIZES if q else DEFAULT_SIZES)),
        algos=algos,
        repeats=a.repeats or (8 if q else 50),
        min_repeats=3 if q else 5,
        rounds=a.rounds or (2 if q else 5),
        budget_bytes=parse_bytes(a.budget) if a.budget else (64 * MiB if q else 2 * GiB),
        raw=not a.no_raw,
        mpi=not a.no_mpi,
        ddp=not a.no_ddp,
        ddp_steps=a.ddp_steps or (4 if q else 120),
        ddp_rounds=2 if q else 12,
        timeout_s=a.timeout or (100.0 if q else 900.0),
        op_timeout_s=60.0 if q else 120.0,
        quick=q,
        baseline_tree=a.baseline_tree,
        baseline_rounds=a.baseline_rounds,
        out=a.out,
    )
    if any(w < 2 for w in cfg.world_sizes):
        p.error("--world-sizes must all be >= 2")
    if (
        cfg.baseline_tree
        and not (Path(cfg.baseline_tree) / "entrenar_pg" / "__init__.py").is_file()
    ):
        p.error(f"--baseline-tree {cfg.baseline_tree}: no entrenar_pg package there")
    if cfg.baseline_rounds < 1:
        p.error("--baseline-rounds must be >= 1")
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: run, print the table, write outputs. Exit 1 on a failed run."""
    logging.basicConfig(level=logging.INFO, format="[bench] %(message)s", stream=sys.stderr)
    cfg = parse_args(argv)
    try:
        result = run_bench(cfg)
    except BenchError as e:
        print(f"bench failed: {e}", file=sys.stderr)
        return 1
    paths = write_outputs(result, Path(cfg.out))
    print("\n".join(report_lines(result)))
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {result['meta']['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    # Re-import under the package name so spawned workers unpickle
    # benchmarks.bench._worker, not __main__._worker.
    from benchmarks.bench import main as _main

    sys.exit(_main())

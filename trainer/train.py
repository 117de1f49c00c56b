"""Train a byte-level GPT on the Python standard library's source over torch.distributed.

Runbook
=======

Single node, two CPU processes, the entrenar backend (the default)::

    torchrun --standalone --nproc_per_node=2 trainer/train.py

Writes to ``runs/train/``: ``metrics.jsonl`` (one JSON object per step),
``loss.png`` (loss and throughput), ``sample.txt`` (text generated at the end)
and ``ckpt/latest.pt`` (checkpoint every ``--checkpoint-every`` steps and at the
end). Rank 0 shows a progress bar (loss, tokens/s, allreduce ms per step).

Same run on gloo, for comparison::

    torchrun --standalone --nproc_per_node=2 trainer/train.py --backend gloo

Resume after a stop (same command plus ``--resume``; any world size)::

    torchrun --standalone --nproc_per_node=4 trainer/train.py --resume

Survive a killed worker: torchrun restarts the whole group, which resumes from
the last checkpoint (``--fail-at-step S`` makes rank 1 exit at step S on the
first attempt, to try it)::

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 trainer/train.py \\
        --resume --checkpoint-every 20

World-size invariant, bitwise-reproducible training (fix the global number of
micro-batches; the final parameter hash in metrics.jsonl is the same at 1, 2, 4
workers)::

    torchrun --standalone --nproc_per_node=2 trainer/train.py --deterministic \\
        --micro-batches 4

Record a verifiable run ledger (one hash-chained line per step; entrenar
only), then check it and the final checkpoint against each other::

    torchrun --standalone --nproc_per_node=2 trainer/train.py --ledger runs/ledger.jsonl
    python -m entrenar_pg.ledger verify runs/ledger.jsonl --checkpoint runs/train/ckpt/latest.pt

Bigger model (flags ``--n-layer --n-head --n-embd --block-size --dropout``),
more data (``--corpus-bytes``), multi-node and cluster launchers: see
docs/trainer.md and launch/.

Without torchrun, ``python trainer/train.py`` runs a single process (world size 1).

How a step works
================

The global batch is ``M`` micro-batches of ``--batch-size`` sequences
(``M = --micro-batches``, or ``--grad-accum`` times the world size when that is
0). Rank ``r`` of ``N`` computes micro-batches ``r*M/N .. (r+1)*M/N - 1``; the
torch RNG is seeded from (seed, step, micro-batch index) before each, so
dropout does not depend on the rank.

- Default mode: DistributedDataParallel; the rank's micro-batches accumulate
  under ``no_sync()`` and the last backward lets DDP allreduce its buckets
  while backward still runs (overlap).
- ``--deterministic``: each micro-batch's gradient is computed separately,
  the rank's gradients are summed in the canonical pairwise tree
  (``tree_sum``), flattened into one buffer and summed across ranks with one
  ``all_reduce`` (entrenar with ``Options(deterministic=True)``, which the
  trainer passes as ``pg_options``, sums across ranks in the same tree), then
  scaled by ``1/M``. With ``M`` and ``N`` powers of two the sum is the same
  tree over all ``M`` micro-batches whatever ``N``, and the scaling is exact,
  so parameters are bit-identical across world sizes.
  Preconditions: deterministic kernels (set here with
  ``torch.use_deterministic_algorithms(True)``), one intra-op thread per
  process (set here), identical hardware/software on every worker, and a
  backend whose allreduce sums in the canonical order (entrenar; not gloo or
  nccl).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script (torchrun trainer/train.py): use this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import checkpoint as ckpt
from trainer.common import (
    BACKENDS,
    BitFlip,
    comm_stats,
    free_port,
    group_options,
    is_power_of_two,
    load_backend,
    optimizer_parameters,
    param_hash,
    run_ledger,
    tree_sum,
)
from trainer.data import (
    SampleStream,
    build_corpus,
    micro_batch_windows,
    num_windows,
    rank_micro_batches,
    val_windows,
    windows_to_batch,
)
from trainer.model import GPT, GPTConfig

# ----------------------------------------------------------------------------
# Configuration: one frozen dataclass; every field is a command-line flag.


def _opt(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # distributed
    backend: str = _opt("entrenar", "process-group backend")
    device: str = _opt("auto", "auto: cuda:LOCAL_RANK when CUDA is available, else cpu")
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


# ----------------------------------------------------------------------------
# Small pieces used by main().


class CosineWithWarmup:
    """LR multiplier: linear warm-up to 1, cosine decay to ``min_ratio`` at ``decay_steps``.

    A callable object (not a lambda) so LambdaLR's state_dict can save it.
    """

    def __init__(self, warmup: int, decay_steps: int, min_ratio: float) -> None:
        self.warmup = warmup
        self.decay_steps = decay_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if step >= self.decay_steps:
            return self.min_ratio
        progress = (step - self.warmup) / max(1, self.decay_steps - self.warmup)
        return self.min_ratio + 0.5 * (1.0 - self.min_ratio) * (1.0 + math.cos(math.pi * progress))


def micro_seed(seed: int, step: int, micro: int) -> int:
    """RNG seed of global micro-batch ``micro`` of step ``step`` (rank-independent)."""
    return (seed * 0x9E3779B1 + step * 0x85EBCA77 + micro * 0xC2B2AE3D) % (1 << 63)


def setup_env_for_single_process() -> None:
    """Let ``python trainer/train.py`` run without torchrun (world size 1)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))


def pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if cfg.backend == "nccl":
        raise ValueError("--backend nccl needs CUDA devices")
    return torch.device("cpu")


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


# ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)

    # -- processes, devices, determinism ------------------------------------
    setup_env_for_single_process()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    master = rank == 0

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

    device = pick_device(cfg, local_rank)
    load_backend(cfg.backend)
    # An ordinary init: entrenar namespaces its store keys by torchrun's restart
    # count itself, so a restarted attempt never reads a dead attempt's addresses.
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    # entrenar's deterministic reductions are an option of the group, passed here.
    pg_options = group_options(cfg.backend, cfg.deterministic, cfg.ledger)
    resuming = cfg.resume and ckpt.latest_checkpoint(cfg.ckpt_dir) is not None
    if cfg.ledger and master and not resuming:
        # A fresh run starts a fresh chain; a resumed one appends to its ledger.
        Path(cfg.ledger).unlink(missing_ok=True)
    dist.init_process_group(backend=cfg.backend, timeout=timeout, pg_options=pg_options)

    # -- global batch geometry ------------------------------------------------
    M = cfg.micro_batches or cfg.grad_accum * world
    my_micros = rank_micro_batches(rank, world, M)
    if cfg.deterministic and not (is_power_of_two(M) and is_power_of_two(world)):
        raise ValueError(
            f"--deterministic needs powers of two: micro-batches M={M}, world size N={world} "
            "(the tree over M micro-batches splits at rank boundaries, 1/M is exact)"
        )
    B, T = cfg.batch_size, cfg.block_size
    tokens_per_step = M * B * T

    # -- data -----------------------------------------------------------------
    corpus = build_corpus(cfg.corpus_bytes, cfg.val_every_file)
    stream = SampleStream(num_windows(corpus.train, T), cfg.seed)
    val_idx = val_windows(corpus.val, T, cfg.eval_batches * B)
    val_batches = [val_idx[i : i + B] for i in range(0, len(val_idx), B)]

    # -- model, optimizer, schedule --------------------------------------------
    torch.manual_seed(cfg.seed)
    mcfg = cfg.model_config()
    model = GPT(mcfg).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.99),
    )
    schedule = CosineWithWarmup(
        cfg.warmup_steps, cfg.lr_decay_steps or cfg.steps, cfg.min_lr / cfg.lr
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    # -- resume -------------------------------------------------------------------
    step, samples_consumed, resumed_from = 0, 0, None
    ckpt_dir = cfg.ckpt_dir
    if master and ckpt_dir is not None:
        # Rank 0 is the only checkpoint writer, so it alone cleans up after a
        # writer killed mid-save (see checkpoint.py: a live writer's file is kept).
        for stale in ckpt.remove_stale_temp_files(ckpt_dir):
            print(f"  removed {stale}, left by a checkpoint writer that died", flush=True)
    ckpt_file = ckpt.latest_checkpoint(ckpt_dir) if cfg.resume else None
    if ckpt_file is not None:
        state = ckpt.load(ckpt_file)
        if state["model_config"] != mcfg.to_dict():
            raise ValueError(
                f"{ckpt_file}: model config {state['model_config']} != {mcfg.to_dict()}"
            )
        if state["corpus_sha256"] != corpus.sha256:
            raise ValueError(f"{ckpt_file}: made on a different corpus (--corpus-bytes?)")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"], device)
        step, samples_consumed = int(state["step"]), int(state["samples_consumed"])
        resumed_from = {"step": step, "path": str(ckpt_file), "world_size": state["world_size"]}
    ledger = run_ledger() if cfg.ledger else None
    if ledger is not None:
        ledger.start_at(step)  # its next line is the next step, whatever it wrote before
    if cfg.flip_bit_at_step >= 0:
        optimizer.register_step_post_hook(BitFlip(cfg.flip_bit_at_step, step))

    # DDP checks shapes and broadcasts rank 0's parameters (a fresh run's init
    # or a checkpoint's, identical anyway). GPT has no buffers to keep in sync.
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)

    metrics = MetricsWriter(cfg.metrics_path, enabled=master, append=resumed_from is not None)
    if master:
        print(
            f"entrenar trainer: backend={cfg.backend} world_size={world} device={device} "
            f"threads/rank={threads} deterministic={cfg.deterministic} restart={restart_count}\n"
            f"  model: {n_params / 1e6:.2f}M params {mcfg}\n"
            f"  corpus: {corpus.n_files} stdlib files, {corpus.n_bytes / 1e6:.2f} MB from "
            f"{corpus.root} (train {corpus.train.numel()} B, val {corpus.val.numel()} B, "
            f"sha256 {corpus.sha256[:12]})\n"
            f"  batch: M={M} micro-batches x {B} seqs x {T} bytes = {tokens_per_step} tokens/step",
            flush=True,
        )
        if resumed_from:
            print(f"  resumed from {ckpt_file} at step {step}", flush=True)
        if cfg.ledger:
            print(f"  ledger: {cfg.ledger} (one line per step)", flush=True)
        metrics.write(
            {
                "event": "start",
                "step": step,
                "backend": cfg.backend,
                "world_size": world,
                "restart_count": restart_count,
                "resumed_from": resumed_from,
                "n_params": n_params,
                "corpus_sha256": corpus.sha256,
                "config": dataclasses.asdict(cfg),
            }
        )

    def evaluate() -> float:
        """Mean validation loss; each rank takes every world-th batch, sums are allreduced."""
        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for vb in val_batches[rank::world]:
                x, y = windows_to_batch(corpus.val, vb, T)
                _, loss = model(x.to(device), y.to(device))
                acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        model.train()
        dist.all_reduce(acc)
        return float(acc[0] / acc[1]) if acc[1] > 0 else float("nan")

    def save_checkpoint() -> None:
        if master and ckpt_dir is not None:
            ckpt.save_atomic(
                {
                    "format": ckpt.FORMAT_VERSION,
                    "step": step,
                    "samples_consumed": samples_consumed,
                    "world_size": world,
                    "micro_batches": M,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": ckpt.rng_state(device),
                    "model_config": mcfg.to_dict(),
                    "train_config": dataclasses.asdict(cfg),
                    "corpus_sha256": corpus.sha256,
                    "param_hash": param_hash(model),
                    # what `python -m entrenar_pg.ledger verify --checkpoint` hashes
                    "ledger_parameters": optimizer_parameters(optimizer),
                },
                ckpt.checkpoint_path(ckpt_dir),
            )

    bar = None
    if master and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, unit="step", dynamic_ncols=True, mininterval=0.5)

    # -- training loop ------------------------------------------------------------
    model.train()
    t_start = time.perf_counter()
    last_val = None
    stats_prev = comm_stats()
    while step < cfg.steps:
        if step == cfg.fail_at_step and rank == cfg.fail_rank and restart_count == 0:
            os._exit(1)  # fault injection: torchrun --max-restarts restarts the group
        t0 = time.perf_counter()
        ar_wall = None
        batches = []
        for j in my_micros:
            x, y = windows_to_batch(
                corpus.train, micro_batch_windows(stream, samples_consumed, j, B), T
            )
            batches.append((j, x.to(device, non_blocking=True), y.to(device, non_blocking=True)))

        if cfg.deterministic:
            # One gradient per micro-batch, summed in the canonical tree, then one
            # allreduce (deterministic tree across ranks), then an exact 1/M.
            grads, losses = [], []
            for j, x, y in batches:
                torch.manual_seed(micro_seed(cfg.seed, step, j))
                with ddp.no_sync():
                    _, loss = ddp(x, y)
                    loss.backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
                losses.append(loss.detach().reshape(1))
                optimizer.zero_grad(set_to_none=True)
            buf = torch.cat([tree_sum(grads), tree_sum(losses)])
            t_ar = time.perf_counter()
            dist.all_reduce(buf)
            ar_wall = time.perf_counter() - t_ar
            buf.mul_(1.0 / M)
            offset = 0
            for p in params:
                p.grad = buf[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            step_loss = float(buf[-1])
        else:
            # DDP: accumulate under no_sync, the last backward overlaps the allreduce.
            loss_sum = torch.zeros((), device=device)
            for i, (j, x, y) in enumerate(batches):
                torch.manual_seed(micro_seed(cfg.seed, step, j))
                sync = i == len(batches) - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    _, loss = ddp(x, y)
                    (loss / len(batches)).backward()
                loss_sum += loss.detach()
            dist.all_reduce(loss_sum)
            step_loss = float(loss_sum) / M

        grad_norm = None
        if cfg.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        samples_consumed += M * B
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0

        val_loss = None
        if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
            val_loss = last_val = evaluate()

        stats = comm_stats()
        ar_ms = None
        if "allreduce_seconds" in stats:
            ar_ms = 1e3 * (stats["allreduce_seconds"] - stats_prev.get("allreduce_seconds", 0.0))
        elif ar_wall is not None:
            ar_ms = 1e3 * ar_wall
        stats_prev = stats
        tok_s = tokens_per_step / dt
        metrics.write(
            {
                "step": step,
                "loss": step_loss,
                "val_loss": val_loss,
                "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": grad_norm,
                "step_s": dt,
                "tokens_per_s": tok_s,
                "allreduce_ms": ar_ms,
                "comm": stats,
                "world_size": world,
                "backend": cfg.backend,
                "restart_count": restart_count,
            }
        )
        if bar is not None:
            bar.update(1)
            bar.set_postfix(
                loss=f"{step_loss:.3f}",
                val=f"{last_val:.3f}" if last_val is not None else "-",
                tok_s=f"{tok_s:,.0f}",
                ar_ms=f"{ar_ms:.1f}" if ar_ms is not None else "-",
                refresh=False,
            )
        if ckpt_dir is not None and (
            step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
        ):
            save_checkpoint()

    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_start

    # -- end: every replica must hold the same weights ------------------------------
    final_hash = param_hash(model)
    ref = torch.tensor(
        [int(final_hash[i : i + 14], 16) for i in range(0, 56, 14)], dtype=torch.int64
    ).to(device)
    mine = ref.clone()
    dist.broadcast(ref, src=0)
    mismatch = torch.tensor([0.0 if torch.equal(ref, mine) else 1.0], device=device)
    dist.all_reduce(mismatch)
    replicas_agree = float(mismatch) == 0.0
    dist.destroy_process_group()

    if master:
        recs = read_metrics(cfg.metrics_path)
        end = {
            "event": "end",
            "step": step,
            "steps_run_this_attempt": step - (resumed_from["step"] if resumed_from else 0),
            "final_loss": recs[-1]["loss"] if recs else None,
            "final_val_loss": last_val,
            "param_hash": final_hash,
            "replicas_agree": replicas_agree,
            "wall_s": wall,
            "world_size": world,
            "backend": cfg.backend,
            "restart_count": restart_count,
            "resumed_from": resumed_from,
        }
        metrics.write(end)
        metrics.close()
        print(
            f"done: {step} steps, final loss {end['final_loss']:.4f}, val loss "
            f"{last_val:.4f}, {wall:.1f}s this attempt, param sha256 {final_hash[:16]}, "
            f"replicas agree: {replicas_agree}",
            flush=True,
        )
        out = Path(cfg.out_dir)
        if cfg.plot and recs:
            png = out / "loss.png"
            plot_metrics(cfg.metrics_path, png)
            print(f"plot: {png}", flush=True)
        if cfg.sample_bytes > 0:
            g = torch.Generator(device=device).manual_seed(cfg.seed)
            prompt = torch.tensor([list(b"def ")], dtype=torch.long, device=device)
            out_ids = model.generate(prompt, cfg.sample_bytes, generator=g)[0].tolist()
            text = bytes(out_ids).decode("utf-8", errors="replace")
            out.mkdir(parents=True, exist_ok=True)
            (out / "sample.txt").write_text(text, encoding="utf-8")
            print("sample:\n" + text, flush=True)
        if cfg.ledger:
            check = f"python -m entrenar_pg.ledger verify {cfg.ledger}"
            if ckpt_dir is not None:
                check += f" --checkpoint {ckpt.checkpoint_path(ckpt_dir)}"
            print(f"ledger: {cfg.ledger} (check it: {check})", flush=True)
        if not replicas_agree:
            print("ERROR: replicas hold different parameters", file=sys.stderr, flush=True)
            return 1
    return 0 if replicas_agree else 1


if __name__ == "__main__":
    sys.exit(main())

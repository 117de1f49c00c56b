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

import dataclasses
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
from trainer.common import BitFlip, is_power_of_two, run_ledger
from trainer.config import TrainConfig, parse_args
from trainer.data import (
    Corpus,
    SampleStream,
    build_corpus,
    num_windows,
    rank_micro_batches,
    val_windows,
    windows_to_batch,
)
from trainer.distributed import Process, replicas_agree, start_process, start_process_group
from trainer.metrics import MetricsWriter, StepReporter, plot_metrics, read_metrics
from trainer.model import GPT
from trainer.optim import build_optimizer
from trainer.step import (
    GlobalBatch,
    MicroBatch,
    accumulated_gradients,
    deterministic_gradients,
    load_micro_batches,
)

# ----------------------------------------------------------------------------
# Set-up and build: one function each, called in this order by main().


def global_batch(cfg: TrainConfig, proc: Process) -> GlobalBatch:
    """M micro-batches of B x T; this rank's share (see the module docstring)."""
    M = cfg.micro_batches or cfg.grad_accum * proc.world
    mine = rank_micro_batches(proc.rank, proc.world, M)
    if cfg.deterministic and not (is_power_of_two(M) and is_power_of_two(proc.world)):
        raise ValueError(
            f"--deterministic needs powers of two: micro-batches M={M}, world size N={proc.world} "
            "(the tree over M micro-batches splits at rank boundaries, 1/M is exact)"
        )
    return GlobalBatch(M, cfg.batch_size, cfg.block_size, mine)


@dataclass(frozen=True)
class Data:
    """The corpus, the training stream over it and the fixed validation batches."""

    corpus: Corpus
    stream: SampleStream
    val_batches: list[list[int]]


def load_data(cfg: TrainConfig) -> Data:
    corpus = build_corpus(cfg.corpus_bytes, cfg.val_every_file)
    stream = SampleStream(num_windows(corpus.train, cfg.block_size), cfg.seed)
    val_idx = val_windows(corpus.val, cfg.block_size, cfg.eval_batches * cfg.batch_size)
    B = cfg.batch_size
    return Data(corpus, stream, [val_idx[i : i + B] for i in range(0, len(val_idx), B)])


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run picks up: the data position and the checkpoint it came from."""

    step: int
    samples_consumed: int
    path: Path
    world_size: int

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "path": str(self.path), "world_size": self.world_size}


def resume(
    cfg: TrainConfig,
    proc: Process,
    corpus: Corpus,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> Resumed | None:
    """With ``--resume`` and a checkpoint: load it into everything; else None (a fresh run)."""
    if proc.master and cfg.ckpt_dir is not None:
        # Rank 0 is the only checkpoint writer, so it alone cleans up after a
        # writer killed mid-save (see checkpoint.py: a live writer's file is kept).
        for stale in ckpt.remove_stale_temp_files(cfg.ckpt_dir):
            print(f"  removed {stale}, left by a checkpoint writer that died", flush=True)
    path = ckpt.latest_checkpoint(cfg.ckpt_dir) if cfg.resume else None
    if path is None:
        return None
    state = ckpt.restore(
        path,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        device=proc.device,
        model_config=model.config.to_dict(),
        corpus_sha256=corpus.sha256,
    )
    return Resumed(int(state["step"]), int(state["samples_consumed"]), path, state["world_size"])


def announce(
    cfg: TrainConfig,
    proc: Process,
    data: Data,
    batch: GlobalBatch,
    model: GPT,
    resumed: Resumed | None,
    metrics: MetricsWriter,
) -> None:
    """Rank 0: what runs (printed) and the metrics file's ``start`` record."""
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    corpus = data.corpus
    print(
        f"entrenar trainer: backend={cfg.backend} world_size={proc.world} device={proc.device} "
        f"threads/rank={proc.threads} deterministic={cfg.deterministic} "
        f"restart={proc.restart_count}\n"
        f"  model: {n_params / 1e6:.2f}M params {model.config}\n"
        f"  corpus: {corpus.n_files} stdlib files, {corpus.n_bytes / 1e6:.2f} MB from "
        f"{corpus.root} (train {corpus.train.numel()} B, val {corpus.val.numel()} B, "
        f"sha256 {corpus.sha256[:12]})\n"
        f"  batch: M={batch.micro_batches} micro-batches x {batch.batch_size} seqs x "
        f"{batch.block_size} bytes = {batch.tokens} tokens/step",
        flush=True,
    )
    if resumed:
        print(f"  resumed from {resumed.path} at step {resumed.step}", flush=True)
    if cfg.ledger:
        print(f"  ledger: {cfg.ledger} (one line per step)", flush=True)
    metrics.write(
        {
            "event": "start",
            "step": resumed.step if resumed else 0,
            "backend": cfg.backend,
            "world_size": proc.world,
            "restart_count": proc.restart_count,
            "resumed_from": resumed.record() if resumed else None,
            "n_params": n_params,
            "corpus_sha256": corpus.sha256,
            "config": dataclasses.asdict(cfg),
        }
    )


# ----------------------------------------------------------------------------
# Pieces of the training loop.


def due(step: int, every: int, last: int) -> bool:
    """Every ``every`` steps (0: never) and at the last step."""
    return step == last or bool(every and step % every == 0)


def evaluate(model: GPT, data: Data, proc: Process) -> float:
    """Mean validation loss; each rank takes every world-th batch, sums are allreduced."""
    model.eval()
    acc = torch.zeros(2, device=proc.device)
    T = model.config.block_size
    with torch.no_grad():
        for vb in data.val_batches[proc.rank :: proc.world]:
            x, y = windows_to_batch(data.corpus.val, vb, T)
            _, loss = model(x.to(proc.device), y.to(proc.device))
            acc += torch.stack([loss.detach().float(), torch.ones((), device=proc.device)])
    model.train()
    dist.all_reduce(acc)
    return float(acc[0] / acc[1]) if acc[1] > 0 else float("nan")


def compute_gradients(
    cfg: TrainConfig,
    ddp: DDP,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    micro_batches: list[MicroBatch],
    step: int,
    total_micro_batches: int,
) -> tuple[float, float | None]:
    """The step's mean gradient into ``p.grad``; its loss, and the allreduce's wall time
    when the trainer issues that allreduce itself (deterministic mode)."""
    if cfg.deterministic:
        return deterministic_gradients(
            ddp,
            optimizer,
            params,
            micro_batches,
            seed=cfg.seed,
            step=step,
            total_micro_batches=total_micro_batches,
        )
    loss = accumulated_gradients(
        ddp, micro_batches, seed=cfg.seed, step=step, total_micro_batches=total_micro_batches
    )
    return loss, None


def save_checkpoint(
    cfg: TrainConfig,
    proc: Process,
    batch: GlobalBatch,
    data: Data,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    samples_consumed: int,
) -> None:
    """Write ``<checkpoint_dir>/latest.pt`` atomically (rank 0 is the only writer)."""
    assert cfg.ckpt_dir is not None
    state = ckpt.training_state(
        step=step,
        samples_consumed=samples_consumed,
        world_size=proc.world,
        micro_batches=batch.micro_batches,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        device=proc.device,
        model_config=model.config.to_dict(),
        train_config=dataclasses.asdict(cfg),
        corpus_sha256=data.corpus.sha256,
    )
    ckpt.save_atomic(state, ckpt.checkpoint_path(cfg.ckpt_dir))


# ----------------------------------------------------------------------------
# Finish: rank 0 reports.


def report_end(
    cfg: TrainConfig,
    proc: Process,
    metrics: MetricsWriter,
    model: GPT,
    *,
    step: int,
    last_val: float | None,
    final_hash: str,
    agree: bool,
    wall: float,
    resumed: Resumed | None,
) -> None:
    """The ``end`` record, the summary line, the plot, the generated sample, the ledger hint."""
    recs = read_metrics(cfg.metrics_path)
    end = {
        "event": "end",
        "step": step,
        "steps_run_this_attempt": step - (resumed.step if resumed else 0),
        "final_loss": recs[-1]["loss"] if recs else None,
        "final_val_loss": last_val,
        "param_hash": final_hash,
        "replicas_agree": agree,
        "wall_s": wall,
        "world_size": proc.world,
        "backend": cfg.backend,
        "restart_count": proc.restart_count,
        "resumed_from": resumed.record() if resumed else None,
    }
    metrics.write(end)
    metrics.close()
    print(
        f"done: {step} steps, final loss {end['final_loss']:.4f}, val loss "
        f"{last_val:.4f}, {wall:.1f}s this attempt, param sha256 {final_hash[:16]}, "
        f"replicas agree: {agree}",
        flush=True,
    )
    out = Path(cfg.out_dir)
    if cfg.plot and recs:
        png = out / "loss.png"
        plot_metrics(cfg.metrics_path, png)
        print(f"plot: {png}", flush=True)
    if cfg.sample_bytes > 0:
        text = generate_sample(model, cfg.sample_bytes, cfg.seed, proc.device)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sample.txt").write_text(text, encoding="utf-8")
        print("sample:\n" + text, flush=True)
    if cfg.ledger:
        check = f"python -m entrenar_pg.ledger verify {cfg.ledger}"
        if cfg.ckpt_dir is not None:
            check += f" --checkpoint {ckpt.checkpoint_path(cfg.ckpt_dir)}"
        print(f"ledger: {cfg.ledger} (check it: {check})", flush=True)
    if not agree:
        print("ERROR: replicas hold different parameters", file=sys.stderr, flush=True)


def generate_sample(model: GPT, n_bytes: int, seed: int, device: torch.device) -> str:
    """``n_bytes`` of text the model writes after ``def ``, sampled from a seeded generator."""
    g = torch.Generator(device=device).manual_seed(seed)
    prompt = torch.tensor([list(b"def ")], dtype=torch.long, device=device)
    out_ids = model.generate(prompt, n_bytes, generator=g)[0].tolist()
    return bytes(out_ids).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    # -- set-up: configuration, this process's place in the job, the group ------
    cfg = parse_args(argv)
    proc = start_process(cfg)
    start_process_group(cfg, proc)
    batch = global_batch(cfg, proc)

    # -- build: data, model, optimizer, resume, DDP, reporting ------------------
    data = load_data(cfg)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config()).to(proc.device)
    optimizer, scheduler = build_optimizer(cfg, model)
    resumed = resume(cfg, proc, data.corpus, model, optimizer, scheduler)
    step = resumed.step if resumed else 0
    samples_consumed = resumed.samples_consumed if resumed else 0
    ledger = run_ledger() if cfg.ledger else None
    if ledger is not None:
        ledger.start_at(step)  # its next line is the next step, whatever it wrote before
    if cfg.flip_bit_at_step >= 0:
        optimizer.register_step_post_hook(BitFlip(cfg.flip_bit_at_step, step))
    # DDP checks shapes and broadcasts rank 0's parameters (a fresh run's init
    # or a checkpoint's, identical anyway). GPT has no buffers to keep in sync.
    ddp = DDP(model, device_ids=[proc.device] if proc.device.type == "cuda" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    metrics = MetricsWriter(cfg.metrics_path, enabled=proc.master, append=resumed is not None)
    if proc.master:
        announce(cfg, proc, data, batch, model, resumed, metrics)
    reporter = StepReporter(
        cfg,
        metrics,
        master=proc.master,
        world=proc.world,
        restart_count=proc.restart_count,
        first_step=step,
    )

    # -- train ------------------------------------------------------------------
    model.train()
    t_start = time.perf_counter()
    while step < cfg.steps:
        if step == cfg.fail_at_step and proc.rank == cfg.fail_rank and proc.restart_count == 0:
            os._exit(1)  # fault injection: torchrun --max-restarts restarts the group
        t0 = time.perf_counter()
        micro_batches = load_micro_batches(
            data.corpus, data.stream, samples_consumed, batch, proc.device
        )
        loss, allreduce_wall = compute_gradients(
            cfg, ddp, optimizer, params, micro_batches, step, batch.micro_batches
        )
        grad_norm = None
        if cfg.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        samples_consumed += batch.samples
        if proc.device.type == "cuda":
            torch.cuda.synchronize(proc.device)
        step_s = time.perf_counter() - t0

        val_loss = evaluate(model, data, proc) if due(step, cfg.eval_every, cfg.steps) else None
        reporter.step(
            step=step,
            loss=loss,
            val_loss=val_loss,
            lr=optimizer.param_groups[0]["lr"],
            grad_norm=grad_norm,
            step_s=step_s,
            tokens=batch.tokens,
            allreduce_wall=allreduce_wall,
        )
        if proc.master and cfg.ckpt_dir is not None and due(step, cfg.checkpoint_every, cfg.steps):
            save_checkpoint(
                cfg, proc, batch, data, model, optimizer, scheduler, step, samples_consumed
            )
    reporter.close_bar()
    wall = time.perf_counter() - t_start

    # -- finish: every replica must hold the same weights; rank 0 reports -------
    final_hash, agree = replicas_agree(model, proc.device)
    dist.destroy_process_group()
    if proc.master:
        report_end(
            cfg,
            proc,
            metrics,
            model,
            step=step,
            last_val=reporter.last_val,
            final_hash=final_hash,
            agree=agree,
            wall=wall,
            resumed=resumed,
        )
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())

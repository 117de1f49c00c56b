"""One rank of a world-size run (a spawned process): its groups, the sweep, the DDP step.

The entry point, :func:`rank_main`, lives here and not in ``benchmarks.bench``
so that the spawned processes unpickle it by this module's name even when the
CLI runs as ``__main__``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import selectors
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import floor
from benchmarks.config import (
    DDP_VARIANTS,
    DEEPSPEED,
    FLOAT32_BYTES,
    RAW,
    SWEEP_VARIANTS,
    BenchConfig,
    Variant,
    with_transports,
)
from benchmarks.ddp_model import make_model
from benchmarks.sizes import ddp_per_block, plan_for, rotated
from benchmarks.turns import Turns

ENV_TRANSPORT = "ENTRENAR_TRANSPORT"  # issue 17's transport switch (tcp | shm | auto)


def _new_group(variant: Variant, world: int) -> dist.ProcessGroup:
    """Create the process group for ``variant`` (collective: every rank, same order)."""
    ranks = list(range(world))
    if variant.backend == "gloo":
        return dist.new_group(ranks, backend="gloo")
    if variant.backend == floor.BACKEND:
        floor.register()
        return dist.new_group(ranks, backend=floor.BACKEND)
    from entrenar_pg import Options

    environ = dict(os.environ)
    if variant.transport:
        # The variable a user sets, read where a user's group reads it (Options.from_env).
        environ[ENV_TRANSPORT] = variant.transport
    if variant.transport not in ("", "tcp") and "transport" not in {
        f.name for f in dataclasses.fields(Options)
    }:
        # An entrenar_pg from before the transports (a --baseline-tree) ignores
        # the variable and is TCP only: its "[shm]" row would silently measure TCP.
        raise RuntimeError(f"{variant.name}: this entrenar_pg has no Options.transport")
    opts = Options.from_env(environ, **variant.options)
    return dist.new_group(ranks, backend="entrenar", pg_options=opts)


class _GroupAllreduce:
    """A contestant that is a torch process group: ``dist.all_reduce`` on it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)


class _GroupMethod:
    """The same group called through its own method (``Variant.call == "method"``):
    what ``dist.all_reduce`` runs for it, without torch's Python wrapper around it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.opts = dist.AllreduceOptions()
        self.opts.asyncOp = False  # as dist.all_reduce's blocking form sets it

    def all_reduce(self, t: torch.Tensor) -> None:
        self.group.allreduce([t], self.opts).wait()


class Contestant(Protocol):
    """What the sweep times: one blocking in-place float32 SUM allreduce over the world."""

    def all_reduce(self, t: torch.Tensor) -> None: ...


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


def _verify(t: torch.Tensor, who: Contestant, rank: int, world: int, name: str) -> None:
    """One checked allreduce (also a warm-up): every element must be sum(1..world)."""
    t.fill_(rank + 1)
    who.all_reduce(t)
    want = world * (world + 1) / 2
    if not bool(torch.all(t == want)):
        bad = t[t != want]
        raise AssertionError(
            f"{name}: allreduce of {t.numel()} floats wrong on rank {rank}: "
            f"{bad.numel()} elements != {want} (e.g. {bad[:4].tolist()})"
        )
    t.zero_()


def _time_allreduce(t: torch.Tensor, who: Contestant, warmup: int, n: int) -> list[float]:
    """``warmup`` untimed then ``n`` timed blocking allreduces; per-call seconds."""
    for _ in range(warmup):
        who.all_reduce(t)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        who.all_reduce(t)
        out.append(time.perf_counter() - t0)
    return out


class Blocks:
    """Where each timed block starts and ends: the job's barrier and, when two
    jobs share the machine (``--baseline-tree``), the turn (``turns.py``).

    ``turns`` is the same object on every rank of a job; only rank 0 waits
    for the turn and passes it on, the barriers keep the others in step.
    """

    def __init__(self, rank: int, ctrl: dist.ProcessGroup, turns: Turns | None) -> None:
        self.ctrl = ctrl
        self.turns = turns
        self.rank = rank
        # (start, end) of each block on this rank, time.monotonic (one clock
        # for every process of the machine: the parent can check the turns).
        self.spans: list[tuple[float, float]] = []
        self._start = 0.0

    def enter(self) -> None:
        if self.turns is not None and self.rank == 0:
            self.turns.wait()
        dist.barrier(group=self.ctrl)
        self._start = time.monotonic()

    def leave(self) -> None:
        if self.turns is not None:
            dist.barrier(group=self.ctrl)  # every rank is done before the other job goes
        self.spans.append((self._start, time.monotonic()))
        if self.turns is not None and self.rank == 0:
            self.turns.done()

    def finish(self) -> None:
        """No more blocks from this job: the other job never waits for it again."""
        if self.turns is not None and self.rank == 0:
            self.turns.finish()


def _sweep(
    rank: int,
    world: int,
    cfg: BenchConfig,
    blocks: Blocks,
    groups: dict[str, Contestant],
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
                blocks.enter()
                if name == RAW:
                    assert raw is not None
                    if raw.sock is not None:
                        if r == 0:
                            raw.exchange(send, recv)
                        samples = [raw.exchange(send, recv) for _ in range(plan.per_block)]
                        raw_times.setdefault(str(size), []).extend(samples)
                else:
                    who = groups[name]
                    warm = plan.warmup
                    if r == 0:
                        _verify(t, who, rank, world, name)
                        warm = max(warm, 1)
                    samples = _time_allreduce(t, who, warm, plan.per_block)
                    times.setdefault(f"{name}|{size}", []).extend(samples)
                blocks.leave()
        del t
        if use_raw:
            del send, recv
    return times, raw_times


def _ddp(
    rank: int,
    world: int,
    cfg: BenchConfig,
    blocks: Blocks,
    variants: Sequence[Variant],
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Interleaved DDP training steps per variant; returns step-time samples and model info."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    spec = make_model()
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
    per_block = ddp_per_block(cfg)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for name in rotated([v.name for v in variants], r):
            blocks.enter()
            step(name)  # warm-up (the first one also builds DDP's buckets)
            for _ in range(per_block):
                t0 = time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - t0)
            blocks.leave()
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


def _deepspeed_contestant(
    rank: int, world: int, ctrl: dist.ProcessGroup
) -> tuple[Contestant | None, str]:
    """DeepSpeed's SHM allreduce if it starts on every rank, else ``(None, why)``.

    Every rank learns every rank's outcome (one all_gather on ``ctrl``), so all
    of them run the column or none does, and a failure is reported, not hidden.
    """
    from benchmarks.deepspeed_peer import DeepSpeedShm

    ds: DeepSpeedShm | None = None
    why = ""
    try:
        ds = DeepSpeedShm(rank)
    except Exception as e:  # noqa: BLE001 - any failure means "no DeepSpeed column"
        why = f"rank {rank}: {e!r}"
    outcomes: list[str | None] = [None] * world
    dist.all_gather_object(outcomes, why, group=ctrl)
    failed = [w for w in outcomes if w]
    if failed:
        return None, failed[0]
    return ds, ""


def torchrun_env(rank: int, world: int, port: int) -> None:
    """Set what ``torchrun --nproc_per_node=world`` gives each rank, before any group exists.

    Every variant then sees the environment of a same-host torchrun job
    (entrenar's transport selection may read it; DeepSpeed needs it).
    """
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )


def rank_main(
    rank: int,
    world: int,
    port: int,
    cfg_json: dict[str, Any],
    out_path: str,
    turns: Turns | None = None,
) -> None:
    """One rank of a world-size run: sweep, raw reference, DDP; writes its samples as JSON.

    ``turns``: this job takes turns with another one, block by block (``turns.py``)."""
    cfg = BenchConfig.from_json(cfg_json)
    if cfg.pin:
        # Before any thread starts (they inherit the mask): the scheduler
        # cannot put two ranks on one core, nor move them (``--pin``).
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    torchrun_env(rank, world, port)
    variants = with_transports([SWEEP_VARIANTS[a] for a in cfg.algos], cfg.transports)
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
        groups: dict[str, Contestant] = {
            v.name: (_GroupMethod if v.call == "method" else _GroupAllreduce)(_new_group(v, world))
            for v in variants
            if v.backend != "deepspeed"
        }
        unavailable: dict[str, str] = {}
        if any(v.backend == "deepspeed" for v in variants):
            ds, why = _deepspeed_contestant(rank, world, ctrl)
            if ds is not None:
                groups[DEEPSPEED] = ds
            else:
                unavailable[DEEPSPEED] = why
        if cfg.raw and world >= 2:
            raw = _RawPair(rank, ctrl, cfg.op_timeout_s)
        blocks = Blocks(rank, ctrl, turns)
        times, raw_times = _sweep(rank, world, cfg, blocks, groups, raw)
        ddp_times: dict[str, list[float]] = {}
        ddp_info: dict[str, Any] = {}
        if cfg.ddp:
            ddp_variants = [v for v in DDP_VARIANTS if v.backend != "entrenar" or cfg.entrenar]
            if cfg.ddp_variants:
                ddp_variants = [v for v in ddp_variants if v.name in cfg.ddp_variants]
            ddp_variants = with_transports(ddp_variants, cfg.transports)
            ddp_times, ddp_info = _ddp(rank, world, cfg, blocks, ddp_variants)
        blocks.finish()
        dist.barrier(group=ctrl)
        result = {
            "rank": rank,
            "allreduce": times,
            "raw": raw_times,
            "ddp": ddp_times,
            "ddp_info": ddp_info,
            "entrenar_pg_file": entrenar_file,
            "block_spans": blocks.spans,
            "affinity": sorted(os.sched_getaffinity(0)),
            "unavailable": unavailable,
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

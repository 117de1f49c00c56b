"""entrenar on CUDA tensors: collectives, stream ordering, buffer lifetimes, DDP vs gloo.

Skipped without CUDA. Ranks share one GPU (``cuda:0``) unless a test says
otherwise; thread-level tests run N ranks as threads of this process (conftest
``run_ranks``), DDP tests start real processes with torchrun. How to run them
and what they need: tests/gpu/README.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, make_groups, run_ranks, torchrun

from entrenar_pg import EntrenarProcessGroup, Options

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU)"),
]

WORKER = Path(__file__).with_name("ddp_worker.py")
DEV = torch.device("cuda", 0)


def _sleep_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles for about ``ms`` milliseconds (measured once)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe / max(start.elapsed_time(end), 1e-3) * ms)


def _reduce_expected(world: int, make: Any) -> torch.Tensor:
    return sum((make(r) for r in range(1, world)), make(0))


# ---------------------------------------------------------------- collectives


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_collectives_on_cuda_tensors(world: int, dtype: torch.dtype) -> None:
    n = 1000

    def data(rank: int, shift: int = 0) -> torch.Tensor:
        return (torch.arange(n, dtype=torch.int64) % 7 + rank + shift).to(dtype)

    def fn(rank: int, g: EntrenarProcessGroup) -> None:
        # allreduce: contiguous, and a non-contiguous view (packed and scattered back).
        t = data(rank).to(DEV)
        g.allreduce([t]).wait()
        assert torch.equal(t.cpu(), _reduce_expected(world, data))
        nc = data(rank).to(DEV).view(n // 2, 2).t()
        assert not nc.is_contiguous()
        g.allreduce([nc]).wait()
        assert torch.equal(nc.cpu(), _reduce_expected(world, data).view(n // 2, 2).t())
        # coalesced: several tensors in one call
        ts = [data(rank, k).to(DEV)[: 100 * (k + 1)] for k in range(3)]
        g.allreduce_coalesced(ts).wait()
        for k, tk in enumerate(ts):
            exp = _reduce_expected(world, lambda r, k=k: data(r, k))[: 100 * (k + 1)]
            assert torch.equal(tk.cpu(), exp)
        # broadcast from the last rank
        b = data(rank).to(DEV)
        opts = dist.BroadcastOptions()
        opts.rootRank = world - 1
        g.broadcast([b], opts).wait()
        assert torch.equal(b.cpu(), data(world - 1))
        # allgather into a list and into one tensor
        outs = [torch.zeros(n, dtype=dtype, device=DEV) for _ in range(world)]
        g.allgather([outs], [data(rank).to(DEV)]).wait()
        for r, o in enumerate(outs):
            assert torch.equal(o.cpu(), data(r))
        if "all_gather_single" in vars(EntrenarProcessGroup):
            flat = torch.zeros(world * n, dtype=dtype, device=DEV)
            g.all_gather_single(flat, data(rank).to(DEV)).wait()
            assert torch.equal(flat.cpu(), torch.cat([data(r) for r in range(world)]))

    run_ranks(world, fn, timeout_s=150)


def _implemented(name: str) -> bool:
    ours = [c for c in EntrenarProcessGroup.__mro__ if c.__module__.startswith("entrenar_pg")]
    return any(name in vars(c) for c in ours)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_every_other_collective_same_on_cuda_as_on_cpu(world: int) -> None:
    """Each remaining collective, run once on CPU tensors and once on CUDA tensors: same result."""
    n = 6 * world  # divisible by the world size

    def val(rank: int, k: int, dev: torch.device) -> torch.Tensor:
        return (torch.arange(n, dtype=torch.float32) * (rank + 1) + 10 * k).to(dev)

    def cases(rank: int, g: EntrenarProcessGroup, dev: torch.device) -> dict[str, Any]:
        """name -> () -> output tensors (after wait)."""

        def opts(o: Any, root: int = 0) -> Any:
            o.rootRank = root
            return o

        def reduce() -> list[torch.Tensor]:
            t = val(rank, 0, dev)
            g.reduce([t], opts(dist.ReduceOptions(), world - 1)).wait()
            return [t]

        def gather() -> list[torch.Tensor]:
            outs = [[torch.zeros(n, device=dev) for _ in range(world)]] if rank == 0 else []
            g.gather(outs, [val(rank, 0, dev)], opts(dist.GatherOptions())).wait()
            return outs[0] if outs else []

        def scatter() -> list[torch.Tensor]:
            out = torch.zeros(n, device=dev)
            ins = [[val(r, 1, dev) for r in range(world)]] if rank == 0 else []
            g.scatter([out], ins, opts(dist.ScatterOptions())).wait()
            return [out]

        def alltoall_base() -> list[torch.Tensor]:
            out = torch.zeros(n, device=dev)
            g.alltoall_base(out, val(rank, 2, dev), [], []).wait()
            return [out]

        def alltoall() -> list[torch.Tensor]:
            outs = [torch.zeros(3, device=dev) for _ in range(world)]
            ins = [val(rank, r, dev)[:3] for r in range(world)]
            g.alltoall(outs, ins).wait()
            return outs

        def reduce_scatter() -> list[torch.Tensor]:
            out = torch.zeros(n, device=dev)
            g.reduce_scatter([out], [[val(rank, r, dev) for r in range(world)]]).wait()
            return [out]

        def reduce_scatter_single() -> list[torch.Tensor]:
            out = torch.zeros(n // world, device=dev)
            g.reduce_scatter_single(out, val(rank, 3, dev)).wait()
            return [out]

        def allgather_into_tensor_coalesced() -> list[torch.Tensor]:
            outs = [torch.zeros(n * world, device=dev), torch.zeros(3 * world, device=dev)]
            ins = [val(rank, 4, dev), val(rank, 5, dev)[:3]]
            g.allgather_into_tensor_coalesced(outs, ins).wait()
            return outs

        def send_recv() -> list[torch.Tensor]:
            t = val(rank, 6, dev)
            if rank == 0:
                g.send([t], 1, 0).wait()
            elif rank == 1:
                t.zero_()
                g.recv([t], 0, 0).wait()
            return [t]

        table = {
            "reduce": reduce,
            "gather": gather,
            "scatter": scatter,
            "alltoall_base": alltoall_base,
            "alltoall": alltoall,
            "reduce_scatter": reduce_scatter,
            "reduce_scatter_single": reduce_scatter_single,
            "allgather_into_tensor_coalesced": allgather_into_tensor_coalesced,
            "send": send_recv,
        }
        return {k: v for k, v in table.items() if _implemented(k)}

    def fn(rank: int, g: EntrenarProcessGroup) -> list[str]:
        checked = []
        for name in sorted(cases(rank, g, torch.device("cpu"))):
            on_cpu = cases(rank, g, torch.device("cpu"))[name]()
            on_gpu = cases(rank, g, DEV)[name]()
            assert len(on_cpu) == len(on_gpu), name
            for a, b in zip(on_cpu, on_gpu, strict=True):
                assert b.device.type == DEV.type, name
                assert torch.equal(a, b.cpu()), f"rank {rank}: {name} differs on CUDA"
            checked.append(name)
        return checked

    checked = run_ranks(world, fn, timeout_s=200)
    assert checked[0] and checked[0] == checked[-1], checked


@pytest.mark.timeout(60)
def test_mixed_cpu_and_cuda_is_a_value_error() -> None:
    def fn(rank: int, g: EntrenarProcessGroup) -> None:
        with pytest.raises(ValueError, match="different devices"):
            g.allreduce([torch.zeros(4), torch.zeros(4, device=DEV)])
        with pytest.raises(ValueError, match="different devices"):
            g.allgather([[torch.zeros(4, device=DEV)] * 2], [torch.zeros(4)])
        t = torch.ones(4, device=DEV)
        g.allreduce([t]).wait()
        assert torch.equal(t.cpu(), torch.full((4,), 2.0))

    run_ranks(2, fn)


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu_and_alternating_devices() -> None:
    """Tensors on cuda:1 while the thread's current device is 0; then alternate devices."""

    def fn(rank: int, g: EntrenarProcessGroup) -> None:
        assert torch.cuda.current_device() == 0
        for step in range(6):
            dev = torch.device("cuda", step % 2)
            t = torch.full((1 << 20,), float(rank + step), device=dev)
            g.allreduce([t]).wait()
            assert torch.equal(t.cpu(), torch.full((1 << 20,), float(1 + 2 * step)))
        assert set(g._runtime.cuda_streams) == {0, 1}

    run_ranks(2, fn)


# ---------------------------------------------------------- stream semantics


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_stream_ordering_never_stale(world: int) -> None:
    """Producer kernel on a high-priority side stream right before the call, consumer on another.

    The producer stream is the caller's current stream when the collective is
    issued, and a slow kernel runs on it just before the write: if the comm
    thread copied without waiting on the caller's event it would send stale
    data. The consumer reads on a third stream right after ``work.wait()`` with
    that stream current: if the future's event did not cover the host -> device
    copy it would read the input, not the sum. Large tensors make the copy slow.
    """
    n = 16 << 20  # 64 MiB of float32
    iters = 12
    cycles = _sleep_cycles(20)

    def fn(rank: int, g: EntrenarProcessGroup) -> list[int]:
        producer = torch.cuda.Stream(DEV, priority=-1)
        consumer = torch.cuda.Stream(DEV)
        x = torch.zeros(n, device=DEV)
        producer.wait_stream(torch.cuda.current_stream(DEV))
        bad = torch.zeros(iters, dtype=torch.int64, device=DEV)
        for i in range(iters):
            with torch.cuda.stream(producer):
                torch.cuda._sleep(cycles)
                x.fill_(float(i + rank))
                work = g.allreduce([x])
            expected = float(world * i + world * (world - 1) // 2)
            with torch.cuda.stream(consumer):
                work.wait()
                y = x.clone()
                bad[i] = (y != expected).sum()
            producer.wait_stream(consumer)  # next write after this read
        torch.cuda.synchronize(DEV)
        return bad.tolist()

    results = run_ranks(world, fn, timeout_s=240)
    for rank, bad in enumerate(results):
        assert bad == [0] * iters, f"rank {rank}: stale elements per iteration {bad}"


@pytest.mark.timeout(300)
def test_future_then_callback_sees_result() -> None:
    """DDP chains on the future: a ``then`` callback runs on a stream synchronized with it."""
    n = 8 << 20

    def fn(rank: int, g: EntrenarProcessGroup) -> bool:
        ok = True
        for i in range(5):
            x = torch.full((n,), float(rank + i), device=DEV)
            fut = g.allreduce([x]).get_future()
            doubled = fut.then(lambda f: [f.value()[0] * 2])
            res = doubled.wait()[0]
            ok &= bool((res == 2.0 * (2 * i + 1)).all())
        return ok

    assert run_ranks(2, fn, timeout_s=240) == [True, True]


@pytest.mark.timeout(300)
def test_tensor_freed_without_wait_is_not_reused_while_copy_in_flight() -> None:
    """record_stream: the user drops the tensor and the Work; its block must not be recycled
    under the in-flight host -> device copy."""
    n = 64 << 20  # 256 MiB: the copy back takes milliseconds
    iters = 6

    def fn(rank: int, g: EntrenarProcessGroup) -> list[int]:
        side = torch.cuda.Stream(DEV)
        bad = []
        for _ in range(iters):
            with torch.cuda.stream(side):
                x = torch.full((n,), 1.0, device=DEV)
                work = g.allreduce([x])
                del x
                while not work.is_completed():
                    time.sleep(0.0002)
                del work
                # A CPU collective lets the comm thread drop the finished job (and x).
                g.allreduce([torch.zeros(1)]).wait()
                z = torch.empty(n, device=DEV)
                z.fill_(-1.0)
            torch.cuda.synchronize(DEV)
            bad.append(int((z != -1.0).sum()))
            del z
        return bad

    for rank, bad in enumerate(run_ranks(2, fn, timeout_s=240)):
        assert bad == [0] * iters, f"rank {rank}: overwritten elements per iteration {bad}"


@pytest.mark.timeout(120)
def test_pinned_buffers_are_reused_across_calls() -> None:
    def fn(rank: int, g: EntrenarProcessGroup) -> tuple[int, bool]:
        for i in range(20):
            t = torch.full((1 << 18,), float(i), device=DEV)
            g.allreduce([t]).wait()
        assert g._runtime.pinned is not None
        return g._runtime.pinned.allocations, g._runtime.pinned.pin

    for allocations, pinned in run_ranks(2, fn):
        assert allocations == 1 and pinned


# -------------------------------------------------------- deterministic mode


@pytest.mark.timeout(240)
def test_deterministic_mode_bit_identical_on_gpu() -> None:
    def run_once(algorithm: str) -> list[torch.Tensor]:
        groups = make_groups(4, Options(deterministic=True, algorithm=algorithm))

        def fn(rank: int, g: EntrenarProcessGroup) -> torch.Tensor:
            gen = torch.Generator().manual_seed(rank)
            t = torch.randn(3 << 20, generator=gen).to(DEV)
            for _ in range(3):
                g.allreduce([t]).wait()
                t.mul_(0.25)
            return t.cpu()

        try:
            return run_ranks(4, fn, groups=groups, timeout_s=200)
        finally:
            for g in groups:
                g.shutdown()

    first = run_once("ring")
    for t in first[1:]:
        assert torch.equal(t, first[0]), "ranks differ"
    for again in (run_once("ring"), run_once("star")):
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b), "deterministic mode must give the same bits every run"


# ---------------------------------------------------------------------- DDP


def _ddp(
    tmp: Path, backend: str, world: int, *extra: str, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    out = tmp / f"{backend}-{world}-{len(list(tmp.iterdir()))}"
    proc = torchrun(
        WORKER, world, "--backend", backend, "--out", str(out), *extra, timeout_s=420, env=env
    )
    assert proc.returncode == 0, f"{backend} world {world} failed:\n{proc.stdout}\n{proc.stderr}"
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_cuda_matches_gloo(tmp_path: Path, world: int) -> None:
    ours = _ddp(tmp_path, "entrenar", world)
    ref = _ddp(tmp_path, "gloo", world)
    assert all(r["device"].startswith("cuda") for r in ours)
    assert ours[0]["stats"].get("allreduce_calls", 0) > 0, ours[0]["stats"]
    for r in range(1, world):
        for k, v in ours[0]["state"].items():
            assert torch.equal(v, ours[r]["state"][k]), f"rank {r} differs from rank 0 in {k}"
    for k, v in ours[0]["state"].items():
        torch.testing.assert_close(v, ref[0]["state"][k], rtol=1e-3, atol=1e-5, msg=k)
    torch.testing.assert_close(
        torch.tensor(ours[0]["losses"]), torch.tensor(ref[0]["losses"]), rtol=1e-3, atol=1e-4
    )


@pytest.mark.timeout(600)
def test_ddp_cuda_compiled_and_profiled_matches_gloo(tmp_path: Path) -> None:
    # torch.compile(DDP) on CUDA (inductor's GPU kernels, DDP's graph split at
    # buckets) under a CPU+CUDA profiler: the same training as compiled gloo,
    # and every bucket's allreduce is one profiler event named as gloo's.
    # 1 MB buckets: with the worker's 0.1 MB, torch's DDPOptimizer asserts its
    # first bucket (1 MB) is no larger than the rest, on gloo as well.
    steps, args = 6, ("--compile", "--bucket-cap-mb", "1", "--steps", "6")
    ours = _ddp(tmp_path, "entrenar", 2, *args, "--profile")
    ref = _ddp(tmp_path, "gloo", 2, *args)
    for k, v in ours[0]["state"].items():
        assert torch.equal(v, ours[1]["state"][k]), f"rank 1 differs from rank 0 in {k}"
        torch.testing.assert_close(v, ref[0]["state"][k], rtol=1e-3, atol=1e-5, msg=k)
    torch.testing.assert_close(
        torch.tensor(ours[0]["losses"]), torch.tensor(ref[0]["losses"]), rtol=1e-3, atol=1e-4
    )
    calls = ours[0]["stats"].get("allreduce_calls", 0)
    assert calls >= steps, ours[0]["stats"]
    for r in range(2):
        seen = ours[r]["profiled_collectives"]
        assert seen.get("entrenar:all_reduce", 0) >= steps, (r, seen)


@pytest.mark.timeout(600)
def test_ddp_cuda_deterministic_and_checked_runs_bit_identical(tmp_path: Path) -> None:
    env = {"ENTRENAR_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    a = _ddp(tmp_path, "entrenar", 3, "--deterministic", env={**env, "ENTRENAR_ALGO": "ring"})
    b = _ddp(tmp_path, "entrenar", 3, "--deterministic", env={**env, "ENTRENAR_ALGO": "star"})
    # The contract checker hashes the staged host copies of the CUDA data; it must pass.
    c = _ddp(tmp_path, "entrenar", 3, "--deterministic", env={**env, "ENTRENAR_CHECK": "1"})
    for run in (b, c):
        for r in range(3):
            for k, v in a[0]["state"].items():
                assert torch.equal(v, run[r]["state"][k]), f"rank {r}: {k} not bit-identical"


@pytest.mark.timeout(10)
def test_worker_script_exists() -> None:
    assert WORKER.is_file() and (REPO / "trainer" / "model.py").is_file()


@pytest.mark.timeout(300)
def test_ddp_cuda_bf16_compress_hook_on_entrenar() -> None:
    """torch's bf16 compression hook (accepted on a CUDA build whatever the
    backend) runs its bf16 allreduce over entrenar: gradients equal on every
    rank and within bf16's rounding of the fp32 allreduce's."""
    proc = torchrun(Path(__file__).with_name("bf16_hook_worker.py"), 2, timeout_s=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.count("equal on every rank True") == 2, proc.stdout

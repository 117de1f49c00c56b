"""The contract checker (ENTRENAR_CHECK=1): C-RING-001, F-DP-003, C-DDP-001.

Fault injection: each fault is injected on one rank at call/step k and must be
caught at exactly k, on every rank, as ContractViolation naming the contract,
the rank and the call/step; a clean run raises nothing (and the checker
demonstrably ran). Unit level: N ranks as threads over loopback TCP; process
level: torchrun + DistributedDataParallel with ENTRENAR_CHECK=1.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import textwrap
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks, torchrun
from preloaded import start_script

from entrenar_pg import ContractChecker, ContractViolation, EntrenarProcessGroup, Options
from entrenar_pg.call import requests as rq
from entrenar_pg.checker import hashing, projection
from entrenar_pg.checker.projection import Projection, block_range
from entrenar_pg.runtime import jobs

CHECK = Options(check=True)


def op(kind: Any, factor: float | None = None) -> dist.AllreduceOptions:
    o = dist.AllreduceOptions()
    o.reduceOp = kind if factor is None else dist._make_nccl_premul_sum(factor)
    return o


class Corrupt:
    """Test double of a faulty algorithm: runs a job, then corrupts the output of
    ``victims`` at their ``at``-th call of that kind.

    It wraps the job itself (``jobs.JOBS``), so the checker measures the
    corrupted output exactly as it would a wrong result left by a broken
    algorithm or transport.
    """

    def __init__(self, job: Any, at: int, victims: set[int], how: str) -> None:
        self.job, self.at, self.victims, self.how = job, at, victims, how
        self.calls: dict[int, int] = {}

    def __call__(self, ctx: Any, req: Any, hosts: list[list[torch.Tensor]]) -> None:
        self.job(ctx, req, hosts)
        rank = ctx.rank
        self.calls[rank] = self.calls.get(rank, 0) + 1
        written = [t for (_, _, write), h in zip(req.io, hosts, strict=True) if write for t in h]
        written = [t for t in written if t.numel()]
        if self.calls[rank] != self.at or rank not in self.victims or not written:
            return
        flat = written[0]
        if self.how == "bump":  # one element off on one rank
            flat[flat.numel() // 2] += 1
        elif self.how == "scale":  # every rank the same wrong (scaled) output
            flat.mul_(1.5)
        elif self.how == "drop":  # a lost contribution: the first chunk zeroed
            flat[: max(1, flat.numel() // ctx.world)] = 0
        elif self.how == "inc7":  # integer off by one
            flat[7] += 1
        elif self.how == "gross":  # one element far off (beyond any rounding bound)
            flat[flat.numel() // 2] += 1000
        elif self.how == "copy-bit":  # the lowest mantissa bit of one float32 element
            flat.view(torch.int32)[flat.numel() // 3] ^= 1


def corrupt(
    monkeypatch: pytest.MonkeyPatch, kind: type, at: int, victims: set[int], how: str
) -> Corrupt:
    wrapper = Corrupt(jobs.JOBS[kind], at, victims, how)
    monkeypatch.setitem(jobs.JOBS, kind, wrapper)
    return wrapper


def run_until_violation(
    world: int,
    k: int,
    make_input: Any,
    setup: Any = None,
    options: Options = CHECK,
    reduce_op: Any = dist.ReduceOp.SUM,
) -> list[tuple[int, str]]:
    """Each rank allreduces ``make_input(rank, i)`` for i = 1..k+2; returns (call, message)."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[int, str]:
        if setup is not None:
            setup(rank, pg)
        for i in range(1, k + 3):
            t = make_input(rank, i)
            try:
                pg.allreduce([t], op(reduce_op)).wait()
            except ContractViolation as e:
                # The group is broken now: the next call says so, with the same class.
                with pytest.raises(ContractViolation):
                    pg.allreduce([torch.ones(2)]).wait()
                return i, str(e)
        return -1, "no violation"

    return run_ranks(world, fn, options=options)


# ---------------------------------------------------------------------- clean runs


@pytest.mark.timeout(90)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_clean_run_raises_nothing(world: int, deterministic: bool) -> None:
    """Many dtypes, ops, sizes, algorithms: no false positive, and every call was checked."""
    cases: list[tuple[torch.dtype, Any, int]] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for kind in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
            for numel in (0, 1, 4095, 4097, 70_001):
                cases.append((dtype, kind, numel))
    for dtype in (torch.int32, torch.int8, torch.uint8, torch.int64):
        for kind in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.BXOR):
            cases.append((dtype, kind, 9000))
    cases.append((torch.bool, dist.ReduceOp.SUM, 100))

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[int, int]:
        g = torch.Generator().manual_seed(rank)
        n = 0
        for dtype, kind, numel in cases:
            if dtype.is_floating_point:
                # Same-sign, wide-range values: the hardest case for the float bound.
                scale = torch.exp(torch.randn(numel, generator=g) * 4).clamp(max=1000)
                t = (torch.rand(numel, generator=g) * scale).to(dtype)  # fp16-safe
            elif dtype == torch.bool:
                t = torch.rand(numel, generator=g) > 0.5
            else:
                t = torch.randint(0, 100, (numel,), generator=g).to(dtype)
            pg.allreduce([t], op(kind)).wait()
            n += 1
        t = torch.randn(1000, generator=g)
        pg.allreduce([t], op(None, factor=0.25)).wait()  # PREMUL_SUM
        parts = [torch.randn(n, generator=g) for n in (10, 5000, 3)]
        pg.allreduce_coalesced(parts).wait()
        assert pg.checker is not None
        return n + 2, pg.checker.allreduces_checked

    opts = Options(check=True, deterministic=deterministic, star_max_bytes=8192, segment_bytes=4096)
    for issued, checked in run_ranks(world, fn, options=opts, timeout_s=80):
        assert checked == issued, "the checker did not see every allreduce"


@pytest.mark.timeout(60)
def test_checker_installed_only_with_check() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> Any:
        return pg.checker

    assert run_ranks(2, fn, options=Options()) == [None, None]
    assert all(isinstance(c, ContractChecker) for c in run_ranks(2, fn, options=CHECK))


@pytest.mark.timeout(60)
def test_install_in_code() -> None:
    """``ContractChecker.install(group)`` on a group created without ENTRENAR_CHECK."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> int:
        assert pg.checker is None
        checker = ContractChecker.install(pg)
        assert pg.checker is checker
        t = torch.ones(100)
        if rank == 1:
            t[0] = float("nan")
        with pytest.raises(ContractViolation, match="F-DP-003"):
            pg.allreduce([t]).wait()
        return checker.allreduces_checked

    assert run_ranks(2, fn, options=Options()) == [1, 1]
    with pytest.raises(TypeError):
        ContractChecker.install(object())


# ---------------------------------------------------------------------- the pieces


@pytest.mark.timeout(60)
def test_measuring_thread_has_the_process_thread_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker measures in the comm thread, which torch did not create: torch
    applies torch.set_num_threads there only once the thread asks. Unasked, the
    projection's matrix product ran MKL with a team of every core in it (~10x the
    product's CPU, spinning against the training thread)."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        mkl_threads = lib.mkl_get_max_threads
    except (OSError, AttributeError):
        pytest.skip("torch built without MKL: no per-thread MKL team to check")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: a team of every core is one thread")
    seen: list[int] = []
    job = jobs.JOBS[rq.Allreduce]

    def probe(ctx: Any, req: Any, hosts: list[list[torch.Tensor]]) -> None:
        seen.append(mkl_threads())  # in the job's thread, right after the checker's `before`
        job(ctx, req, hosts)

    monkeypatch.setitem(jobs.JOBS, rq.Allreduce, probe)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def body(rank: int, group: EntrenarProcessGroup) -> None:
            work = group.allreduce([torch.randn(3 * 4096)], op(dist.ReduceOp.SUM))  # async
            work.wait()

        run_ranks(2, body, options=CHECK)
    finally:
        torch.set_num_threads(threads)
    assert seen == [1, 1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("numel", [0, 1, 4095, 4096, 4097, 3 * 4096, 100_003])
def test_projection_parts_add_up(numel: int) -> None:
    """Each rank projects 1/N of the output: the N parts must add up to the whole."""
    proj = Projection()
    x = torch.randn(numel, dtype=torch.float64)
    whole, norm = proj.floats(x)
    assert norm == pytest.approx(float(x.norm()))
    xi = torch.randint(-1000, 1000, (numel,), dtype=torch.int32)
    whole_i = proj.ints(xi)
    for parts in (1, 2, 3, 7):
        got = [proj.floats(x, part=(i, parts), norm=False)[0] for i in range(parts)]
        for k in range(len(whole)):
            assert sum(g[k] for g in got) == pytest.approx(whole[k], rel=1e-12, abs=1e-9)
        got_i = [proj.ints(xi, part=(i, parts)) for i in range(parts)]
        assert [sum(g[k] for g in got_i) for k in range(len(whole_i))] == whole_i
    # the projections see every block: a change anywhere changes them
    if numel:
        y = x.clone()
        y[numel - 1] += 1.0
        assert proj.floats(y)[0] != whole


@pytest.mark.timeout(30)
def test_projection_views_are_kept_by_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket projected again (the same memory every step) makes no view of it:
    the (blocks x 4096) and tail views are kept by address and range. They own
    nothing, so the tensor is freed as before, and a new tensor at the same
    address is read as it is now. (Before: two views made per call.)"""
    import gc

    proj = Projection()
    x = torch.randn(5 * 4096 + 7)
    first = proj.floats(x)
    made: list[int] = []
    real_as_strided, real_getitem = torch.Tensor.as_strided, torch.Tensor.__getitem__

    def as_strided(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        made.append(1)
        return real_as_strided(self, *a, **k)

    def getitem(self: torch.Tensor, *a: Any) -> torch.Tensor:
        made.append(1)
        return real_getitem(self, *a)

    monkeypatch.setattr(torch.Tensor, "as_strided", as_strided)
    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    for part in ((0, 1), (1, 2)):
        proj.floats(x, part=part)  # the first time at each range: views made
    made.clear()
    assert proj.floats(x) == first
    proj.floats(x, part=(1, 2), hasher=hashing.hasher())
    assert made == []
    monkeypatch.undo()
    # The same address, other values: read as they are now.
    x.copy_(torch.randn(x.numel()))
    assert proj.floats(x) == Projection().floats(x)
    # Nothing kept alive by the cache: neither the tensor nor a view of its
    # storage. (This read the process's resident bytes before: whether a
    # freed 64 MiB goes back to the system depends on what earlier tests in
    # the worker left in malloc's free lists, so it failed by test order.)
    big = torch.ones(16 << 20)
    uses = torch._C._storage_Use_Count(big.untyped_storage()._cdata)
    proj.floats(big)
    assert torch._C._storage_Use_Count(big.untyped_storage()._cdata) == uses, (
        "the projection's cache holds a view of the tensor's storage"
    )
    alive = weakref.ref(big)
    del big
    gc.collect()
    assert alive() is None, "the projection's cache kept the tensor alive"


@dataclass(frozen=True)
class _Noting:
    """A torch function that notes ``name`` in ``log`` on each call, then runs."""

    name: str
    original: Any
    log: list[str]

    def __call__(self, *a: Any, **k: Any) -> Any:
        self.log.append(self.name)
        return self.original(*a, **k)


@pytest.mark.timeout(30)
def test_every_variant_is_made_at_a_buckets_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DDP step uses a new pair of vectors per bucket until all VARIANTS have come
    round: the vectors, the block weights and the bucket's reads are made for every
    variant at the bucket's first call, so the later steps make none. (Before: one
    variant's generators per call over a run's first 16 steps, ~5 ms in the
    measured steps.) The projections are the same as made one at a time, for
    every variant and range, including a share that reads the partial last block
    after one of the same first block that does not."""
    proj = Projection()
    x = torch.randn(4096 + 7)
    proj.floats(x)  # the bucket's first call (variant 0)
    made: list[str] = []
    monkeypatch.setattr(torch, "randn", _Noting("randn", torch.randn, made))
    monkeypatch.setattr(torch, "randint", _Noting("randint", torch.randint, made))
    got = {v: proj.floats(x, variant=v) for v in range(projection.VARIANTS)}
    assert made == [], f"vectors made after the bucket's first call: {made}"
    monkeypatch.undo()
    for v, value in got.items():
        assert value == Projection().floats(x, variant=v)
    # (0, 2) and (0, 1) start at the same block and read one whole block each; only
    # (0, 1) reads the partial last one.
    for part in ((0, 2), (0, 1), (1, 2)):
        for v in (0, 5):
            alone = Projection().floats(x, part=part, variant=v, norm=False)
            assert proj.floats(x, part=part, variant=v, norm=False) == alone


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_read_makes_no_conversion(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """A kept read writes its products, its tail's products and the norm into one
    buffer and reads it back through a memoryview, with no torch conversion (each
    torch call costs 10-30 us in a job thread after a backward pass, and a
    ``tolist``'s fresh float objects were walked cold by the weighted sums); only
    a range with no whole block (the tail alone) converts its tail's product. The
    values are bit for bit those of separate results (fresh tensors, converted
    one by one), which the buffer's contiguous parts keep: a strided result takes
    other kernels. (Before: one ``tolist`` per call; before that, two and a
    ``float`` per input call.)"""
    conversions: list[str] = []
    real_tolist, real_float = torch.Tensor.tolist, torch.Tensor.__float__

    def tolist(self: torch.Tensor) -> Any:
        conversions.append("tolist")
        return real_tolist(self)

    def to_float(self: torch.Tensor) -> float:
        conversions.append("float")
        return real_float(self)

    gen = torch.Generator().manual_seed(3)
    for numel in (4096, 4096 + 7, 5 * 4096, 5 * 4096 + 7, 141 * 4096 + 768):
        x = torch.randn(numel, generator=gen, dtype=dtype)
        proj = Projection()
        for variant in (0, 9):
            for part in ((0, 1), (1, 2), (0, 2)):
                norm = part == (0, 1)
                proj.floats(x, part=part, variant=variant, norm=norm)  # the first call: made
                monkeypatch.setattr(torch.Tensor, "tolist", tolist)
                monkeypatch.setattr(torch.Tensor, "__float__", to_float)
                got = proj.floats(x, part=part, variant=variant, norm=norm)
                monkeypatch.undo()
                b0, f1, _, with_tail = block_range(numel, part)
                # a tail alone is converted; with whole blocks, nothing is
                read = ["tolist"] if f1 <= b0 and with_tail else []
                assert conversions == read, (numel, part, conversions)
                conversions.clear()
                assert got == _separately(proj, x, part, variant, norm), (numel, part, variant)


@pytest.mark.timeout(30)
def test_kept_read_takes_the_norm_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """An input's norm runs before its product: the norm streams the bucket in from
    memory (its first read after the backward pass) and the product, which computes
    more per byte, then finds it in cache (~50 us less per 2.3 MiB bucket inside the
    DDP job). (Before: the product first.)"""
    calls: list[str] = []
    x = torch.randn(5 * 4096 + 7)
    proj = Projection()
    first = proj.floats(x)
    monkeypatch.setattr(torch, "mm", _Noting("mm", torch.mm, calls))
    monkeypatch.setattr(
        torch.linalg, "vector_norm", _Noting("norm", torch.linalg.vector_norm, calls)
    )
    again = proj.floats(x)
    monkeypatch.undo()
    assert calls == ["norm", "mm"]
    assert again == first


def _separately(
    proj: Projection, x: torch.Tensor, part: tuple[int, int], variant: int, norm: bool
) -> tuple[list[float], float]:
    """``Projection.floats`` as separate torch results: the product, the tail's, the norm."""
    b0, f1, tail, with_tail = block_range(x.numel(), part)
    full = x.numel() // projection.BLOCK
    w = proj.weights_list(full + (1 if tail else 0), variant)
    r = proj.base(variant)[0 if x.dtype == torch.float64 else 1]
    sums = [0.0] * projection.PROJECTIONS
    if f1 > b0:
        cols = x[b0 * projection.BLOCK : f1 * projection.BLOCK].view(f1 - b0, -1).t()
        per_block = torch.mm(r, cols).tolist()
        sums = [
            sum(a * b for a, b in zip(per_block[k], w[k][b0:f1], strict=True)) for k in range(2)
        ]
    if with_tail:
        last = torch.mv(r[:, :tail], x[full * projection.BLOCK :]).tolist()
        sums = [sums[k] + last[k] * w[k][full] for k in range(2)]
    return sums, float(torch.linalg.vector_norm(x, dtype=x.dtype)) if norm else 0.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_pass_measures_as_separate_passes(dtype: torch.dtype) -> None:
    """The fused pass (projection and hash in one read: a share of at most FUSED_ROWS
    blocks hashed whole then projected, a larger one chunk by chunk) gives what
    separate passes give: the same projections, the norm, and the digest, across
    chunk boundaries and in every share of a replicated output, on both sides of
    FUSED_ROWS."""
    proj = Projection()
    rows, fused = projection.CHUNK_ROWS, projection.FUSED_ROWS
    sizes = [0, 5, 4096, rows * 4096, rows * 4096 + 7, (2 * rows + 3) * 4096 + 100]
    sizes += [fused * 4096, (2 * fused + 1) * 4096 + 9]  # shares just over FUSED_ROWS
    for numel in sizes:
        x = torch.randn(numel, dtype=torch.float64).to(dtype)
        whole, norm = proj.floats(x)
        assert norm == pytest.approx(float(x.double().norm()), rel=1e-4)  # float32 sums
        for parts in (1, 2, 3):
            sums = [0.0, 0.0]
            for i in range(parts):
                h = hashing.hasher()
                got, _ = proj.floats(x, norm=False, part=(i, parts), hasher=h)
                assert hashing.to_i64(h.intdigest()) == hashing.digest([x])
                alone = proj.floats(x, norm=False, part=(i, parts))[0]
                assert got == pytest.approx(alone, abs=1e-6 * norm + 1e-9)
                sums = [a + b for a, b in zip(sums, got, strict=True)]
            # (float32 blocks: rounding of the order the matrix product adds in)
            assert sums == pytest.approx(whole, abs=1e-5 * norm + 1e-9)
    bad = torch.randn(3 * 4096 + 3).to(dtype)
    for at in (0, 4096 + 1, 3 * 4096 + 2):  # F-DP-003: a non-finite element anywhere
        for value in (float("nan"), float("inf")):
            y = bad.clone()
            y[at] = value
            assert not math.isfinite(proj.floats(y)[1])


@pytest.mark.timeout(30)
def test_digest_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = torch.arange(1000.0), torch.arange(1000.0)
    b[500] = 0.5
    assert hashing.digest([a]) == hashing.digest([a.clone()])
    assert hashing.digest([a]) != hashing.digest([b])
    assert hashing.digest([a[:400], a[400:]]) == hashing.digest([a])  # streaming
    monkeypatch.setattr(hashing, "_xxhash", None)  # xxhash not installed: blake2b
    assert hashing.digest([a]) == hashing.digest([a.clone()])
    assert hashing.digest([a]) != hashing.digest([b])


@pytest.mark.timeout(30)
def test_digest_reads_the_tensors_as_they_are_now() -> None:
    """The digest hashes contiguous CPU tensors where they lie (views cached by address
    and size): it must equal the hash of the values' bytes, in order, also after a
    tensor's storage was replaced or written in place."""

    def expected(ts: list[torch.Tensor]) -> int:
        h = hashing.hasher()
        h.update(b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in ts))
        return hashing.to_i64(h.intdigest())

    ts = [torch.randn(1000), torch.randn(3, 5).to(torch.bfloat16), torch.ones(()), torch.empty(0)]
    assert hashing.digest(ts) == expected(ts)
    ts[0].data = torch.randn(1000)  # a new storage behind the same tensor
    assert hashing.digest(ts) == expected(ts)
    ts[0][7] += 1.0  # written in place
    assert hashing.digest(ts) == expected(ts)
    ts[1] = ts[1].t()  # not contiguous: hashed through a copy, in its logical order
    assert hashing.digest(ts) == expected(ts)
    # C-DDP-001's count of bytes comes from the same pass: every tensor's, copies included
    assert hashing.digest_sized(ts) == (expected(ts), sum(t.nbytes for t in ts))


@pytest.mark.timeout(60)
def test_digest_keeps_its_copy_alive() -> None:
    """A tensor that is not a contiguous CPU tensor is hashed through a copy, which
    must outlive the hashing: it did not (a ctypes view of the freed 16 MiB copy;
    SIGSEGV), so it runs in a process of its own."""
    code = textwrap.dedent(
        """
        import torch
        from entrenar_pg.checker import hashing, projection
        x = torch.randn(2048, 2048)
        assert hashing.digest([x.t()]) == hashing.digest([x.t().contiguous()])
        assert hashing.digest([x.t()]) != hashing.digest([x])
        view = hashing.tensor_bytes(x.t())
        again = torch.randn(2048, 2048)  # memory a freed copy would give back
        assert bytes(view) == x.t().contiguous().numpy().tobytes()
        print("ok")
        """
    )
    proc = start_script(["-c", code], env=dict(os.environ))
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 0 and out.strip() == "ok", (proc.returncode, err)


# ---------------------------------------------------------------------- C-RING-001


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("world", "how", "victims"),
    [
        (3, "bump", {1}),  # one rank's output differs: the hash names it
        (2, "bump", {0}),  # two ranks: no majority, both named, still caught
        (4, "scale", {0, 1, 2, 3}),  # all ranks agree on a wrong output: the checksum
        (3, "drop", {0, 1, 2}),  # a lost contribution on every rank: the checksum
    ],
)
@pytest.mark.parametrize("algorithm", ["ring", "star", "direct"])
def test_corrupt_output_caught_at_k(
    monkeypatch: pytest.MonkeyPatch, world: int, how: str, victims: set[int], algorithm: str
) -> None:
    k = 4
    corrupt(monkeypatch, rq.Allreduce, k, victims, how)

    def make(rank: int, i: int) -> torch.Tensor:
        return torch.randn(10_000, generator=torch.Generator().manual_seed(rank * 100 + i))

    opts = Options(check=True, algorithm=algorithm)
    results = run_until_violation(world, k, make, options=opts)
    for rank, (at, msg) in enumerate(results):
        assert at == k, f"rank {rank}: caught at call {at}, not {k}: {msg}"
        assert "C-RING-001" in msg and f"allreduce #{k} " in msg, msg
        named = set(map(int, re.findall(r"\d+", msg.split("offending rank(s):")[1])))
        expected = victims if len(victims) < world and world > 2 else set(range(world))
        assert named == expected, f"rank {rank}: named {named}, expected {expected}: {msg}"


@pytest.mark.timeout(60)
def test_integer_checksum_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """int64 SUM: an off-by-one on every rank (hashes agree) is caught by the exact checksum."""
    k, world = 2, 3
    corrupt(monkeypatch, rq.Allreduce, k, {0, 1, 2}, "inc7")

    def make(rank: int, i: int) -> torch.Tensor:
        return torch.randint(-(2**40), 2**40, (5000,), generator=torch.Generator().manual_seed(i))

    for at, msg in run_until_violation(world, k, make):
        assert at == k and "C-RING-001" in msg and "not the SUM" in msg, msg


# ---------------------------------------------------------------------- F-DP-003


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("bad", "dtype", "reduce_op"),
    [
        (float("nan"), torch.float32, dist.ReduceOp.SUM),
        (float("inf"), torch.float32, dist.ReduceOp.AVG),
        (-float("inf"), torch.bfloat16, dist.ReduceOp.SUM),
        (float("nan"), torch.bfloat16, dist.ReduceOp.MAX),  # a non-linear op: still caught
        (float("inf"), torch.float16, dist.ReduceOp.MIN),
    ],
)
def test_nonfinite_input_caught_at_k(bad: float, dtype: torch.dtype, reduce_op: Any) -> None:
    k, world, victim, index = 3, 3, 2, 4321

    def make(rank: int, i: int) -> torch.Tensor:
        t = torch.randn(10_000).to(dtype)
        if rank == victim and i == k:
            t[index] = bad
        return t

    for rank, (at, msg) in enumerate(run_until_violation(world, k, make, reduce_op=reduce_op)):
        assert at == k, f"rank {rank}: caught at {at}: {msg}"
        assert "F-DP-003" in msg and f"allreduce #{k} " in msg, msg
        assert f"rank(s) [{victim}]" in msg and f"element {index}" in msg, msg
        assert f"bucket {k} of optimizer step 1" in msg, msg


# ---------------------------------------------------------------------- C-DDP-001


def _train(
    rank: int, pg: EntrenarProcessGroup, steps: int, fault: tuple[str, int, int] | None
) -> tuple[int, str, bool]:
    """Data-parallel SGD by hand: grads averaged through ``pg``, the checker watching.

    ``fault`` = (kind, step, rank): "perturb" a weight after that step's update,
    or "nan" one gradient element before its allreduce. Returns the step whose
    ``optimizer.step()`` raised (0: the group's shutdown, which judges the last
    step; -1: none), the message, and whether the parameters were left as they
    were when that step began (the raise came before its update).
    """
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    init = torch.Generator().manual_seed(0)  # same init on every rank (not the global RNG,
    with torch.no_grad():  # which the rank threads share)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    current = [0]
    before: list[torch.Tensor] = []

    def snapshot(o: Any, args: Any, kwargs: Any) -> None:  # runs before the checker's pre-hook
        before[:] = [p.detach().clone() for p in model.parameters()]

    def perturb(o: Any, args: Any, kwargs: Any) -> None:  # runs before the checker's hook
        if fault is not None and fault[0] == "perturb" and (current[0], rank) == fault[1:]:
            with torch.no_grad():
                model[0].weight[3, 5] += 1e-6

    opt.register_step_pre_hook(snapshot)
    opt.register_step_post_hook(perturb)
    assert pg.checker is not None
    pg.checker.watch(opt)
    g = torch.Generator().manual_seed(rank)
    try:
        for step in range(1, steps + 1):
            current[0] = step
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():
                assert p.grad is not None
                if fault is not None and fault[0] == "nan" and (step, rank) == fault[1:]:
                    p.grad[0] = float("nan")
                pg.allreduce([p.grad], op(dist.ReduceOp.AVG)).wait()
            opt.step()
        current[0] = 0
        pg.shutdown()  # every rank at once, as each process's destroy: judges the last step
    except ContractViolation as e:
        kept = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        return current[0], str(e), kept
    assert pg.checker.steps_checked == steps
    assert pg.checker.checked["C-DDP-001"] == steps  # the last one judged at shutdown
    return -1, "no violation", True


@pytest.mark.timeout(60)
def test_training_clean() -> None:
    results = run_ranks(3, lambda r, pg: _train(r, pg, 6, None), options=CHECK)
    assert results == [(-1, "no violation", True)] * 3


@pytest.mark.timeout(60)
def test_batch_exchange_builds_its_plan_once_per_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """The records' exchange keeps its plan per payload length: a training loop's
    steps (the same batch every step) build it once, then only restamp it.
    (Built per exchange before: 10 plans for these 6 steps, 3 distinct lengths.)"""
    from entrenar_pg.transport.plan import Plan
    from entrenar_pg.wire import OpCode

    opened: dict[int, int] = {}
    real_open = Plan.open

    def counting_open(self: Plan, peer: int, header: Any, **kw: Any) -> None:
        if header.op == OpCode.CHECK:
            opened[self.rank] = opened.get(self.rank, 0) + 1
        real_open(self, peer, header, **kw)

    monkeypatch.setattr(Plan, "open", counting_open)
    world = 3
    results = run_ranks(world, lambda r, pg: _train(r, pg, 6, None), options=CHECK)
    assert results == [(-1, "no violation", True)] * world
    # Lengths: one record (the 4 per-call batches before the first step), then
    # each step's parameters + the next step's 4 records (judged at its
    # pre-hook), and the last step's parameters alone (at shutdown).
    assert opened == {r: 3 * (world - 1) for r in range(world)}


@pytest.mark.timeout(60)
def test_step_check_takes_the_thin_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's check job on an idle group runs in the caller's thread without the
    runtime's job machinery (no Job, torch Future or JobContext: ``ThinPath.check``),
    in issue order (its own seq), judged and counted in the engine's stats.
    (Before: every step's check went through ``Engine.execute``, 6 jobs per rank here.)"""
    from entrenar_pg.runtime.engine import Engine

    executed: list[str] = []
    real_execute = Engine.execute

    def counting_execute(self: Engine, job: Any) -> None:
        executed.append(job.kind)
        real_execute(self, job)

    monkeypatch.setattr(Engine, "execute", counting_execute)
    steps = 6

    def body(rank: int, pg: EntrenarProcessGroup) -> tuple[int, int, int, dict[str, float]]:
        assert pg.checker is not None
        params = [torch.arange(10.0), torch.ones(3, 4)]
        for _ in range(steps):  # nothing else runs on the group: it is idle at every check
            pg.checker.check_parameters(params)
        stats = pg._runtime.engine.stats.as_dict()
        return pg.checker.steps_checked, pg.checker.checked["C-DDP-001"], pg._runtime.seq, stats

    for checked, held, seq, stats in run_ranks(2, body, options=CHECK):
        assert (checked, held, seq, stats["check_calls"]) == (steps, steps, steps, steps)
    assert executed == []


_IN_CHECKER = os.path.join("entrenar_pg", "checker", "")  # the checker's files


@pytest.mark.timeout(60)
def test_checking_runs_no_generator() -> None:
    """Measuring a call (its record, its finiteness, its projections) and a step's
    check (the parameters' groups, the batch's payload, the verdicts of its
    records) run no generator of the checker's: each is a frame per element, and
    each costs several us in the cold caches after a backward pass. (Before: a
    generator per tensor and per projection in every call, and per parameter,
    per payload field and per verdict sum in a step: 213 frames here.)"""
    import sys
    from types import FrameType

    def body(rank: int, pg: EntrenarProcessGroup) -> tuple[list[str], int]:
        assert pg.checker is not None
        params = [torch.nn.Parameter(torch.full((5,), float(i))) for i in range(52)]
        bucket = torch.randn(4096 + 3)  # one bucket, the same memory every step (as DDP's)
        blocking = op(dist.ReduceOp.SUM)
        blocking.asyncOp = False  # as dist.all_reduce makes it: run in this (profiled) thread
        pg.checker.check_parameters(params)  # the first step: later records are held
        for _ in range(3):  # the bucket's first calls make its reads (once per bucket)
            pg.allreduce([bucket], blocking).wait()
        pg.checker.check_parameters(params)
        generators: list[str] = []

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            code = frame.f_code
            # (the checker's own code: the transport's exchange is another file's business)
            if event == "call" and code.co_name == "<genexpr>" and _IN_CHECKER in code.co_filename:
                generators.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}")

        sys.setprofile(profile)
        try:
            for _ in range(3):  # measured now, judged at the next step
                pg.allreduce([bucket], blocking).wait()
            pg.checker.check_parameters(params)
        finally:
            sys.setprofile(None)
        return generators, pg.checker.checked["C-RING-001"]

    for generators, held in run_ranks(2, body, options=CHECK):
        assert held == 6  # the records were judged in the steps' checks
        assert generators == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_weight_perturbation_caught_before_the_next_update(world: int) -> None:
    """Replicas diverged after step k: ``optimizer.step()`` of step k + 1 raises on
    every rank before it updates anything, naming step k and the culprit (the
    step's batch waits for the next step's pre-hook: no rank waits for the other
    at a step's end). (Before: raised by step k's own post-hook.)"""
    k, victim = 4, 1
    results = run_ranks(
        world, lambda r, pg: _train(r, pg, 8, ("perturb", k, victim)), options=CHECK
    )
    for rank, (at, msg, kept) in enumerate(results):
        assert at == k + 1, f"rank {rank}: caught at step {at}: {msg}"
        assert "C-DDP-001" in msg and f"optimizer step {k}:" in msg, msg
        assert kept, f"rank {rank}: step {k + 1} updated the parameters before raising"
        if world > 2:
            assert f"rank(s) [{victim}] diverged" in msg, msg


@pytest.mark.timeout(60)
def test_nonfinite_gradient_caught_before_its_update() -> None:
    """A NaN gradient at step k: ``optimizer.step()`` of step k raises F-DP-003 on every
    rank, naming the culprit, before the update (the parameters stay finite).
    (Before: raised by step k's post-hook, after the NaN update was applied.)"""
    k, victim = 3, 2
    results = run_ranks(3, lambda r, pg: _train(r, pg, 6, ("nan", k, victim)), options=CHECK)
    for rank, (at, msg, kept) in enumerate(results):
        assert at == k, f"rank {rank}: caught at step {at}: {msg}"
        assert "F-DP-003" in msg and f"of optimizer step {k};" in msg, msg
        assert f"rank(s) [{victim}]" in msg, msg
        assert kept, f"rank {rank}: step {k} updated the parameters before raising"


@pytest.mark.timeout(60)
def test_last_step_judged_at_shutdown() -> None:
    """Replicas diverged after the run's last step: no later step comes, so the
    group's shutdown (torch's destroy_process_group) judges it and raises on every
    rank, naming the step and the culprit. (Before the deferral: at the step.)"""
    steps, victim = 5, 0
    results = run_ranks(
        3, lambda r, pg: _train(r, pg, steps, ("perturb", steps, victim)), options=CHECK
    )
    for rank, (at, msg, _) in enumerate(results):
        assert at == 0, f"rank {rank}: caught at step {at}, not at shutdown: {msg}"
        assert "C-DDP-001" in msg and f"optimizer step {steps}:" in msg, msg
        assert f"rank(s) [{victim}] diverged" in msg, msg


@pytest.mark.timeout(60)
def test_shutdown_hides_no_error_of_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    """One rank destroys its group while a step waits and the other rank is in
    another call (as a rank handling its own error in a ``finally`` would): the
    exchange fails on both, the destroying rank's shutdown logs that the step
    went unjudged and returns (raising only a violation, it never replaces the
    caller's error), and the other rank's call fails; nothing hangs."""
    from entrenar_pg.errors import EntrenarError

    def body(rank: int, pg: EntrenarProcessGroup) -> str:
        model = torch.nn.Linear(4, 2)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert pg.checker is not None
        pg.checker.watch(opt)
        for _ in range(2):
            model(torch.ones(3, 4)).sum().backward()
            for p in model.parameters():
                assert p.grad is not None
                pg.allreduce([p.grad], op(dist.ReduceOp.AVG)).wait()
            opt.step()
        if rank == 0:
            pg.shutdown()  # a step waits: its exchange meets rank 1's allreduce
            return "returned"
        try:
            pg.allreduce([torch.ones(8)], op(dist.ReduceOp.SUM)).wait()
        except EntrenarError as e:
            return type(e).__name__
        return "no error"

    with caplog.at_level("WARNING", logger="entrenar_pg.checker.checker"):
        results = run_ranks(2, body, options=CHECK, timeout_s=40)
    assert results[0] == "returned" and results[1] != "no error", results
    assert "optimizer step (2) could not be judged at shutdown" in caplog.text, caplog.text


@pytest.mark.timeout(60)
def test_step_end_waits_for_no_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A watched step's post-hook exchanges nothing (it hashes the parameters and
    marks the step); the step's batch goes in the next step's pre-hook, with that
    step's records: one exchange per step, none at a step's end. (Before: the
    post-hook's exchange was a point where every rank waited for the others.)"""
    from entrenar_pg.checker import checker as checker_mod

    phase: dict[int, str] = {}  # by rank: where each rank's thread is (its jobs may run in
    seen: list[tuple[int, str]] = []  # its comm thread, while it waits for them)
    real_exchange = checker_mod.exchange

    def tagged(call: Any, payload: list[int], aux: int) -> list[list[int]]:
        seen.append((call.rank, phase[call.rank]))
        return real_exchange(call, payload, aux)

    monkeypatch.setattr(checker_mod, "exchange", tagged)

    def body(rank: int, pg: EntrenarProcessGroup) -> None:
        model = torch.nn.Linear(4, 2)
        with torch.no_grad():  # the same on every rank (the threads share the global RNG)
            for p in model.parameters():
                p.fill_(0.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # registered first, so they run before the checker's hooks
        opt.register_step_pre_hook(lambda o, a, k: phase.__setitem__(rank, "pre"))
        opt.register_step_post_hook(lambda o, a, k: phase.__setitem__(rank, "post"))
        assert pg.checker is not None
        pg.checker.watch(opt)
        for _ in range(4):
            phase[rank] = "backward"
            model(torch.ones(3, 4)).sum().backward()
            for p in model.parameters():
                assert p.grad is not None
                pg.allreduce([p.grad], op(dist.ReduceOp.AVG)).wait()
            opt.step()
        phase[rank] = "shutdown"
        pg.shutdown()

    run_ranks(2, body, options=CHECK)
    for rank in range(2):
        mine = [name for r, name in seen if r == rank]
        # the first step's 2 calls judged one by one, steps 1-3 in the pre-hooks
        # of steps 2-4 (with those steps' records), step 4 at shutdown
        assert mine == ["backward"] * 2 + ["pre"] * 3 + ["shutdown"], mine


# ---------------------------------------------------------------------- process level (DDP)

DDP_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    import entrenar_pg
    from torch.nn.parallel import DistributedDataParallel as DDP

    fault, _, at = sys.argv[1].partition(":")  # clean | perturb:K | nan:K (on rank 1)
    out_dir = sys.argv[2]
    at = int(at or 0)
    torch.set_num_threads(1)
    dist.init_process_group("entrenar")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    step = 0

    # The faults (an unmodified script has none of this).
    def perturb(o, args, kwargs):
        if fault == "perturb" and rank == 1 and step == at:
            with torch.no_grad():
                model[2].bias[0] += 1e-7

    def poison(grad):
        if fault == "nan" and rank == 1 and step == at:
            grad = grad.clone()
            grad[0, 0] = float("nan")
        return grad

    opt.register_step_post_hook(perturb)
    model[0].weight.register_hook(poison)
    g = torch.Generator().manual_seed(rank)
    checker = dist.distributed_c10d._get_default_group().checker
    try:
        for step in range(1, 7):
            x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        step = "destroy"  # judges the last step's batch
        dist.destroy_process_group()
    except Exception as e:
        line = f"VIOLATION rank={rank} step={step} {type(e).__name__} {e}".replace(chr(10), " ")
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(line)
        os._exit(0)  # the test is about the verdict; skip interpreter teardown after a failure
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"CLEAN rank={rank} steps={checker.steps_checked} "
                f"allreduces={checker.allreduces_checked} "
                f"judged={checker.checked['C-DDP-001']}")
    """
)


def _ddp_run(tmp_path: Path, fault: str) -> str:
    script = tmp_path / "ddp_contracts.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = torchrun(script, 2, fault, str(out), env={"ENTRENAR_CHECK": "1"}, timeout_s=70)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return "\n".join(
        (out / f"rank{r}.txt").read_text() for r in range(2) if (out / f"rank{r}.txt").exists()
    )


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_ddp_torchrun_clean(tmp_path: Path) -> None:
    """Unmodified DDP training, ENTRENAR_CHECK=1: no violation, every step and bucket checked."""
    out = _ddp_run(tmp_path, "clean")
    lines = re.findall(r"CLEAN rank=(\d) steps=(\d+) allreduces=(\d+) judged=(\d+)", out)
    assert sorted(r for r, _, _, _ in lines) == ["0", "1"], out
    for _, steps, allreduces, judged in lines:
        assert int(steps) == 6 and int(allreduces) >= 6  # every bucket of every step checked
        assert int(judged) == 6  # the last step's parameters too, judged at destroy


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("fault", "at", "raised", "contract"),
    [
        ("perturb:3", "4", "optimizer step 3:", "C-DDP-001"),
        ("perturb:6", "destroy", "optimizer step 6:", "C-DDP-001"),
        ("nan:3", "3", "of optimizer step 3;", "F-DP-003"),
    ],
)
def test_ddp_torchrun_fault_caught(
    tmp_path: Path, fault: str, at: str, raised: str, contract: str
) -> None:
    """Unmodified DDP, rank 1's weights perturbed after step k, or a NaN in its
    gradient at step k: every rank raises ContractViolation itself, naming the
    step and the culprit. The NaN: in ``optimizer.step()`` of step k, before its
    update (the step's pre-hook judges its allreduces). The perturbation: in
    ``optimizer.step()`` of step k + 1, before its update, or at
    ``destroy_process_group()`` after the run's last step. (Before: both in step
    k's post-hook, after its update; ``perturb:6``: at step 6.)
    """
    out = _ddp_run(tmp_path, fault)
    caught = re.findall(r"VIOLATION rank=(\d) step=(\w+) (\w+) (.*)", out)
    assert sorted(r for r, _, _, _ in caught) == ["0", "1"], out
    for _, step, kind, msg in caught:
        assert step == at and contract in msg and raised in msg, msg
        assert kind == "ContractViolation", msg
        if fault.startswith("nan"):
            assert re.search(r"allreduce #\d+ \(bucket \d of optimizer step 3;", msg), msg
            assert "rank(s) [1]" in msg, msg

"""Differential tests: every torch.distributed collective on entrenar against gloo.

One spawn per world size (1..5). Every process joins a gloo default group and
then creates entrenar groups beside it with ``new_group(backend="entrenar")``
(default options, deterministic, and forced ring/chain with tiny segments),
plus an entrenar and a gloo subgroup of the even ranks. Each case runs the
public ``torch.distributed`` API on the same inputs on gloo and on every
entrenar group, interleaved, and the outputs must agree: exactly for integer
data and integer-valued floats (any summation order gives the same bits),
within float tolerance for AVG. Sizes include 0, 1, odd, uneven splits and
messages larger than the star threshold and the segment size (so the ring,
chain and pipelined paths run). Where gloo refuses a case, the expected
result is computed from every rank's inputs instead (they are reproducible).
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port
from preloaded import FORKSERVER_PRELOAD

from entrenar_pg import Options

# ----------------------------------------------------------------------------- spawning


def spawn_ranks(world: int, fn: Callable[..., None], *args: Any, timeout_s: float = 150.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes with a rendezvous env.

    A rank that raises fails the test with its traceback; ranks still running
    after ``timeout_s`` are killed (by pid) and the test fails: a hang is a failure.

    The ranks are fresh processes forked by multiprocessing's fork server,
    which has imported torch once (``preloaded.FORKSERVER_PRELOAD``): each rank then
    starts in milliseconds instead of importing torch again (about 2 s of
    CPU each, some 40 ranks over the suite). The server runs nothing but
    those imports, so no thread or group state is forked into a rank.
    """
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    ctx = mp.start_processes(
        _entry, args=(world, env, fn, args), nprocs=world, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks still running after {timeout_s}s: a hang")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _entry(rank: int, world: int, env: dict[str, str], fn: Callable[..., None], args: Any) -> None:
    gc.freeze()  # torch's objects, from the fork server: as in preloaded._run
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise


# ----------------------------------------------------------------------------- cases

SUM, AVG, PRODUCT, MIN, MAX = (
    dist.ReduceOp.SUM,
    dist.ReduceOp.AVG,
    dist.ReduceOp.PRODUCT,
    dist.ReduceOp.MIN,
    dist.ReduceOp.MAX,
)
BIG = 70_001  # float32: > star_max_bytes (64 KiB) and > the forced 4 KiB segments
SIZES = (0, 1, 7, BIG)


def data(rank: int, numel: int, dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    """Reproducible integer-valued inputs (exact under any summation order)."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * numel + salt)
    vals = torch.randint(-8, 9, (numel,), generator=g)
    return vals.to(dtype)


class Cases:
    """Each case: ``fn(group, rank, world) -> list of output tensors`` (public API only)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def all_reduce(self, g: Any, op: Any, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
        if dtype.is_complex:  # torch hands the backend a real view
            t = torch.complex(data(self.rank, n), data(self.rank, n, salt=5))
            dist.all_reduce(t, op=op, group=g)
            return [t]
        t = data(self.rank, n, dtype)
        if op == PRODUCT:
            t = t.clamp(1, 2)
        dist.all_reduce(t, op=op, group=g)
        return [t]

    def broadcast(self, g: Any, n: int) -> list[torch.Tensor]:
        outs = []
        for src in range(dist.get_world_size(g)):
            t = data(self.rank, n, salt=src)
            dist.broadcast(t, group_src=src, group=g)
            outs.append(t)
        return outs

    def reduce(self, g: Any, op: Any, n: int) -> list[torch.Tensor]:
        w, r = dist.get_world_size(g), dist.get_rank(g)
        dst = w - 1
        t = data(self.rank, n)
        if op == PRODUCT:
            t = t.clamp(1, 2)
        before = t.clone()
        dist.reduce(t, group_dst=dst, op=op, group=g)
        if r == dst:
            return [t]
        if dist.get_backend(g) == "entrenar":
            assert torch.equal(t, before), "entrenar reduce changed a non-root input"
        return []

    def all_gather(self, g: Any, n: int) -> list[torch.Tensor]:
        w = dist.get_world_size(g)
        t = data(self.rank, n)
        outs = [torch.empty(n) for _ in range(w)]
        dist.all_gather(outs, t, group=g)
        flat = torch.empty(n * w)
        dist.all_gather_into_tensor(flat, t, group=g)
        return [*outs, flat]

    def all_gather_coalesced(self, g: Any) -> list[torch.Tensor]:
        w = dist.get_world_size(g)
        ins = [data(self.rank, 3), data(self.rank, 0), data(self.rank, 5, salt=1)]
        outs_a = [torch.empty(w * t.numel()) for t in ins]
        with dist._coalescing_manager(group=g):
            for o, i in zip(outs_a, ins, strict=True):
                dist.all_gather_into_tensor(o, i, group=g)
        return outs_a

    def gather(self, g: Any, n: int) -> list[torch.Tensor]:
        w, r = dist.get_world_size(g), dist.get_rank(g)
        outs: list[torch.Tensor] = []
        for dst in sorted({0, w - 1}):
            t = data(self.rank, n, salt=dst)
            lst = [torch.empty(n) for _ in range(w)] if r == dst else None
            dist.gather(t, lst, group_dst=dst, group=g)
            outs += lst or []
        return outs

    def scatter(self, g: Any, n: int) -> list[torch.Tensor]:
        w, r = dist.get_world_size(g), dist.get_rank(g)
        outs = []
        for src in sorted({0, w - 1}):
            lst = [data(p, n, salt=src) for p in range(w)] if r == src else None
            t = torch.empty(n)
            dist.scatter(t, lst, group_src=src, group=g)
            outs.append(t)
        return outs

    def all_to_all_single(self, g: Any, uneven: bool) -> list[torch.Tensor]:
        w, r = dist.get_world_size(g), dist.get_rank(g)
        if uneven:  # rank r sends (r + p) % 3 rows of 2 to rank p (some zero)
            in_splits = [(r + p) % 3 for p in range(w)]
            out_splits = [(p + r) % 3 for p in range(w)]
        else:
            in_splits = out_splits = [2] * w
        t = data(self.rank, 2 * sum(in_splits)).reshape(-1, 2)
        out = torch.empty(sum(out_splits), 2)
        dist.all_to_all_single(
            out,
            t,
            output_split_sizes=out_splits if uneven else None,
            input_split_sizes=in_splits if uneven else None,
            group=g,
        )
        return [out]

    def all_to_all(self, g: Any) -> list[torch.Tensor]:
        w, r = dist.get_world_size(g), dist.get_rank(g)
        ins = [data(r, (r + p) % 4, salt=p) for p in range(w)]
        outs = [torch.empty((p + r) % 4) for p in range(w)]
        dist.all_to_all(outs, ins, group=g)
        for p in range(w):  # gloo refuses uneven lists: check against the senders' inputs too
            assert torch.equal(outs[p], data(p, (p + r) % 4, salt=r)), (p, outs[p])
        return outs

    def all_gather_coalesced_lists(self, g: Any) -> list[torch.Tensor]:
        w = dist.get_world_size(g)
        ins = [data(self.rank, 3), data(self.rank, 2, salt=1).reshape(1, 2)]
        outs = [[torch.empty_like(t) for t in ins] for _ in range(w)]
        dist.all_gather_coalesced(outs, ins, group=g)
        return [t for lst in outs for t in lst]

    def reduce_scatter(self, g: Any, op: Any, n: int) -> list[torch.Tensor]:
        w = dist.get_world_size(g)
        ins = [data(self.rank, n, salt=p) for p in range(w)]
        out = torch.empty(n)
        dist.reduce_scatter(out, ins, op=op, group=g)
        return [out]

    def reduce_scatter_tensor(self, g: Any, op: Any, n: int) -> list[torch.Tensor]:
        w = dist.get_world_size(g)
        t = data(self.rank, n * w)
        keep = t.clone()
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, t, op=op, group=g)
        assert torch.equal(t, keep), "reduce_scatter_tensor changed its input"
        return [out]

    def reduce_scatter_coalesced(self, g: Any) -> list[torch.Tensor]:
        w = dist.get_world_size(g)
        ins = [data(self.rank, 3 * w), data(self.rank, 0), data(self.rank, 2 * w, salt=1)]
        outs = [torch.empty(t.numel() // w) for t in ins]
        with dist._coalescing_manager(group=g):
            for o, i in zip(outs, ins, strict=True):
                dist.reduce_scatter_tensor(o, i, group=g)
        return outs

    def all_reduce_coalesced(self, g: Any) -> list[torch.Tensor]:
        ts = [data(self.rank, 5), data(self.rank, 0), data(self.rank, 9, salt=2)]
        with dist._coalescing_manager(group=g):
            for t in ts:
                dist.all_reduce(t, group=g)
        return ts

    def objects(self, g: Any) -> list[torch.Tensor]:
        w, r = dist.get_world_size(g), dist.get_rank(g)
        got: list[Any] = [None] * w
        dist.all_gather_object(got, {"rank": r, "pad": "x" * r}, group=g)
        b: list[Any] = [("from", r)]
        dist.broadcast_object_list(b, group_src=w - 1, group=g)
        gl: list[Any] | None = [None] * w if r == 0 else None
        dist.gather_object(r * r, gl, group_dst=0, group=g)
        s: list[Any] = [None]
        dist.scatter_object_list(
            s, [p + 100 for p in range(w)] if r == 0 else None, group_src=0, group=g
        )
        assert got == [{"rank": p, "pad": "x" * p} for p in range(w)], got
        assert b == [("from", w - 1)], b
        assert gl is None or gl == [p * p for p in range(w)], gl
        assert s == [r + 100], s
        return [torch.tensor([len(got)])]

    def p2p(self, g: Any) -> list[torch.Tensor]:
        """A ring of isend/irecv with two tags posted in opposite orders, then batch_isend_irecv."""
        w, r = dist.get_world_size(g), dist.get_rank(g)
        nxt, prv = (r + 1) % w, (r - 1) % w
        a, b = torch.empty(4), torch.empty(BIG)
        reqs = [
            dist.irecv(b, group_src=prv, group=g, tag=2),
            dist.irecv(a, group_src=prv, group=g, tag=1),
            dist.isend(data(r, 4, salt=1), group_dst=nxt, group=g, tag=1),
            dist.isend(data(r, BIG, salt=2), group_dst=nxt, group=g, tag=2),
        ]
        for q in reqs:
            q.wait()
        c = torch.empty(3)
        ops = [
            dist.P2POp(dist.isend, data(r, 3, salt=3), group_peer=prv, group=g),
            dist.P2POp(dist.irecv, c, group_peer=nxt, group=g),
        ]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        assert torch.equal(a, data(prv, 4, salt=1)) and torch.equal(b, data(prv, BIG, salt=2))
        assert torch.equal(c, data(nxt, 3, salt=3))
        if w == 1:
            return [a, b, c]
        # blocking send / recv from any source / object p2p, into group rank 0
        senders = []
        if r == 0:
            for _ in range(w - 1):
                t = torch.empty(2)
                src = dist.recv(t, group=g, tag=11)  # returns the sender's global rank
                senders.append(dist.get_group_rank(g or dist.group.WORLD, src))
                assert torch.equal(t, data(senders[-1], 2, salt=11))
            objs: list[Any] = [None, None]
            dist.recv_object_list(objs, group_src=w - 1, group=g)
            assert objs == [{"from": w - 1}, "x" * 1000], objs
        else:
            dist.send(data(r, 2, salt=11), group_dst=0, group=g, tag=11)
            if r == w - 1:
                dist.send_object_list([{"from": r}, "x" * 1000], group_dst=0, group=g)
        assert sorted(senders) == (list(range(1, w)) if r == 0 else [])
        return [a, b, c]


def _cases(c: Cases, full: bool) -> list[tuple[str, Callable[[Any], list[torch.Tensor]]]]:
    """(name, fn(group)) for every case; ``full`` adds the big and exotic variants."""
    out: list[tuple[str, Callable[[Any], list[torch.Tensor]]]] = []
    sizes = SIZES if full else (0, 7)
    for n in sizes:
        for op in (SUM, MAX, MIN, PRODUCT, AVG):
            out.append(
                (
                    f"all_reduce/{op}/{n}",
                    lambda g, op=op, n=n: c.all_reduce(g, op, n, torch.float32),
                )
            )
        out.append((f"broadcast/{n}", lambda g, n=n: c.broadcast(g, n)))
        out.append((f"all_gather/{n}", lambda g, n=n: c.all_gather(g, n)))
        out.append((f"gather/{n}", lambda g, n=n: c.gather(g, n)))
        out.append((f"scatter/{n}", lambda g, n=n: c.scatter(g, n)))
        for op in (SUM, MAX, PRODUCT):
            out.append((f"reduce/{op}/{n}", lambda g, op=op, n=n: c.reduce(g, op, n)))
        for op in (SUM, MAX, AVG):
            out.append(
                (f"reduce_scatter/{op}/{n}", lambda g, op=op, n=n: c.reduce_scatter(g, op, n))
            )
            out.append(
                (
                    f"reduce_scatter_tensor/{op}/{n}",
                    lambda g, op=op, n=n: c.reduce_scatter_tensor(g, op, n),
                )
            )
    if full:
        for dtype in (torch.int32, torch.int64, torch.uint8):
            for op in (SUM, MAX, dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
                out.append(
                    (
                        f"all_reduce/{op}/{dtype}",
                        lambda g, op=op, dtype=dtype: c.all_reduce(g, op, 33, dtype),
                    )
                )
    out.append(("all_reduce/complex", lambda g: c.all_reduce(g, SUM, 9, torch.complex64)))
    for uneven in (False, True):
        out.append(
            (f"all_to_all_single/uneven={uneven}", lambda g, u=uneven: c.all_to_all_single(g, u))
        )
    out.append(("all_to_all", c.all_to_all))
    out.append(("all_gather_coalesced", c.all_gather_coalesced))
    out.append(("all_gather_coalesced_lists", c.all_gather_coalesced_lists))
    out.append(("reduce_scatter_coalesced", c.reduce_scatter_coalesced))
    out.append(("all_reduce_coalesced", c.all_reduce_coalesced))
    out.append(("objects", c.objects))
    out.append(("p2p", c.p2p))
    out.append(("barrier", lambda g: [torch.tensor([float(dist.barrier(group=g) is None)])]))
    return out


def _compare(name: str, backend: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want), f"{name} on {backend}: {len(got)} outputs, gloo {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, (
            f"{name}[{i}] on {backend}: {a.shape} vs {b.shape}"
        )
        if "AVG" in name:
            torch.testing.assert_close(a, b, msg=f"{name}[{i}] on {backend} differs from gloo")
        else:
            assert torch.equal(a, b), f"{name}[{i}] on {backend} differs from gloo:\n{a}\n{b}"


def _differential_worker(rank: int, world: int) -> None:
    import entrenar_pg  # noqa: F401  (registers the backend)

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    groups: dict[str, Any] = {
        "entrenar": dist.new_group(backend="entrenar"),
        "entrenar-deterministic": dist.new_group(
            backend="entrenar", pg_options=Options(deterministic=True)
        ),
        "entrenar-ring": dist.new_group(
            backend="entrenar",
            pg_options=Options(algorithm="ring", star_max_bytes=0, segment_bytes=4096),
        ),
    }
    assert len({g.group_name for g in groups.values()}) == 3
    evens = list(range(0, world, 2))
    gloo_sub = dist.new_group(evens, backend="gloo")
    ent_sub = dist.new_group(evens, backend="entrenar")
    ent_sub2 = dist.new_group(evens, backend="entrenar")  # a second group, same members
    c = Cases(rank, world)

    def on_gloo(name: str, fn: Callable[[Any], list[torch.Tensor]], g: Any) -> Any:
        """gloo's outputs, or None for the cases gloo refuses (checked: it must refuse)."""
        w = dist.get_world_size(g)
        refuses = (name == "all_to_all" and w > 1) or (name == "p2p" and w == 1)
        if not refuses:
            return fn(g)
        with pytest.raises(RuntimeError):  # uneven all_to_all lists; isend to self
            fn(g)
        return None

    for name, fn in _cases(c, full=True):
        want = on_gloo(name, fn, None)
        first: list[torch.Tensor] | None = None
        for label, g in groups.items():
            got = fn(g)
            if want is not None:
                _compare(name, label, got, want)
            elif first is None:
                first = got  # (the case asserts its own expected values too)
            else:  # every entrenar algorithm agrees with the default one
                _compare(name, label, got, first)
    # Subgroups: interleaved with the full groups, one member set, both backends.
    if rank in evens:
        for name, fn in _cases(c, full=False):
            want = on_gloo(name, fn, gloo_sub)
            got = fn(ent_sub)
            one = torch.ones(1)
            dist.all_reduce(one, group=ent_sub2)  # interleaved with another live group
            assert one.item() == len(evens)
            if want is not None:
                _compare(f"subgroup {name}", "entrenar", got, want)
    for g in groups.values():
        dist.destroy_process_group(g)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_every_collective_matches_gloo(world: int) -> None:
    spawn_ranks(world, _differential_worker, timeout_s=170)

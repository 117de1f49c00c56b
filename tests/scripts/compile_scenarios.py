"""Every way a program compiles distributed code, on entrenar and on gloo, in one job.

Usage: torchrun --nproc_per_node=2 compile_scenarios.py --out DIR [--only a,b]

The default group is entrenar; a gloo group over the same ranks is made with
``new_group``. Each scenario runs twice in these processes, once per group,
from the same seed and the same data, with dynamo's caches reset in between,
and each rank writes DIR/rank<R>.json: per scenario, whether the entrenar run's
final parameters (or results) equal gloo's bit for bit (``torch.equal``),
whether training changed them at all, facts that show the scenario ran as
named (graphs compiled, compiled-autograd captures), the collectives the
entrenar run issued by kind, and the error of a run that raised.

Scenarios (tests/test_compile.py asserts them):
- ``ddp_optimizer``: ``torch.compile(DDP(m))``, dynamo's default DDPOptimizer
  (graph split per bucket, two buckets); the C++ reducer rebuilds its
  buckets at step 1 and broadcasts through the group inside the compiled call;
  ``ddp_optimizer_inductor``: the same with the default backend, inductor
  (the other DDP scenarios use aot_eager: no C++ compiler needed, faster);
- ``ddp_no_optimization``: the same with ``optimize_ddp=False``;
- ``ddp_batchnorm``: a BatchNorm model (DDP broadcasts its buffers every
  forward, from inside the compiled call, from step 0);
- ``fsdp2_per_block``: ``fully_shard`` and ``torch.compile`` per block;
- ``collectives_in_compiled_fn``: ``dist.all_reduce`` and the functional
  ``all_reduce`` inside a ``fullgraph=True`` compiled function;
- ``python_reducer_aot_eager`` / ``python_reducer_inductor``: compiled
  autograd with DDP's Python reducer (``optimize_ddp="python_reducer"``), the
  backward traced into the compiled step with its allreduces. These run
  after the other DDP ones: constructing such a DDP adds
  ``torch.nn.parallel.distributed`` to dynamo's inline list for the rest of
  the process;
- ``group_method_in_compiled_fn``: a group's method called in compiled code,
  refused by dynamo on gloo and on entrenar alike (a torch limit).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import entrenar_pg

STEPS = 4  # DDP rebuilds its buckets after step 0: steps 1..3 run on the rebuilt ones


class Block(nn.Module):
    """Linear, then ReLU (but in the last block). A class of the program's own:
    dynamo compiles the ``forward`` of user classes, but skips torch's built-in
    modules' (a compiled ``DDP(nn.Sequential(...))`` would compile nothing)."""

    def __init__(self, n_in: int, n_out: int, *, last: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)
        self.last = last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y if self.last else torch.relu(y)


class Net(nn.Module):
    """Three blocks; the 512x512 weight (1 MiB) fills a DDP bucket of its own
    (DDP's first bucket and DDPOptimizer's are 1 MiB, torch's
    ``_DEFAULT_FIRST_BUCKET_BYTES``, and DDPOptimizer refuses a smaller cap),
    so DDPOptimizer splits the graph in two. ``batchnorm``: a BatchNorm1d after
    the first block (running stats: buffers DDP broadcasts every forward)."""

    def __init__(self, *, batchnorm: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(8, 512), Block(512, 512), Block(512, 4, last=True)])
        self.norm = nn.BatchNorm1d(512) if batchnorm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.blocks[0](x))
        return self.blocks[2](self.blocks[1](x))


def _net(*, batchnorm: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(batchnorm=batchnorm)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


Result = tuple[list[torch.Tensor], dict[str, int]]  # tensors to compare, facts to check


def _train_ddp(group: Any, *, batchnorm: bool = False, backend: str = "aot_eager") -> Result:
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _net(batchnorm=batchnorm)
    graphs = CompileCounterWithBackend(backend)  # DDPOptimizer: one graph per bucket
    ddp = torch.compile(DDP(model, process_group=group, bucket_cap_mb=1), backend=graphs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        ddp(_batch(dist.get_rank(), step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return _state(model), {"graphs": int(graphs.frame_count)}


def ddp_optimizer(group: Any) -> Result:
    with torch._dynamo.config.patch(optimize_ddp=True):
        return _train_ddp(group)


def ddp_optimizer_inductor(group: Any) -> Result:
    with torch._dynamo.config.patch(optimize_ddp=True):
        return _train_ddp(group, backend="inductor")


def ddp_no_optimization(group: Any) -> Result:
    with torch._dynamo.config.patch(optimize_ddp=False):
        return _train_ddp(group)


def ddp_batchnorm(group: Any) -> Result:
    return _train_ddp(group, batchnorm=True)


def fsdp2_per_block(group: Any) -> Result:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    model = _net()
    graphs = CompileCounterWithBackend("aot_eager")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
        block.compile(backend=graphs)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        model(_batch(dist.get_rank(), step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = [p.full_tensor().detach() for p in model.parameters()]
    return params, {"graphs": int(graphs.frame_count)}


def collectives_in_compiled_fn(group: Any) -> Result:
    """Traced into the graph (``fullgraph``): ``dist.all_reduce``, the functional
    ``all_reduce``; run eagerly at a graph break, inside the compiled call:
    ``dist.broadcast``, an ``async_op`` allreduce. Each result is also checked
    against its value computed here from both ranks' inputs."""

    def c10d(v: torch.Tensor) -> torch.Tensor:
        w = v * 2
        dist.all_reduce(w, group=group)
        return w + 1

    def functional(v: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(v * 3, "sum", group) - 1

    def broadcast(v: torch.Tensor) -> torch.Tensor:
        w = v * 2
        dist.broadcast(w, dist.get_global_rank(group, 0), group=group)
        return w + 1

    def async_allreduce(v: torch.Tensor) -> torch.Tensor:
        w = v * 2
        dist.all_reduce(w, group=group, async_op=True).wait()
        return w - 1

    def expected(name: str, step: int) -> torch.Tensor:
        b = [_batch(r, step) for r in range(dist.get_world_size())]
        return {
            "c10d": (b[0] * 2 + b[1] * 2) + 1,
            "functional": (b[0] * 3 + b[1] * 3) - 1,
            "broadcast": b[0] * 2 + 1,
            "async_allreduce": (b[0] * 2 + b[1] * 2) - 1,
        }[name]

    out = []
    for fn, fullgraph in ((c10d, True), (functional, True), (broadcast, False)):
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)
        for step in range(2):
            got = compiled(_batch(dist.get_rank(), step))
            assert torch.equal(got, expected(fn.__name__, step)), (fn.__name__, step)
            out.append(got)
    compiled = torch.compile(async_allreduce, backend="aot_eager")
    for step in range(2):
        got = compiled(_batch(dist.get_rank(), step))
        assert torch.equal(got, expected("async_allreduce", step)), ("async_allreduce", step)
        out.append(got)
    return out, {}


def group_method_in_compiled_fn(group: Any) -> Result:
    """A torch limit, pinned: dynamo cannot call a process group's method
    (``group.allreduce([t])``) in compiled code, on any backend (a group is an
    opaque script object to it). The fact recorded is the error's class."""

    def direct(v: torch.Tensor) -> torch.Tensor:
        w = v * 2
        group.allreduce([w]).wait()
        return w

    try:
        torch.compile(direct, backend="aot_eager")(_batch(dist.get_rank(), 0))
    except Exception as e:
        return [], {"refused": type(e).__name__}
    return [], {"refused": ""}


def _python_reducer(group: Any, backend: str) -> Result:
    from torch._dynamo.utils import counters

    model = _net()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer", compiled_autograd=True):
        ddp = DDP(model, process_group=group, bucket_cap_mb=1)

        @torch.compile(backend=backend)
        def train_step(x: torch.Tensor) -> None:
            ddp(x).square().mean().backward()  # traced by compiled autograd

        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            train_step(_batch(dist.get_rank(), step))
            opt.step()
            opt.zero_grad()
    return _state(model), {"captures": int(counters["compiled_autograd"]["captures"])}


def python_reducer_aot_eager(group: Any) -> Result:
    return _python_reducer(group, "aot_eager")


def python_reducer_inductor(group: Any) -> Result:
    return _python_reducer(group, "inductor")


SCENARIOS: dict[str, Callable[[Any], Result]] = {
    f.__name__: f
    for f in (
        ddp_optimizer,
        ddp_optimizer_inductor,
        ddp_no_optimization,
        ddp_batchnorm,
        fsdp2_per_block,
        collectives_in_compiled_fn,
        python_reducer_aot_eager,  # after the DDPOptimizer ones: see the module docstring
        python_reducer_inductor,
        group_method_in_compiled_fn,
    )
}


def _calls(group: Any) -> dict[str, int]:
    return {k: int(v) for k, v in entrenar_pg.get_stats(group).items() if k.endswith("_calls")}


def _run(fn: Callable[[Any], Result], group: Any) -> Result:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # each run compiles afresh, as a new program would
    counters.clear()
    return fn(group)


def _scenario(name: str, gloo: Any) -> dict[str, Any]:
    world = dist.group.WORLD
    before = _calls(world)
    ours, facts = _run(SCENARIOS[name], world)
    after = _calls(world)
    ref, ref_facts = _run(SCENARIOS[name], gloo)
    start = _state(_net(batchnorm="batchnorm" in name))
    return {
        "error": None,
        "facts": facts,
        "gloo_facts": ref_facts,
        # collectives entrenar ran during its run, by kind
        "calls": {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)},
        "tensors": len(ref),
        "equal": _all_equal(ours, ref),
        # every floating-point tensor moved off its initial value (a training scenario)
        "changed": len(ours) == len(start)
        and not any(
            torch.equal(a, b) for a, b in zip(ours, start, strict=True) if a.is_floating_point()
        ),
    }


def _all_equal(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return len(xs) == len(ys) and all(torch.equal(a, b) for a, b in zip(xs, ys, strict=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("entrenar", timeout=timedelta(seconds=60))
    assert dist.get_backend() == "entrenar"
    gloo = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    results: dict[str, dict[str, Any]] = {}
    for name in [n for n in args.only.split(",") if n] or list(SCENARIOS):
        t0 = time.perf_counter()
        try:
            results[name] = _scenario(name, gloo)
        except Exception as e:  # recorded; the test names the scenario and shows it
            tb = traceback.format_exc()[-3000:]
            results[name] = {"error": f"{type(e).__name__}: {e}\n{tb}"}
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)  # both runs
        print(f"rank {rank}: {name}: {results[name]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": STEPS, "scenarios": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

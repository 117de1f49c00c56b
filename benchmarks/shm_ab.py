"""The shm allreduce against a baseline tree's, in the same processes (issue 25, item 7).

``python -m benchmarks.shm_ab --baseline-tree DIR [--world 2] [--sizes 4K,1M,16M]``

Two bench runs of different trees are separate jobs, and on a shared
machine the load between them moves even unchanged code by 20-40%. Here
both algorithms run in one job, on the same slot areas: each rank loads the
baseline's ``collectives/shm_allreduce.py`` and ``transport/shm/slots.py`` (from
``DIR/entrenar_pg``) beside this checkout's, builds a baseline ``SlotArea``
over the same mapped memory, and swaps the group's slot area and SHM
allreduce between the two every ``--per`` calls (the phase counter lives in
the shared memory, so either picks up where the other left). The baseline
must still run on this checkout's modules below it (``common``, ``wire``,
``reduce_ops``, ``shm``). Reported: per-iteration maximum over ranks,
median and quartiles, new / baseline; both are checked to give the
same sum first.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
import time
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .sizes import parse_sizes

_ARRIVED = 8  # slots._ARRIVED: the control word holding the last phase published


def _load(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Swap:
    """The group's slot area and SHM allreduce, switched between new and baseline."""

    def __init__(self, mesh: Any, baseline_dir: str) -> None:
        from entrenar_pg.runtime import jobs
        from entrenar_pg.wire import Algo

        old_slots = _load(
            "entrenar_pg.transport.shm._baseline_slots", f"{baseline_dir}/transport/shm/slots.py"
        )
        old_alg = _load(
            "entrenar_pg.collectives._baseline_shm_allreduce",
            f"{baseline_dir}/collectives/shm_allreduce.py",
        )
        new_area = mesh.slots
        links = {link.peer: link for link in new_area._links}
        old_area = old_slots.SlotArea(new_area.rank, dict(enumerate(new_area._areas)), links)
        self._mesh, self._table, self._key = mesh, jobs._ALLREDUCE, Algo.SHM
        self._scratch: Any = None  # the group's ScratchPool (set by ``_rank``)
        self.thin: Any = None  # the group's ThinPath (set by ``_rank``)
        self._plans: dict[str, dict[Any, Any]] = {"baseline": {}, "new": {}}
        self._using = "new"
        self.variants = {
            "baseline": (old_area, old_alg.allreduce_shm),
            "new": (new_area, jobs._ALLREDUCE[Algo.SHM]),
        }

    def use(self, name: str) -> None:
        if self._scratch is not None:  # each variant keeps its own cached shapes
            plans = self._scratch._plans
            mine = {k: v for k, v in plans.items() if k and k[0] == "shm"}
            self._plans[self._using] = mine
            for k in mine:
                del plans[k]
            plans.update(self._plans[name])
        self._using = name
        if self.thin is not None:
            # The thin path's own two-rank sums bypass the table: only the
            # new tree's; its routes are made again under the variant in use.
            self.thin.pair_sums = name == "new"
            self.thin._routes.clear()
        area, fn = self.variants[name]
        area.phase = int(area._own[_ARRIVED])  # the shared truth
        self._mesh.slots = area
        self._table[self._key] = fn


def _rank(rank: int, world: int, port: int, args: dict[str, Any], queue: Any) -> None:
    torch.set_num_threads(1)
    if args["pin"]:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    os.environ["ENTRENAR_TRANSPORT"] = "shm"
    import entrenar_pg  # noqa: F401  (registers the backend)

    dist.init_process_group(
        "entrenar",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    group = dist.group.WORLD
    assert group is not None
    backend: Any = group._get_backend(torch.device("cpu"))  # the EntrenarProcessGroup
    swap = _Swap(backend._runtime.mesh, args["dirs"])
    swap._scratch = backend._runtime.scratch
    swap.thin = backend._thin
    names = list(swap.variants)
    out: dict[int, dict[str, list[float]]] = {}
    for nbytes in args["sizes"]:
        n = nbytes // 4
        for name in names:  # the same sum from both
            swap.use(name)
            x = torch.arange(n, dtype=torch.float32) + rank
            dist.all_reduce(x)
            want = world * torch.arange(n, dtype=torch.float32) + sum(range(world))
            assert torch.equal(x, want), (name, nbytes)
        t = torch.ones(n)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for block in range(args["blocks"]):
            for name in names if block % 2 == 0 else names[::-1]:
                swap.use(name)
                dist.all_reduce(t)  # warm-up of the block
                for _ in range(args["per"]):
                    began = time.perf_counter()
                    dist.all_reduce(t)
                    samples[name].append(time.perf_counter() - began)
        out[nbytes] = samples
    swap.use("new")
    queue.put((rank, out))
    dist.destroy_process_group()


_QUANTILES = (0.25, 0.5, 0.75)  # the columns: quartiles and median


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shm_ab", description=__doc__)
    p.add_argument("--baseline-tree", required=True, help="a directory holding entrenar_pg/")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes", default="4K,64K,1M,4M,16M", help="float32 message sizes")
    p.add_argument("--blocks", type=int, default=10, help="alternating blocks per size")
    p.add_argument("--per", type=int, default=20, help="timed calls per block")
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin rank r to CPU r mod the CPU count: ranks on cores of their own, as on a "
        "quiet machine (a loaded scheduler may put two ranks on one core for a whole run)",
    )
    a = p.parse_args(argv)
    root = os.path.join(a.baseline_tree, "entrenar_pg")
    if not os.path.exists(f"{root}/collectives/shm_allreduce.py"):
        raise SystemExit(f"no entrenar_pg/collectives/shm_allreduce.py under {a.baseline_tree}")
    args = {
        "dirs": root,
        "sizes": parse_sizes(a.sizes),
        "blocks": a.blocks,
        "per": a.per,
        "pin": a.pin,
    }
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = random.randint(20000, 60000)
    procs = [
        ctx.Process(target=_rank, args=(r, a.world, port, args, queue)) for r in range(a.world)
    ]
    for proc in procs:
        proc.start()
    got = dict(queue.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join(60)
    pinned = "; ranks pinned to CPUs" if a.pin else ""
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; N={a.world}{pinned}")
    print(f"per iteration, max over ranks; {a.blocks} alternating blocks of {a.per} calls; us")
    print(
        f"{'size':>9} {'base p25':>9} {'base med':>9} {'base p75':>9}  {'new p25':>9} "
        f"{'new med':>9} {'new p75':>9}  {'new/base med':>12} {'p25':>5} {'p75':>5}"
    )
    for nbytes in args["sizes"]:
        per_iter = {
            name: [
                max(got[r][nbytes][name][i] for r in got) for i in range(len(got[0][nbytes][name]))
            ]
            for name in ("baseline", "new")
        }
        base = [_quantile(per_iter["baseline"], q) * 1e6 for q in _QUANTILES]
        new = [_quantile(per_iter["new"], q) * 1e6 for q in _QUANTILES]
        ratios = [n / b for n, b in zip(new, base, strict=True)]
        print(
            f"{nbytes:>9} {base[0]:9.1f} {base[1]:9.1f} {base[2]:9.1f}  {new[0]:9.1f} "
            f"{new[1]:9.1f} {new[2]:9.1f}  {ratios[1]:12.2f} {ratios[0]:5.2f} {ratios[2]:5.2f}"
        )


if __name__ == "__main__":
    main()

"""Differential test: identical inputs through gloo and through entrenar (ring, star, auto).

Run under torchrun. Every group size ``n`` from 2 to the job's world size is
checked in the one job: the whole job, then groups of its first ``n`` ranks
(gloo's and entrenar's alike), so the interpreters start once. Prints
``DIFF <n> <rank> <checked> <failures> <gloo-unsupported>`` for each group
this rank is in, and one ``FAIL ...`` line per disagreement.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from entrenar_pg import Options

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
ops = {
    "SUM": dist.ReduceOp.SUM,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "BAND": dist.ReduceOp.BAND,
    "BOR": dist.ReduceOp.BOR,
    "BXOR": dist.ReduceOp.BXOR,
    "AVG": dist.ReduceOp.AVG,
}
dtypes = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def compare(members: int, gloo: dist.ProcessGroup) -> None:
    """Every op, dtype and size through ``gloo`` and through entrenar groups of the same ranks."""
    # new_group is collective over the default group: every rank creates every group.
    ranks = list(range(members))
    groups = {
        a: dist.new_group(
            ranks, backend="entrenar", pg_options=Options(algorithm=a, segment_bytes=256)
        )
        for a in ("ring", "star", "auto")
    }
    if rank >= members:
        return
    checked = failures = unsupported = 0
    for name, op in ops.items():
        for dt in dtypes:
            for n in (0, 1, 7, 1000):
                g = torch.Generator().manual_seed(hash((name, str(dt), n, rank)) % 2**31)
                if dt == torch.bool:
                    x = torch.rand(n, generator=g) > 0.5
                elif dt.is_floating_point:
                    x = (torch.rand(n, generator=g) + 0.5).to(dt)
                else:
                    x = torch.randint(1, 4, (n,), generator=g).to(dt)
                ref = x.clone()
                if name == "AVG" and not dt.is_floating_point:
                    # gloo divides a bool or integer tensor in place after the sum
                    # ("result type Float can't be cast to ... Byte"): an error raised
                    # in its work thread, usually by this call's wait but now and then
                    # only at the next one (the final barrier: 1 in ~20 runs, for bool
                    # and for uint8); the same "unsupported" as a gloo call that raises
                    # here. entrenar's integer AVG is checked in tests/test_int_avg.py.
                    unsupported += 1
                    continue
                try:
                    dist.all_reduce(ref, op=op, group=gloo)
                except Exception:
                    unsupported += 1
                    # entrenar must then either compute it or refuse it with ValueError
                    continue
                for algo, grp in groups.items():
                    got = x.clone()
                    try:
                        dist.all_reduce(got, op=op, group=grp)
                    except ValueError as e:
                        failures += 1
                        print(
                            f"FAIL {rank} {algo} {name} {dt} n={n}: entrenar refused: {e}",
                            flush=True,
                        )
                        continue
                    checked += 1
                    if dt.is_floating_point:
                        tol = 1e-2 if dt in (torch.float16, torch.bfloat16) else 1e-6
                        ok = torch.allclose(got.double(), ref.double(), rtol=tol, atol=tol)
                    else:
                        ok = torch.equal(got, ref)
                    if not ok:
                        failures += 1
                        print(
                            f"FAIL {rank} {algo} {name} {dt} n={n}: {got[:4]} vs {ref[:4]}",
                            flush=True,
                        )
    print(f"DIFF {members} {rank} {checked} {failures} {unsupported}", flush=True)


for members in range(world, 1, -1):
    gloo = dist.group.WORLD if members == world else dist.new_group(list(range(members)))
    compare(members, gloo)
dist.barrier()
dist.destroy_process_group()

"""entrenar's shared-memory allreduce against DeepSpeed's, in pairs of blocks moments apart.

``torchrun --standalone --nproc_per_node=2 -m benchmarks.shm_pairs [--size 64K]
[--pairs 40] [--calls 3000] [--out pairs.json]``

This 2-vCPU VM changes state every few seconds to minutes (docs/benchmarks.md,
"the two states of the machine", and the twenty-seventh session's "three
states"), and a shared-memory allreduce of 64 KiB takes 11, 15, 19 or 37 us
with the state, ours and DeepSpeed's alike but not by the same factor. The
bench's short blocks (a few calls each, every contestant in turn) mix the
states, so one job's medians can favour either side. Here each pair is one
block of ``--calls`` blocking calls of each, back to back, both after a
barrier, so both blocks of a pair nearly always ran in one state; the
cross-core round trip (``benchmarks/cross_core.py``) after each pair says
which. The report: each pair's medians and ratio, how many pairs ours won,
and the ratios' median and range.

Both run on one process group each over the same two ranks: the default
gloo group (DeepSpeed wraps it) and an entrenar group. DeepSpeed's segments
are unlinked at the end (``deepspeed_peer.remove_segments``). Without
DeepSpeed (``bash benchmarks/install_peers.sh``) it says so and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .cross_core import round_trip_ns
from .deepspeed_peer import DeepSpeedShm, deepspeed_available, remove_segments
from .sizes import format_bytes, parse_bytes
from .workers import Contestant, _GroupAllreduce, _time_allreduce, _verify

WARMUP_CALLS = 200


@dataclass(frozen=True)
class Pair:
    """One pair of blocks: each side's median seconds a call, then the probe."""

    entrenar_s: float
    deepspeed_s: float
    round_trip_ns: float | None  # rank 0's probe after the pair (None: not both CPUs)

    @property
    def ratio(self) -> float:
        return self.entrenar_s / self.deepspeed_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.shm_pairs", description=__doc__)
    ap.add_argument("--size", default="64K", help="message size (default 64K)")
    ap.add_argument("--pairs", type=int, default=40, help="pairs of blocks (default 40)")
    ap.add_argument("--calls", type=int, default=3000, help="calls per block (default 3000)")
    ap.add_argument("--out", type=Path, help="write the pairs as JSON here (rank 0)")
    args = ap.parse_args(argv)
    ok, why = deepspeed_available()
    if not ok:
        print(f"shm_pairs: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("shm_pairs: two ranks (torchrun --nproc_per_node=2)")
    deepspeed = DeepSpeedShm(rank)
    ours = _GroupAllreduce(dist.new_group(backend="entrenar"))
    nbytes = parse_bytes(args.size)
    t = torch.ones(nbytes // 4)
    try:
        for name, who in (("entrenar", ours), ("deepspeed", deepspeed)):
            _verify(t, who, rank, world, name)
            _time_allreduce(t, who, WARMUP_CALLS, 0)
        pairs: list[Pair] = []
        for _ in range(args.pairs):
            dist.barrier()
            a = _median(t, ours, args.calls)
            dist.barrier()
            b = _median(t, deepspeed, args.calls)
            dist.barrier()  # the probe pins a process to each CPU: no rank spins meanwhile
            probe = round_trip_ns(5000) if rank == 0 else None
            dist.barrier()
            pairs.append(Pair(a, b, probe))
    finally:
        dist.barrier()
        if rank == 0:
            # Named after torchrun's MASTER_ADDR ("localhost" with --standalone).
            remove_segments(int(os.environ["MASTER_PORT"]), world, addr=os.environ["MASTER_ADDR"])
    if rank == 0:
        _report(pairs, nbytes, args)
    dist.destroy_process_group()
    return 0


def _median(t: torch.Tensor, who: Contestant, calls: int) -> float:
    """Median seconds a call over one block of ``calls`` blocking allreduces."""
    return statistics.median(_time_allreduce(t, who, 0, calls))


def _report(pairs: list[Pair], nbytes: int, args: argparse.Namespace) -> None:
    print(f"{format_bytes(nbytes)}, N=2, {len(pairs)} pairs of {args.calls} calls each")
    print("pair  entrenar  deepspeed  ratio  round trip")
    for i, p in enumerate(pairs):
        where = "-" if p.round_trip_ns is None else f"{p.round_trip_ns:.0f} ns"
        us = 1e6 * p.entrenar_s, 1e6 * p.deepspeed_s
        print(f"{i:4d}  {us[0]:6.1f} us  {us[1]:6.1f} us  {p.ratio:5.2f}  {where}")
    ratios = [p.ratio for p in pairs]
    won = sum(r <= 1 for r in ratios)
    print(
        f"entrenar at or under DeepSpeed's time in {won} of {len(ratios)} pairs; "
        f"ratio median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})"
    )
    if args.out is not None:
        rows = [dataclasses.asdict(p) for p in pairs]
        args.out.write_text(json.dumps({"nbytes": nbytes, "calls": args.calls, "pairs": rows}))


if __name__ == "__main__":
    raise SystemExit(main())

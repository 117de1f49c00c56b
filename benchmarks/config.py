"""What a benchmark run measures: units, variant names, the variants, :class:`BenchConfig`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks import floor

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
FLOAT32_BYTES = 4

RAW = "raw-tcp"
MPI_SHM = "mpi"
MPI_TCP = "mpi-tcp"
GLOO = "gloo"
DEEPSPEED = "deepspeed-shm"  # deepspeed.comm.inference_all_reduce (benchmarks/deepspeed_peer.py)
BASELINE = "@baseline"  # suffix of the variants run on the --baseline-tree's entrenar_pg


@dataclass(frozen=True)
class Variant:
    """One process group under test: a backend plus entrenar ``Options`` keyword arguments."""

    name: str
    backend: str
    options: dict[str, Any] = field(default_factory=dict)
    # entrenar only: the ENTRENAR_TRANSPORT its group is created with ("": the
    # environment's, unchanged). Set by with_transports(), which also names it.
    transport: str = ""
    # How the sweep calls it: "dist" is ``dist.all_reduce(t, group=g)``, what a
    # program writes; "method" is the group's own ``g.allreduce([t], opts).wait()``,
    # which skips torch.distributed's Python wrapper (~2 us a call here), as
    # DeepSpeed's ``inference_all_reduce`` skips it for its op.
    call: str = "dist"


# Allreduce sweep variants, keyed by the short names --algos takes.
SWEEP_VARIANTS: dict[str, Variant] = {
    "gloo": Variant(GLOO, "gloo"),
    "ring": Variant("entrenar-ring", "entrenar", {"algorithm": "ring"}),
    "star": Variant("entrenar-star", "entrenar", {"algorithm": "star"}),
    "direct": Variant("entrenar-direct", "entrenar", {"algorithm": "direct"}),
    "inline": Variant(
        "entrenar-auto-inline", "entrenar", {"algorithm": "auto", "inline_max_bytes": 262144}
    ),
    "auto": Variant("entrenar-auto", "entrenar", {"algorithm": "auto"}),
    "method": Variant("entrenar-auto-method", "entrenar", {"algorithm": "auto"}, call="method"),
    "det": Variant("entrenar-det", "entrenar", {"algorithm": "auto", "deterministic": True}),
    # DeepSpeed's same-host shared-memory allreduce (SUM only, whole world only):
    # the peer of entrenar's shm transport. Skipped, with a note, where deepspeed
    # is not installed (benchmarks/install_peers.sh installs it).
    "deepspeed": Variant(DEEPSPEED, "deepspeed"),
}

# The ENTRENAR_TRANSPORT values --transports takes.
TRANSPORTS = ("tcp", "shm", "auto")

FLOOR = "floor (no comm)"

# DDP step variants (the entrenar ones when entrenar is available). The floor
# is a reference, not a contestant: a backend that moves nothing
# (benchmarks/floor.py), so a step's distance above it is what
# communication costs.
DDP_VARIANTS: tuple[Variant, ...] = (
    Variant(GLOO, "gloo"),
    Variant("entrenar", "entrenar", {"algorithm": "auto"}),
    Variant("entrenar-check", "entrenar", {"algorithm": "auto", "check": True}),
    # The opt-in that runs DDP's async bucket allreduces in the autograd thread
    # (no comm-thread hand-off; see Options.inline_max_bytes for its hazard).
    Variant("entrenar-inline", "entrenar", {"algorithm": "auto", "inline_max_bytes": 64 << 20}),
    Variant(FLOOR, floor.BACKEND),
)


def with_transports(variants: Sequence[Variant], transports: Sequence[str]) -> list[Variant]:
    """Each entrenar variant once per transport, named ``<name>[<transport>]``; others as given.

    No transports: the variants unchanged (their groups take ENTRENAR_TRANSPORT
    from the environment, as a user's would).
    """
    if not transports:
        return list(variants)
    out: list[Variant] = []
    for v in variants:
        if v.backend != "entrenar":
            out.append(v)
            continue
        out += [dataclasses.replace(v, name=f"{v.name}[{t}]", transport=t) for t in transports]
    return out


def base_name(name: str) -> str:
    """A variant's name without its ``[transport]`` and ``@baseline`` suffixes."""
    return name.removesuffix(BASELINE).split("[", 1)[0]


DEFAULT_SIZES = "4K:256M:x4"
QUICK_SIZES = "4K,64K,1M,4M"
# Issue 17's table: the sizes its goals name.
ISSUE17_SIZES = "4K,64K,1M,16M,64M"


@dataclass(frozen=True)
class BenchConfig:
    """Everything a benchmark run needs; plain data so it can be sent to spawned workers."""

    world_sizes: tuple[int, ...] = (2, 4)
    sizes: tuple[int, ...] = ()
    algos: tuple[str, ...] = tuple(SWEEP_VARIANTS)
    transports: tuple[str, ...] = ()
    ddp_variants: tuple[str, ...] = ()  # DDP_VARIANTS names to run ((): all)
    repeats: int = 50
    min_repeats: int = 5
    rounds: int = 5
    # Untimed calls before each block's timed ones; -1: by size (``sizes.plan_for``).
    warmup: int = -1
    budget_bytes: int = 2 * GiB
    raw: bool = True
    raw_min_bytes: int = 1 * MiB
    mpi: bool = True
    ddp: bool = True
    ddp_steps: int = 120
    ddp_rounds: int = 12
    timeout_s: float = 900.0
    op_timeout_s: float = 120.0
    quick: bool = False
    entrenar: bool = True
    baseline_tree: str = ""
    baseline_rounds: int = 2
    pin: bool = False  # rank r's process on the r-th allowed CPU (modulo their number)
    out: str = "bench_out"

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchConfig:
        """Inverse of :meth:`to_json`."""
        kw = dict(data)
        for name in ("world_sizes", "sizes", "algos", "transports", "ddp_variants"):
            kw[name] = tuple(kw[name])
        return cls(**kw)

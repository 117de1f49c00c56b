"""What an emulated-cluster run measures: its variants and :class:`ClusterConfig` (plain data)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from benchmarks.config import GLOO, BenchConfig, MiB, Variant

ENTRENAR = "entrenar"
ENTRENAR_FLAT = "entrenar-flat"

ENTRENAR_HOSTS = "entrenar-hosts"  # host-aware whatever the link probe says
ENTRENAR_LEADERS = "entrenar-leaders"
ENTRENAR_SLICES = "entrenar-slices"
# The waits spinning on past their job's spin while no other thread waits
# for a core (Options.idle_spin_us: transport/spin.py), against entrenar's
# default (off) in the same job.
ENTRENAR_IDLE_SPIN = "entrenar-idle-spin"

# entrenar with host-awareness forced off. The one place that says how: the
# Options override. Where Options has no such field (an entrenar_pg before
# issue 26), resolve_variants() drops the override and entrenar-flat runs the
# same code as entrenar, and the run's notes say so.
FLAT_OVERRIDES: dict[str, Any] = {"topology": "flat"}

# The contestants, in the order of the first round (later rounds rotate it).
# entrenar-hosts forces the host-aware rows on any link (today's path before
# the link probe: compare it with entrenar unshaped). The last two pin one
# host-aware allreduce at every size (the policy's crossover between them,
# Options.host_leaders_max_bytes, is measured with them); entrenar-idle-spin
# is entrenar with a 1 ms idle spin. These four run only when named in
# --variants.
CLUSTER_VARIANTS: tuple[Variant, ...] = (
    Variant(GLOO, "gloo"),
    Variant(ENTRENAR, "entrenar"),
    Variant(ENTRENAR_FLAT, "entrenar", FLAT_OVERRIDES),
    Variant(ENTRENAR_HOSTS, "entrenar", {"topology": "hosts"}),
    Variant(
        ENTRENAR_LEADERS,
        "entrenar",
        {
            "host_leaders_max_bytes": 1 << 40,
            "host_leaders_link_bytes": 1 << 40,
            "host_star_max_bytes": 0,
        },
    ),
    Variant(ENTRENAR_SLICES, "entrenar", {"host_leaders_max_bytes": 0}),
    Variant(ENTRENAR_IDLE_SPIN, "entrenar", {"idle_spin_us": 1000}),
)
DEFAULT_VARIANTS: tuple[str, ...] = (GLOO, ENTRENAR, ENTRENAR_FLAT)

DEFAULT_SIZES = "4K,64K,1M,16M,64M"


@dataclass(frozen=True)
class ClusterConfig:
    """Everything one emulated-cluster job needs; JSON-able, read by every rank."""

    hosts: int = 2
    local: int = 2
    sizes: tuple[int, ...] = ()
    rate: str | None = None  # tbf rate of every host link, both ways (tc units)
    delay: str | None = None  # netem delay on every host's egress (needs sch_netem)
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    repeats: int = 20
    min_repeats: int = 4
    rounds: int = 4
    budget_bytes: int = 512 * MiB
    calibration_blocks: int = 5
    op_timeout_s: float = 120.0
    timeout_s: float = 900.0

    @property
    def world(self) -> int:
        """Ranks in the job."""
        return self.hosts * self.local

    def plan_config(self) -> BenchConfig:
        """The sampling knobs as benchmarks.sizes.plan_for reads them."""
        return BenchConfig(
            repeats=self.repeats,
            min_repeats=self.min_repeats,
            rounds=self.rounds,
            budget_bytes=self.budget_bytes,
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterConfig:
        """Inverse of :meth:`to_json`."""
        kw = dict(data)
        kw["sizes"] = tuple(kw["sizes"])
        kw["variants"] = tuple(kw["variants"])
        return cls(**kw)


def resolve_variants(
    names: tuple[str, ...], option_fields: set[str]
) -> tuple[list[Variant], list[str]]:
    """The named variants with every Options override this entrenar_pg lacks dropped.

    Returns the variants to run and one note per dropped override (a variant
    whose override is gone measures the same code as its plain twin, and the
    report must say so rather than show two names for one thing).
    """
    by_name = {v.name: v for v in CLUSTER_VARIANTS}
    out: list[Variant] = []
    notes: list[str] = []
    for name in names:
        v = by_name[name]
        missing = sorted(k for k in v.options if k not in option_fields)
        if missing:
            notes.append(
                f"{v.name}: entrenar_pg.Options has no {', '.join(missing)} field; "
                f"{v.name} runs the same code as {ENTRENAR} (overrides {v.options} dropped)"
            )
            v = dataclasses.replace(
                v, options={k: x for k, x in v.options.items() if k not in missing}
            )
        out.append(v)
    return out, notes

"""One rank of a measurement: ``python -m benchmarks.model.rank --config SPEC.json --out DIR``.

Started by ``measure.py`` under torchrun in an emulated host's namespace
(``benchmarks/netns_job.py``). The rank is the emulated cluster's
(``benchmarks/cluster_rank.py``: the checked first call, the interleaved
rounds with the order rotated, the fenced blocks, the per-call timing) run on
the spec's own variants (entrenar with a forced transport and algorithm,
gloo) instead of the cluster's. SPEC is ``{"cluster": ClusterConfig JSON,
"variants": [config.Variant fields, ...]}``; ``DIR/rank<R>.json`` is the
cluster's rank record, whose ``times`` the measurement reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.cluster_config import ClusterConfig
from benchmarks.cluster_rank import run_or_exit
from benchmarks.config import Variant


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model.rank")
    p.add_argument("--config", required=True, help="the sweep's spec (measure.Sweep.spec())")
    p.add_argument("--out", required=True, help="directory for rank<R>.json")
    a = p.parse_args(argv)
    spec = json.loads(Path(a.config).read_text())
    variants = [Variant(**v) for v in spec["variants"]]
    run_or_exit(ClusterConfig.from_json(spec["cluster"]), Path(a.out), variants)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

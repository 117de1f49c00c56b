"""A rank of ``benchmarks.cluster_trainer``: trainer/train.py, counting the algorithms it sends.

Runs trainer/train.py's ``main`` with this process's arguments (torchrun's
environment as the trainer reads it), with every collective header entrenar
packs counted by (op, algorithm) (``wire.Header.pack_into``: what a link is
sent, so what ran, not what the policy would answer; a kept plan packs its
header once and its reruns only restamp the seq, so a DDP bucket's
``HOST_SLICES`` counts once, not once a step). At exit the rank
prints one line::

    TRAINER-ALGOS <rank> <world> {"ALLREDUCE/HOST_SLICES": 14, ...}

which the driver reads to check that an emulated multi-host run took the
host-aware path. Nothing else of the trainer changes.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

from entrenar_pg.wire import Header

REPO = Path(__file__).resolve().parents[1]
MARK = "TRAINER-ALGOS"

sent: collections.Counter[str] = collections.Counter()
_pack = Header.pack_into


def _counting_pack(self: Header, buf: bytearray) -> None:
    sent[f"{self.op.name}/{self.algo.name}"] += 1
    _pack(self, buf)


def main() -> int:
    Header.pack_into = _counting_pack  # type: ignore[method-assign]
    sys.path.insert(0, str(REPO))
    from trainer.train import main as train

    try:
        return train(sys.argv[1:])
    finally:
        rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
        # One write: under PYTHONUNBUFFERED print's text and newline are two,
        # and the ranks share torchrun's stdout.
        sys.stdout.write(f"{MARK} {rank} {world} {json.dumps(dict(sorted(sent.items())))}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())

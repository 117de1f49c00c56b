"""The link kinds of the cost model and their fitted parameters.

A *kind* is one way bytes move between two ranks (or, for ``reduce``, through
one rank's CPU); its parameters are the alpha-beta pair of the model,
``time = alpha + beta * bytes`` for one message. Alpha is everything paid
once per message in sequence (software and wire latency), beta everything
paid per byte on the busiest resource (copies, the wire's rate, and for
entrenar's kinds the receiver's bookkeeping; the sums themselves are the
separate ``reduce`` kind, measured in process).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# entrenar's kinds
SHM = "shm"  # shared-memory byte rings between two ranks of one host (transport/shm/ring.py)
SLOTS = "slots"  # the shm-native allreduce's slot copies (collectives/shm_allreduce.py)
LOOPBACK = "loopback"  # TCP over the loopback interface
NET = "net"  # TCP through a host's link (the shaped veth); bytes counted per host link
REDUCE = "reduce"  # one combine (a += b) on one rank's CPU: beta per byte of the result
# Not a link: a hop's wait for its rank to be scheduled, alpha per turn of the
# other ranks sharing its core (costs.hop_wait: k-1 turns a rooted hop, k/2 a
# symmetric round; a spinning rank's turn); fitted from the
# emulated clusters' rows below 1 MiB (wake.py), beta unused.
WAKE = "wake"
# gloo's: a hop's wake-up of a sleeping thread (gloo blocks where entrenar
# spins: costs.Fabric.spins), alpha per hop while ranks outnumber cores.
GLOO_WAKE = "gloo-wake"
# Not a link: the load. A spinning rank's hop's wait for another job's thread,
# alpha at a busy share of 1 (costs.Conditions.load_wait: alpha x the share of the
# cores other processes took, recorded per row by the cluster harness), fitted
# from loaded cluster rows (wake.py); gloo blocks and pays none. beta unused.
LOAD = "load"
# Not links: what a call pays with a core per rank beyond its hops' alphas, fitted
# from emulated-cluster rows below 1 MiB where every rank has its own core
# (dedicated.py), beta unused. GLOO_CALL: alpha once per gloo call (its work
# handed to a thread and waited for), split off the 2-rank sweep's alpha per
# message, which paid it once per 2 messages. QUEUED_FRAME: alpha per frame that
# the busiest rank of an entrenar hop handles after another one (a star's root
# takes its N-1 peers' frames one after another: costs.Phase.queued); a 2-rank
# sweep's hop has none.
GLOO_CALL = "gloo-call"
QUEUED_FRAME = "queued-frame"
# gloo's kinds (its own software costs over the same wires; its sums are in its betas)
GLOO_LOOPBACK = "gloo-loopback"
GLOO_NET = "gloo-net"

KINDS = (
    SHM,
    SLOTS,
    LOOPBACK,
    NET,
    REDUCE,
    GLOO_LOOPBACK,
    GLOO_NET,
)  # the links (not the wake kinds)


@dataclass(frozen=True)
class LinkParams:
    """One kind's alpha (seconds per message) and beta (seconds per byte)."""

    alpha: float
    beta: float

    def time(self, messages: float, nbytes: float) -> float:
        """Seconds for ``messages`` in sequence carrying ``nbytes`` in all."""
        return messages * self.alpha + nbytes * self.beta


@dataclass
class LinkTable:
    """The parameters of every kind, and how they were obtained."""

    params: dict[str, LinkParams]
    meta: dict[str, Any]

    def __getitem__(self, kind: str) -> LinkParams:
        try:
            return self.params[kind]
        except KeyError:
            raise KeyError(
                f"link kind {kind!r} has no parameters (have: {sorted(self.params)})"
            ) from None

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "params": {k: asdict(p) for k, p in self.params.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinkTable:
        params = {
            k: LinkParams(float(v["alpha"]), float(v["beta"])) for k, v in data["params"].items()
        }
        return cls(params, dict(data.get("meta", {})))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> LinkTable:
        return cls.from_json(json.loads(path.read_text()))

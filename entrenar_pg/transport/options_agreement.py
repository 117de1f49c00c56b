"""Set-up's check that every rank of a group set the plan-deciding Options alike.

A call's plan is chosen on each rank from its own ``Options`` (the algorithm,
the size thresholds, determinism, transport, topology: ``config.AGREED_FIELDS``).
Ranks that set one differently run other plans for the same call, and a plan
that waits for a peer's connect or bytes that the peer's plan never sends
stalls until the group's timeout. So each rank publishes a digest of these
fields in the rendezvous' one store exchange (``rendezvous.exchange``: in
front of its host key, so set-up reads no more keys than before), and every
rank compares the N digests; only where they differ does every rank publish
and read the texts (a second round trip) to name the difference: every rank
raises the same ``OptionsMismatchError``
naming the field, its variable and which ranks hold which value, before any
link is made.
The fields that may differ per rank are ``config.PER_RANK_FIELDS``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import AGREED_FIELDS, Options
from ..errors import OptionsMismatchError

# What a rank whose text lacks a field (another entrenar version) shows for it.
ABSENT = "(absent: another entrenar version?)"


def encode(options: Options) -> str:
    """This rank's agreed fields as the compact text it publishes."""
    values = {f.name: getattr(options, f.name) for f in AGREED_FIELDS}
    return json.dumps(values, separators=(",", ":"))


# The digest's length: a fixed width, so it can ride in front of another value.
DIGEST_CHARS = 16


def digest(text: str) -> str:
    """What every rank reads of ``text`` (``encode``'s): 16 hex digits of its SHA-256."""
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def alike(digests: Sequence[str]) -> bool:
    """Every rank published the same digest: nothing to compare further."""
    return len(set(digests)) == 1


@dataclass(frozen=True)
class Difference:
    """One field the ranks set differently: each value (as shown) and its ranks,
    the value most ranks hold first (ties: the one rank 0 holds first)."""

    field: str
    env: str
    holders: tuple[tuple[str, tuple[int, ...]], ...]

    def describe(self) -> str:
        where = " but ".join(f"{value} on {rank_list(ranks)}" for value, ranks in self.holders)
        return f"{self.field} ({self.env}) is {where}"

    def outliers(self) -> set[int]:
        """The ranks that do not hold the most common value."""
        return {r for _, ranks in self.holders[1:] for r in ranks}


def differences(texts: Sequence[str]) -> list[Difference]:
    """Every field whose value is not the same in all of ``texts`` (rank order)."""
    decoded = [json.loads(t) for t in texts]
    names = [f.name for f in AGREED_FIELDS]
    names += sorted({n for d in decoded for n in d} - set(names))  # another version's
    env = {f.name: f.env for f in AGREED_FIELDS}
    found = []
    for name in names:
        by_value: dict[str, list[int]] = {}
        for rank, d in enumerate(decoded):
            value = repr(d[name]) if name in d else ABSENT
            by_value.setdefault(value, []).append(rank)
        if len(by_value) > 1:
            # dicts keep insertion order, so among equal counts rank 0's value leads
            ordered = sorted(by_value.items(), key=lambda kv: -len(kv[1]))
            holders = tuple((value, tuple(ranks)) for value, ranks in ordered)
            found.append(Difference(name, env.get(name, "?"), holders))
    return found


def check(rank: int, texts: Sequence[str]) -> None:
    """Raise ``OptionsMismatchError`` on this rank where ``texts`` (every rank's
    ``encode``, in rank order) differ; the message is the same on every rank
    but for its own rank. ``culprit``: the one rank that differs, if only one."""
    found = differences(texts)
    if not found:
        return
    outliers = set().union(*(d.outliers() for d in found))
    raise OptionsMismatchError(
        f"rank {rank}: cannot create the group: its ranks set entrenar Options that must "
        f"agree differently: {'; '.join(d.describe() for d in found)}. These fields choose "
        "each call's algorithm and protocol: ranks that differ would run other plans "
        "for the same call and fail at it, or wait for each other until the timeout; "
        "set them alike on every rank (environment or pg_options)",
        culprit=next(iter(outliers)) if len(outliers) == 1 else None,
    )


def rank_list(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``: ascending ranks, runs as ranges."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"

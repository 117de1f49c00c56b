"""A mismatch whose plans wait for a data socket the other plan never makes.

Across hosts, data sockets are made on a link's first use: the lower rank
connects, the higher one waits for it (``transport/data_links.py``). When
ranks issue different collectives in one call, a rank can wait for a lower
rank's connect that the lower rank's plan never makes: a star allreduce's
leaf (rank 2) waits for the star's root, rank 0, which runs a gather and
connects only to the gather's root and its ring neighbours. No header ever
meets, so before the waiting rank asked, every rank failed only at the
call's timeout (torch's default: 30 minutes), with a stall naming its own
call. Now the waiting rank asks the silent lower rank which call it is in
(once the wait is long: ``data_links.ASK_AFTER_S``) and, meeting another
collective in the same call, raises ``CollectiveMismatchError`` naming both;
its abort carries the class and the message to every rank in that call.
Still a limit (strict xfail below): the same collective with other
arguments, where the answers are alike.

Thread ranks over real loopback TCP, one emulated host per rank
(``host_id``), so no data socket exists before the call.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks

from entrenar_pg import CollectiveMismatchError, EntrenarProcessGroup, Options
from entrenar_pg.transport.data_links import ASK_AFTER_S, other_call

# Long enough that a failure at the timeout and one at once cannot be confused.
TIMEOUT_S = 20.0
WORLD = 4
# A small allreduce is a star, a large one a ring (the policy's crossover).
STAR_MAX_BYTES = 1024


def _issue(pg: EntrenarProcessGroup, rank: int, call: str, timeout_s: float) -> None:
    """``call``: "allreduce" (10 floats: a star), "allreduce-large" (4096 floats:
    a ring, over ``STAR_MAX_BYTES``) or "gather<root>"."""
    t = torch.ones(4096 if call == "allreduce-large" else 10)
    wait = timedelta(seconds=timeout_s + 10)
    if call.startswith("allreduce"):
        pg.allreduce([t]).wait(wait)
        return
    root = int(call.removeprefix("gather"))
    opts = dist.GatherOptions()
    opts.rootRank = root
    outs = [[torch.empty_like(t) for _ in range(WORLD)]] if rank == root else []
    pg.gather(outs, [t], opts).wait(wait)


def _outcomes(
    calls: list[str], delay: dict[int, float] | None = None, timeout_s: float = TIMEOUT_S
) -> list[tuple[Exception | None, float]]:
    """Rank r issues ``calls[r]`` (after ``delay[r]`` seconds) on fresh groups, one
    emulated host per rank; per rank: the error it raised (None: it returned)
    and how long its call took."""
    groups = make_groups(
        WORLD,
        [
            Options(transport="tcp", host_id=f"h{r}", star_max_bytes=STAR_MAX_BYTES)
            for r in range(WORLD)
        ],
        timeout_s=timeout_s,
    )

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[Exception | None, float]:
        time.sleep((delay or {}).get(rank, 0.0))
        start = time.monotonic()
        try:
            _issue(pg, rank, calls[rank], timeout_s)
        except Exception as e:  # judged by the caller
            return e, time.monotonic() - start
        return None, time.monotonic() - start

    try:
        return run_ranks(WORLD, fn, groups=groups, timeout_s=timeout_s + 30)
    finally:
        for g in groups:
            g.abort()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("gather_root", [3, 1])
def test_a_wait_for_a_connect_that_never_comes_is_a_mismatch_on_every_rank(
    gather_root: int,
) -> None:
    # Rank 2's star waits for rank 0's connect; rank 0's gather never makes it.
    gather = f"gather{gather_root}"
    calls = [gather, gather, "allreduce", gather]
    got = _outcomes(calls)
    errors = [e for e, _ in got]
    assert all(isinstance(e, CollectiveMismatchError) for e in errors), errors
    # Every rank names both calls of the one call (seq 1), whoever found it.
    assert all("allreduce#1" in str(e) and "gather#1" in str(e) for e in errors), errors
    # In the call, not at its timeout (a stall cannot end before it).
    assert max(t for _, t in got) < TIMEOUT_S / 2, got


@pytest.mark.timeout(90)
def test_a_lower_rank_late_to_the_same_call_is_waited_for() -> None:
    # Rank 0 (the star's root, which connects to every rank) comes late:
    # the others ask it while it is in no call, keep waiting, and complete.
    got = _outcomes(["allreduce"] * WORLD, delay={0: 3 * ASK_AFTER_S})
    assert [e for e, _ in got] == [None] * WORLD, got


@pytest.mark.timeout(60)
@pytest.mark.xfail(
    strict=True,
    reason="the same collective with other arguments (here the size, so a star beside a "
    "ring) in one call: the answer names only the collective and seq, alike on both "
    "ranks, so the wait for rank 0's connect still ends at the timeout as a stall",
)
def test_the_same_collective_with_another_size_is_a_mismatch_on_every_rank() -> None:
    # Rank 2's star waits for rank 0's connect; rank 0's ring never makes it.
    calls = ["allreduce-large", "allreduce-large", "allreduce", "allreduce-large"]
    got = _outcomes(calls, timeout_s=3.0)
    errors = [e for e, _ in got]
    assert all(isinstance(e, CollectiveMismatchError) for e in errors), errors


def test_only_another_collective_in_the_same_call_is_a_mismatch() -> None:
    assert other_call("allreduce#4", "gather#4")
    assert other_call("gather#4", "broadcast#4")
    assert not other_call("allreduce#4", "allreduce#4")  # the same call: its connect is coming
    assert not other_call("allreduce#4", "gather#3")  # still in an earlier call
    assert not other_call("allreduce#4", None)  # in no call yet
    assert not other_call("allreduce#4", "p2p link to rank 0")  # not a collective
    # The contract checker's exchange follows its collective with the same seq.
    assert not other_call("check#4", "allreduce#4")
    assert not other_call("allreduce#4", "check#4")

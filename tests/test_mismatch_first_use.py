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
The same collective with other arguments (an allreduce whose size makes a
star on one rank and a ring on the others) answers alike by name and seq,
so the answer also carries the call's terms (``transport/in_flight.py``:
what every rank must agree on, published by the runtime per call): terms
that differ are the mismatch, alike ones a late rank.

Thread ranks over real loopback TCP, one emulated host per rank
(``host_id``), so no data socket exists before the call.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks

from entrenar_pg import CollectiveMismatchError, EntrenarProcessGroup, Options
from entrenar_pg.api import checks
from entrenar_pg.api.checks import Checks
from entrenar_pg.call import agreement
from entrenar_pg.call import requests as rq
from entrenar_pg.runtime.state import GroupState
from entrenar_pg.runtime.thin import DoneWork
from entrenar_pg.transport.data_links import ASK_AFTER_S, other_call, other_terms
from entrenar_pg.transport.in_flight import Terms
from entrenar_pg.wire import OpCode

# Long enough that a failure at the timeout and one at once cannot be confused.
TIMEOUT_S = 20.0
WORLD = 4
# A small allreduce is a star, a large one a ring (the policy's crossover).
STAR_MAX_BYTES = 1024


def _issue(pg: EntrenarProcessGroup, rank: int, call: str, timeout_s: float) -> Any:
    """``call``: "allreduce" (10 floats: a star), "allreduce-large" (4096 floats:
    a ring, over ``STAR_MAX_BYTES``), either with a "-thin" suffix (the
    blocking form ``dist.all_reduce`` makes: ``runtime/thin.py``'s path once
    the group has learnt SUM on float32, else the long one), or
    "gather<root>". Returns the call's Work, waited for."""
    t = torch.ones(4096 if call.startswith("allreduce-large") else 10)
    wait = timedelta(seconds=timeout_s + 10)
    if call.startswith("allreduce"):
        opts = dist.AllreduceOptions()
        opts.asyncOp = not call.endswith("-thin")
        work = pg.allreduce([t], opts)
    else:
        root = int(call.removeprefix("gather"))
        gather = dist.GatherOptions()
        gather.rootRank = root
        outs = [[torch.empty_like(t) for _ in range(WORLD)]] if rank == root else []
        work = pg.gather(outs, [t], gather)
    work.wait(wait)
    return work


def _outcomes(
    calls: list[str],
    delay: dict[int, float] | None = None,
    timeout_s: float = TIMEOUT_S,
    warm_up: str | None = None,
) -> list[tuple[Exception | None, float]]:
    """Rank r issues ``calls[r]`` (after ``delay[r]`` seconds) on fresh groups, one
    emulated host per rank, after ``warm_up`` (a call every rank issues first,
    if given); per rank: the error it raised (None: it returned) and how long
    its call took."""
    groups = make_groups(
        WORLD,
        [
            Options(transport="tcp", host_id=f"h{r}", star_max_bytes=STAR_MAX_BYTES)
            for r in range(WORLD)
        ],
        timeout_s=timeout_s,
    )

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[Exception | None, float]:
        if warm_up is not None:
            _issue(pg, rank, warm_up, timeout_s)
        time.sleep((delay or {}).get(rank, 0.0))
        start = time.monotonic()
        try:
            _issue(pg, rank, calls[rank], timeout_s)
        except Exception as e:  # judged by the caller
            return e, time.monotonic() - start
        return None, time.monotonic() - start

    return run_ranks(WORLD, fn, groups=groups, timeout_s=timeout_s + 30, release="abort")


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


@pytest.mark.timeout(90)
@pytest.mark.parametrize("path", ["", "-thin"])
def test_the_same_collective_with_another_size_is_a_mismatch_on_every_rank(path: str) -> None:
    # A ring first (every rank: its links exist after, and the thin path has
    # learnt SUM on float32). Then rank 2's star waits for rank 0's first
    # connect, which rank 0's ring never makes (and rank 3 waits for rank
    # 2's, which its star never makes). Rank 0 answers allreduce#2 as rank 2
    # does: only the terms differ.
    calls = [f"allreduce-large{path}"] * WORLD
    calls[2] = f"allreduce{path}"
    got = _outcomes(calls, warm_up="allreduce-large-thin")
    errors = [e for e, _ in got]
    assert all(isinstance(e, CollectiveMismatchError) for e in errors), errors
    # Every rank names both calls with what differs, whoever found it.
    small = "allreduce#2(float32, 10 elements, sum)"
    large = "allreduce#2(float32, 4096 elements, sum)"
    assert all(small in str(e) and large in str(e) for e in errors), errors
    # In the call, not at its timeout (a stall cannot end before it).
    assert max(t for _, t in got) < TIMEOUT_S / 2, got


@pytest.mark.timeout(90)
def test_a_late_lower_rank_in_the_same_ring_is_waited_for() -> None:
    # Rank 0 comes late to a ring whose terms every rank shares: the ranks
    # that ask it hear it in no call, or in this one with the same terms.
    got = _outcomes(["allreduce-large"] * WORLD, delay={0: 3 * ASK_AFTER_S})
    assert [e for e, _ in got] == [None] * WORLD, got


@pytest.mark.timeout(60)
def test_a_rank_tells_the_terms_of_its_call_alike_on_either_path() -> None:
    # What rank 1's control channel hears rank 0 run while rank 0 waits in
    # the call: the long path (the first blocking call teaches the thin path
    # SUM on float32), then the thin one; the same words.
    groups = make_groups(
        2, [Options(transport="tcp", host_id=f"h{r}") for r in range(2)], timeout_s=TIMEOUT_S
    )

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[Any]:
        got: list[Any] = []
        for seq in (1, 2):
            if rank == 0:
                got.append(
                    isinstance(_issue(pg, rank, "allreduce-large-thin", TIMEOUT_S), DoneWork)
                )
                continue
            heard = None
            deadline = time.monotonic() + TIMEOUT_S / 2
            while (heard is None or heard.seq != seq) and time.monotonic() < deadline:
                state = pg._runtime.mesh.causes.calls([0], 0.5).get(0)
                heard = None if state is None else state.call
            got.append(heard)
            _issue(pg, rank, "allreduce-large", TIMEOUT_S)  # let rank 0's call end
        return got

    thin, told = run_ranks(2, fn, groups=groups, timeout_s=TIMEOUT_S + 30, release="abort")
    assert thin == [False, True]  # the long path, then the thin one
    agreed = "float32, 4096 elements, sum"
    assert told == [Terms(1, "allreduce", agreed), Terms(2, "allreduce", agreed)], told


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


def test_only_other_terms_of_this_same_call_are_a_mismatch() -> None:
    small = Terms(4, "allreduce", "float32, 10 elements, sum")
    large = Terms(4, "allreduce", "float32, 4096 elements, sum")
    assert other_terms("allreduce#4", small, large)
    assert other_terms("allreduce#4", small, Terms(4, "gather", "root 1, float32"))
    assert not other_terms("allreduce#4", small, small)  # a late rank: its connect is coming
    assert not other_terms("allreduce#4", small, large._replace(seq=3))  # an earlier call
    assert not other_terms("allreduce#4", small, None)  # nothing to compare (checker's job)
    assert not other_terms("allreduce#4", None, large)
    # This rank's published call is not the one it waits in (a job publishing none).
    assert not other_terms("check#5", small, large._replace(seq=5))


def _opts(kind: Any, root: int = 0) -> Any:
    opts = kind()
    if hasattr(opts, "rootRank"):
        opts.rootRank = root
    return opts


def _requests(rank: int, root: int = 0, n: int = 6) -> dict[str, rq.Request]:
    """One rank's requests of a correct two-rank program (``n`` elements per
    piece; the all-to-all's splits differ between the ranks, as they may),
    built by the real argument checks."""
    c = Checks(rank, 2, GroupState(rank))
    t = torch.ones(n)
    uneven = [1, n - 1] if rank == 0 else [n - 2, 2]
    pieces = [torch.ones(n) for _ in range(2)]
    return {
        "allreduce": checks.allreduce(
            c, "allreduce", [t, torch.ones(2)], _opts(dist.AllreduceOptions)
        ),
        "broadcast": checks.broadcast(
            c, [t, torch.ones(2, dtype=torch.int64)], _opts(dist.BroadcastOptions, root)
        ),
        "reduce": checks.reduce(c, [t], _opts(dist.ReduceOptions, root)),
        "gather": checks.gather(
            c, [pieces] if rank == root else [], [t], _opts(dist.GatherOptions, root)
        ),
        "scatter": checks.scatter(
            c, [t], [pieces] if rank == root else [], _opts(dist.ScatterOptions, root)
        ),
        "allgather": checks.allgather(c, [pieces], [t]),
        "alltoall": checks.alltoall_single(
            c, "alltoall_base", torch.ones(n), torch.ones(n), uneven, uneven
        ),
        "reduce_scatter": checks.reduce_scatter(c, [t], [pieces], _opts(dist.ReduceScatterOptions)),
        "barrier": checks.barrier(c),
    }


def test_the_terms_of_a_correct_program_agree_on_every_rank_and_differ_with_its_arguments() -> None:
    rank0, rank1 = _requests(0), _requests(1)
    said = {k: agreement.agreed(req) for k, req in rank0.items()}
    # Each rank's own parts (the root's lists, its splits, its output) left out.
    assert said == {k: agreement.agreed(req) for k, req in rank1.items()}
    assert said["allreduce"] == "float32, 8 elements, sum"
    assert said["broadcast"] == "root 0, [float32 x 6, int64 x 2]"
    assert said["gather"] == "root 0, float32" and said["alltoall"] == "float32"
    # What must agree: another root or size says so.
    other = {k: agreement.agreed(req) for k, req in _requests(0, root=1).items()}
    assert {k for k in said if other[k] != said[k]} == {"broadcast", "reduce", "gather", "scatter"}
    bigger = {k: agreement.agreed(req) for k, req in _requests(0, n=7).items()}
    assert {k for k in said if bigger[k] != said[k]} == {
        "allreduce",
        "broadcast",
        "reduce",
        "reduce_scatter",
    }
    # Nothing to compare: the contract checker's own job.
    assert agreement.agreed(rq.custom(OpCode.CHECK, print)) is None

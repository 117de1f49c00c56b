"""Ranks whose Options would pick other plans for the same call fail at creation.

A call's plan is each rank's own choice from its ``Options``. With one rank
flat among host-aware ones (``ENTRENAR_TOPOLOGY``), the call's terms (dtype,
count, op) agree, so the first-use query found nothing to blame and every
rank waited until the group's timeout; with another transport on one rank,
shared memory's set-up did; with another star threshold, algorithm or
determinism, the header rule caught the plans at the first collective. Now
set-up publishes the fields that decide plans (``config.AGREED_FIELDS``)
beside each rank's address and every rank compares them
(``transport/options_agreement.py``): a difference raises
``OptionsMismatchError`` on every rank at creation, naming the field, its
variable, the values and the ranks holding each, before any collective.
Fields that only tune a rank's own threads, sockets, segments and records
(``config.PER_RANK_FIELDS``) may still differ.

Thread ranks over real loopback TCP (one store, one group per rank), and two
real torchrun jobs where one rank's environment or pg_options differ.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, run_ranks, torchrun

from entrenar_pg import EntrenarProcessGroup, Options, OptionsMismatchError
from entrenar_pg.config import AGREED_FIELDS, PER_RANK_FIELDS
from entrenar_pg.transport import options_agreement
from entrenar_pg.transport.options_agreement import ABSENT, differences, digest, encode, rank_list

WORLD = 4
# Long enough that a failure at the timeout and one at creation cannot be confused.
TIMEOUT_S = 10.0
# What "at once" means: set-up's store round trips, on a loaded 2-core machine.
PROMPT_S = 5.0
# 16 KiB: a star under the default threshold (1 MiB), a ring under 4 KiB.
NUMEL = 4096


def _create_each(options: list[Options]) -> dict[int, Any]:
    """Every rank's group, made at once (a thread each, one store), or the
    error its creation raised; a rank still creating after the bound fails."""
    store = dist.HashStore()
    got: dict[int, Any] = {}

    def make(rank: int) -> None:
        t0 = time.monotonic()
        try:
            got[rank] = EntrenarProcessGroup(
                dist.PrefixStore("t", store),
                rank,
                len(options),
                timeout=timedelta(seconds=TIMEOUT_S),
                options=options[rank],
            )
        except Exception as e:  # the outcome under test
            e.seconds = time.monotonic() - t0  # type: ignore[attr-defined]
            got[rank] = e

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(len(options))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in threads), "group creation hung"
    return got


def _allreduce_each(groups: list[EntrenarProcessGroup]) -> list[float]:
    """A 16 KiB allreduce of each rank's rank + 1 on every rank (the call whose
    plan the thresholds decide); its first element on each."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> float:
        t = torch.full((NUMEL,), float(rank + 1))
        pg.allreduce([t]).wait(timedelta(seconds=TIMEOUT_S))
        return float(t[0])

    return run_ranks(len(groups), fn, groups=groups, timeout_s=TIMEOUT_S + 10, release="shutdown")


def _outcome_of(options: list[Options]) -> dict[int, Any]:
    """Each rank's creation error or, where every rank's group formed (before
    the check), what the 16 KiB allreduce did on it: its sum or its error."""
    got = _create_each(options)
    groups = [g for g in got.values() if isinstance(g, EntrenarProcessGroup)]
    if len(groups) < len(options):
        for g in groups:
            g.shutdown()
        return got
    try:
        return dict(enumerate(_allreduce_each([got[r] for r in range(len(options))])))
    except Exception as e:  # what the unchecked group did: reported by the caller
        return dict.fromkeys(range(len(options)), e)


def _assert_every_rank_names(got: dict[int, Any], field: str, env: str, *values: str) -> None:
    for rank in range(WORLD):
        e = got[rank]
        assert isinstance(e, OptionsMismatchError), (rank, e)
        text = str(e)
        assert text.startswith(f"rank {rank}: "), text
        for part in (field, f"({env})", *values):
            assert part in text, (part, text)
        assert e.seconds < PROMPT_S, (rank, e.seconds)  # type: ignore[attr-defined]


# (what the odd rank sets, the field, its variable, the two values as the message shows them)
ODD_ONES = [
    (
        {"star_max_bytes": 4096},
        "star_max_bytes",
        "ENTRENAR_STAR_MAX_BYTES",
        "1048576 on ranks 0-2",
        "4096 on rank 3",
    ),
    (
        {"algorithm": "ring"},
        "algorithm",
        "ENTRENAR_ALGO",
        "'auto' on ranks 0-2",
        "'ring' on rank 3",
    ),
    (
        {"deterministic": True},
        "deterministic",
        "ENTRENAR_DETERMINISTIC",
        "False on ranks 0-2",
        "True on rank 3",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("odd, field, env, common, other", ODD_ONES, ids=[o[1] for o in ODD_ONES])
def test_one_rank_with_another_plan_fails_every_rank_at_creation(
    odd: dict[str, Any], field: str, env: str, common: str, other: str
) -> None:
    """Rank 3's pg_options differ in one field: before the check, every group
    formed and the 16 KiB allreduce ran other plans: star beside ring waited
    until the timeout (the calls' terms alike), another algorithm or the
    deterministic tree met the header rule at the first collective; now
    creation fails."""
    # One emulated host per rank (host_id, a field of each rank's own): data
    # sockets are made on first use, where other plans wait for each other.
    options = [Options(host_id=str(r)) for r in range(WORLD)]
    options[-1] = dataclasses.replace(options[-1], **odd)
    got = _outcome_of(options)
    _assert_every_rank_names(got, field, env, common, other)
    assert {got[r].culprit for r in range(WORLD)} == {WORLD - 1}


@pytest.mark.timeout(60)
def test_host_aware_and_flat_ranks_fail_at_creation() -> None:
    """2 hosts x 2 ranks, rank 3 flat, the rest host-aware: before the check,
    every rank waited out the timeout at the first allreduce. With a second
    field off on another rank (the checker's tolerance: no plan changes, the
    checker is off), every difference is named."""
    options = [
        Options(host_id=h, topology=("flat" if r == 3 else "hosts"), host_star_max_bytes=0)
        for r, h in enumerate("aabb")
    ]
    options[1] = dataclasses.replace(options[1], check_tolerance=0.01)
    got = _outcome_of(options)
    _assert_every_rank_names(got, "topology", "ENTRENAR_TOPOLOGY", "'hosts' on ranks 0-2")
    _assert_every_rank_names(got, "check_tolerance", "ENTRENAR_CHECK_TOLERANCE", "0.01 on rank 1")
    assert {got[r].culprit for r in range(WORLD)} == {None}  # two ranks differ


@pytest.mark.timeout(60)
def test_tcp_on_one_rank_of_a_shared_memory_host_fails_at_creation() -> None:
    """One host, rank 3 on ENTRENAR_TRANSPORT=tcp: before the check, the
    other ranks waited out the timeout in shared memory's set-up."""
    options = [Options(transport="tcp" if r == WORLD - 1 else "auto") for r in range(WORLD)]
    got = _outcome_of(options)
    _assert_every_rank_names(got, "transport", "ENTRENAR_TRANSPORT", "'auto' on ranks 0-2")
    assert str(got[0]).count("'tcp' on rank 3") == 1


@pytest.mark.timeout(60)
def test_fields_of_a_rank_s_own_may_differ(tmp_path: Path) -> None:
    """Per-rank fields set differently on every rank: the group forms and the
    allreduce is right (the check refuses only what changes a plan)."""
    own = [
        {"spin_us": 0, "caller_spin_us": 0, "shm_placement": False, "segment_bytes": 1000},
        {"inline_max_bytes": 1 << 20, "socket_buffer_bytes": 1 << 18, "tcp_placement": False},
        {"fr_buffer_size": 16, "fr_dump_prefix": str(tmp_path / "fr_"), "host_id": "x"},
        {"ledger": str(tmp_path / "ledger.jsonl"), "fr_dump_on_timeout": True},
    ]
    options = [Options(**kw) for kw in own]
    assert set().union(*own) <= set(PER_RANK_FIELDS)
    got = _outcome_of(options)
    assert got == dict.fromkeys(range(WORLD), float(sum(range(1, WORLD + 1)))), got


def test_every_field_is_agreed_or_per_rank() -> None:
    """A new Options field must be put in one list or the other (config.py)."""
    agreed = [f.name for f in AGREED_FIELDS]
    fields = {f.name for f in dataclasses.fields(Options)}
    assert set(agreed) | set(PER_RANK_FIELDS) == fields
    assert not set(agreed) & set(PER_RANK_FIELDS)
    assert len(agreed) + len(PER_RANK_FIELDS) == len(fields)
    for f in AGREED_FIELDS:  # each variable is the one from_env reads for it
        assert getattr(Options.from_env({f.env: _env_text(f.name)}), f.name) != getattr(
            Options(), f.name
        ), f


def _env_text(name: str) -> str:
    """A value of ``name``'s variable other than the default."""
    default = getattr(Options(), name)
    if isinstance(default, bool):
        return "0" if default else "1"
    if name == "algorithm":
        return "ring"
    if name == "transport":
        return "tcp"
    if name == "topology":
        return "flat"
    return str(default * 2 if isinstance(default, float) else default + 1)


def test_differences_name_every_value_and_its_ranks() -> None:
    texts = [encode(Options(star_max_bytes=b)) for b in (1, 2, 2, 2, 1, 2, 3)]
    (d,) = differences(texts)
    assert d.field == "star_max_bytes" and d.env == "ENTRENAR_STAR_MAX_BYTES"
    assert d.holders == (("2", (1, 2, 3, 5)), ("1", (0, 4)), ("3", (6,)))
    assert d.outliers() == {0, 4, 6}
    assert differences([encode(Options(spin_us=s)) for s in (0, 1, 2)]) == []
    # a rank of another version, without a field this one has (and with one it lacks)
    other = json.loads(texts[0])
    del other["check"]
    other["newer"] = 1
    got = {x.field: x.holders for x in differences([texts[0], json.dumps(other)])}
    assert got == {
        "check": (("False", (0,)), (ABSENT, (1,))),
        "newer": ((ABSENT, (0,)), ("1", (1,))),
    }
    assert rank_list([3]) == "rank 3"
    assert rank_list([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_check_passes_alike_options_and_blames_a_lone_rank() -> None:
    alike = [encode(Options(algorithm="star"))] * 3
    # what every rank reads: a digest, alike exactly where the texts are
    digests = [
        digest(encode(Options(algorithm=a, spin_us=s))) for a, s in (("star", 0), ("star", 9))
    ]
    assert options_agreement.alike(digests) and len(digests[0]) == 16
    assert not options_agreement.alike([*digests, digest(encode(Options(algorithm="ring")))])
    options_agreement.check(0, alike)  # nothing raised
    with pytest.raises(
        OptionsMismatchError, match=r"^rank 2: .*'star' on ranks 0, 2 but 'ring' on rank 1"
    ) as e:
        options_agreement.check(2, [alike[0], encode(Options(algorithm="ring")), alike[0]])
    assert e.value.culprit == 1 and isinstance(e.value, ValueError)


def _job(out: Path, mode: str, setting: str) -> dict[int, dict[str, Any]]:
    """``tests/scripts/options_disagree.py`` under torchrun, 2 emulated hosts x 2
    ranks, ENTRENAR_TOPOLOGY=hosts and the host star off (the host-aware
    ranks take the leaders); each rank's outcome."""
    out.mkdir()
    done = torchrun(
        REPO / "tests" / "scripts" / "options_disagree.py",
        WORLD,
        str(out),
        mode,
        setting,
        timeout_s=90,
        env={
            "TIMEOUT_S": str(TIMEOUT_S),
            "ENTRENAR_TOPOLOGY": "hosts",
            "ENTRENAR_HOST_STAR_MAX_BYTES": "0",
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)}


def _assert_refused(got: dict[int, dict[str, Any]], named: str) -> None:
    for r, o in got.items():
        assert o["stage"] == "creation" and o["error"] == "OptionsMismatchError", o
        assert o["message"].startswith(f"rank {r}: "), o
        assert named in o["message"], o
        assert o["culprit"] == WORLD - 1 and o["seconds"] < PROMPT_S, o


@pytest.mark.timeout(200)
def test_torchrun_rank_with_its_own_options_fails_every_rank(tmp_path: Path) -> None:
    """Real jobs. (1) The last rank's environment says ENTRENAR_TOPOLOGY=flat:
    every rank's init_process_group raises, naming it, at once (before: init
    passed and the first allreduce waited out the group's timeout). (2) The
    last rank passes pg_options with another star threshold to new_group:
    every rank's new_group raises, and the default group still works."""
    _assert_refused(
        _job(tmp_path / "init", "init", "ENTRENAR_TOPOLOGY=flat"),
        "topology (ENTRENAR_TOPOLOGY) is 'hosts' on ranks 0-2 but 'flat' on rank 3",
    )
    got = _job(tmp_path / "new_group", "new_group", "host_leaders_max_bytes=4096")
    _assert_refused(
        got,
        "host_leaders_max_bytes (ENTRENAR_HOST_LEADERS_MAX_BYTES) is 65536 on ranks 0-2 "
        "but 4096 on rank 3",
    )
    assert [got[r]["world_sum"] for r in range(WORLD)] == [float(sum(range(WORLD)))] * WORLD

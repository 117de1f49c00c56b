"""``benchmarks/scale.py``: a real small job (8 ranks over 2 processes), checked against the design.

The connection design today (``transport/rendezvous.py``, ``transport/mesh.py``,
``transport/loop.py``, ``transport/control.py``, ``p2p/channel.py``): the
ranks on one host get a data socket per pair at set-up (shared memory keeps
it for wake-ups and hang-ups; other data sockets come on first use), and each
rank a control socket per overlay neighbour (ranks one bit apart); p2p
sockets are made on first use, so a job that only reduces has none; the
listener stays open for lazy connections, and the p2p thread's loop holds one
socketpair to be woken. So with every rank on this host a rank's group holds
(N-1) + |overlay| + 3 sockets. (Before: 2(N-1) + 3, control to every peer;
before that 3(N-1) + 2, a p2p socket to every peer at set-up.) The control
channel also holds two eventfds (its thread's wake-up, the loop's news).
With every rank on one host and shared memory on, each rank also holds
2(N-1) + 1 memfd descriptors: CPython's ``mmap`` keeps a duplicate of the
descriptor it maps, once for its own segment and twice per peer (the ring
block it reads, the peer's slot area). These tests fail when a rank holds
a socket more or less than that, or when the process holds one no group
does (a leak), or when destroying leaves anything open.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest
from conftest import run_session

from benchmarks.scale import SCHEMA, ScaleConfig, procs_for, split
from benchmarks.scale_report import fd_limit_projection
from entrenar_pg.transport.control import overlay

WORLD, PROCS = 8, 2


def design_sockets(world: int) -> int:
    """Sockets one rank's group holds after set-up, by the current design (module
    docstring): a data socket per peer (all on this host), a control socket per
    overlay neighbour (3 for every rank at N = 8), the listener and the p2p
    loop's wake-up pair. (Before: 2(N - 1) + 3, control to every peer.)"""
    (n_control,) = {len(overlay(r, world)) for r in range(world)}
    return (world - 1) + n_control + 3


def design_other_fds(world: int) -> int:
    """Descriptors one rank holds besides sockets: the control channel's two
    eventfds, and memfds when all ``world`` ranks share memory (``auto``
    offers shared memory on x86-64 only: ``transport/shm/setup.py``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return 2
    return 2 + 2 * (world - 1) + 1


def test_split_and_limit_projection() -> None:
    assert split(8, 2) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert split(10, 4) == [(0, 1), (2, 3, 4), (5, 6), (7, 8, 9)]
    assert split(3, 8) == [(0,), (1,), (2,)]  # never an empty process
    cfg = ScaleConfig((8, 256), 8, ("entrenar",), 1, 60.0, "", Path("unused"))
    assert procs_for(8, cfg, None, 1024) == 8
    assert procs_for(256, cfg, None, 1024) == 8  # nothing measured yet: as asked
    assert procs_for(4, cfg, 10.0, 1024) == 4  # never more processes than ranks
    # 1,300 descriptors per rank under 0.8 * 20,000: 12 ranks per process, 22 processes.
    assert procs_for(256, cfg, 1300.0, 20000) == 22
    rows = [
        {"world": n, "fds_per_rank": {"median": 5.0 * (n - 1) + 3}, "fds_one_rank_before_setup": 4}
        for n in (128, 256)
    ]
    p = fd_limit_projection(rows)
    # 4 + 5N - 2 <= 1024  <=>  N <= 204.4
    assert (p["per_rank_slope"], p["per_rank_intercept"], p["n_max"]) == (5.0, -2.0, 204)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_small_job_matches_the_connection_design(tmp_path: Path) -> None:
    out = tmp_path / "scale"
    cmd = [sys.executable, "-m", "benchmarks.scale", "--ranks", str(WORLD), "--procs", str(PROCS)]
    cmd += ["--backends", "entrenar", "--transport", "auto", "--timeout", "60", "--out", str(out)]
    run_session(cmd, timeout=80)
    result = json.loads((out / "scale.json").read_text())
    assert {"schema", "config", "fd_limit", "machine", "summary", "jobs"} <= set(result)
    assert result["schema"] == SCHEMA
    assert result["failures"] == []
    assert result["fd_limit"]["soft_used"] == result["fd_limit"]["hard"]
    assert (out / "results.md").read_text().count("| entrenar | 8 |") == 1
    assert (out / "scale.png").stat().st_size > 0

    (job,) = result["jobs"]
    assert [len(p["ranks"]) for p in job["processes"]] == [WORLD // PROCS] * PROCS
    ranks = sorted(r["rank"] for p in job["processes"] for r in p["ranks"])
    assert ranks == list(range(WORLD))
    want = design_sockets(WORLD)
    for p in job["processes"]:
        k = len(p["ranks"])
        for r in p["ranks"]:
            assert r["allreduce_ok"] and not r["error"], r
            assert r["held_sockets"] == want, (r["rank"], r["held_sockets"], want)
            assert 0 < r["create_s"] and 0 < r["first_allreduce_s"] < r["setup_s"]
        # The kernel's count: every new socket is some group's, none is two ranks'.
        assert p["sockets_after_setup"] == k * want
        assert p["sockets_unheld"] == 0 and p["sockets_shared"] == 0
        assert p["new_fds"] == k * (want + design_other_fds(WORLD))
        assert p["sockets_after_destroy"] == 0 and p["fds_after_destroy"] == 0

    (row,) = result["summary"]["rows"]
    assert row["allreduce_verified"] == row["rank_results"] == WORLD
    assert row["sockets_per_rank"] == {"min": want, "median": want, "max": want}
    assert row["sockets_per_peer"] == pytest.approx(want / (WORLD - 1))
    assert row["setup_vs_linear"] == 1.0  # the smallest N is its own reference


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_one_rank_per_host_no_rank_holds_a_socket_per_peer(tmp_path: Path) -> None:
    """32 ranks, each its own emulated host (``--hosts 32``: the flat rows),
    the default policy beside the star forced, 2 timed calls each: with the
    default (``DOUBLING`` from 32 ranks) every rank holds exactly its doubling
    partners and ring neighbours as data sockets, beside its overlay's control
    sockets and 3; with the star, rank 0 holds one to each of the 31 others.
    The timed calls are reported per backend with their ratio to the first.
    (Before: the default was the star, rank 0 at 31 + 5 + 3 = 39.)"""
    from entrenar_pg.collectives.doubling import partners

    world = 32
    out = tmp_path / "scale"
    cmd = [sys.executable, "-m", "benchmarks.scale", "--ranks", str(world), "--procs", "2"]
    cmd += ["--hosts", str(world), "--backends", "entrenar,entrenar-star", "--calls", "2"]
    cmd += ["--timeout", "90", "--out", str(out)]
    run_session(cmd, timeout=140)
    result = json.loads((out / "scale.json").read_text())
    assert result["failures"] == []
    held = {
        j["backend"]: {r["rank"]: r["held_sockets"] for p in j["processes"] for r in p["ranks"]}
        for j in result["jobs"]
    }
    for r in range(world):
        data = partners(world, r) | {(r - 1) % world, (r + 1) % world}
        assert held["entrenar"][r] == len(data) + len(overlay(r, world)) + 3, r
    assert max(held["entrenar"].values()) <= 2 * 5 + 2 + 5 + 3
    assert held["entrenar-star"][0] == (world - 1) + len(overlay(0, world)) + 3
    rows = {r["backend"]: r for r in result["summary"]["rows"]}
    for row in rows.values():
        assert row["allreduce_verified"] == world
        assert 0 < row["allreduce_s"]["min"] <= row["allreduce_s"]["max"]
        assert row["allreduce_cpu_s"] > 0
    text = (out / "results.md").read_text()
    assert "2 timed 4 KiB allreduces per rank" in text and "| entrenar-star | 32 |" in text

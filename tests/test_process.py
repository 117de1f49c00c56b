"""Core backend, process level: real processes, real torchrun, real DDP.

Each test has a timeout and the subprocesses have their own, so a hang fails.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port, rank_env, torchrun
from preloaded import start_script

SCRIPTS = REPO / "tests" / "scripts"
pytestmark = pytest.mark.slow


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc.stdout


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One job of 3 ranks: entrenar is the default group, gloo a group of the
    same ranks; then both again on groups of the first 2 ranks. Its output dir."""
    out = tmp_path_factory.mktemp("ddp")
    args = ["--backends", "entrenar", "gloo", "--members", "3", "2", "--out", str(out)]
    _ok(torchrun(SCRIPTS / "ddp_check.py", 3, *args, timeout_s=240))
    return out


@pytest.mark.xdist_group("process_ddp")  # one worker runs the shared job once
@pytest.mark.timeout(300)
@pytest.mark.parametrize("members", [2, 3])
def test_ddp_matches_gloo_and_ranks_agree(members: int, ddp_job: Path) -> None:
    states = {
        b: [torch.load(ddp_job / f"n{members}" / b / f"rank{r}.pt") for r in range(members)]
        for b in ("entrenar", "gloo")
    }
    ours = states["entrenar"]
    for r in range(1, members):
        for k, v in ours[0].items():
            assert torch.equal(v, ours[r][k]), f"N={members}: rank {r} differs from rank 0 in {k}"
    for k, v in ours[0].items():
        where = f"N={members}: {k} vs gloo"
        if v.is_floating_point():
            torch.testing.assert_close(
                v, states["gloo"][0][k], rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}"
            )
        else:
            assert torch.equal(v, states["gloo"][0][k]), where


@pytest.mark.timeout(200)
def test_allreduce_against_gloo() -> None:
    """At N = 3 (the job's group) and 2 (groups of its first two ranks): one job."""
    out = _ok(torchrun(SCRIPTS / "allreduce_vs_gloo.py", 3, timeout_s=150))
    # ranks share one stdout pipe, so lines may run together: match tokens, not lines
    rows = re.findall(r"DIFF (\d+) (\d+) (\d+) (\d+) (\d+)", out)
    got = sorted((int(n), int(rank)) for n, rank, *_ in rows)
    assert got == [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)], out
    assert "FAIL" not in out, out
    for _n, _rank, checked, failures, _unsupported in rows:
        assert int(failures) == 0, out
        assert int(checked) > 100, out  # it really compared things


@pytest.mark.timeout(400)
def test_256mib_allreduce_completes() -> None:
    """At N = 4 (the job's group), 3 and 2 (groups of its first ranks): one job."""
    out = _ok(torchrun(SCRIPTS / "big_allreduce.py", 4, timeout_s=300))
    # ranks share one stdout pipe, so lines may run together: match tokens, not lines
    checks = re.findall(r"CHECK (\d+) (\d+) (ok|bad)", out)
    expected = [(str(n), str(r), "ok") for n in (2, 3, 4) for r in range(n)]
    assert sorted(checks) == sorted(expected), out


def _spawn(mode: str, world: int, timeout_s: float) -> dict[int, list[str]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port, TIMEOUT_S=str(timeout_s))
        procs.append(start_script([str(SCRIPTS / "fault.py"), mode], env=env))
    results: dict[int, list[str]] = {}
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout_s + 60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank hung in mode {mode}")
        for line in out.splitlines():  # one process per pipe here: lines stay whole
            if line.startswith("RESULT"):
                parts = line.split(maxsplit=4)
                results[int(parts[1])] = parts[2:]
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_killed_rank_raises_peer_connection_error_on_others(world: int) -> None:
    timeout_s = 20.0
    results = _spawn("kill", world, timeout_s)
    assert 1 not in results  # it was killed
    survivors = [r for r in range(world) if r != 1]
    assert sorted(results) == survivors, results
    for r in survivors:
        kind, seconds = results[r][0], float(results[r][1])
        assert kind == "PeerConnectionError", results[r]
        assert seconds < timeout_s, results[r]  # well within the timeout


@pytest.mark.timeout(120)
def test_different_collectives_raise_mismatch_on_both() -> None:
    results = _spawn("mismatch", 2, 20.0)
    assert sorted(results) == [0, 1], results
    for r in (0, 1):
        assert results[r][0] == "CollectiveMismatchError", results[r]
        assert "allreduce#" in results[r][2] and "allgather#" in results[r][2], results[r]


@pytest.mark.timeout(240)
def test_torchrun_restart_forms_a_fresh_group() -> None:
    """torchrun reuses one store across restart attempts; entrenar namespaces its keys."""
    proc = torchrun(SCRIPTS / "restart_probe.py", 2, timeout_s=180, extra=["--max-restarts=1"])
    out = _ok(proc)
    done = sorted(re.findall(r"DONE (\d+) (\d+)", out))
    assert done == [("1", "0"), ("1", "1")], out + proc.stderr[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "mode"), [(2, "size"), (3, "root")])
def test_a_mismatched_last_broadcast_fails_every_process(world: int, mode: str) -> None:
    """The job's last call disagrees: no process may exit as if it completed
    (the root used to return once the kernel took its bytes, destroy the
    group and exit 0 while another rank's copy differed)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port, TIMEOUT_S="20")
        procs.append(start_script([str(SCRIPTS / "last_call.py"), mode], env=env))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=90))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode != 0, f"rank {rank} exited 0: {out}"
        assert "CollectiveMismatchError" in err, f"rank {rank}: {err[-2000:]}"

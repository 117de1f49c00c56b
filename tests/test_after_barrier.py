"""benchmarks/after_barrier.py: per-call times by place after a barrier, every
contestant timed, DeepSpeed's column exactly where it is installed, its
segments gone afterwards; bad arguments refused before anything starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import run_session

from benchmarks import after_barrier, deepspeed_peer


def test_by_place_is_the_median_of_each_column() -> None:
    assert after_barrier.by_place([[3.0, 1.0], [1.0, 5.0], [2.0, 3.0]]) == [2.0, 3.0]


def test_too_few_calls_are_refused() -> None:
    with pytest.raises(SystemExit):
        after_barrier.main(["--calls", str(after_barrier.STEADY_FROM)])


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_ranks_time_every_contestant_by_place(tmp_path: Path) -> None:
    out = tmp_path / "after.json"
    before = {p.name for p in Path("/dev/shm").glob(f"{deepspeed_peer.SEGMENT_PREFIX}_*")}
    cmd = [sys.executable, "-m", "benchmarks.after_barrier", "--size", "4K"]
    proc = run_session(
        [*cmd, "--blocks", "2", "--calls", "12", "--json", str(out)], timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads(out.read_text())
    assert got["bytes"] == 4096 and got["blocks"] == 2 and got["calls"] == 12
    want = {"dist", "method"} | (
        {"deepspeed"} if deepspeed_peer.deepspeed_available()[0] else set()
    )
    assert set(got) - {"bytes", "blocks", "calls"} == want, got
    for name in want:
        places = got[name]["by_place_us"]
        assert len(places) == 12 and all(x > 0 for x in places), (name, places)
        assert got[name]["settled_us"] > 0
        assert f"{name:>10}: settled" in proc.stdout
    left = {p.name for p in Path("/dev/shm").glob(f"{deepspeed_peer.SEGMENT_PREFIX}_*")}
    assert not (left - before), f"DeepSpeed's segments left behind: {sorted(left - before)}"

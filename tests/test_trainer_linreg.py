"""trainer/linreg.py: the scaling analysis over 1, 2, 4, 8 workers is bit-identical
on entrenar in deterministic mode (gloo is expected to differ at some N)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from conftest import run_session

REPO = Path(__file__).resolve().parent.parent
BACKEND = os.environ.get("TRAINER_TEST_BACKEND", "entrenar")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_linreg_scaling_table_is_bit_identical(tmp_path):
    out = tmp_path / "linreg.json"
    cmd = [
        sys.executable, str(REPO / "trainer" / "linreg.py"), "--backend", BACKEND,
        "--world-sizes", "1", "2", "4", "8", "--steps", "30", "--json", str(out),
    ]  # fmt: skip
    stdout = run_session(cmd, timeout=140).stdout  # fails the test on a hang or an error
    results = json.loads(out.read_text())["results"]
    assert [r["world_size"] for r in results] == [1, 2, 4, 8]
    # it learned: the noise variance is 0.01, the untrained model's MSE is ~30
    assert all(math.isfinite(r["mse"]) and r["mse"] < 0.05 for r in results)
    hashes = {r["world_size"]: r["hash"] for r in results}
    assert len(set(hashes.values())) == 1, hashes
    assert len({r["mse"] for r in results}) == 1
    assert "bit-identical across world sizes: yes" in stdout
    for n in (1, 2, 4, 8):
        assert any(line.split()[:1] == [str(n)] for line in stdout.splitlines())

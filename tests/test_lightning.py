"""Lightning 2.x drop-in: ``DDPStrategy(process_group_backend="entrenar")`` against gloo.

Lightning's ``_sync_ddp`` rewrites ``reduce_fx="mean"`` as SUM-then-divide
only for a backend named "gloo"; every other backend gets ``ReduceOp.AVG``,
on int64 tensors too (the batch-size counter of every epoch-level mean), as
NCCL accepts it. tests/scripts/lightning_fit.py runs the same small fit on
both backends under torchrun (2 ranks, real processes); the logged values and
the final weights must agree.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import REPO, torchrun

# Looked up, not imported: importing lightning here would cost every xdist
# worker ~2.5 s of CPU at collection; only the torchrun ranks need it.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None,
        reason="the test extra installs lightning",
    ),
]
WORLD = 2


@pytest.mark.timeout(200)
def test_lightning_fit_logs_and_weights_match_gloo(tmp_path: Path) -> None:
    proc = torchrun(
        REPO / "tests" / "scripts" / "lightning_fit.py",
        WORLD,
        "--out",
        str(tmp_path),
        timeout_s=180,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    runs = {
        b: [torch.load(tmp_path / b / f"rank{r}.pt") for r in range(WORLD)]
        for b in ("entrenar", "gloo")
    }
    ours, gloo = runs["entrenar"], runs["gloo"]
    for table in ("callback_metrics", "logged_metrics"):
        names = set(gloo[0][table])
        assert {"loss_epoch", "rank_mean", "steps_sum", "loss_sum", "val_loss"} <= names
        for r in range(WORLD):
            assert set(ours[r][table]) == names, (table, r)
            for name in names:
                mine, ref = ours[r][table][name], gloo[r][table][name]
                assert mine.dtype == ref.dtype, (table, name)
                torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7, msg=(table, name))
                # synced: every rank logs the same value
                torch.testing.assert_close(mine, ours[0][table][name], rtol=0, atol=0)
    # Independent of either backend: rank r logs 10r + idx with batch size
    # 2 + 3r over 3 steps; the value sums (6 and 165) average to 85.5 and the
    # int64 batch-size counters (6 and 15) to 21 // 2 = 10 (gloo: 21 / 2
    # truncated by copy_, AVG on int64: truncated toward zero as in NCCL).
    last = ours[0]["callback_metrics"]
    assert last["rank_mean"].item() == pytest.approx(85.5 / 10)
    assert last["steps_sum"].item() == WORLD * 3
    for r in range(WORLD):
        for k, v in ours[r]["state"].items():
            torch.testing.assert_close(v, gloo[0]["state"][k], rtol=1e-6, atol=1e-7, msg=k)
            assert torch.equal(v, ours[0]["state"][k]), f"rank {r} differs from rank 0 in {k}"

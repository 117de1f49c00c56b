"""``torch.compile`` of distributed programs on entrenar, bit for bit against gloo.

tests/scripts/compile_scenarios.py runs every scenario under torchrun (2
ranks, real processes) on entrenar and on a gloo group over the same ranks,
same seed, same data; one job for all of them, since compiling dominates.
Each test checks one scenario's record: no error on any rank, the final
parameters (or results) ``torch.equal`` to gloo's, and facts showing the
scenario ran as named (graph split per DDP bucket or not, one graph per
FSDP2 block, compiled autograd capturing the backward) with its collectives
going through entrenar.

Before ``api/dynamo_boundary.py`` the four compiled-DDP scenarios and the
collectives at a graph break failed on entrenar with dynamo's
``UnsafeScriptObjectError`` (dynamo tried to compile ``broadcast`` as user
code); FSDP2 per block and the Python reducer already worked.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import REPO, torchrun

# xdist_group: one worker runs this module, so its module-scoped torchrun job runs once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile")]
WORLD = 2
JOB_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("compile")
    proc = torchrun(
        REPO / "tests" / "scripts" / "compile_scenarios.py",
        WORLD,
        "--out",
        str(out),
        timeout_s=JOB_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _scenario(records: list[dict[str, Any]], name: str) -> tuple[int, list[dict[str, Any]]]:
    """The scenario's record on every rank, after the checks every scenario shares."""
    per_rank = [rec["scenarios"][name] for rec in records]
    for r, entry in enumerate(per_rank):
        assert entry["error"] is None, f"rank {r}: {name} raised:\n{entry['error']}"
        assert entry["equal"], f"rank {r}: {name}: results differ from gloo's"
        assert entry["facts"] == entry["gloo_facts"], (r, entry)
    return records[0]["steps"], per_rank


TRAINING = [
    "ddp_optimizer",
    "ddp_optimizer_inductor",
    "ddp_no_optimization",
    "ddp_batchnorm",
    "fsdp2_per_block",
    "python_reducer_aot_eager",
    "python_reducer_inductor",
]


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)  # the first test waits for the job
@pytest.mark.parametrize("name", TRAINING)
def test_compiled_training_equals_gloo(records: list[dict[str, Any]], name: str) -> None:
    steps, per_rank = _scenario(records, name)
    for entry in per_rank:
        assert entry["changed"], f"{name}: training left a tensor at its initial value"
        facts, calls = entry["facts"], entry["calls"]
        if name.startswith("ddp_"):
            # DDPOptimizer splits the graph at the 2 buckets; without it, one graph
            assert facts["graphs"] == (1 if name == "ddp_no_optimization" else 2), facts
            assert calls.get("allreduce_calls", 0) >= steps, calls
            # bucket rebuild (and BatchNorm buffers every forward) from inside the compiled call
            assert calls.get("broadcast_calls", 0) >= (steps if "batchnorm" in name else 1)
        elif name == "fsdp2_per_block":
            assert facts["graphs"] == 3, facts  # one per block
            assert calls.get("allgather_calls", 0) > 0 and calls.get("reduce_scatter_calls", 0) > 0
        else:  # compiled autograd traced the backward and its allreduces
            assert facts["captures"] >= 1, facts
            assert calls.get("allreduce_calls", 0) >= steps, calls


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_collectives_inside_compiled_functions(records: list[dict[str, Any]]) -> None:
    # dist.all_reduce and funcol.all_reduce traced into fullgraph graphs, dist.broadcast
    # and an async_op all_reduce run at graph breaks; 2 calls each, every value checked
    # in the script against both ranks' inputs
    _, per_rank = _scenario(records, "collectives_in_compiled_fn")
    for entry in per_rank:
        assert entry["calls"] == {"allreduce_calls": 6, "broadcast_calls": 2}, entry["calls"]


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_group_method_in_compiled_code_is_refused_as_on_gloo(
    records: list[dict[str, Any]],
) -> None:
    # a torch limit (docs/api.md): if a torch upgrade lifts it on gloo, this fails
    _, per_rank = _scenario(records, "group_method_in_compiled_fn")
    for entry in per_rank:
        assert entry["facts"]["refused"] == "InternalTorchDynamoError", entry["facts"]

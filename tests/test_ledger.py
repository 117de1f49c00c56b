"""The run ledger (ENTRENAR_LEDGER): the chain, the parameter hash, the CLI, and the trainer.

The trainer tests run three tiny deterministic trainings at once (N=1, N=2,
and N=1 with one weight bit flipped after step FLIP_AT) and check their
ledgers with the CLI's functions; the format's own tests need no process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port, rank_env, run_ranks
from preloaded import ScriptProcess, start_script

from entrenar_pg import Options
from entrenar_pg.config import ENV_LEDGER
from entrenar_pg.ledger import FAILED, OK, UNREADABLE, LedgerError, chain_errors, read_lines
from entrenar_pg.ledger import diff as ledger_diff
from entrenar_pg.ledger import main as ledger_main
from entrenar_pg.ledger import verify as ledger_verify
from entrenar_pg.ledger_writer import GENESIS, RunLedger, canonical, parameter_hash, seal

# xdist_group: one worker runs this module, so the module-scoped trainings run once.
pytestmark = pytest.mark.xdist_group("ledger_runs")

STEPS = 4
FLIP_AT = 3
TINY = [
    "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
    "--batch-size", "4", "--corpus-bytes", "200000", "--eval-batches", "2",
    "--eval-every", "0", "--sample-bytes", "0", "--no-plot", "--no-progress",
    "--warmup-steps", "2", "--dropout", "0.1", "--threads", "1",
    "--deterministic", "--micro-batches", "2", "--steps", str(STEPS),
]  # fmt: skip


# ---------------------------------------------------------------------- the format


class _OneRank:
    """The two methods of a process group the writer asks (rank, size)."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _write(path: Path, hashes: list[str]) -> RunLedger:
    ledger = RunLedger(_OneRank(), path)
    for h in hashes:
        ledger.step += 1
        ledger.write({"ledger": 1, "step": ledger.step, "param_hash": h, "world_size": 1})
    ledger.close()
    return ledger


def test_chain_links_each_line_to_the_one_before(tmp_path):
    path = tmp_path / "l.jsonl"
    _write(path, ["aa", "bb", "cc"])
    lines = [json.loads(raw) for raw in path.read_text().splitlines()]
    assert lines[0]["prev"] == GENESIS
    assert [b["prev"] for b in lines[1:]] == [a["hash"] for a in lines[:-1]]
    assert len({line["hash"] for line in lines}) == 3
    assert path.read_text().splitlines()[1] == canonical(lines[1])
    assert chain_errors(read_lines(path)) is None


def test_reopened_ledger_continues_the_chain_and_cuts_a_torn_tail(tmp_path):
    path = tmp_path / "l.jsonl"
    _write(path, ["aa", "bb"])
    with open(path, "a") as f:
        f.write('{"hash":"12')  # a writer killed mid-line
    ledger = RunLedger(_OneRank(), path)
    ledger.start_at(2)
    ledger.step += 1
    ledger.write({"step": ledger.step, "param_hash": "cc"})
    ledger.close()
    lines = read_lines(path)
    assert [line.step for line in lines] == [1, 2, 3]
    assert chain_errors(lines) is None


def test_chain_names_the_first_broken_line(tmp_path):
    path = tmp_path / "l.jsonl"
    _write(path, ["aa", "bb", "cc", "dd"])
    raw = path.read_text().splitlines()

    edited = json.loads(raw[1])
    edited["param_hash"] = "ff"  # hash left as it was
    (tmp_path / "a").write_text("\n".join([raw[0], canonical(edited), *raw[2:]]) + "\n")
    msg = chain_errors(read_lines(tmp_path / "a"))
    assert msg is not None and msg.startswith("line 2 (step 2) was altered"), msg

    resealed = seal({k: v for k, v in edited.items() if k not in ("prev", "hash")}, edited["prev"])
    (tmp_path / "b").write_text("\n".join([raw[0], canonical(resealed), *raw[2:]]) + "\n")
    msg = chain_errors(read_lines(tmp_path / "b"))
    assert msg is not None and msg.startswith("line 3 (step 3) does not chain to line 2's"), msg

    (tmp_path / "c").write_text("\n".join([raw[0], *raw[2:]]) + "\n")  # line 2 removed
    msg = chain_errors(read_lines(tmp_path / "c"))
    assert msg is not None and msg.startswith("line 2 (step 3) does not chain"), msg

    (tmp_path / "d").write_text("\n".join(raw[1:]) + "\n")  # the first line removed
    msg = chain_errors(read_lines(tmp_path / "d"))
    assert msg is not None and "to the genesis value" in msg, msg


def test_parameter_hash_covers_values_dtype_shape_and_order():
    a, b = torch.arange(6.0), torch.ones(2, 3)
    base = parameter_hash([a, b])
    assert base == parameter_hash([a.clone(), b.clone()]) and base[1] == 2
    flipped = a.clone()
    flipped.view(torch.uint8)[0] ^= 1
    variants = [
        [flipped, b],
        [b, a],
        [a.reshape(2, 3), b],
        [a.double(), b],
        [a, b.t()],  # same values as a 3x2: the shape differs
        [a],
    ]
    hashes = {parameter_hash(v)[0] for v in variants}
    assert base[0] not in hashes and len(hashes) == len(variants)
    assert parameter_hash([a[::2]])[0] == parameter_hash([a[::2].contiguous()])[0]


def test_options_read_the_ledger_path():
    assert Options.from_env({ENV_LEDGER: " /x/run.jsonl "}).ledger == "/x/run.jsonl"
    assert Options.from_env({}).ledger == ""


def test_trainer_passes_the_ledger_path_to_entrenar_only():
    from trainer.common import group_options
    from trainer.config import parse_args

    assert parse_args(["--ledger", "run.jsonl"]).ledger == "run.jsonl"
    options = group_options("entrenar", True, "run.jsonl")
    assert options.ledger == "run.jsonl" and options.deterministic
    assert group_options("entrenar", False).ledger == ""
    with pytest.raises(ValueError, match="--ledger needs the entrenar backend"):
        group_options("gloo", False, "run.jsonl")


@pytest.mark.timeout(60)
def test_group_with_a_ledger_writes_on_rank_0_only_with_the_checker_verdicts(tmp_path):
    path = tmp_path / "run.jsonl"

    def train(rank: int, group) -> str:
        # Ranks are threads: a generator of their own (the global RNG is shared).
        w = torch.nn.Parameter(torch.randn(8, 3, generator=torch.Generator().manual_seed(0)))
        opt = torch.optim.SGD([w], lr=0.1)
        group.checker.watch(opt)  # not the default group: each step by hand
        group.ledger.watch(opt)
        for _ in range(3):
            w.grad = torch.full_like(w, 0.5)
            group.allreduce([w.grad]).wait()
            opt.step()
        return parameter_hash([w])[0]

    final = run_ranks(2, train, options=Options(check=True, ledger=str(path)))
    lines = read_lines(path)
    assert [line.step for line in lines] == [1, 2, 3]  # rank 1 wrote nothing
    assert all(line.fields["world_size"] == 2 for line in lines)
    # Each step: its allreduce (C-RING-001, F-DP-003) and C-DDP-001; from step 2 also the
    # ledger's own digest all-gather of the step before (C-AG-001), judged with this step.
    step = {"C-RING-001": 1, "F-DP-003": 1, "C-DDP-001": 1}
    expected = [step] + [{**step, "C-AG-001": 1}] * 2
    assert [line.fields["verdicts"] for line in lines] == expected
    assert lines[-1].param_hash == final[0] == final[1]
    assert chain_errors(lines) is None


# ---------------------------------------------------------------------- FSDP2


def _mlp_and_batches() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    g = torch.Generator().manual_seed(1)
    return model, [
        (torch.randn(5, 12, generator=g), torch.randn(5, 3, generator=g)) for _ in range(3)
    ]


def _train(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
    """SGD on ``batches`` (the same on every rank); the parameter hash after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hashes = []
    for x, y in batches:
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        hashes.append(
            parameter_hash(
                [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
            )[0]
        )
    return hashes


def _fsdp_ledger_worker(rank: int, world: int, path: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group(
        "entrenar", timeout=timedelta(seconds=60), pg_options=Options(ledger=path)
    )
    model, batches = _mlp_and_batches()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())
    _train(model, batches)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp2_sharded_parameters_are_hashed_whole(tmp_path):
    """FSDP2 at N=2 (every rank sees the same batch, so the averaged gradient is
    exactly one rank's): the ledger's hashes equal an unsharded model's, step by step."""
    from test_api_collectives import spawn_ranks

    path = tmp_path / "fsdp.jsonl"
    spawn_ranks(2, _fsdp_ledger_worker, str(path), timeout_s=100)
    lines = read_lines(path)
    assert [line.step for line in lines] == [1, 2, 3]
    assert {line.fields["world_size"] for line in lines} == {2}
    model, batches = _mlp_and_batches()
    assert [line.param_hash for line in lines] == _train(model, batches)


# ---------------------------------------------------------------------- trainer runs


def _start(args: list[str], env: dict[str, str], log: Path) -> ScriptProcess:
    cmd = [str(REPO / "trainer" / "train.py"), *TINY, *args]
    return start_script(cmd, env=env, cwd=REPO, log=log, new_session=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Three deterministic trainings at once: N=1, N=2 (checker on), N=1 with a flipped bit."""
    tmp = tmp_path_factory.mktemp("ledger_runs")

    def out(name: str) -> list[str]:
        return ["--out-dir", str(tmp / name), "--ledger", str(tmp / f"{name}.jsonl")]

    single = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    single.pop("RANK", None)
    port = free_port()
    procs = [
        _start(out("one"), single, tmp / "one.log"),
        _start([*out("flip"), "--flip-bit-at-step", str(FLIP_AT)], single, tmp / "flip.log"),
        *(
            _start(out("two"), rank_env(r, 2, port, ENTRENAR_CHECK="1"), tmp / f"two{r}.log")
            for r in range(2)
        ),
    ]
    deadline = time.monotonic() + 100
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    logs = {log.name: log.read_text(errors="replace")[-3000:] for log in tmp.glob("*.log")}
    assert all(p.returncode == 0 for p in procs), logs
    assert f"ledger: {tmp / 'one.jsonl'}" in logs["one.log"], logs["one.log"]
    return {name: tmp / name for name in ("one", "two", "flip")}


def _ledger(runs: dict[str, Path], name: str) -> Path:
    return runs[name].with_suffix(".jsonl")


def _checkpoint(runs: dict[str, Path], name: str) -> Path:
    return runs[name] / "ckpt" / "latest.pt"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_world_sizes_1_and_2_hash_the_same_at_every_step(runs):
    one, two = read_lines(_ledger(runs, "one")), read_lines(_ledger(runs, "two"))
    assert [line.step for line in one] == [line.step for line in two] == [1, 2, 3, 4]
    assert {line.fields["world_size"] for line in two} == {2}
    assert [line.param_hash for line in one] == [line.param_hash for line in two]
    assert len({line.param_hash for line in one}) == STEPS  # the weights moved every step
    assert all(line.fields["verdicts"] is None for line in one)
    assert all(line.fields["verdicts"]["C-DDP-001"] == 1 for line in two)
    status, msg = ledger_diff(_ledger(runs, "one"), _ledger(runs, "two"))
    assert status == OK and "agree over 4 common steps (1..4; world sizes 1 and 2)" in msg, msg


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_diff_finds_a_flipped_bit_at_its_step(runs):
    status, msg = ledger_diff(_ledger(runs, "two"), _ledger(runs, "flip"))
    assert status == FAILED and msg.startswith(f"the runs differ first at step {FLIP_AT}:"), msg
    flip = read_lines(_ledger(runs, "flip"))
    assert chain_errors(flip) is None  # an honest ledger of a corrupted run


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_verify_accepts_the_run_and_its_checkpoint_at_any_world_size(runs):
    for ledger, ckpt in (("one", "one"), ("two", "two"), ("two", "one"), ("flip", "flip")):
        status, msg = ledger_verify(_ledger(runs, ledger), _checkpoint(runs, ckpt))
        assert status == OK and f"matches step {STEPS} (line {STEPS})" in msg, msg


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_verify_rejects_a_checkpoint_of_other_weights_or_another_step(runs, tmp_path):
    status, msg = ledger_verify(_ledger(runs, "one"), _checkpoint(runs, "flip"))
    assert status == FAILED and f"do not match the ledger at step {STEPS}" in msg, msg

    payload = torch.load(_checkpoint(runs, "one"), weights_only=True)
    for step, expected in ((2, "do not match the ledger at step 2"), (9, "step 9 is not in")):
        torch.save(dict(payload, step=step), tmp_path / "other.pt")
        status, msg = ledger_verify(_ledger(runs, "one"), tmp_path / "other.pt")
        assert status == FAILED and expected in msg, msg

    del payload["ledger_parameters"]
    torch.save(payload, tmp_path / "plain.pt")
    with pytest.raises(LedgerError, match="no 'ledger_parameters' list"):
        ledger_verify(_ledger(runs, "one"), tmp_path / "plain.pt")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_verify_rejects_a_tampered_line_of_a_real_run(runs, tmp_path):
    raw = _ledger(runs, "two").read_text().splitlines()
    flip = read_lines(_ledger(runs, "flip"))
    line = json.loads(raw[FLIP_AT - 1])
    line["param_hash"] = flip[FLIP_AT - 1].param_hash  # pretend the corrupted step was clean
    raw[FLIP_AT - 1] = canonical(line)
    (tmp_path / "t.jsonl").write_text("\n".join(raw) + "\n")
    status, msg = ledger_verify(tmp_path / "t.jsonl", None)
    assert status == FAILED and f"line {FLIP_AT} (step {FLIP_AT}) was altered" in msg, msg


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_exit_status_and_messages(runs, tmp_path, capsys):
    one, flip = str(_ledger(runs, "one")), str(_ledger(runs, "flip"))
    assert ledger_main(["diff", one, flip]) == FAILED
    assert f"FAILED: the runs differ first at step {FLIP_AT}" in capsys.readouterr().out
    assert ledger_main(["verify", str(tmp_path / "missing.jsonl")]) == UNREADABLE
    assert "error: " in capsys.readouterr().err
    (tmp_path / "junk.jsonl").write_text('{"step": 1}\n')
    assert ledger_main(["verify", str(tmp_path / "junk.jsonl")]) == UNREADABLE
    assert "line 1 is not a ledger line" in capsys.readouterr().err
    # the module runs as `python -m entrenar_pg.ledger`
    proc = subprocess.run(
        [sys.executable, "-m", "entrenar_pg.ledger", "verify", one, "--checkpoint",
         str(_checkpoint(runs, "one"))],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == OK, proc.stderr
    assert f"chain intact over {STEPS} lines" in proc.stdout and not proc.stderr, proc.stderr
    shutil.copy(one, tmp_path / "copy.jsonl")
    assert ledger_main(["diff", one, str(tmp_path / "copy.jsonl")]) == OK

"""Unit tests of the trainer's pieces (no processes): corpus, sharding, model, checkpoints."""

from __future__ import annotations

import math
import os
import random
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
from preloaded import ScriptProcess, start_script

from trainer import checkpoint as ckpt
from trainer.common import is_power_of_two, param_hash, state_hash, tree_sum
from trainer.config import TrainConfig, parse_args
from trainer.data import (
    EXCLUDED_DIRS,
    SampleStream,
    build_corpus,
    list_source_files,
    micro_batch_windows,
    num_windows,
    rank_micro_batches,
    stdlib_root,
    val_windows,
    windows_to_batch,
)
from trainer.distributed import pick_device
from trainer.metrics import read_metrics
from trainer.model import GPT, GPTConfig
from trainer.optim import CosineWithWarmup
from trainer.step import micro_seed

REPO = Path(__file__).resolve().parent.parent
TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)


# -- tree_sum ---------------------------------------------------------------------


def _reference_tree(xs):
    if len(xs) == 1:
        return xs[0]
    m = (len(xs) + 1) // 2
    return ("+", _reference_tree(xs[:m]), _reference_tree(xs[m:]))


class _Sym:
    """A value that records the expression it was built from."""

    def __init__(self, e):
        self.e = e

    def __add__(self, other):
        return _Sym(("+", self.e, other.e))


@pytest.mark.parametrize("n", range(1, 10))
def test_tree_sum_order_is_canonical(n):
    got = tree_sum([_Sym(i) for i in range(n)]).e
    assert got == _reference_tree(list(range(n)))
    if n == 4:
        assert got == ("+", ("+", 0, 1), ("+", 2, 3))


def test_tree_sum_matches_backend_when_available():
    try:
        import entrenar_pg
    except ImportError:
        pytest.skip("entrenar_pg not importable")
    if not hasattr(entrenar_pg, "tree_sum"):
        pytest.skip("entrenar_pg.tree_sum not provided")
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 4, 5, 8):
        xs = [torch.randn(1000, generator=g) * 10 ** (i % 5) for i in range(n)]
        assert torch.equal(entrenar_pg.tree_sum(xs), tree_sum(xs)), n


def test_tree_of_rank_trees_equals_global_tree_for_powers_of_two():
    """The world-size-invariance argument, checked on float32 bits."""
    g = torch.Generator().manual_seed(1)
    m = 8
    xs = [torch.randn(4096, generator=g) * 10 ** (i % 4) for i in range(m)]
    ref = tree_sum(xs)
    for n in (1, 2, 4, 8):
        per = m // n
        partial = [tree_sum(xs[r * per : (r + 1) * per]) for r in range(n)]
        assert torch.equal(tree_sum(partial), ref), n
    # ...and a left-to-right sum is not the same bits (else the test proves nothing).
    seq = xs[0]
    for x in xs[1:]:
        seq = seq + x
    assert not torch.equal(seq, ref)


def test_is_power_of_two():
    assert [n for n in range(0, 17) if is_power_of_two(n)] == [1, 2, 4, 8, 16]


# -- corpus and sharding ------------------------------------------------------------


def test_corpus_is_stdlib_sorted_and_capped():
    files = list_source_files()
    assert files == sorted(files) and len(files) > 100
    assert all(f.endswith(".py") for f in files)
    assert not any(set(Path(f).parts) & EXCLUDED_DIRS for f in files)
    assert "os.py" in files
    c1 = build_corpus(300_000)
    c2 = build_corpus(300_000)
    assert c1.n_bytes == 300_000
    assert c1.sha256 == c2.sha256 and torch.equal(c1.train, c2.train)
    assert c1.val.numel() > 0 and c1.train.numel() > c1.val.numel()
    text = bytes(c1.train[:2000].tolist()).decode()
    assert text.startswith("# file: " + files[0] + "\n")
    assert c1.root == str(stdlib_root())
    assert build_corpus(200_000).sha256 != c1.sha256


def test_tiny_corpus_still_has_a_validation_split():
    c = build_corpus(5_000, val_every=20)
    assert c.val.numel() == 250 and c.train.numel() == 4750


def test_batches_are_shifted_windows():
    data = torch.arange(100, dtype=torch.uint8)
    assert num_windows(data, 8) == 12
    x, y = windows_to_batch(data, [0, 3], 8)
    assert x.dtype == torch.long and x.shape == (2, 8)
    assert x[1].tolist() == list(range(24, 32)) and y[1].tolist() == list(range(25, 33))


def test_stream_epochs_are_permutations_with_fresh_shuffles():
    s = SampleStream(50, seed=3)
    e0, e1 = s.take(0, 50), s.take(50, 50)
    assert sorted(e0) == list(range(50)) and sorted(e1) == list(range(50))
    assert e0 != e1 and e0 != list(range(50))
    assert SampleStream(50, seed=3).take(37, 20) == s.take(37, 20)
    assert SampleStream(50, seed=4).take(0, 50) != e0


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_sharding_is_disjoint_complete_and_world_size_invariant(world):
    stream = SampleStream(1000, seed=0)
    m, b = 8, 3
    seen: list[int] = []
    by_micro: dict[tuple[int, int], list[int]] = {}
    for step in range(5):
        consumed = step * m * b
        owners = [j for r in range(world) for j in rank_micro_batches(r, world, m)]
        assert owners == list(range(m))  # every micro-batch on exactly one rank, in order
        for r in range(world):
            for j in rank_micro_batches(r, world, m):
                w = micro_batch_windows(stream, consumed, j, b)
                by_micro[(step, j)] = w
                seen.extend(w)
    assert len(seen) == len(set(seen)) == 5 * m * b  # disjoint and gap-free
    assert seen == stream.take(0, 5 * m * b)  # complete: the stream's prefix
    # the same micro-batch holds the same samples whatever the world size
    ref = {(s, j): micro_batch_windows(stream, s * m * b, j, b) for s in range(5) for j in range(m)}
    assert by_micro == ref


def test_rank_micro_batches_rejects_indivisible():
    with pytest.raises(ValueError, match="divisible"):
        rank_micro_batches(0, 3, 8)


def test_val_windows_fixed_and_spread():
    val = torch.zeros(10_001, dtype=torch.uint8)
    w = val_windows(val, 100, 10)
    assert w == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90]
    assert val_windows(val, 100, 500) == list(range(100))
    assert val_windows(torch.zeros(5, dtype=torch.uint8), 100, 3) == []


# -- model -----------------------------------------------------------------------------


def test_gpt_shapes_initial_loss_and_tied_weights():
    torch.manual_seed(0)
    m = GPT(TINY)
    x = torch.randint(0, 256, (3, 16))
    logits, loss = m(x, x)
    assert logits.shape == (3, 16, 256)
    assert abs(loss.item() - math.log(256)) < 0.3  # near uniform at init
    assert m.head.weight is m.tok_emb.weight
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_learns_a_repeating_pattern():
    torch.manual_seed(0)
    m = GPT(TINY)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    data = torch.tensor(list(b"abcdefgh" * 4), dtype=torch.long)
    x, y = data[:16].unsqueeze(0), data[1:17].unsqueeze(0)
    first = None
    for _ in range(60):
        _, loss = m(x, y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first
    g = torch.Generator().manual_seed(0)
    out = m.generate(torch.tensor([list(b"abc")]), 5, temperature=0.1, top_k=1, generator=g)
    assert bytes(out[0].tolist()) == b"abcdefgh"


def test_gpt_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)


def test_dropout_depends_only_on_the_micro_batch_seed():
    cfg = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.5)
    torch.manual_seed(0)
    m = GPT(cfg)
    x = torch.randint(0, 256, (2, 16))
    torch.manual_seed(micro_seed(1, 7, 3))
    a = m(x, x)[1]
    torch.randn(100)  # unrelated RNG use in between (another rank's work)
    torch.manual_seed(micro_seed(1, 7, 3))
    b = m(x, x)[1]
    torch.manual_seed(micro_seed(1, 7, 4))
    c = m(x, x)[1]
    assert torch.equal(a, b) and not torch.equal(a, c)


# -- schedule and config ----------------------------------------------------------------


def test_cosine_with_warmup():
    f = CosineWithWarmup(warmup=10, decay_steps=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    vals = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(vals, vals[1:], strict=False))


@pytest.mark.parametrize("gpus", [1, 2])
def test_more_ranks_than_gpus_share_them_round_robin(monkeypatch, gpus):
    # torchrun --nproc_per_node=2 on a one-GPU machine (the README's command):
    # local rank 1 once asked for cuda:1 and failed with "invalid device ordinal".
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    cfg = parse_args(["--device", "cuda"])
    picked = [pick_device(cfg, local_rank) for local_rank in range(4)]
    assert [d.index for d in picked] == [r % gpus for r in range(4)]
    assert chosen == picked


def test_device_cuda_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no CUDA device"):
        pick_device(parse_args(["--device", "cuda"]), 0)


def test_parse_args_maps_onto_frozen_config():
    cfg = parse_args(["--backend", "gloo", "--steps", "7", "--deterministic", "--no-progress"])
    assert isinstance(cfg, TrainConfig)
    assert (cfg.backend, cfg.steps, cfg.deterministic, cfg.progress) == ("gloo", 7, True, False)
    assert cfg.metrics_path == Path("runs/train/metrics.jsonl")
    assert cfg.ckpt_dir == Path("runs/train/ckpt")
    assert parse_args(["--checkpoint-dir", "none"]).ckpt_dir is None
    with pytest.raises(Exception):  # noqa: B017 (dataclasses.FrozenInstanceError)
        cfg.steps = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="backend"):
        TrainConfig(backend="mpi")
    with pytest.raises(SystemExit):
        parse_args(["--backend", "mpi"])
    with pytest.raises(SystemExit):
        parse_args(["--steps", "many"])


def test_read_metrics_keeps_the_last_record_per_step(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(
        '{"event": "start", "step": 0}\n{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n'
        '{"event": "start", "step": 1}\n{"step": 2, "loss": 3.5}\n{"step": 3, "loss": 3.0}\n'
    )
    assert [(r["step"], r["loss"]) for r in read_metrics(p)] == [(1, 5.0), (2, 3.5), (3, 3.0)]


# -- checkpoints ---------------------------------------------------------------------------


def test_checkpoint_round_trip_restores_everything(tmp_path):
    torch.manual_seed(0)
    m = GPT(TINY)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, CosineWithWarmup(2, 10, 0.1))
    x = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        m(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    random.seed(5)
    torch.manual_seed(6)
    payload = {
        "format": ckpt.FORMAT_VERSION,
        "step": 3,
        "model": m.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": ckpt.rng_state(torch.device("cpu")),
    }
    path = ckpt.save_atomic(payload, ckpt.checkpoint_path(tmp_path / "c"))
    assert ckpt.latest_checkpoint(tmp_path / "c") == path
    assert [p.name for p in path.parent.iterdir()] == ["latest.pt"]  # no temp file left
    expect_py, expect_t = random.random(), torch.rand(3)

    torch.manual_seed(1)
    m2 = GPT(TINY)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, CosineWithWarmup(2, 10, 0.1))
    state = ckpt.load(path)
    m2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    sched2.load_state_dict(state["scheduler"])
    ckpt.set_rng_state(state["rng"], torch.device("cpu"))
    assert random.random() == expect_py and torch.equal(torch.rand(3), expect_t)
    assert param_hash(m2) == param_hash(m)
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # the next step is the same on both
    for model, o, s in ((m, opt, sched), (m2, opt2, sched2)):
        model(x, x)[1].backward()
        o.step()
        s.step()
    assert param_hash(m2) == param_hash(m)


def test_save_atomic_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = ckpt.checkpoint_path(tmp_path)
    ckpt.save_atomic({"format": ckpt.FORMAT_VERSION, "step": 1}, path)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_atomic({"format": ckpt.FORMAT_VERSION, "step": 2}, path)
    monkeypatch.undo()
    assert ckpt.load(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt"]


# A writer that dies inside save_atomic the way a SIGKILLed rank 0 does: the
# payload is written, the kill comes at fsync, before the rename.
KILLED_WRITER = """
import os, signal, sys
import torch
from trainer import checkpoint as ckpt
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
ckpt.save_atomic({"format": ckpt.FORMAT_VERSION, "step": 99, "w": torch.zeros(1000)}, sys.argv[1])
"""

# A writer that stops inside save_atomic (its temporary written and locked)
# until told to go on: a live job saving into the same directory.
PAUSED_WRITER = """
import os, sys, time
import torch
from trainer import checkpoint as ckpt
real_fsync = os.fsync
def fsync(fd):
    open(sys.argv[2], "w").close()  # "I am inside, file written and locked"
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.01)
    real_fsync(fd)
os.fsync = fsync
ckpt.save_atomic({"format": ckpt.FORMAT_VERSION, "step": 7}, sys.argv[1])
"""


def _python(code: str, *args: str) -> ScriptProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return start_script(["-c", code, *args], env=env, cwd=REPO)


def _temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.timeout(60)
def test_a_killed_writers_temp_file_is_removed_and_the_checkpoint_kept(tmp_path):
    path = ckpt.checkpoint_path(tmp_path)
    ckpt.save_atomic({"format": ckpt.FORMAT_VERSION, "step": 1}, path)
    proc = _python(KILLED_WRITER, str(path))
    _, err = proc.communicate(timeout=50)
    assert proc.returncode == -signal.SIGKILL, err
    left = _temp_files(tmp_path)
    assert len(left) == 1 and left[0].startswith(".latest.pt."), left
    assert ckpt.load(path)["step"] == 1  # the kill left the old checkpoint whole

    removed = ckpt.remove_stale_temp_files(tmp_path)
    assert [p.name for p in removed] == left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt"]
    assert ckpt.load(path)["step"] == 1
    assert ckpt.remove_stale_temp_files(tmp_path) == []
    assert ckpt.remove_stale_temp_files(tmp_path / "missing") == []


@pytest.mark.timeout(60)
def test_a_live_writers_temp_file_is_kept(tmp_path):
    """Another job saving into the same directory right now keeps its file."""
    path = ckpt.checkpoint_path(tmp_path / "c")
    inside, go = tmp_path / "inside", tmp_path / "go"
    proc = _python(PAUSED_WRITER, str(path), str(inside), str(go))
    try:
        deadline = time.monotonic() + 40
        while not inside.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the writer never got inside save_atomic"
            time.sleep(0.01)
        live = _temp_files(path.parent)
        assert len(live) == 1
        assert ckpt.remove_stale_temp_files(path.parent) == []
        assert _temp_files(path.parent) == live
    finally:
        go.touch()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest.pt"]
    assert ckpt.load(path)["step"] == 7


def test_cleanup_touches_only_our_temp_pattern_in_the_directory(tmp_path):
    dead = ".latest.pt.ab_c1234.tmp"
    keep_files = [
        "latest.pt",
        ".latest.pt.abc.tmp",  # not mkstemp's 8 characters
        ".latest.pt.ABCDEFGH.tmp",  # not mkstemp's alphabet
        ".latest.pt.abcdefgh.tmp.bak",
        ".other.pt.abcdefgh.tmp",
        "notes.tmp",
    ]
    for name in [dead, *keep_files]:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".latest.pt.dir12345.tmp").mkdir()  # a directory with the name
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / ".latest.pt.abcdefgh.tmp").write_bytes(b"x")  # not in the directory itself
    outside = tmp_path.parent / f"{tmp_path.name}-target"
    outside.write_bytes(b"keep me")
    (tmp_path / ".latest.pt.link1234.tmp").symlink_to(outside)

    removed = ckpt.remove_stale_temp_files(tmp_path)
    assert [p.name for p in removed] == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*keep_files, ".latest.pt.dir12345.tmp", "sub", ".latest.pt.link1234.tmp"]
    )
    assert (sub / ".latest.pt.abcdefgh.tmp").exists() and outside.read_bytes() == b"keep me"


def test_save_survives_a_cleaner_taking_its_temp_file_before_it_locked(tmp_path, monkeypatch):
    """The race the lock cannot close by itself: a cleaner that runs between
    mkstemp and the writer's flock sees an unlocked file and removes it; the
    writer notices (no link left) and takes a fresh temporary."""
    real_mkstemp = tempfile.mkstemp
    calls = []

    def mkstemp_then_clean(*args, **kwargs):
        fd, name = real_mkstemp(*args, **kwargs)
        calls.append(name)
        if len(calls) == 1:
            assert [str(p) for p in ckpt.remove_stale_temp_files(tmp_path)] == [name]
        return fd, name

    monkeypatch.setattr(ckpt.tempfile, "mkstemp", mkstemp_then_clean)
    path = ckpt.save_atomic(
        {"format": ckpt.FORMAT_VERSION, "step": 3}, ckpt.checkpoint_path(tmp_path)
    )
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt"]
    assert ckpt.load(path)["step"] == 3


def test_load_rejects_foreign_files(tmp_path):
    p = tmp_path / "x.pt"
    torch.save({"weights": torch.zeros(1)}, p)
    with pytest.raises(ValueError, match="not an entrenar trainer checkpoint"):
        ckpt.load(p)
    assert ckpt.latest_checkpoint(tmp_path) is None and ckpt.latest_checkpoint("") is None


def test_state_hash_sees_every_bit():
    t = torch.zeros(4)
    h0 = state_hash([("a", t)])
    t2 = t.clone()
    t2.view(torch.int32)[2] = 1  # smallest subnormal: a one-bit change
    assert state_hash([("a", t2)]) != h0
    assert state_hash([("b", t)]) != h0
    assert state_hash([("a", t.double())]) != h0
    assert state_hash([("a", torch.tensor(1.0))]) != state_hash([("a", torch.tensor([1.0]))])

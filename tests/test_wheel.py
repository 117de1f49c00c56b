"""The wheel, as a user gets it: its contents, a job run from it, and a broken install.

Every other test runs the checkout (editable install, the repository on
sys.path). These build the wheel from a copy of the source tree, install it
(not editable, with pip resolving its dependencies) into one fresh venv, and
run everything with the venv's own programs, in a directory outside the
checkout and without PYTHONPATH, so only the installed wheel can be imported
(each job reports ``entrenar_pg.__file__``, and the tests check that it is
in the venv).

The venv's torch is this environment's, not a second copy: a .pth file in
the venv names a directory of links to what the wheel requires (torch, numpy)
and their own requirements, nothing else of this environment, so pip finds
the wheel's requirements installed (``--no-index``: it could not fetch one)
and torch starts from its compiled modules. A pip-installed copy cost ~14 s of CPU for
the venv and ~8 s more for its first start-ups (compiling torch's modules),
and proved nothing of ours. Costs now: building ~3 s, the venv ~3 s, then a
torch start-up (~2 s of CPU) per program run.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from entrenar_pg import _plugin

REPO = Path(__file__).resolve().parents[1]
# Not part of the source: what a checkout accumulates (builds, caches, runs).
COPY_IGNORE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".*_cache", "runs", "bench_out"
)
# A backstop over each test and the fixtures it starts (the wheel, the venv):
# every step below has its own, shorter timeout.
# xdist_group: one worker runs this module, so its module-scoped wheel and venv are built once.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("wheel")]


def isolated_env(**extra: str) -> dict[str, str]:
    """This environment without anything that could import the checkout (a
    PYTHONPATH naming it would also make pip see its egg-info as installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1", **extra)
    return env


@dataclass(frozen=True)
class Venv:
    root: Path
    site: Path  # its site-packages, where the wheel went
    work: Path  # a directory outside the checkout to run in

    def bin(self, name: str) -> str:
        return str(self.root / "bin" / name)

    def env(self, **extra: str) -> dict[str, str]:
        return isolated_env(**extra)

    def run(self, args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args,
            cwd=self.work,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def checked(proc: subprocess.CompletedProcess[str], what: str) -> str:
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the tree (a checkout's stale build/ would leak into it)."""
    base = tmp_path_factory.mktemp("wheel")
    src, out = base / "src", base / "dist"
    shutil.copytree(REPO, src, ignore=COPY_IGNORE)
    # No build isolation: the backend (setuptools, in the test extra) is this
    # environment's, so building needs no index and no download.
    checked(
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
            + ["-w", str(out), str(src)],
            capture_output=True,
            text=True,
            timeout=60,
        ),
        "pip wheel",
    )
    (built,) = out.glob("entrenar_pg-*.whl")
    return built


def run_requirements(requires: list[str]) -> list[str]:
    """The names among ``requires`` (Requires-Dist lines) that are needed to
    run here: markers that hold on this Python, no extras."""
    reqs = [Requirement(text) for text in requires]
    return [r.name for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as whl:
        (metadata,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        text = whl.read(metadata).decode()
    return run_requirements(
        [
            line.split(":", 1)[1].strip()
            for line in text.splitlines()
            if line.startswith("Requires-Dist:")
        ]
    )


def requirement_closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``names`` need to run, those included,
    found in this environment (their requirements, transitively)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name not in found:
            found[name] = importlib.metadata.distribution(name)
            todo += run_requirements(found[name].requires or [])
    return list(found.values())


def link_installed(dists: list[importlib.metadata.Distribution], into: Path) -> None:
    """Link each distribution's top-level files and directories (and its
    metadata, so pip and importlib.metadata see it installed) into ``into``."""
    for d in dists:
        site = Path(d.locate_file("")).resolve()
        tops = {Path(f).parts[0] for f in d.files or [] if not str(f).startswith("..")}
        for top in tops:
            target = site / top
            if target.exists() and not (into / top).exists():
                (into / top).symlink_to(target)


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv holding the wheel, installed the way a user would, over this torch."""
    base = tmp_path_factory.mktemp("venv")
    root, work, installed = base / "venv", base / "work", base / "torch-site"
    work.mkdir()
    installed.mkdir()
    checked(
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(root)],
            capture_output=True,
            text=True,
            timeout=60,
        ),
        "python -m venv",
    )
    (site,) = root.glob("lib/python*/site-packages")
    link_installed(requirement_closure(wheel_requirements(wheel)), installed)
    (site / "torch_of_the_test_env.pth").write_text(f"{installed}\n")
    # This pip, installing into the venv (--python): pip runs as the venv's
    # interpreter, so it sees what the venv sees (torch through the .pth).
    pip = [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install"]
    checked(
        subprocess.run(
            pip + ["-q", "--no-compile", "--no-index", str(wheel)],
            cwd=work,
            env=isolated_env(),
            capture_output=True,
            text=True,
            timeout=180,
        ),
        f"pip install {wheel.name}",
    )
    return Venv(root, site, work)


def test_the_wheel_holds_the_source_package_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        parsed = configparser.ConfigParser()
        parsed.read_string(whl.read(entry_points).decode())
    packaged = {n for n in names if ".dist-info/" not in n}
    source = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "entrenar_pg").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert packaged == source, (
        f"missing from the wheel: {sorted(source - packaged)}; "
        f"not from entrenar_pg/: {sorted(packaged - source)}"
    )
    assert dict(parsed["torch.backends"]) == {"entrenar": "entrenar_pg._plugin:entry_point"}


def test_import_torch_loads_nothing_of_ours_but_the_entry_points_two_modules(venv: Venv) -> None:
    """What runs inside `import torch` can fail torch itself: only __init__ and
    _plugin, which import nothing else of ours (the backend loads on first use)."""
    program = (
        "import sys, json, torch, torch.distributed as dist; "
        "print(json.dumps([sorted(m for m in sys.modules if m.startswith('entrenar_pg')), "
        "'ENTRENAR' in dist.Backend._plugins]))"
    )
    loaded, registered = json.loads(
        checked(venv.run([venv.bin("python"), "-c", program], timeout=60), "import torch")
    )
    assert loaded == ["entrenar_pg", "entrenar_pg._plugin"], loaded
    assert registered


def test_the_entry_point_warns_and_returns_when_it_cannot_register(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.distributed refuses the backend: the entry point still returns (torch's
    import goes on) and says why."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no custom backends here")

    monkeypatch.delitem(dist.Backend._plugins, _plugin.BACKEND_NAME.upper(), raising=False)
    monkeypatch.setattr(dist.Backend, "register_backend", refuse)
    with pytest.warns(RuntimeWarning, match="no custom backends here"):
        _plugin.entry_point()


JOB = """
import json, sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

out = Path(sys.argv[1])
# No import of entrenar_pg: torch's entry point registered the backend.
dist.init_process_group("entrenar", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
reduced = torch.full((1000,), float(rank + 1))
dist.all_reduce(reduced)

torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):  # ENTRENAR_LEDGER: one ledger line per step
    torch.manual_seed(100 * step + rank)
    model(torch.randn(16, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()

import entrenar_pg
from entrenar_pg.ledger_writer import checkpoint_parameters

if rank == 0:
    torch.save({"step": 3, "ledger_parameters": checkpoint_parameters(opt)}, out / "ckpt.pt")
entrenar_pg.dump_flight_recorder()  # to TORCH_FR_DUMP_TEMP_FILE + rank
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
# One write per line (print writes the text and its newline apart): under
# PYTHONUNBUFFERED the two ranks' lines could interleave on torchrun's stdout.
sys.stdout.write(json.dumps({
    "rank": rank,
    "reduced": sorted(set(reduced.tolist())),
    "expected": world * (world + 1) / 2,
    "backend": type(backend).__module__,
    "package": entrenar_pg.__file__,
}) + "\\n")
dist.destroy_process_group()
"""


def test_a_two_rank_job_and_the_tools_run_from_the_installed_wheel(venv: Venv) -> None:
    out = venv.work / "job"
    (out / "fr").mkdir(parents=True)
    script = venv.work / "job.py"
    script.write_text(textwrap.dedent(JOB))
    ledger = out / "ledger.jsonl"
    stdout = checked(
        venv.run(
            # torchrun as the launch scripts run it (the venv has torch's
            # modules, not its console scripts)
            [venv.bin("python"), "-m", "torch.distributed.run", "--standalone"]
            + ["--nproc_per_node=2", str(script), str(out)],
            timeout=180,
            ENTRENAR_LEDGER=str(ledger),
            TORCH_FR_BUFFER_SIZE="200",
            TORCH_FR_DUMP_TEMP_FILE=str(out / "fr" / "rank_"),
        ),
        "python -m torch.distributed.run job.py",
    )
    reports = sorted(
        (json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in reports] == [0, 1], stdout
    for r in reports:
        assert r["reduced"] == [r["expected"]] == [3.0], r
        assert r["backend"].startswith("entrenar_pg."), r
        assert Path(r["package"]).is_relative_to(venv.site), r  # the wheel, not the checkout

    verified = checked(
        venv.run(
            [venv.bin("python"), "-m", "entrenar_pg.ledger", "verify", str(ledger)]
            + ["--checkpoint", str(out / "ckpt.pt")],
            timeout=60,
        ),
        "python -m entrenar_pg.ledger verify",
    )
    assert "chain intact over 3 lines (steps 1..3)" in verified, verified
    assert "matches step 3" in verified, verified

    traced = checked(
        venv.run([venv.bin("python"), "-m", "entrenar_pg.trace", "--json", str(out / "fr")], 60),
        "python -m entrenar_pg.trace",
    )
    (group,) = json.loads(traced)
    assert group["ranks"] == group["dumped"] == [0, 1], group
    assert group["first_mismatch"] is None and group["first_incomplete"] is None, group
    assert group["failures"] == {}, group


@dataclass(frozen=True)
class Breakage:
    """One way an install goes bad: ``path`` (in site-packages) removed or overwritten."""

    path: str
    content: str | None  # None: removed
    cause: str  # what the error must name


BREAKAGES = [
    # The case: a subpackage the hand-kept package list left out.
    Breakage("entrenar_pg/checker", None, "No module named 'entrenar_pg.checker'"),
    # The backend's own module, unloadable.
    Breakage("entrenar_pg/api/process_group.py", "def broadcast(:\n", "SyntaxError"),
]


@pytest.fixture
def broken(venv: Venv, request: pytest.FixtureRequest) -> Iterator[Breakage]:
    """The venv's install with one breakage, repaired afterwards."""
    breakage: Breakage = request.param
    target = venv.site / breakage.path
    saved = target.with_name(target.name + ".saved")
    target.rename(saved)
    if breakage.content is not None:
        target.write_text(breakage.content)
    try:
        yield breakage
    finally:
        if target.is_file():
            target.unlink()
        saved.rename(target)


BROKEN_PROGRAM = """
import json
import torch
import torch.distributed as dist

report = {"torch_works": torch.ones(2).add(1).tolist() == [2.0, 2.0]}
try:
    dist.init_process_group("entrenar", store=dist.HashStore(), rank=0, world_size=1)
except Exception as e:
    report.update(error=type(e).__name__, message=str(e), cause=repr(e.__cause__))
import entrenar_pg  # its public names load on first use
try:
    entrenar_pg.EntrenarProcessGroup
except Exception as e:
    report["import_entrenar_pg"] = repr(e)
print(json.dumps(report))
"""


@pytest.mark.parametrize("broken", BREAKAGES, ids=lambda b: b.path, indirect=True)
def test_a_broken_install_leaves_torch_working_and_says_how_to_repair_it(
    venv: Venv, broken: Breakage
) -> None:
    stdout = checked(
        venv.run([venv.bin("python"), "-c", BROKEN_PROGRAM], timeout=60),
        f"import torch with {broken.path} broken",
    )
    report = json.loads(stdout.splitlines()[-1])
    assert report["torch_works"], report
    assert report["error"] == "BackendUnavailableError", report
    message = report["message"]
    assert broken.cause in message and broken.cause in report["cause"], report
    assert "pip install --force-reinstall --no-deps entrenar-pg" in message, message
    assert str(venv.site) in message, message  # where the broken install is
    assert broken.cause in report["import_entrenar_pg"], report  # the package's own error

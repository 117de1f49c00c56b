"""What this machine and checkout offer: entrenar, MPI, CPU and versions, git revision."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def entrenar_available() -> tuple[bool, str]:
    """Whether the ``entrenar`` backend is importable and registered (and why not)."""
    try:
        import entrenar_pg  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return False, f"import entrenar_pg failed: {e!r}"
    if "entrenar" not in dist.Backend.backend_list:
        return False, "import entrenar_pg did not register backend 'entrenar'"
    return True, ""


def entrenar_transports() -> tuple[str, ...]:
    """The ENTRENAR_TRANSPORT values this entrenar_pg honours (issue 17's ``Options.transport``).

    Before the shared-memory transport landed there was no such option: the
    variable was ignored and every group was TCP, so only ``tcp`` is honest then.
    """
    import dataclasses

    from entrenar_pg import Options

    if "transport" not in {f.name for f in dataclasses.fields(Options)}:
        return ("tcp",)
    return ("tcp", "shm", "auto")


def mpi_available() -> tuple[str | None, str]:
    """Path of ``mpiexec`` if it and mpi4py are usable, else ``(None, reason)``."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None, "mpi4py not importable (pip install mpich mpi4py)"
    exe = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    if exe is None:
        return None, "mpiexec not found on PATH"
    return exe, ""


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, kernel, python and torch versions."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hostname": platform.node(),
    }


def git_revision(repo: Path | None = None) -> str:
    """``<short sha>[+dirty]`` of ``repo`` (default: this module's checkout), or ``""``."""
    repo = repo or Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return ""
    return sha + ("+dirty" if dirty else "")

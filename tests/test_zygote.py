"""tests/zygote.py: a stand-in behaves as ``python script`` would, for torchrun.

Each test runs the stand-in as torchrun would (``python -u tests/zygote.py
script args``, its own session) against this test worker's zygote.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zygote

pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import os, signal, sys, time
import torch
mode = sys.argv[1]
if mode == "wait":  # the handler before the pid line, which the test acts on
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(7)))
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("ZYGOTE_TEST"))
print("pid", os.getpid(), "imported before", "torch" in sys.modules, flush=True)
print("to stderr", file=sys.stderr, flush=True)
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise ValueError("from the script")
if mode == "wait":
    time.sleep(30)
"""


def _start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, ZYGOTE_TEST="seen", **zygote.job_env())
    return subprocess.Popen(
        [sys.executable, "-u", str(zygote.STAND_IN), str(script), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _worker_pid(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("pid "):
            return int(line.split()[1])
    raise AssertionError("the worker printed no pid")


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie). The process can be reaped between the
    signal probe and the read of its stat: gone then too."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


@pytest.mark.parametrize(
    ("args", "code"), [(("exit", "0"), 0), (("exit", "3"), 3), (("raise",), 1)]
)
def test_argv_env_cwd_streams_and_exit_status_are_the_scripts(
    tmp_path: Path, args: tuple[str, ...], code: int
) -> None:
    proc = _start(tmp_path, *args)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == code, (out, err)
    assert f"argv {list(args)!r} cwd {tmp_path} env seen" in out, out
    assert "imported before True" in out  # torch came with the fork
    assert "to stderr" in err
    if args[0] == "raise":
        assert "ValueError: from the script" in err


def test_a_signal_to_the_stand_in_reaches_the_worker(tmp_path: Path) -> None:
    """torchrun stops its workers with SIGTERM: the script's handler runs, its status returns."""
    proc = _start(tmp_path, "wait")
    worker = _worker_pid(proc)
    assert worker != proc.pid
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=50)
    assert "got SIGTERM" in out and proc.returncode == 7, (out, err)


def test_a_worker_killed_by_a_signal_kills_its_stand_in_with_it(tmp_path: Path) -> None:
    proc = _start(tmp_path, "wait")
    os.kill(_worker_pid(proc), signal.SIGKILL)
    proc.communicate(timeout=50)
    assert proc.returncode == -signal.SIGKILL


def test_a_stand_in_killed_takes_its_worker_with_it(tmp_path: Path) -> None:
    """SIGKILL cannot be passed on: the zygote sees the stand-in's connection close."""
    proc = _start(tmp_path, "wait")
    worker = _worker_pid(proc)
    proc.kill()
    proc.communicate(timeout=50)
    deadline = time.monotonic() + 20
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(worker), f"worker {worker} outlived its stand-in"

"""tests/preloaded.py: a script started from the fork server behaves as ``python script``
would for what the tests read: argv, environment, pipes, session, exit status, atexit."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from preloaded import run_in_session, start_script

SCRIPT = """
import atexit, os, sys
atexit.register(lambda: print("atexit", flush=True))
print("argv", sys.argv[1:], os.environ.get("PRELOADED_PROBE"), os.environ.get("HOME_X"))
print("session", os.getsid(0) == os.getpid(), file=sys.stderr)
print("sys.path[0]", sys.path[0])
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.timeout(60)
def test_a_script_gets_its_argv_env_pipes_session_and_exit_status(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {"PRELOADED_PROBE": "yes", "PATH": os.environ.get("PATH", "")}
    p = start_script([str(script), "3", "x"], env=env, new_session=True)
    out, err = p.communicate(timeout=50)
    assert p.returncode == 3, (out, err)
    lines = out.splitlines()
    assert lines[0] == "argv ['3', 'x'] yes None"  # only the given environment
    assert lines[1] == f"sys.path[0] {tmp_path}"  # the script's directory, as python's
    assert lines[-1] == "atexit"
    assert err.strip() == "session True"


@pytest.mark.timeout(60)
def test_a_signal_is_the_exit_status_and_an_exception_exits_1(tmp_path: Path) -> None:
    env = dict(os.environ)
    p = start_script(["-c", "import time; print('up', flush=True); time.sleep(60)"], env=env)
    assert p.stdout is not None and p.stdout.readline() == "up\n"
    p.kill()
    assert p.wait(10) == -signal.SIGKILL
    q = start_script(["-c", "raise ValueError('named')"], env=env)
    out, err = q.communicate(timeout=50)
    assert q.returncode == 1 and "ValueError: named" in err, err


@pytest.mark.timeout(60)
def test_a_module_in_its_session_and_a_hang_is_stopped(tmp_path: Path) -> None:
    env = dict(os.environ)
    done = run_in_session(["-m", "json.tool", "--help"], timeout_s=50, env=env, cwd=tmp_path)
    assert done.returncode == 0 and "json.tool" in done.stdout, done.stderr
    assert done.args[0] == sys.executable
    hang = ["-c", "import time; time.sleep(60)"]
    stopped = run_in_session(hang, timeout_s=1, env=env, cwd=tmp_path)
    assert stopped.returncode == 124  # TIMED_OUT: SIGTERM to its session ended it


@pytest.mark.timeout(60)
def test_a_script_starts_with_the_preloaded_heap_frozen_and_still_collects_its_own() -> None:
    """The objects the fork server preloaded are out of the collector's reach (the
    script's full collections walk only what it makes), and a cycle the script
    makes is still collected."""
    code = (
        "import gc, torch, weakref\n"
        "class Node: pass\n"
        "a = Node(); a.me = a; alive = weakref.ref(a); del a\n"
        "print(gc.get_freeze_count(), gc.collect() > 0, alive() is None)\n"
    )
    p = start_script(["-c", code], env=dict(os.environ))
    out, err = p.communicate(timeout=50)
    assert p.returncode == 0, err
    frozen, collected, freed = out.split()
    assert int(frozen) > 100_000, out  # torch, torch.distributed, torch._dynamo
    assert collected == freed == "True", out

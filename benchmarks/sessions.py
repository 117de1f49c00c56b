"""Run a command in a session of its own, and stop the whole session when it hangs.

Launch scripts start trees of processes (torchrun, its ranks, namespaces): a
timeout must reach all of them. SIGTERM first, so a script's trap tears down
what it built, then SIGKILL, so nothing outlives the caller. Used by the
emulated clusters (``netns.run_on_hosts``) and the tests' ``run_session``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMED_OUT = 124  # the exit status reported for a stopped session, as timeout(1)'s
TERM_GRACE_S = 20.0  # how long a script's trap gets after SIGTERM


def run_in_session(
    cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``cmd`` from the repository root, output captured; past ``timeout_s`` the
    session is stopped and the status is ``TIMED_OUT``."""
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        return subprocess.CompletedProcess(cmd, TIMED_OUT, out, err)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)

"""Script processes that start with torch already imported.

``start_script(argv, env=...)`` runs a Python script (or ``-c`` code) as its
own process, like ``subprocess.Popen([sys.executable, *argv], ...)`` with
stdout and stderr piped as text, and returns a ``ScriptProcess`` with the
Popen methods the tests use (``pid``, ``stdout``, ``poll``, ``wait``,
``communicate``, ``kill``, ``send_signal``, ``returncode``).

Why: a fresh interpreter spends about 1.4 s of CPU importing torch, which was
most of what a rank of the fault tests cost (some 40 ranks over the suite). Here
the process is forked by multiprocessing's fork server, which imported torch
once (``FORKSERVER_PRELOAD``; test_api_collectives.spawn_ranks forks its ranks
from the same server) and runs nothing else, so no thread, socket or
group state is forked into it. It is still a separate OS process with its own
pid, session (``new_session``), environment, ``sys.argv`` and exit status
(``-N`` when killed by signal N, as with Popen); its exit runs the script's
atexit handlers, as an interpreter's does. The differences from a fresh
interpreter: ``import torch`` is already done (so torch's import-time
environment comes from the server, and OMP_NUM_THREADS is applied with
``torch.set_num_threads``), and the pid is a child of the fork server.
"""

from __future__ import annotations

import atexit
import gc
import io
import multiprocessing as mp
import os
import runpy
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import IO, Any

import torch

from benchmarks.sessions import TERM_GRACE_S, TIMED_OUT

# torch._dynamo too: building any optimizer imports it (about 1 s of CPU per rank).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def start_script(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    new_session: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    log: str | os.PathLike[str] | None = None,
) -> ScriptProcess:
    """Start ``python *argv``: a script and its arguments, ``-c CODE args`` or ``-m MODULE args``.

    Its stdout and stderr are pipes (``ScriptProcess.stdout``/``stderr``), or
    both go to the file ``log`` (then those are None, as Popen's would be).
    """
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    ctx = mp.get_context("forkserver")
    if log is None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
    else:
        out_w = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err_w = os.dup(out_w)
    # A Connection pickles as a duplicate of its fd, sent to the fork server with the job.
    writers = (Connection(out_w, readable=False), Connection(err_w, readable=False))
    where = Place(list(argv), dict(env), new_session, None if cwd is None else str(cwd))
    proc = ctx.Process(target=_run, args=(where, *writers), daemon=True)
    try:
        proc.start()
    finally:
        for w in writers:
            w.close()
    if log is not None:
        return ScriptProcess(proc, None, None)
    return ScriptProcess(proc, open(out_r, errors="replace"), open(err_r, errors="replace"))


def run_in_session(
    argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str], cwd: str | os.PathLike[str]
) -> subprocess.CompletedProcess[str]:
    """benchmarks.sessions.run_in_session for ``python *argv``, started here: output
    captured; past ``timeout_s`` its session gets SIGTERM (a launcher's chance to
    stop its workers), then SIGKILL, and the status is ``TIMED_OUT``."""
    p = start_script(argv, env=env, cwd=cwd, new_session=True)
    cmd = [sys.executable, *argv]
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_session(p.pid, signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_session(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        return subprocess.CompletedProcess(cmd, TIMED_OUT, out, err)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # the whole session already ended
        pass


@dataclass(frozen=True)
class Place:
    """What the forked process becomes: ``python *argv`` in ``cwd`` with ``env``."""

    argv: list[str]
    env: dict[str, str]
    new_session: bool
    cwd: str | None


class ScriptProcess:
    """A started script: the subset of ``subprocess.Popen`` the tests call."""

    def __init__(self, proc: Any, stdout: IO[str] | None, stderr: IO[str] | None) -> None:
        self._proc = proc
        self.pid: int = proc.pid
        self.stdout = stdout
        self.stderr = stderr

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self._proc.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both pipes read to their end, then the exit; TimeoutExpired past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict[IO[str], list[str]] = {f: [] for f in (self.stdout, self.stderr) if f}
        with selectors.DefaultSelector() as sel:
            for f in chunks:
                if not f.closed:
                    sel.register(f.fileno(), selectors.EVENT_READ, f)
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[key.data].append(data.decode(errors="replace"))
                    else:
                        sel.unregister(key.fd)
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        self.wait(left)
        for f in chunks:
            f.close()
        out, err = ("".join(chunks[f]) if f else "" for f in (self.stdout, self.stderr))
        return out, err

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run(place: Place, out: Connection, err: Connection) -> None:
    """In the forked process: become ``python *argv`` with ``env``, output to the pipes."""
    argv, env = place.argv, place.env
    # What the server preloaded (torch, dynamo: ~280,000 objects that live as long
    # as the process) out of the collector's reach: the script's full collections
    # walk only what it makes (0.2 s of CPU less per walk; a rank of the fault
    # tests does several). The fork server cannot do it once for all: 3.11's
    # forkserver.main drops the sys_path it is given, so no module of tests/
    # can be in its preload list.
    gc.freeze()
    # daemonic for the test process (stopped at its exit), but a script may start
    # its own multiprocessing children, as any interpreter may
    mp.current_process().daemon = False
    if place.new_session:
        os.setsid()
    if place.cwd is not None:
        os.chdir(place.cwd)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    # unbuffered text streams on the pipes, so os._exit loses nothing a script printed
    sys.stdout = _text_stream(1)
    sys.stderr = _text_stream(2)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:0] = ["", *paths]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file first
            sys.path[:0] = [os.getcwd(), *paths]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[:0] = [os.path.dirname(os.path.abspath(argv[0])), *paths]
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()


def _text_stream(fd: int) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, line_buffering=True, write_through=True)

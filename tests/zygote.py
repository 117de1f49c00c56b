"""torchrun's workers, forked from a process that has imported torch.

torchrun starts each worker as a fresh interpreter (``python -u script
args``), which spends about 2 s of CPU importing torch and ``torch._dynamo``
(DDP's constructor imports it) before the script's first line: some 50
workers over the suite, a quarter of its CPU. The tests' torchrun jobs
(``conftest.torchrun``, test_trainer_dist's) therefore give torchrun this
file as the script: ``python -u tests/zygote.py script args``. This
*stand-in* imports nothing of torch; it hands its argv, environment,
working directory and standard streams to the *zygote*, a process of the
test worker's that imported torch once (started from ``preloaded``'s fork
server), which forks the worker from itself and runs the script there as
``preloaded`` runs one (``__main__``, ``sys.argv``, exit status, atexit).

torchrun still starts, watches, signals and restarts its workers as it
would: the stand-in is the process it started, and mirrors the worker's
life. A signal torchrun sends it (SIGTERM when a peer failed, ...) goes on
to the worker; the worker's exit status becomes the stand-in's, a death by
signal included (the stand-in kills itself with the same signal). A
stand-in that dies without its worker (SIGKILL) closes its connection, and
the zygote kills the worker. Without ``ZYGOTE_ENV`` in its environment
(a job run by hand) the stand-in becomes the script itself (``exec``).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ZYGOTE_ENV = "ENTRENAR_TEST_ZYGOTE"  # the zygote's socket path
_STATUS = struct.Struct("!i")  # the pid, then the exit status (negative: killed by that signal)
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2)  # fmt: skip
_MAX_REQUEST = 1 << 20
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
STAND_IN = Path(__file__).resolve()  # the script torchrun is given, before the real one
_START_TIMEOUT_S = 60.0


# ------------------------------------------------------------------ for the tests


class _Running:
    """This test worker's zygote, once started: its socket and its process."""

    path: str | None = None
    proc: Any = None


def job_env() -> dict[str, str]:
    """The environment entry that sends a torchrun job's stand-ins to this test
    worker's zygote (started on first use, stopped at the worker's exit)."""
    if _Running.proc is None or _Running.proc.poll() is not None:
        _start()
    assert _Running.path is not None
    return {ZYGOTE_ENV: _Running.path}


def _start() -> None:
    import preloaded  # torch: only the test worker imports this part

    where = tempfile.mkdtemp(prefix="zygote-")
    path, log = os.path.join(where, "socket"), os.path.join(where, "log")
    tests = str(STAND_IN.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    env.pop(ZYGOTE_ENV, None)
    code = f"import zygote; zygote.serve({path!r})"
    proc = preloaded.start_script(["-c", code], env=env, new_session=True, log=log)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the zygote did not start: {Path(log).read_text()[-3000:]}")
        time.sleep(0.01)
    if _Running.proc is None:
        atexit.register(_stop)
    _Running.path, _Running.proc = path, proc


def _stop() -> None:
    if _Running.proc is not None:
        _Running.proc.kill()


# ------------------------------------------------------------------ the stand-in


def stand_in(argv: list[str]) -> None:
    """torchrun's worker process: ``argv`` (script and arguments) run by the zygote."""
    path = os.environ.get(ZYGOTE_ENV)
    if not path:
        os.execv(sys.executable, [sys.executable, "-u", *argv])
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    # Held until the handlers that forward them are in place: a signal that
    # came once the worker ran (it may print before this process hears its
    # pid) would otherwise end the stand-in, and the zygote, seeing the
    # connection close, would kill the worker before its own handler ran.
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [_STATUS.pack(len(request)) + request], [0, 1, 2])
    (pid,) = _STATUS.unpack(_recv_exactly(conn, _STATUS.size))
    for sig in _FORWARDED:
        signal.signal(sig, functools.partial(_forward, pid))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)  # a held one is forwarded now
    status = _STATUS.unpack(_recv_exactly(conn, _STATUS.size))[0]
    sys.stdout.flush()
    if status < 0:  # die as the worker died
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # the two with no handler
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


def _forward(pid: int, signum: int, _frame: Any) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # it has just ended: its status is on the way
        pass


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the zygote closed the connection (it was stopped)")
        data += chunk
    return data


# ------------------------------------------------------------------ the zygote


def serve(path: str) -> None:
    """Fork a worker for each stand-in that connects to ``path``; report its end.

    One thread (it forks): a selector over the listening socket, each
    stand-in's connection (readable at its end: kill its worker) and a pipe
    that SIGCHLD writes to (reap, and send each stand-in its worker's status).
    """
    import preloaded  # noqa: F401 -- imported once here, not in each worker

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)  # the path appears once it accepts
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    workers: dict[int, socket.socket] = {}  # worker pid -> its stand-in's connection
    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                pid = _fork_worker(conn, listener)
                if pid is None:
                    conn.close()
                    continue
                workers[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
            elif key.data == "child":
                os.read(wake_r, 4096)
                _reap(workers, sel)
            else:  # the stand-in ended (or sent more, which it never does)
                pid = key.data
                sel.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                if workers.pop(pid, None) is not None:
                    _kill(pid)


def _fork_worker(conn: socket.socket, listener: socket.socket) -> int | None:
    """Read one request and fork its worker; its pid, sent to the stand-in too."""
    head, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
    if len(head) < _STATUS.size or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    (size,) = _STATUS.unpack(head[: _STATUS.size])
    body = head[_STATUS.size :]
    try:
        request = json.loads(body + _recv_exactly(conn, size - len(body)))
    except (ConnectionError, ValueError):  # the stand-in went away mid-request
        for fd in fds:
            os.close(fd)
        return None
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        _become_worker(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(_STATUS.pack(pid))
    except OSError:  # the stand-in is gone: the loop sees its connection close, kills the worker
        pass
    return pid


def _become_worker(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked worker: the stand-in's streams, then the script, as
    ``preloaded`` runs one; exits with the script's status."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, *_FORWARDED):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()  # its own session, as torchrun gives each worker
    # Dies with the zygote (stopped at the test worker's exit), as the stand-in's
    # connection closing kills it while the zygote lives: no worker outlives both.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    code = 1
    try:
        from multiprocessing.connection import Connection

        import preloaded

        os.dup2(fds[0], 0)
        out, err = (Connection(fd, readable=False) for fd in fds[1:])
        os.close(fds[0])
        place = preloaded.Place(request["argv"], request["env"], False, request["cwd"])
        code = _exit_code(place, out, err, preloaded)
    except BaseException:  # noqa: BLE001 -- nothing may return into the zygote's loop
        traceback.print_exc()
    finally:
        os._exit(code)


def _exit_code(place: Any, out: Any, err: Any, preloaded: Any) -> int:
    """Run the script; its exit status as an interpreter's (SystemExit, a traceback: 1)."""
    import threading

    try:
        preloaded._run(place, out, err)
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            sys.stderr.write(f"{e.code}\n")
            code = 1
    except BaseException:  # noqa: BLE001 -- the interpreter prints it and exits 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _reap(workers: dict[int, socket.socket], sel: selectors.BaseSelector) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = workers.pop(pid, None)
        if conn is None:
            continue
        sel.unregister(conn)
        try:
            conn.sendall(_STATUS.pack(os.waitstatus_to_exitcode(status)))
        except OSError:  # the stand-in is gone: nobody to tell
            pass
        conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    stand_in(sys.argv[1:])

"""What a process holds open: its descriptors, its sockets, and the sockets one object holds.

``benchmarks/scale.py`` counts sockets two ways, each a check on the other:

- the kernel's view (``socket_fds``): every descriptor of this process that
  is a socket (``/proc/self/fd`` links reading ``socket:[inode]``), so a
  leaked socket that no object refers to any more is still counted;
- a group's own view (``held_sockets``): the open ``socket.socket`` objects
  reachable from one process-group object. With several ranks as threads of
  one process this is what tells the ranks' sockets apart (the kernel keeps
  one descriptor table per process). It names no attribute of the library,
  so it counts whatever a group holds, however the library comes to hold it
  (a full mesh at set-up today, connections made on first use later).

A group's sockets are then the sockets it holds, and the process's sockets
beyond its baseline must be exactly the union of its groups' (nothing
leaked, nothing shared between two ranks).
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import types
from typing import Any

_FD_DIR = "/proc/self/fd"

# Objects whose references lead out of one group into the whole process:
# modules (and their globals, which hold registries of every group), classes,
# and code. A function is entered through its closure and defaults only.
_STOP = (types.ModuleType, type, types.CodeType, types.FrameType, types.BuiltinFunctionType)


def open_fds() -> dict[int, str]:
    """This process's descriptors and what each one is (``readlink`` of its /proc entry)."""
    out: dict[int, str] = {}
    for name in os.listdir(_FD_DIR):
        try:
            out[int(name)] = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            pass  # the directory's own descriptor, gone once listed
    return out


def socket_fds() -> set[int]:
    """The descriptors of this process that are sockets (TCP, UDP or Unix)."""
    return {fd for fd, what in open_fds().items() if what.startswith("socket:")}


def fd_soft_limit() -> tuple[int, int]:
    """``RLIMIT_NOFILE``: (soft, hard)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(soft), int(hard)


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return (before, after).

    Children inherit it, so every rank process of a run may hold this many.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return int(soft), int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _module_dicts() -> set[int]:
    return {id(vars(m)) for m in list(sys.modules.values()) if m is not None}


def held_sockets(root: Any) -> set[int]:
    """Descriptors of the open sockets reachable from ``root`` (see the module docstring).

    The walk follows ``gc.get_referents`` but never enters a module, a
    module's globals, a class, code or a frame, so it stays inside the
    objects ``root`` owns (its threads, links, loops and their closures).
    """
    stop_dicts = _module_dicts()
    seen: set[int] = set()
    found: set[int] = set()
    todo: list[Any] = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, socket.socket):
            fd = obj.fileno()
            if fd >= 0:  # -1: closed
                found.add(fd)
            continue
        if isinstance(obj, _STOP) or id(obj) in stop_dicts:
            continue
        if isinstance(obj, types.FunctionType):
            todo.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            todo.extend(obj.__defaults__ or ())
            continue
        todo.extend(gc.get_referents(obj))
    return found


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True

"""Helpers shared by the trainer, the linear-regression example and the tests."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

T = TypeVar("T")

BACKENDS = ("entrenar", "gloo", "nccl")


def tree_sum(xs: Sequence[T]) -> T:
    """Sum in the canonical balanced pairwise order of the entrenar backend.

    ``tree(xs) = xs[0] if len(xs) == 1 else tree(xs[:m]) + tree(xs[m:])`` with
    ``m = (len(xs) + 1) // 2``; for four terms ``((x0 + x1) + (x2 + x3))``. This is
    the order in which entrenar's deterministic mode sums across ranks, so summing
    the micro-batches of a rank with it and then across ranks with the backend
    gives the same bits as summing all micro-batches on one rank, whenever the
    world size and the micro-batches per rank are powers of two. Kept here
    (identical definition to ``entrenar_pg.tree_sum``) so the trainer does not
    depend on the backend for it.
    """
    if not xs:
        raise ValueError("tree_sum of an empty sequence")
    if len(xs) == 1:
        return xs[0]
    m = (len(xs) + 1) // 2
    return tree_sum(xs[:m]) + tree_sum(xs[m:])  # type: ignore[operator]


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def load_backend(backend: str) -> None:
    """Make sure ``backend`` can be passed to ``init_process_group``.

    ``entrenar`` registers itself when torch is imported (entry point), but only
    once the package is installed; importing ``entrenar_pg`` covers a plain
    checkout (the repository root must be on ``sys.path``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "entrenar":
        try:
            import entrenar_pg  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                "backend 'entrenar' needs the entrenar_pg package: run `pip install -e .` "
                "in the repository, or run from the repository root"
            ) from e


def group_options(backend: str, deterministic: bool, ledger: str = "") -> Any:
    """The ``pg_options`` for ``init_process_group``: entrenar's ``Options``, else None.

    The ``ENTRENAR_*`` environment still applies (``Options.from_env``); only
    what the trainer itself decides (deterministic reductions, the run
    ledger's path) is set on top. Other backends get None: their defaults.
    """
    if backend != "entrenar":
        if ledger:
            raise ValueError(f"--ledger needs the entrenar backend, not {backend!r}")
        return None
    from entrenar_pg import Options

    chosen: dict[str, Any] = {}
    if deterministic:
        chosen["deterministic"] = True
    if ledger:
        chosen["ledger"] = ledger
    return Options.from_env(**chosen)


def run_ledger() -> Any:
    """The default group's run ledger (entrenar with ``Options.ledger``), else None."""
    return getattr(dist.distributed_c10d._get_default_group(), "ledger", None)


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, detached, in the run ledger's order (groups, then params).

    A checkpoint stores them as ``ledger_parameters`` so that
    ``python -m entrenar_pg.ledger verify --checkpoint`` can hash its weights as
    the ledger did; they share storage with the model's state_dict, which
    ``torch.save`` writes once.
    """
    return [p.detach() for group in optimizer.param_groups for p in group["params"]]


class BitFlip:
    """Test hook: flips one bit of the first parameter's first byte after step ``at``.

    An optimizer step post-hook; the optimizer's own hooks run before torch's
    global ones, so the run ledger records the step with the flipped bit.
    """

    def __init__(self, at: int, steps_done: int) -> None:
        self.at = at
        self.steps_done = steps_done

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps_done += 1
        if self.steps_done == self.at:
            first = optimizer.param_groups[0]["params"][0]
            with torch.no_grad():
                first.view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)


def comm_stats(group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """The entrenar group's communication counters; ``{}`` for other backends."""
    try:
        import entrenar_pg

        return dict(entrenar_pg.get_stats(group))
    except (ImportError, AttributeError):
        return {}
    except Exception:  # a stats call must never take training down
        return {}


def state_hash(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes of named tensors (in the order given)."""
    h = hashlib.sha256()
    for name, t in tensors:
        t = t.detach().to("cpu").contiguous()
        flat = t.reshape(-1)
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


def param_hash(module: nn.Module) -> str:
    """Hash of a module's state_dict in sorted key order (bitwise identity check)."""
    sd = module.state_dict()
    return state_hash((k, sd[k]) for k in sorted(sd))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

"""Set up the default entrenar group for a failure scenario, then shorten its timeout.

The scenarios time a stall or a death against a short timeout (a few
seconds, ``TIMEOUT_S``). Set-up runs under a generous one: on a loaded
machine the rank processes start seconds apart, and a set-up that times out
is not the failure a test is about. After the barrier (every rank set up)
the group's later calls run under ``TIMEOUT_S``.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

SET_UP_TIMEOUT = timedelta(seconds=60)


def init_group() -> None:
    """``init_process_group("entrenar")``, a barrier, then the ``TIMEOUT_S`` timeout."""
    dist.init_process_group("entrenar", timeout=SET_UP_TIMEOUT)
    dist.barrier()
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    backend.set_timeout(timedelta(seconds=float(os.environ["TIMEOUT_S"])))

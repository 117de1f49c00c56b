"""A receive that waits on a gate (``transport.plan.Recv.ready``), over real links.

The host slices' one plan (collectives/hierarchical.py) lets a piece's
cross-host ring take in its first bytes only once the piece's reduce-scatter
inside the host is done, since those bytes are combined into the same memory:
taken in earlier, they would be summed in another order (other bits) on a
rank whose host was late. The progress loop must then leave the bytes in the
socket, keep the link out of its poll set (it waits on another link, not on
this socket) and take them in as soon as the gate opens, over TCP and over
shared memory alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from conftest import make_groups, run_ranks

from entrenar_pg import EntrenarProcessGroup, Options
from entrenar_pg.collectives.common import is_set
from entrenar_pg.transport.plan import Plan, bytes_of
from entrenar_pg.wire import Algo, Header, OpCode

LATE_S = 0.3  # rank 2 sends this long after rank 1, whose bytes wait behind the gate


@dataclass(frozen=True)
class _Pace:
    spin_s: float
    timeout_s: float


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("spin_s", [0.0, 0.001])
def test_a_gated_receive_takes_its_bytes_only_after_its_gate(transport: str, spin_s: float) -> None:
    """Rank 0 receives from rank 1 behind a gate that rank 2's (later) bytes open:
    rank 1's bytes, in long before, complete after rank 2's, and intact; the header
    in front of them on the same link is checked as always (it is not filled
    together with the gated piece in one syscall)."""
    groups = make_groups(3, Options(transport=transport))
    seen: list[tuple[int, bool]] = []

    def fn(rank: int, pg: EntrenarProcessGroup) -> torch.Tensor:
        header = Header(7, OpCode.ALLREDUCE, Algo.RING, torch.float32, numel=4)
        plan = Plan(rank)
        got = torch.zeros(4)
        if rank == 0:
            from_2 = [False]
            late = torch.zeros(4)
            plan.open(1, header, send=False)
            plan.open(2, header, send=False)

            def late_in() -> None:
                seen.append((2, from_2[0]))
                from_2[0] = True

            plan.recv(2, bytes_of(late), late_in)
            plan.recv(1, bytes_of(got), lambda: seen.append((1, from_2[0])), ready=is_set(from_2, 0))
            pg._runtime.mesh.run(plan, "gate#7", _Pace(spin_s, 20.0))
            return torch.cat([got, late])
        plan.open(0, header, recv=False)
        payload = torch.full((4,), float(rank))
        plan.send(0, bytes_of(payload))
        if rank == 2:
            time.sleep(LATE_S)
        pg._runtime.mesh.run(plan, "gate#7", _Pace(spin_s, 20.0))
        return payload

    try:
        t0 = time.monotonic()
        out = run_ranks(3, fn, groups=groups, timeout_s=30)
        took = time.monotonic() - t0
    finally:
        for g in groups:
            g.shutdown()
    assert seen == [(2, False), (1, True)]
    assert torch.equal(out[0], torch.tensor([1.0] * 4 + [2.0] * 4))
    assert took < 20.0  # the gate opened the link again: no wait ran into the timeout

"""entrenar as torchft's inner process group (entrenar_pg.torchft; needs torchft).

- ``ProcessGroupEntrenar`` on its own, two ranks as threads, as torchft's
  Manager drives it: ``configure`` on every new quorum replaces the old group
  (aborted: its ``errored()`` says so) and returns with a working one; sends
  posted before their receives on the fresh group, by tag (healing);
  ``errored()`` reports the inner group's failure; the group's own timeout
  ends a collective torchft would wait on forever.
- The whole thing (``benchmarks/torchft_recovery.py``'s scenario): a real
  lighthouse, two replica groups (separate processes) running torchft's
  ``Manager`` with gradients through ``Manager.allreduce``, one SIGKILLed
  mid-training; the survivor keeps committing steps and a replacement rejoins
  and heals (torchft's ``PGTransport``: send/recv on our group) to the
  survivor's state bit for bit (SHA-256 of every parameter and momentum
  buffer at every step both committed).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip(
    "torchft", reason="torchft is not installed (pip install torch==2.13.0 torchft==0.2.0)"
)

from entrenar_pg import PeerConnectionError  # noqa: E402
from entrenar_pg.api.process_group import EntrenarProcessGroup  # noqa: E402
from entrenar_pg.torchft import ProcessGroupEntrenar  # noqa: E402


def configure_all(pgs: list[ProcessGroupEntrenar], store_addr: str, quorum_id: int) -> None:
    """What the Manager's quorum thread does on each rank: configure, concurrently."""
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            pgs[rank].configure(store_addr, f"replica_{rank}", rank, len(pgs), quorum_id)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(len(pgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "configure hung"
    if errors:
        raise errors[0]


def on_both(fn: Any, pgs: list[ProcessGroupEntrenar]) -> list[Any]:
    out: list[Any] = [None, None]
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            out[rank] = fn(rank, pgs[rank])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return out


def allreduce(rank: int, pg: ProcessGroupEntrenar) -> float:
    t = torch.full((8,), float(rank + 1))
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    assert pg.allreduce([t], opts).wait()
    return float(t[0])


@pytest.mark.timeout(90)
def test_configure_replaces_the_group_and_healing_sends_may_precede_their_recvs() -> None:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    pgs = [ProcessGroupEntrenar(timeout=timedelta(seconds=10)) for _ in range(2)]
    try:
        configure_all(pgs, f"127.0.0.1:{server.port}/torchft/1/0", 1)
        assert on_both(allreduce, pgs) == [3.0, 3.0]
        assert all(pg.errored() is None for pg in pgs)
        old = [pg.parent for pg in pgs]
        assert all(isinstance(g, EntrenarProcessGroup) for g in old)

        # A new quorum: each rank's old group is aborted and a new one built.
        t0 = time.monotonic()
        configure_all(pgs, f"127.0.0.1:{server.port}/torchft/2/0", 2)
        print(f"reconfigure took {time.monotonic() - t0:.3f}s")
        for pg, before in zip(pgs, old, strict=True):
            assert pg.parent is not before
            first = before.errored()
            assert isinstance(first, PeerConnectionError) and "aborted" in str(first), first
        assert all(pg.errored() is None for pg in pgs)  # the new group is healthy

        # Healing (torchft's PGTransport): the sender posts everything first,
        # by tag, before the receiver posts a single recv.
        state = [torch.randn(100), torch.arange(7, dtype=torch.int64), torch.randn(3, 3)]

        def heal(rank: int, pg: ProcessGroupEntrenar) -> list[torch.Tensor]:
            if rank == 0:
                works = [pg.send([t], 1, 3 + i) for i, t in enumerate(state)]
                for w in works:
                    assert w.wait(timedelta(seconds=10))
                return state
            time.sleep(0.3)  # the sends are out before the first recv is posted
            got = [torch.empty_like(t) for t in state]
            for i in reversed(range(len(got))):  # in another order than sent: tags match
                assert pg.recv([got[i]], 0, 3 + i).wait(timedelta(seconds=10))
            return got

        _, received = on_both(heal, pgs)
        for a, b in zip(state, received, strict=True):
            assert torch.equal(a, b)
        assert on_both(allreduce, pgs) == [3.0, 3.0]
    finally:
        for pg in pgs:
            pg.shutdown()


@pytest.mark.timeout(60)
def test_the_group_enforces_its_own_timeout_and_errored_reports_it() -> None:
    """torchft waits on allreduce Works with no timeout: a peer that never joins
    the collective must fail it after the group's timeout, and ``errored()``
    (asked at every commit) must report it."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    pgs = [ProcessGroupEntrenar(timeout=timedelta(seconds=2)) for _ in range(2)]
    try:
        configure_all(pgs, f"127.0.0.1:{server.port}/torchft/1/0", 1)
        t0 = time.monotonic()
        work = pgs[0].allreduce([torch.ones(4)], dist.AllreduceOptions())  # rank 1 never joins
        with pytest.raises(PeerConnectionError, match="no progress"):
            work.wait()  # no timeout here, as the Manager waits
        assert time.monotonic() - t0 < 10
        assert isinstance(pgs[0].errored(), PeerConnectionError)
    finally:
        for pg in pgs:
            pg.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_replica_is_replaced_and_heals_to_the_survivors_weights(
    tmp_path: Path,
) -> None:
    from benchmarks.torchft_recovery import run_scenario

    out = run_scenario("entrenar", tmp_path, steps_before=5, steps_after=5, budget_s=180)
    print(
        f"kill -> survivor's next commit {out.survivor_recovery_s:.2f}s, "
        f"kill -> replacement's first commit {out.replacement_recovery_s:.2f}s "
        f"(joining {out.replacement_join_s:.2f}s)"
    )
    for name in ("r0", "r1", "r1b"):
        inner = {r["inner"] for r in out.logs[name] if r["committed"]}
        assert inner == {"EntrenarProcessGroup"}, (name, inner)
    # The survivor kept committing steps between the kill and the replacement's first.
    replacement_first = min(r["t"] for r in out.logs["r1b"] if r["committed"])
    survivor_alone = [
        r
        for r in out.logs["r0"]
        if r["committed"] and r["t"] < replacement_first and r["participants"] == 1
    ]
    assert survivor_alone, "the survivor did not step on its own"
    # The survivor's allreduce was waiting on the killed replica: our group
    # failed it (naming the dead rank) and the Manager skipped that step.
    failed = [r for r in out.logs["r0"] if r["error"]]
    assert failed and not failed[0]["committed"], failed[:1]
    assert "PeerConnectionError" in failed[0]["error"], failed[0]["error"]
    assert "closed the connection without a word" in failed[0]["error"], failed[0]["error"]
    # The replacement healed: its first committed step continues the survivor's
    # count (it did not start over at 1), and the states agree bit for bit.
    assert min(r["step"] for r in out.logs["r1b"] if r["committed"]) > out.steps_before_kill
    assert len(out.common_steps) >= 3, out.common_steps
    assert out.mismatched_steps == []
    assert out.survivor_recovery_s < 30

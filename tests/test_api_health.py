"""The inner-group contract torchft relies on: errored(), abort(), set_timeout(),
per-call timeouts, and the error class every wait path raises.

torchft (torchft/process_group.py) wraps a process group and asks it
``errored()`` (the first failure, None while healthy) to decide whether to
reconfigure, calls ``abort()`` from its own timeout callbacks,
``set_timeout(td)`` when the quorum changes, and passes torch's options
(whose ``timeout`` gloo honours) and ``work.wait(timeout or None)``.
Ranks are threads over loopback TCP; every stall is bounded by a short
group or call timeout, so a regression fails fast instead of hanging.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import make_groups, run_ranks

from entrenar_pg import (
    CollectiveMismatchError,
    EntrenarError,
    EntrenarProcessGroup,
    PeerConnectionError,
)

c10d = torch._C._distributed_c10d


def _stall(
    timeout_s: float, issue: Any, *, group_timeout_s: float = 20.0, peer_follows: bool = True
) -> tuple[BaseException, float, BaseException | None]:
    """Rank 0 runs ``issue(pg)`` (a call rank 1 never joins) and waits on it.

    Returns rank 0's error, the seconds until it came, and (``peer_follows``)
    the error of rank 1's next collective, an allreduce like rank 0's issued
    once rank 0 gave up: it must fail naming rank 0 instead of hanging.
    ``timeout_s`` bounds the whole exchange.
    """
    gs = make_groups(2, timeout_s=group_timeout_s)
    gave_up = threading.Event()

    def fn(rank: int, pg: EntrenarProcessGroup) -> tuple[BaseException | None, float]:
        if rank == 0:
            start = time.monotonic()
            try:
                issue(pg).wait()
            except BaseException as e:
                return e, time.monotonic() - start
            finally:
                gave_up.set()
            raise AssertionError("the stalled collective completed")
        assert gave_up.wait(timeout_s)
        if not peer_follows:
            return None, 0.0
        with pytest.raises(EntrenarError, match="rank 0") as info:
            pg.allreduce([torch.ones(4)]).wait()
        return info.value, 0.0

    (err0, seconds), (err1, _) = run_ranks(2, fn, groups=gs, timeout_s=timeout_s)
    for g in gs:
        g.shutdown()
    return err0, seconds, err1


# ---------------------------------------------------------------- timeouts


@pytest.mark.timeout(60)
def test_per_call_opts_timeout_is_honoured() -> None:
    opts = c10d.AllreduceOptions()
    opts.timeout = timedelta(seconds=1)
    err, seconds, peer_err = _stall(15, lambda pg: pg.allreduce([torch.ones(4)], opts))
    assert isinstance(err, PeerConnectionError), err
    assert "rank 0: allreduce#1: no progress for 1.0s" in str(err), err
    assert 0.9 <= seconds < 8, seconds  # the group's own timeout is 20 s
    assert "aborted because rank 0 failed" in str(peer_err), peer_err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["allreduce", "barrier"])
def test_short_form_timeout_is_honoured(call: str) -> None:
    one = timedelta(seconds=1)
    issue = {
        "allreduce": lambda pg: pg.allreduce(torch.ones(4), dist.ReduceOp.SUM, one),
        "barrier": lambda pg: pg.barrier(one),
    }[call]
    err, seconds, _ = _stall(15, issue)
    assert isinstance(err, PeerConnectionError) and "no progress for 1.0s" in str(err), err
    assert 0.9 <= seconds < 8, seconds


@pytest.mark.timeout(60)
def test_torch_default_opts_timeout_means_the_groups() -> None:
    # AllreduceOptions().timeout is torch's kUnsetTimeout (-1 ms): the group's 1.5 s applies
    assert c10d.AllreduceOptions().timeout < timedelta(0)
    err, seconds, _ = _stall(
        15, lambda pg: pg.allreduce([torch.ones(4)], c10d.AllreduceOptions()), group_timeout_s=1.5
    )
    assert "no progress for 1.5s" in str(err), err
    assert 1.4 <= seconds < 8, seconds


@pytest.mark.timeout(60)
def test_set_timeout_applies_to_later_calls() -> None:
    def issue(pg: EntrenarProcessGroup) -> Any:
        pg.set_timeout(timedelta(seconds=1))
        return pg.allreduce([torch.ones(4)])

    err, seconds, _ = _stall(15, issue)
    assert isinstance(err, PeerConnectionError) and "no progress for 1.0s" in str(err), err
    assert 0.9 <= seconds < 8, seconds


@pytest.mark.timeout(60)
def test_set_timeout_applies_to_p2p() -> None:
    def issue(pg: EntrenarProcessGroup) -> Any:
        pg.set_timeout(timedelta(seconds=1))
        return pg.recv([torch.zeros(2)], 1, 0)  # rank 1 never sends

    err, seconds, _ = _stall(15, issue, peer_follows=False)  # p2p failures spare the group
    assert isinstance(err, PeerConnectionError) and "1.0s" in str(err), err
    assert 0.9 <= seconds < 8, seconds


@pytest.mark.timeout(60)
def test_set_timeout_refuses_non_positive_and_keeps_the_group_usable() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> float:
        for bad in (timedelta(0), timedelta(seconds=-1), 5):
            with pytest.raises(ValueError, match=rf"rank {rank}: set_timeout: .*positive"):
                pg.set_timeout(bad)  # type: ignore[arg-type]
        pg.set_timeout(timedelta(seconds=9))
        t = torch.ones(2)
        pg.allreduce([t]).wait()
        return float(t[0])

    assert run_ranks(2, fn, timeout_s=30) == [2.0, 2.0]


# ---------------------------------------------------------------- errored / abort


@pytest.mark.timeout(60)
def test_errored_is_none_while_healthy_then_the_first_failure() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> None:
        pg.allreduce([torch.ones(3)]).wait()
        pg.barrier().wait()
        assert pg.errored() is None
        work = pg.allreduce([torch.ones(4 + rank)])  # sizes differ: a mismatch
        with pytest.raises(CollectiveMismatchError) as info:
            work.wait()
        first = pg.errored()
        assert isinstance(first, CollectiveMismatchError), first
        assert f"rank {rank}: collective mismatch" in str(first)
        assert first is info.value or str(info.value) == str(first)
        with pytest.raises(CollectiveMismatchError, match="cannot be used any more"):
            pg.allreduce([torch.ones(1)])
        assert pg.errored() is first  # still the first failure

    run_ranks(2, fn, timeout_s=30)


@pytest.mark.timeout(60)
def test_abort_fails_the_running_collective_at_once_and_errored_says_aborted() -> None:
    gs = make_groups(2, timeout_s=20)
    started = threading.Event()

    def fn(rank: int, pg: EntrenarProcessGroup) -> Any:
        if rank == 1:
            assert started.wait(10)
            time.sleep(0.3)  # rank 0's allreduce is now blocked waiting for this rank
            gs[0].abort()  # torchft calls abort() from a timeout callback thread
            return None
        work = pg.allreduce([torch.ones(1000)])
        started.set()
        t0 = time.monotonic()
        with pytest.raises(EntrenarError) as info:
            work.wait()
        return info.value, time.monotonic() - t0

    (err, seconds), _ = run_ranks(2, fn, groups=gs, timeout_s=30)
    assert seconds < 5, seconds  # not the 20 s group timeout
    assert "aborted" in str(err), err
    first = gs[0].errored()
    assert isinstance(first, EntrenarError) and "rank 0: the process group was aborted" in str(
        first
    )
    with pytest.raises(EntrenarError, match=r"rank 0: allreduce refused: .*abort\(\)"):
        gs[0].allreduce([torch.ones(1)])
    for g in gs:
        g.shutdown()


@pytest.mark.timeout(60)
def test_abort_of_an_idle_group() -> None:
    gs = make_groups(2, timeout_s=20)
    try:
        assert gs[0].errored() is None
        gs[0].abort()
        err = gs[0].errored()
        assert isinstance(err, EntrenarError) and "aborted" in str(err)
        with pytest.raises(EntrenarError, match="aborted"):
            gs[0].barrier()
        # the peer's next collective learns it from rank 0's abort record
        with pytest.raises(EntrenarError, match="rank 0 failed: rank 0: the process group was"):
            gs[1].allreduce([torch.ones(1)]).wait()
        assert isinstance(gs[1].errored(), EntrenarError)
    finally:
        for g in gs:
            g.shutdown()


# ---------------------------------------------------------------- what each wait path raises


@pytest.mark.timeout(60)
def test_every_python_wait_path_raises_the_entrenar_class() -> None:
    """work.wait(), work.wait(None) (torchft), work.wait(timedelta), dist.all_reduce:
    the collective's own class. get_future() is a C++ future (DDP's reducer chains
    on it): torch turns a failed callback into a RuntimeError naming our class."""

    def fn(rank: int, pg: EntrenarProcessGroup) -> list[str]:
        work = pg.allreduce([torch.ones(4 + rank)])  # mismatch
        seen = []
        for wait in (
            lambda: work.wait(),
            lambda: work.wait(None),
            lambda: work.wait(timedelta(seconds=10)),
            lambda: work.result(),
        ):
            with pytest.raises(CollectiveMismatchError):
                wait()
            seen.append("ok")
        assert isinstance(work.exception(), CollectiveMismatchError)
        assert not work.is_success()
        with pytest.raises(RuntimeError, match="CollectiveMismatchError: rank"):
            work.get_future().wait()
        with pytest.raises(CollectiveMismatchError):  # a later call via torch's Python API
            dist.all_reduce(torch.ones(2), group=pg)
        return seen

    assert run_ranks(2, fn, timeout_s=30) == [["ok"] * 4] * 2


@pytest.mark.timeout(60)
def test_dist_all_reduce_raises_the_entrenar_class() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> str:
        with pytest.raises(CollectiveMismatchError) as info:
            dist.all_reduce(torch.ones(4 + rank), group=pg)
        return str(info.value)

    msgs = run_ranks(2, fn, timeout_s=30)
    assert msgs[0].startswith("rank 0: collective mismatch with rank 1")


@pytest.mark.timeout(60)
def test_functional_collectives_wait_raises_the_entrenar_class() -> None:
    """torch's C++ (functional collectives, wait_tensor) calls our Work's wait:
    pybind11 carries the Python exception through C++ unchanged."""
    gs = make_groups(2, timeout_s=20)
    names = [f"health-fc-{r}-{id(g)}" for r, g in enumerate(gs)]
    for name, g in zip(names, gs, strict=True):
        g._set_group_name(name)
        c10d._register_process_group(name, g)

    def fn(rank: int, pg: EntrenarProcessGroup) -> None:
        y = torch.ops._c10d_functional.all_reduce(torch.ones(4 + rank), "sum", names[rank])
        with pytest.raises(CollectiveMismatchError):
            torch.ops._c10d_functional.wait_tensor(y)

    try:
        run_ranks(2, fn, groups=gs, timeout_s=30)
    finally:
        for name, g in zip(names, gs, strict=True):
            c10d._unregister_process_group(name)
            g.shutdown()


@pytest.mark.timeout(60)
def test_a_job_interrupted_by_the_groups_failure_keeps_its_culprit() -> None:
    """The group fails (here: a failure naming rank 1 recorded from outside the
    job) while rank 0's allreduce waits for a peer; the job's error names the
    group's first failure and keeps its culprit (before: culprit None)."""
    groups = make_groups(2, timeout_s=20.0)
    try:
        work = groups[0].allreduce([torch.ones(4)])  # rank 1 never joins
        # Inside the job, waiting for rank 1 (what a QUERY would hear): a
        # failure recorded before the job started would refuse it instead.
        mesh = groups[0]._runtime.mesh
        deadline = time.monotonic() + 10
        while mesh.control.waiting is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert mesh.control.waiting is not None, "the job never waited for rank 1"
        groups[0]._runtime.state.fail(PeerConnectionError("rank 0: injected", culprit=1), "test")
        with pytest.raises(PeerConnectionError, match="interrupted.*injected") as info:
            work.wait()
        assert info.value.culprit == 1
    finally:
        for g in groups:
            g.abort()

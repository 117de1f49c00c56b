"""The contract checker's per-step path: what a step costs the group's job machinery.

A deferred step's post-hook marks the step in issue order without a job of its
own (docs/contracts.md, "Costs"). Ranks are threads over real loopback
(conftest.run_ranks).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

from entrenar_pg import EntrenarProcessGroup, Options
from entrenar_pg.checker import projection

CHECK = Options(check=True)


def _sum(async_op: bool) -> dist.AllreduceOptions:
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.SUM
    o.asyncOp = async_op
    return o


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():  # the same on every rank (the threads share the global RNG)
        for p in model.parameters():
            p.fill_(0.5)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.timeout(60)
def test_a_deferred_step_is_marked_without_a_job() -> None:
    """A watched step's post-hook hashes the parameters and marks the step in issue
    order: no job, so no sequence number of its own. Each step after the first
    costs one job (its pre-hook's exchange); every step and record is still
    judged. (Before: each post-hook also ran a job to mark the step, one more
    sequence number per step.)"""
    steps = 4

    def body(rank: int, pg: EntrenarProcessGroup) -> tuple[int, int, int, int]:
        model, opt = _model()
        assert pg.checker is not None
        pg.checker.watch(opt)
        for _ in range(steps):
            model(torch.ones(3, 4)).sum().backward()
            for p in model.parameters():
                assert p.grad is not None
                pg.allreduce([p.grad], _sum(async_op=True)).wait()
            opt.step()
        seq = pg._runtime.seq
        pg.checker.flush()  # judges the last step (one more job)
        checker = pg.checker
        return seq, checker.steps_checked, checker.checked["C-DDP-001"], pg._runtime.seq

    allreduces = 2 * steps
    for seq, stepped, compared, after_flush in run_ranks(2, body, options=CHECK):
        # the allreduces, and steps 1..3 judged in the pre-hooks of steps 2..4
        assert seq == allreduces + (steps - 1), seq
        assert (stepped, compared, after_flush) == (steps, steps, seq + 1)


@dataclass(slots=True)
class _Variants:
    """``Projection.floats`` noting the pair of vectors of every input of ``numel``
    elements it projects (an input: its norm is taken)."""

    floats: Any
    numel: int
    seen: list[int] = field(default_factory=list)

    def __call__(self, proj: Any, x: torch.Tensor, **kw: Any) -> Any:
        if x.numel() == self.numel and kw.get("norm", True):
            self.seen.append(kw["variant"])
        return self.floats(proj, x, **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("buckets", [1, 2, 4])
def test_a_bucket_meets_every_pair_of_vectors(
    monkeypatch: pytest.MonkeyPatch, buckets: int
) -> None:
    """The same bucket, checked at every optimizer step, meets all 16 pairs of
    projection vectors in 16 consecutive steps whatever the number of buckets per
    step, so a corruption recurring every step escapes each pair independently
    (docs/contracts.md, "What each check can and cannot miss"). (Before: the
    pair was ``seq mod 16``, and a step advanced seq by its buckets plus two:
    with 2 buckets the bucket met 4 of the pairs, with 4 buckets 8.)"""
    sizes = [5 + b for b in range(buckets)]  # bucket b: a gradient of 5 + b elements
    noting = _Variants(projection.Projection.floats, sizes[0])
    monkeypatch.setattr(projection.Projection, "floats", _DescribedAs(noting))
    steps = 1 + projection.VARIANTS  # the first step's calls are judged one by one

    def body(rank: int, pg: EntrenarProcessGroup) -> None:
        params = [torch.nn.Parameter(torch.full((n,), 0.5)) for n in sizes]
        opt = torch.optim.SGD(params, lr=0.1)
        assert pg.checker is not None
        pg.checker.watch(opt)
        for _ in range(steps):
            for p in params:
                p.grad = torch.ones_like(p)
                pg.allreduce([p.grad], _sum(async_op=True)).wait()
            opt.step()
        pg.checker.flush()  # the last step, judged here (not at teardown, one rank at a time)

    run_ranks(2, body, options=CHECK)
    assert len(noting.seen) == 2 * steps  # the first bucket's input, on both ranks
    later = noting.seen[2:]  # (both ranks' first-step calls left out)
    assert set(later) == set(range(projection.VARIANTS)), sorted(later)


@dataclass(slots=True)
class _DescribedAs:
    """A callable set on a class that binds as a method does (``self`` first)."""

    fn: Any

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self.fn if obj is None else types.MethodType(self.fn, obj)


@pytest.mark.timeout(60)
def test_two_marked_steps_without_a_pre_hook_between() -> None:
    """With the pre-hook removed (only the post-hook left), each step's mark finds
    the previous step's batch still waiting: the group's next job judges the
    older one first. Replicas diverged after step 2 are still caught on every
    rank, naming C-DDP-001 and step 2, and nothing hangs."""
    k = 2

    def body(rank: int, pg: EntrenarProcessGroup) -> str:
        model, opt = _model()
        step = [0]

        def perturb(o: Any, args: Any, kwargs: Any) -> None:  # before the checker's hash
            if step[0] == k and rank == 1:
                with torch.no_grad():
                    model.weight[0, 0] += 1e-6

        opt.register_step_post_hook(perturb)
        assert pg.checker is not None
        handles = pg.checker.watch(opt)
        handles.before.remove()  # no pre-hook: steps are marked back to back
        try:
            for n in range(1, 6):
                step[0] = n
                model(torch.ones(3, 4)).sum().backward()
                for p in model.parameters():
                    assert p.grad is not None
                    pg.allreduce([p.grad], _sum(async_op=True)).wait()
                opt.step()
        except Exception as e:  # the violation, from the job that judged the step
            return f"{type(e).__name__}: {e}"
        return "no violation"

    for msg in run_ranks(2, body, options=CHECK):
        assert "C-DDP-001" in msg and f"after optimizer step {k}:" in msg, msg

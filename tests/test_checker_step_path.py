"""The contract checker's per-step path: what a step costs the group's job machinery.

A deferred step's post-hook marks the step in issue order without a job of its
own (docs/contracts.md, "Costs"). Ranks are threads over real loopback
(conftest.run_ranks).
"""

from __future__ import annotations

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
    judged. So a step of two buckets advances the sequence number by 3, and
    the same bucket meets all 16 pairs of projection vectors (``seq mod 16``)
    over 16 steps (docs/contracts.md, "What each check can and cannot
    miss"). (Before: each post-hook also ran a job to mark the step: 4 per
    step, and the bucket met only 4 of the pairs.)"""
    steps = 17

    def body(rank: int, pg: EntrenarProcessGroup) -> tuple[int, int, int, int, set[int]]:
        model, opt = _model()
        assert pg.checker is not None
        pg.checker.watch(opt)
        pairs: set[int] = set()  # the pairs the first bucket met, from the second step on
        for step in range(steps):
            model(torch.ones(3, 4)).sum().backward()
            for i, p in enumerate(model.parameters()):
                assert p.grad is not None
                pg.allreduce([p.grad], _sum(async_op=True)).wait()
                if i == 0 and step:
                    pairs.add(pg._runtime.seq % projection.VARIANTS)
            opt.step()
        seq = pg._runtime.seq
        pg.checker.flush()  # judges the last step (one more job)
        checker = pg.checker
        return seq, checker.steps_checked, checker.checked["C-DDP-001"], pg._runtime.seq, pairs

    allreduces = 2 * steps
    for seq, stepped, compared, after_flush, pairs in run_ranks(2, body, options=CHECK):
        # the allreduces, and steps 1..16 judged in the pre-hooks of steps 2..17
        assert seq == allreduces + (steps - 1), seq
        assert (stepped, compared, after_flush) == (steps, steps, seq + 1)
        assert pairs == set(range(projection.VARIANTS)), sorted(pairs)


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

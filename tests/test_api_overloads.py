"""Every call form torch 2.13's ProcessGroup binding accepts, on EntrenarProcessGroup.

torch binds short forms beside the options form (torch/csrc/distributed/c10d/
init.cpp): a bare reduce op (``ReduceOp`` or ``ReduceOp.RedOpType``), a bare
root, a single tensor instead of a list, an optional timeout, keywords, and
defaults. torchft and its tests call them (``pg.allreduce(tensors,
ReduceOp.SUM)``). A Python subclass receives the raw arguments, so each form
is called here directly, on 3 ranks, and its result checked against values
computed in the test from the inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

from entrenar_pg import EntrenarProcessGroup

WORLD = 3
SUM, MAX, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN  # RedOpType
TD = timedelta(seconds=30)
c10d = torch._C._distributed_c10d


def x(rank: int, n: int = 4) -> torch.Tensor:
    return torch.arange(float(n)) * (rank + 1) + 10 * rank


def xs(n: int = 4) -> list[torch.Tensor]:
    return [x(r, n) for r in range(WORLD)]


def stack_op(op: Any, ts: list[torch.Tensor]) -> torch.Tensor:
    s = torch.stack(ts)
    kind = getattr(op, "op", op)  # a ReduceOp object wraps its RedOpType
    if kind == MAX:
        return s.amax(0)
    if kind == MIN:
        return s.amin(0)
    return s.sum(0)


def opts(cls: type, **fields: Any) -> Any:
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


class Case(NamedTuple):
    """``call(rank, pg)`` issues the form and returns (work, tensors to check);
    ``expect(rank)`` gives those tensors' expected values (None: not checked)."""

    label: str
    call: Callable[[int, Any], tuple[Any, list[torch.Tensor]]]
    expect: Callable[[int], list[torch.Tensor] | None]


def _one(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def _outs(n: int = 4) -> list[torch.Tensor]:
    return [torch.zeros(n) for _ in range(WORLD)]


def _with(t: Any, work: Any) -> tuple[Any, list[torch.Tensor]]:
    return work, t if isinstance(t, list) else [t]


def _root_only(root: int, value: Callable[[], list[torch.Tensor]]) -> Callable[[int], Any]:
    return lambda r: value() if r == root else [x(r)]  # non-root inputs are left unchanged


def _gather(r: int, pg: Any, form: str) -> tuple[Any, list[torch.Tensor]]:
    root = 1
    outs = _outs() if r == root else []
    if form == "opts":
        w = pg.gather([outs] if outs else [], [x(r)], opts(c10d.GatherOptions, rootRank=root))
    elif form == "bare":
        w = pg.gather(outs, x(r), root)
    else:
        w = pg.gather(output_tensors=outs, input_tensor=x(r), root=root, timeout=TD)
    return w, outs


def _scatter(r: int, pg: Any, form: str) -> tuple[Any, list[torch.Tensor]]:
    root = 2
    out = torch.zeros(4)
    ins = [x(p) + 100 for p in range(WORLD)] if r == root else []
    if form == "opts":
        w = pg.scatter([out], [ins] if ins else [], opts(c10d.ScatterOptions, rootRank=root))
    elif form == "bare":
        w = pg.scatter(out, ins, root)
    else:
        w = pg.scatter(output_tensor=out, input_tensors=ins, root=root, timeout=TD)
    return w, [out]


def _reduce_scatter_in(r: int) -> list[torch.Tensor]:
    return [x(r) + p for p in range(WORLD)]


def _reduce_scatter_expect(op: Any) -> Callable[[int], list[torch.Tensor]]:
    return lambda r: [stack_op(op, [x(q) + r for q in range(WORLD)])]


def _alltoall(r: int, pg: Any, method: str, form: str) -> tuple[Any, list[torch.Tensor]]:
    inp = torch.arange(6.0) + 100 * r
    out = torch.zeros(6)
    fn = getattr(pg, method)
    if form == "opts":
        w = fn(out, inp, [], [], c10d.AllToAllOptions())
    elif form == "default":
        w = fn(out, inp, [2, 2, 2], [2, 2, 2])
    else:
        w = fn(out, inp, [], [], timeout=TD)
    return w, [out]


def _alltoall_expect(r: int) -> list[torch.Tensor]:
    return [torch.cat([torch.arange(6.0)[2 * r : 2 * r + 2] + 100 * p for p in range(WORLD)])]


def _barrier(pg: Any, form: str) -> tuple[Any, list[torch.Tensor]]:
    call = {
        "none": lambda: pg.barrier(),
        "opts": lambda: pg.barrier(c10d.BarrierOptions()),
        "None": lambda: pg.barrier(None),
        "timeout": lambda: pg.barrier(TD),
        "timeout kw": lambda: pg.barrier(timeout=TD),
    }[form]
    return call(), []


CASES: list[Case] = [
    # allreduce: (tensors, opts) | (tensors, op=SUM, timeout=None) | (tensor, op=SUM, timeout=None)
    Case(
        "allreduce(tensors, opts)",
        lambda r, pg: _with(
            t := x(r), pg.allreduce([t], opts(c10d.AllreduceOptions, reduceOp=MAX))
        ),
        lambda r: [stack_op(MAX, xs())],
    ),
    Case(
        "allreduce(tensors)",
        lambda r, pg: _with(t := x(r), pg.allreduce([t])),
        lambda r: [stack_op(SUM, xs())],
    ),
    Case(
        "allreduce(tensors, RedOpType)",
        lambda r, pg: _with(t := x(r), pg.allreduce([t], MAX)),
        lambda r: [stack_op(MAX, xs())],
    ),
    Case(
        "allreduce(tensors, ReduceOp)",
        lambda r, pg: _with(t := x(r), pg.allreduce([t], dist.ReduceOp(MIN))),
        lambda r: [stack_op(MIN, xs())],
    ),
    Case(
        "allreduce(tuple, op, timeout)",
        lambda r, pg: _with(t := x(r), pg.allreduce((t,), SUM, TD)),
        lambda r: [stack_op(SUM, xs())],
    ),
    Case(
        "allreduce(tensor)",
        lambda r, pg: _with(t := x(r), pg.allreduce(t)),
        lambda r: [stack_op(SUM, xs())],
    ),
    Case(
        "allreduce(tensor=, op=, timeout=)",
        lambda r, pg: _with(t := x(r), pg.allreduce(tensor=t, op=MAX, timeout=TD)),
        lambda r: [stack_op(MAX, xs())],
    ),
    Case(
        "allreduce(tensors=, op=)",
        lambda r, pg: _with(t := x(r), pg.allreduce(tensors=[t], op=MIN)),
        lambda r: [stack_op(MIN, xs())],
    ),
    Case(
        "allreduce(tensor, PREMUL_SUM)",
        lambda r, pg: _with(t := x(r), pg.allreduce(t, dist._make_nccl_premul_sum(2.0))),
        lambda r: [2 * stack_op(SUM, xs())],
    ),
    Case(
        "allreduce(tensors, opts=None)",
        lambda r, pg: _with(t := x(r), pg.allreduce([t], opts=None)),
        lambda r: [stack_op(SUM, xs())],
    ),
    # allreduce_coalesced: (tensors, opts); torchft also passes a bare op
    Case(
        "allreduce_coalesced(tensors, opts)",
        lambda r, pg: _with(
            ts := [x(r), x(r, 3)],
            pg.allreduce_coalesced(ts, opts(c10d.AllreduceCoalescedOptions, reduceOp=MAX)),
        ),
        lambda r: [stack_op(MAX, xs()), stack_op(MAX, xs(3))],
    ),
    Case(
        "allreduce_coalesced(tensors, RedOpType)",
        lambda r, pg: _with(ts := [x(r), x(r, 3)], pg.allreduce_coalesced(ts, MIN)),
        lambda r: [stack_op(MIN, xs()), stack_op(MIN, xs(3))],
    ),
    # broadcast: (tensors, opts) | (tensor, root, timeout=None)
    Case(
        "broadcast(tensors, opts)",
        lambda r, pg: _with(t := x(r), pg.broadcast([t], opts(c10d.BroadcastOptions, rootRank=2))),
        lambda r: [x(2)],
    ),
    Case("broadcast(tensors)", lambda r, pg: _with(t := x(r), pg.broadcast([t])), lambda r: [x(0)]),
    Case(
        "broadcast(tensor, root)",
        lambda r, pg: _with(t := x(r), pg.broadcast(t, 1)),
        lambda r: [x(1)],
    ),
    Case(
        "broadcast(tensor=, root=, timeout=)",
        lambda r, pg: _with(t := x(r), pg.broadcast(tensor=t, root=2, timeout=TD)),
        lambda r: [x(2)],
    ),
    # reduce: (tensors, opts) | (tensor, root, op=SUM, timeout=None)
    Case(
        "reduce(tensors, opts)",
        lambda r, pg: _with(
            t := x(r), pg.reduce([t], opts(c10d.ReduceOptions, rootRank=1, reduceOp=MAX))
        ),
        _root_only(1, lambda: [stack_op(MAX, xs())]),
    ),
    Case(
        "reduce(tensor, root)",
        lambda r, pg: _with(t := x(r), pg.reduce(t, 2)),
        _root_only(2, lambda: [stack_op(SUM, xs())]),
    ),
    Case(
        "reduce(tensor, root, ReduceOp)",
        lambda r, pg: _with(t := x(r), pg.reduce(t, 0, dist.ReduceOp(MIN))),
        _root_only(0, lambda: [stack_op(MIN, xs())]),
    ),
    Case(
        "reduce(tensor=, root=, op=, timeout=)",
        lambda r, pg: _with(t := x(r), pg.reduce(tensor=t, root=1, op=MAX, timeout=TD)),
        _root_only(1, lambda: [stack_op(MAX, xs())]),
    ),
    # allgather: (lists, tensors, opts) | (list, tensor, timeout=None)
    Case(
        "allgather(lists, tensors, opts)",
        lambda r, pg: _with(outs := _outs(), pg.allgather([outs], [x(r)], c10d.AllgatherOptions())),
        lambda r: xs(),
    ),
    Case(
        "allgather(list, tensor)",
        lambda r, pg: _with(outs := _outs(), pg.allgather(outs, x(r))),
        lambda r: xs(),
    ),
    Case(
        "allgather(output_tensors=, input_tensor=, timeout=)",
        lambda r, pg: _with(
            outs := _outs(), pg.allgather(output_tensors=outs, input_tensor=x(r), timeout=TD)
        ),
        lambda r: xs(),
    ),
    # gather: (lists, tensors, opts) | (list, tensor, root, timeout=None)
    Case(
        "gather(lists, tensors, opts)",
        lambda r, pg: _gather(r, pg, "opts"),
        lambda r: xs() if r == 1 else [],
    ),
    Case(
        "gather(list, tensor, root)",
        lambda r, pg: _gather(r, pg, "bare"),
        lambda r: xs() if r == 1 else [],
    ),
    Case("gather(keywords)", lambda r, pg: _gather(r, pg, "kw"), lambda r: xs() if r == 1 else []),
    # scatter: (tensors, lists, opts) | (tensor, list, root, timeout=None)
    Case(
        "scatter(tensors, lists, opts)",
        lambda r, pg: _scatter(r, pg, "opts"),
        lambda r: [x(r) + 100],
    ),
    Case(
        "scatter(tensor, list, root)", lambda r, pg: _scatter(r, pg, "bare"), lambda r: [x(r) + 100]
    ),
    Case("scatter(keywords)", lambda r, pg: _scatter(r, pg, "kw"), lambda r: [x(r) + 100]),
    # reduce_scatter: (tensors, lists, opts) | (output, input, op=SUM, timeout=None)
    Case(
        "reduce_scatter(tensors, lists, opts)",
        lambda r, pg: _with(
            out := torch.zeros(4),
            pg.reduce_scatter(
                [out], [_reduce_scatter_in(r)], opts(c10d.ReduceScatterOptions, reduceOp=MAX)
            ),
        ),
        _reduce_scatter_expect(MAX),
    ),
    Case(
        "reduce_scatter(output, input)",
        lambda r, pg: _with(out := torch.zeros(4), pg.reduce_scatter(out, _reduce_scatter_in(r))),
        _reduce_scatter_expect(SUM),
    ),
    Case(
        "reduce_scatter(output, input, RedOpType)",
        lambda r, pg: _with(
            out := torch.zeros(4), pg.reduce_scatter(out, _reduce_scatter_in(r), MIN)
        ),
        _reduce_scatter_expect(MIN),
    ),
    Case(
        "reduce_scatter(output=, input=, op=, timeout=)",
        lambda r, pg: _with(
            out := torch.zeros(4),
            pg.reduce_scatter(output=out, input=_reduce_scatter_in(r), op=MAX, timeout=TD),
        ),
        _reduce_scatter_expect(MAX),
    ),
    # the all-to-all pair: (..., opts) | (..., timeout=None)
    *[
        Case(
            f"{m}({form})",
            lambda r, pg, m=m, form=form: _alltoall(r, pg, m, form),
            _alltoall_expect,
        )
        for m in ("alltoall_base", "all_to_all_single")
        for form in ("opts", "default", "timeout")
    ],
    # barrier: (opts) | (timeout=None)
    *[
        Case(f"barrier({form})", lambda r, pg, form=form: _barrier(pg, form), lambda r: [])
        for form in ("none", "opts", "None", "timeout", "timeout kw")
    ],
    # one-form methods: options object, None, keywords
    Case(
        "_allgather_base(output=, input=)",
        lambda r, pg: _with(out := torch.zeros(12), pg._allgather_base(output=out, input=x(r))),
        lambda r: [torch.cat(xs())],
    ),
    Case(
        "reduce_scatter_single(out, in, opts)",
        lambda r, pg: _with(
            out := torch.zeros(4),
            pg.reduce_scatter_single(
                out, torch.cat(_reduce_scatter_in(r)), opts(c10d.ReduceScatterOptions, reduceOp=MAX)
            ),
        ),
        _reduce_scatter_expect(MAX),
    ),
]


@pytest.mark.timeout(120)
def test_every_torch_form_gives_the_expected_result() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> list[list[torch.Tensor]]:
        got = []
        for case in CASES:
            work, outs = case.call(rank, pg)
            assert work.wait() is True, case.label
            got.append(outs)
        return got

    results = run_ranks(WORLD, fn, timeout_s=100)
    for i, case in enumerate(CASES):
        for rank in range(WORLD):
            want = case.expect(rank)
            if want is None:
                continue
            got = results[rank][i]
            assert len(got) == len(want), (case.label, rank)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, msg=f"{case.label} on rank {rank}")


@pytest.mark.timeout(60)
def test_a_short_form_timeout_reaches_the_options() -> None:
    """The timeout of a short form lands in the options object the collective reads."""
    seen = []

    def fn(rank: int, pg: EntrenarProcessGroup) -> None:
        original = pg._runtime.submit

        def spy(req: Any, o: Any) -> Any:
            seen.append((rank, o.timeout, o.reduceOp))
            return original(req, o)

        pg._runtime.submit = spy  # type: ignore[method-assign]
        pg.allreduce(torch.ones(2), MAX, timedelta(seconds=7)).wait()

    run_ranks(2, fn, timeout_s=30)
    assert sorted(r for r, _, _ in seen) == [0, 1]
    for _, timeout, op in seen:
        assert timeout == timedelta(seconds=7)
        assert op == MAX


@pytest.mark.timeout(60)
def test_arguments_that_fit_no_form_fail_in_the_caller() -> None:
    def fn(rank: int, pg: EntrenarProcessGroup) -> float:
        bad = [
            ("allreduce", lambda: pg.allreduce(torch.ones(2), "sum")),
            ("allreduce", lambda: pg.allreduce([torch.ones(2)], c10d.BroadcastOptions())),
            ("broadcast", lambda: pg.broadcast(torch.ones(2))),  # the short form needs a root
            ("broadcast", lambda: pg.broadcast(torch.ones(2), True)),
            ("reduce", lambda: pg.reduce(torch.ones(2), 0, SUM, TD, 5)),
            (
                "reduce_scatter",
                lambda: pg.reduce_scatter(torch.ones(2), [torch.ones(2)] * 2, nope=1),
            ),
            ("barrier", lambda: pg.barrier(3)),
        ]
        for name, call in bad:
            with pytest.raises(
                TypeError, match=rf"rank {rank}: {name}: .*fit none of torch's forms"
            ):
                call()
        t = torch.ones(3)  # nothing was sent: the ranks are still in step
        pg.allreduce(t).wait()
        return float(t[0])

    assert run_ranks(2, fn, timeout_s=30) == [2.0, 2.0]

"""torch's ProcessGroup call forms, reduced to one: the options form.

torch 2.13 binds several overloads per collective on ``ProcessGroup``
(torch/csrc/distributed/c10d/init.cpp): the options form every torch API
and torch's C++ use, ``allreduce(tensors, opts)``, and short forms taking a
bare reduce op, root or timeout: ``allreduce(tensor, op=SUM, timeout=None)``,
``broadcast(tensor, root)``, ``reduce_scatter(output, inputs, op)``, ...
(torchft and its tests call them). A Python subclass's method shadows every
overload, so it receives whatever the caller passed. ``normalize`` binds the
arguments to the first form they fit, in torch's order, as pybind11 does, and
returns them as the options form: the first form's positional arguments and
an options object (None where the caller gave none; the collectives read
None as torch's defaults). A short form's op, root and timeout land in a
fresh options object of the call's class, just as torch's C++ lambdas build
it.

The options form itself (what DDP, ``dist.*`` and the functional
collectives pass) is recognised by one type test and returned untouched: every
collective goes through here.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

_REQUIRED = object()  # a parameter without a default
OPTS = "opts"  # Param.to of the options object itself


class Arg(enum.Enum):
    """What a parameter accepts (the C++ type torch binds it to)."""

    TENSOR = "Tensor"
    TENSORS = "list[Tensor]"
    TENSOR_LISTS = "list[list[Tensor]]"
    SIZES = "list[int]"
    RANK = "int"
    OP = "ReduceOp"
    TIMEOUT = "timedelta | None"
    OPTIONS = "options | None"


class Wrap(enum.Enum):
    """How a short form's argument becomes the options form's (as torch's C++ lambdas do)."""

    NONE = enum.auto()
    LIST = enum.auto()  # x -> [x]
    LIST_IF_ANY = enum.auto()  # x -> [x], or [] if x is empty (gather / scatter roots)


class Param(NamedTuple):
    """One parameter of one form: its name, type, and where its value goes.

    ``to``: the position in the options form's arguments, ``OPTS`` for the
    options object itself, or the name of the options field it sets.
    """

    name: str
    arg: Arg
    to: int | str
    wrap: Wrap = Wrap.NONE
    default: Any = _REQUIRED


class Spec(NamedTuple):
    """A method's forms, the options form first (``arity`` positional arguments + opts)."""

    options: type
    arity: int
    forms: tuple[tuple[Param, ...], ...]


def _opts() -> Param:
    return Param("opts", Arg.OPTIONS, OPTS, default=None)


def _op() -> Param:
    return Param("op", Arg.OP, "reduceOp", default=dist.ReduceOp.SUM)


def _timeout() -> Param:
    return Param("timeout", Arg.TIMEOUT, "timeout", default=None)


def _root() -> Param:
    return Param("root", Arg.RANK, "rootRank")


def _one_form(options: type, *params: Param) -> Spec:
    return Spec(options, len(params), ((*params, _opts()),))


_SIZES = (
    Param("output_split_sizes", Arg.SIZES, 2),
    Param("input_split_sizes", Arg.SIZES, 3),
)
_ALLTOALL_BASE = Spec(
    c10d.AllToAllOptions,
    4,
    (
        (Param("output", Arg.TENSOR, 0), Param("input", Arg.TENSOR, 1), *_SIZES, _opts()),
        (Param("output", Arg.TENSOR, 0), Param("input", Arg.TENSOR, 1), *_SIZES, _timeout()),
    ),
)

SPECS: dict[str, Spec] = {
    "allreduce": Spec(
        c10d.AllreduceOptions,
        1,
        (
            (Param("tensors", Arg.TENSORS, 0), _opts()),
            (Param("tensors", Arg.TENSORS, 0), _op(), _timeout()),
            (Param("tensor", Arg.TENSOR, 0, Wrap.LIST), _op(), _timeout()),
        ),
    ),
    # torch binds only the options form; torchft's wrappers also pass a bare op
    "allreduce_coalesced": Spec(
        c10d.AllreduceCoalescedOptions,
        1,
        (
            (Param("tensors", Arg.TENSORS, 0), _opts()),
            (Param("tensors", Arg.TENSORS, 0), _op(), _timeout()),
        ),
    ),
    "broadcast": Spec(
        c10d.BroadcastOptions,
        1,
        (
            (Param("tensors", Arg.TENSORS, 0), _opts()),
            (Param("tensor", Arg.TENSOR, 0, Wrap.LIST), _root(), _timeout()),
        ),
    ),
    "reduce": Spec(
        c10d.ReduceOptions,
        1,
        (
            (Param("tensors", Arg.TENSORS, 0), _opts()),
            (Param("tensor", Arg.TENSOR, 0, Wrap.LIST), _root(), _op(), _timeout()),
        ),
    ),
    "allgather": Spec(
        c10d.AllgatherOptions,
        2,
        (
            (
                Param("output_tensors", Arg.TENSOR_LISTS, 0),
                Param("input_tensors", Arg.TENSORS, 1),
                _opts(),
            ),
            (
                Param("output_tensors", Arg.TENSORS, 0, Wrap.LIST),
                Param("input_tensor", Arg.TENSOR, 1, Wrap.LIST),
                _timeout(),
            ),
        ),
    ),
    "gather": Spec(
        c10d.GatherOptions,
        2,
        (
            (
                Param("output_tensors", Arg.TENSOR_LISTS, 0),
                Param("input_tensors", Arg.TENSORS, 1),
                _opts(),
            ),
            (
                Param("output_tensors", Arg.TENSORS, 0, Wrap.LIST_IF_ANY),
                Param("input_tensor", Arg.TENSOR, 1, Wrap.LIST),
                _root(),
                _timeout(),
            ),
        ),
    ),
    "scatter": Spec(
        c10d.ScatterOptions,
        2,
        (
            (
                Param("output_tensors", Arg.TENSORS, 0),
                Param("input_tensors", Arg.TENSOR_LISTS, 1),
                _opts(),
            ),
            (
                Param("output_tensor", Arg.TENSOR, 0, Wrap.LIST),
                Param("input_tensors", Arg.TENSORS, 1, Wrap.LIST_IF_ANY),
                _root(),
                _timeout(),
            ),
        ),
    ),
    "reduce_scatter": Spec(
        c10d.ReduceScatterOptions,
        2,
        (
            (
                Param("output_tensors", Arg.TENSORS, 0),
                Param("input_tensors", Arg.TENSOR_LISTS, 1),
                _opts(),
            ),
            (
                Param("output", Arg.TENSOR, 0, Wrap.LIST),
                Param("input", Arg.TENSORS, 1, Wrap.LIST),
                _op(),
                _timeout(),
            ),
        ),
    ),
    "alltoall_base": _ALLTOALL_BASE,
    "all_to_all_single": _ALLTOALL_BASE,
    "barrier": Spec(c10d.BarrierOptions, 0, ((_opts(),), (_timeout(),))),
    # one form each: the options object (or None)
    "_allgather_base": _one_form(
        c10d.AllgatherOptions, Param("output", Arg.TENSOR, 0), Param("input", Arg.TENSOR, 1)
    ),
    "all_gather_single": _one_form(
        c10d.AllgatherOptions, Param("output", Arg.TENSOR, 0), Param("input", Arg.TENSOR, 1)
    ),
    "allgather_coalesced": _one_form(
        c10d.AllgatherOptions,
        Param("output_lists", Arg.TENSOR_LISTS, 0),
        Param("input_list", Arg.TENSORS, 1),
    ),
    "allgather_into_tensor_coalesced": _one_form(
        c10d.AllgatherOptions, Param("outputs", Arg.TENSORS, 0), Param("inputs", Arg.TENSORS, 1)
    ),
    "all_gather_single_coalesced": _one_form(
        c10d.AllgatherOptions, Param("outputs", Arg.TENSORS, 0), Param("inputs", Arg.TENSORS, 1)
    ),
    "_reduce_scatter_base": _one_form(
        c10d.ReduceScatterOptions,
        Param("outputTensor", Arg.TENSOR, 0),
        Param("inputTensor", Arg.TENSOR, 1),
    ),
    "reduce_scatter_single": _one_form(
        c10d.ReduceScatterOptions,
        Param("outputTensor", Arg.TENSOR, 0),
        Param("inputTensor", Arg.TENSOR, 1),
    ),
    "reduce_scatter_tensor_coalesced": _one_form(
        c10d.ReduceScatterOptions,
        Param("outputs", Arg.TENSORS, 0),
        Param("inputs", Arg.TENSORS, 1),
    ),
    "reduce_scatter_single_coalesced": _one_form(
        c10d.ReduceScatterOptions,
        Param("outputs", Arg.TENSORS, 0),
        Param("inputs", Arg.TENSORS, 1),
    ),
    "alltoall": _one_form(
        c10d.AllToAllOptions,
        Param("output_tensors", Arg.TENSORS, 0),
        Param("input_tensors", Arg.TENSORS, 1),
    ),
}


# method -> (options class, positional count of the options form): the hot path's test
_OPTIONS_FORM = {name: (spec.options, spec.arity + 1) for name, spec in SPECS.items()}


def normalize(
    method: str, args: Sequence[Any], kwargs: dict[str, Any], rank: int
) -> tuple[Sequence[Any], Any]:
    """``method``'s arguments in the options form: (positional arguments, options or None).

    TypeError naming the rank, the call and torch's forms when no form fits.
    """
    options, count = _OPTIONS_FORM[method]
    if len(args) == count and type(args[-1]) is options and not kwargs:
        return args[:-1], args[-1]  # the options form, as torch itself calls it
    spec = SPECS[method]
    for form in spec.forms:
        values = _bind(form, args, kwargs, spec.options)
        if values is not None:
            return _options_form(spec, form, values)
    raise TypeError(
        f"rank {rank}: {method}: the arguments ({_describe(args, kwargs)}) fit none of "
        f"torch's forms: {'; '.join(_signature(method, f) for f in spec.forms)}"
    )


def _bind(
    form: tuple[Param, ...], args: Sequence[Any], kwargs: dict[str, Any], options: type
) -> dict[str, Any] | None:
    """The form's parameter values, or None if the arguments do not fit it."""
    if len(args) > len(form):
        return None
    values = {p.name: a for p, a in zip(form, args, strict=False)}
    for name, value in kwargs.items():
        if name in values or all(p.name != name for p in form):
            return None
        values[name] = value
    for p in form:
        if p.name not in values:
            if p.default is _REQUIRED:
                return None
            values[p.name] = p.default
        elif not _accepts(p.arg, values[p.name], options):
            return None
    return values


def _options_form(
    spec: Spec, form: tuple[Param, ...], values: dict[str, Any]
) -> tuple[Sequence[Any], Any]:
    positional: list[Any] = [None] * spec.arity
    opts = None
    fields: list[tuple[str, Any]] = []
    for p in form:
        v = values[p.name]
        if p.to == OPTS:
            opts = v
        elif isinstance(p.to, int):
            if p.wrap is Wrap.LIST:
                v = [v]
            elif p.wrap is Wrap.LIST_IF_ANY:
                v = [list(v)] if len(v) else []
            positional[p.to] = v
        else:
            fields.append((p.to, v))
    if fields:  # a short form: its op / root / timeout in a fresh options object
        opts = spec.options()
        for field, v in fields:
            if v is not None:  # timeout=None: torch's unset timeout (the group's)
                setattr(opts, field, v)
    return positional, opts


def _accepts(arg: Arg, v: Any, options: type) -> bool:
    if arg is Arg.TENSOR:
        return isinstance(v, torch.Tensor)
    if arg is Arg.TENSORS:
        return isinstance(v, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in v)
    if arg is Arg.TENSOR_LISTS:
        return isinstance(v, (list, tuple)) and all(
            isinstance(ts, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in ts)
            for ts in v
        )
    if arg is Arg.SIZES:
        return isinstance(v, (list, tuple)) and all(_is_int(s) for s in v)
    if arg is Arg.RANK:
        return _is_int(v)
    if arg is Arg.OP:
        return isinstance(v, (dist.ReduceOp, dist.ReduceOp.RedOpType))
    if arg is Arg.TIMEOUT:
        return v is None or isinstance(v, timedelta)
    return v is None or isinstance(v, options)  # Arg.OPTIONS


def _is_int(v: Any) -> bool:
    """What pybind11 takes for a C++ int: anything with ``__index__`` but bools and tensors."""
    return hasattr(type(v), "__index__") and not isinstance(v, (bool, torch.Tensor))


def _describe(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    parts = [_type_name(a) for a in args]
    parts += [f"{k}={_type_name(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _type_name(v: Any) -> str:
    """``list[Tensor]``, ``list[list[float]]``, ``RedOpType``: what the caller passed."""
    if isinstance(v, (list, tuple)):
        inner = sorted({_type_name(x) for x in v})
        return f"{type(v).__name__}[{' | '.join(inner)}]" if inner else type(v).__name__
    return type(v).__name__


def _signature(method: str, form: tuple[Param, ...]) -> str:
    return f"{method}({', '.join(f'{p.name}: {p.arg.value}' for p in form)})"

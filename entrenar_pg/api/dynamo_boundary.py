"""Make the methods torch calls on our objects as opaque to torch.compile as gloo's C++ ones.

While a ``torch.compile``d program runs, dynamo's frame hook (PEP 523) is
installed in its thread and offers it every Python frame that starts there,
including the ones torch starts when it calls back into Python from C++ or
from its own eager code: DDP's C++ reducer rebuilding its buckets or syncing
BatchNorm buffers inside the compiled ``forward`` (``_broadcast_coalesced``
→ ``ProcessGroup.broadcast`` → ``Work.wait``), ``dist.broadcast`` or an
``async_op`` collective at a graph break. gloo's methods are C++: no frame,
nothing to offer. Ours are Python, so dynamo tried to compile
``EntrenarProcessGroup.broadcast`` as user code and failed on ``self._rank``
(a process group is an opaque script object to dynamo); and it would go on
to offer every frame our code calls (``threading``, ``socket``,
``selectors``: "inlined by default" in its trace rules).

``hide_from_dynamo`` marks the code object of every method of the given
classes with dynamo's own per-code execution strategy, SKIP for the frame
and SKIP for everything it calls: the C hook reads the mark and runs the
frame with no callback, as ``torch.compiler.disable`` would, so a collective
issued from compiled code behaves exactly as in eager mode (and as on gloo).

Why this and not the alternatives:
- ``torch.compiler.disable`` on each method wraps it in a Python function
  that swaps the eval-frame callback on every call, compiled or not: a cost
  on every eager collective, which this must not add.
- A trace-rules skip of the package (``torch._dynamo.trace_rules.add``) is
  not recursive: dynamo would still compile the stdlib frames our code calls,
  and it needs ``torch._dynamo`` imported (about 1 s) at ``import entrenar_pg``.
- The mark is read only by dynamo's hook, and only for a frame started while
  a compiled call runs in that thread (elsewhere the hook finds no callback
  and runs the frame as CPython would): the eager path never looks at it.

Marking once at import covers every group, Work and method torch may call
(torch calls the methods found on the class, whose code objects these are).
``torch._dynamo.reset()`` leaves the marks alone: it resets only the code
objects dynamo compiled or was offered, and it is never offered these.
``set_code_exec_strategy`` is torch-internal (dynamo's own ``skip_code``
sets its marks with it; tested on torch 2.13); on a torch without it nothing
is marked and a compiled DDP fails as it did before, which
``tests/test_compile.py`` shows.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any


def hide_from_dynamo(*classes: type) -> int:
    """Mark every method of ``classes`` (and what they call) never to be traced.

    Returns the number of code objects marked (0 where torch lacks the hook).
    """
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:  # a torch without the hook (or without dynamo)
        return 0
    skip_all = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    marked = 0
    for cls in classes:
        for member in vars(cls).values():
            for fn in _functions(member):
                set_code_exec_strategy(fn.__code__, skip_all)
                marked += 1
    return marked


def _functions(member: Any) -> Iterator[types.FunctionType]:
    """The Python functions a class attribute runs: a method, a property's accessors."""
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    if isinstance(member, property):
        for accessor in (member.fget, member.fset, member.fdel):
            if isinstance(accessor, types.FunctionType):
                yield accessor
    elif isinstance(member, types.FunctionType):
        yield member

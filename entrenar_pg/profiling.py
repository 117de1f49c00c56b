"""torch.profiler events for collectives and p2p ops: opened at the call, closed at completion.

Each call is one event named as the flight recorder names it
(``flight_recorder.PROFILING_NAMES``, ``flight_recorder.p2p_name``:
``entrenar:all_reduce``, ``entrenar:send 0->1``, torch's names for gloo's
and NCCL's), opened in the caller's thread when the call is made and closed
when its future completes, in whichever thread completes it, as torch's own
``c10d::Work`` does for NCCL. So a default profiler, which records only the
threads it runs in, shows the async calls too (DDP's buckets), each lasting
from the call to the end of its transfer.

Callers test ``torch.autograd.profiler._is_profiler_enabled`` first (a
module attribute: one test per call when no profiler runs) and call
``event_until`` only when it is set.
"""

from __future__ import annotations

from typing import Any

import torch

# torch's public record_function carries only a string, which traces drop;
# this is what it runs underneath, with arguments: the profiler shows the
# tensors' shapes and dtypes (record_shapes=True) and the scalars' values.
_enter = torch._C._autograd._record_function_with_args_enter
# Ends the event when the future completes. Its callback restores the
# caller's thread-local profiler state, so the end is recorded even when our
# comm thread (which the profiler does not watch) completes the future;
# torch.distributed.rpc ends its events this way.
_end_when_done = torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction


def event_until(future: torch.futures.Future, name: str, *args: Any) -> torch.futures.Future:
    """Open the profiler event ``name`` (inputs ``args``) now; it ends when ``future`` completes.

    Returns the future to hand to the caller (the Work's): it completes, with
    ``future``'s value or error, only after the event has ended. A torch future
    wakes its waiters before it runs its callbacks, so a caller waiting on
    ``future`` itself could leave the profiler (which frees its state) while
    our thread is still ending the event in it: a crash, seen under load.
    """
    return _end_when_done(_enter(name, *args), future)

"""A job's context: what one call's job runs with, built once per call and passed down."""

from __future__ import annotations

from typing import Any, NamedTuple

from ..call import agreement
from ..collectives import Call, Choice, ScratchPool, choose
from ..config import Options
from ..transport import Mesh
from ..transport.in_flight import Terms
from ..wire import OpCode

# The policy's answers kept per group (see JobContext.call).
Choices = dict[tuple[OpCode, int], Choice]
_MAX_CACHED_CHOICES = 1024
_OP_NAMES = {op: op.name.lower() for op in OpCode}


class JobContext(NamedTuple):
    """What a job (``runtime/jobs.py``) and the contract checker's hooks run with.

    The runtime builds one per call, in the thread that runs the job
    (``Runtime.run``): the group's mesh and scratch, the call's ``seq``, its
    pace (``spin_s`` of that thread, the call's own ``timeout_s`` or the
    group's) and the group's policy answers. It is an argument all the way
    down to the progress loop (``Call``), so nothing shared is rewritten per
    job and two jobs never see each other's pace.
    """

    mesh: Mesh
    rank: int
    world: int
    seq: int
    scratch: ScratchPool
    spin_s: float
    timeout_s: float
    choices: Choices  # the group's, filled as (op, nbytes) pairs are first asked
    options: Options
    req: Any = None  # the call's request (``call/requests.py``), for ``terms``

    def terms(self) -> Terms | None:
        """The call as a peer is told it (``transport/in_flight.py``; the
        runtime publishes this context while its job runs)."""
        req = self.req
        if req is None:
            return None
        agreed = agreement.agreed(req)
        return None if agreed is None else Terms(self.seq, _OP_NAMES[req.op], agreed)

    def call(self, op: OpCode, nbytes: int) -> Call:
        """The context one algorithm runs in: the policy's choice for ``op`` of ``nbytes``."""
        # The answer for (op, nbytes) never changes (the options are frozen,
        # the world fixed), so it is asked once: choose() is ~3 us here, a
        # dict lookup a fifth of that, on every collective's path.
        choice = self.choices.get((op, nbytes))
        if choice is None:
            choice = _choose(self, op, nbytes)
        return Call(self.mesh, self.seq, choice, self.scratch, self.spin_s, self.timeout_s)


def _choose(ctx: JobContext, op: OpCode, nbytes: int) -> Choice:
    """Ask the policy, and keep its answer in the group's ``choices``."""
    choices = ctx.choices
    if len(choices) >= _MAX_CACHED_CHOICES:
        choices.clear()
    choice = choose(op, nbytes, ctx.world, ctx.options, ctx.mesh.all_local, ctx.mesh.topology)
    choices[(op, nbytes)] = choice
    return choice

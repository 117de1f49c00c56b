"""The contract checker of a group: measures every collective, judges in batches, raises everywhere.

The runtime calls ``before`` and ``after`` around every job (runtime/runtime.py,
``Runtime.run``). ``before`` asks the request kind for its slots
(checker/kinds.py) and measures the inputs; ``after`` measures the outputs and
keeps the record. Records are exchanged (one small direct exchange, op CHECK)
and judged (checker/verdict.py) in batches:

- until the group's first optimizer step, after every collective (the verdict
  is raised by the collective itself: plain ``dist.all_reduce`` loops);
- from then on, once per optimizer step, in the same exchange as C-DDP-001's
  parameter hashes, and whenever ``flush_every`` records are pending or a
  barrier runs (so a loop without steps still gets verdicts within
  ``flush_every`` calls). The step's exchange waits for the next step's
  pre-hook (``before_optimizer_step``; a flush or the group's shutdown if
  none comes), so no rank waits for another at a step's end: a violation in
  step k's collectives raises in ``optimizer.step()`` of step k before its
  update, diverged parameters after step k in that of step k + 1, naming the
  collective's kind and sequence number or the step.

Which batch a record lands in is decided inside the group's jobs, which run
in the same order on every rank, so every rank exchanges the same batches.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import time
from array import array
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import step_hook
from ..collectives.common import Call
from ..errors import ContractViolation, EntrenarError
from ..wire import Algo, OpCode
from . import records, replicas
from .hashing import FAST_HASH, HASH_NAME, digest_sized
from .kinds import CONTRACTS, PARAMETERS_ID, VIEWS, Contract, Rule, Views
from .projection import Projection
from .verdict import Judge, minority

log = logging.getLogger(__name__)

FLUSH_EVERY = 64  # records pending at most between optimizer steps

# The step part of a batch: whether this group compares parameters at this
# step, their hash, count, bytes and the step number; and whether another
# group of this rank found a violation at this step (1 + its culprit's global
# rank, or -1 for no single culprit; 0: none), so every rank of the default
# group raises it; and whether this rank checks other groups (1) at all, so
# every rank of the group defers its next step alike (``after_optimizer_step``).
_P_HAS, _P_HASH, _P_COUNT, _P_BYTES, _P_STEP, _P_ELSEWHERE, _P_OTHERS = range(7)
_NO_PARAMETERS = [0, 0, 0, 0, 0, 0, 0]
_OTHERS_OF = operator.itemgetter(_P_OTHERS)  # no generator frame in a step's path
# aux field of the CHECK header: a step's batch and a batch between steps
# can't be confused.
_AUX_BATCH = 1
_AUX_STEP = 2


def exchange(call: Call, payload: list[int], aux: int) -> list[list[int]]:
    """All-gather one int64 vector per rank, directly (1 hop), op CHECK; row i is rank i's.

    Bytes on the wire per rank: (N - 1) x the payload each way. The rows are
    Python arrays, not tensors: a few hundred bytes need no torch call (each
    costs tens of us in a loaded job thread, measured). The plan and its rows
    are kept per payload length (a DDP step's batch has the same length every
    step), so a later exchange only copies the payload in and restamps the
    sequence number, as a cached collective's plan does (collectives/direct.py).
    """
    n, r = call.world, call.rank
    if n == 1:
        return [list(payload)]
    flags = call.choice.flags
    key = (_EXCHANGE, len(payload), aux, n, flags, call.team)
    cached = call.scratch.plan(key)
    if cached is not None:
        plan, rows = cached
        rows[r][:] = array("q", payload)
        plan.restamp(call.seq)
    else:
        rows = [
            array("q", payload) if p == r else array("q", bytes(8 * len(payload))) for p in range(n)
        ]
        header = call.header(
            OpCode.CHECK, Algo.DIRECT, torch.int64, numel=n * len(payload), aux=aux
        )
        plan = call.plan()
        mine = memoryview(rows[r]).cast("B")
        for p in range(n):
            if p != r:
                plan.open(p, header)
                plan.send(p, mine)
                plan.recv(p, memoryview(rows[p]).cast("B"))
        call.scratch.keep_plan(key, (plan, rows))
    call.mesh.run(plan, call.what(OpCode.CHECK), call)
    return [row.tolist() for row in rows]


_EXCHANGE = "check-exchange"  # the exchange's plans in the group's scratch pool


@dataclass(slots=True)
class Measuring:
    """One collective between ``before`` and ``after``: its contract, slots and record."""

    contract: Contract
    views: Views
    record: list[int]


class ContractChecker:
    """Checks every collective of ``group`` against its contract, and C-DDP-001 per step.

    Counters: ``allreduces_checked``, ``steps_checked``, ``checked`` (judged
    checks per contract id), ``seconds`` and ``cpu_seconds`` (what checking cost).
    """

    def __init__(
        self,
        group: Any,
        *,
        tolerance: float | None = None,
        watch_optimizers: bool = True,
        flush_every: int = FLUSH_EVERY,
        defer_steps: bool = True,
    ) -> None:
        if flush_every < 1:
            raise ValueError(f"ContractChecker: flush_every must be >= 1, got {flush_every}")
        self.group = group
        options = getattr(group, "options", None)
        self.tolerance = (
            tolerance
            if tolerance is not None
            else (options.check_tolerance if options is not None else 1e-3)
        )
        self.flush_every = flush_every
        # A step's batch is exchanged at the next step's pre-hook rather than
        # at the step (see _step): no rank waits for the others at a step's end.
        self.defer_steps = defer_steps
        self.step = 0  # optimizer steps checked
        self.allreduces_checked = 0
        self.steps_checked = 0
        self.checked: Counter[str] = Counter()  # checks judged and held, by contract id
        self.seconds = 0.0  # wall time spent checking (measuring, exchanges)
        self.cpu_seconds = 0.0  # CPU time of the checking threads in it (excludes waiting)
        self._projection = Projection()
        self._pending: list[list[int]] = []  # records not judged yet (job threads only)
        self._hold = 1  # records held before judging: 1 until the first step, then flush_every
        # The parameter record of the last step while its batch waits for the
        # next step's pre-hook (set and taken in the group's jobs, so the same
        # on every rank).
        self._due: list[int] | None = None
        # Whether some rank checks other groups too, as the last step's exchange
        # said: the same on every rank, unlike a rank's own groups (a subgroup of
        # some ranks). This rank's account of a violation in another group while
        # its step is deferred: raised in the pre-hook whose exchange tells all.
        self._others_checked = False
        self._account: ContractViolation | None = None
        # Deferred steps marked in issue order, (seq, parameter record): the step
        # comes after job ``seq`` and before the next, on every rank alike. The
        # post-hook appends (``mark_issue``); the group's next job applies it
        # (``_catch_up``), so marking a step runs no job of its own.
        self._marks: deque[tuple[int, list[int]]] = deque()
        self._since_step: Counter[int] = Counter()  # calls of each opcode since the last step
        self._passed: Counter[str] = Counter()  # held since take_verdicts
        self._lock = threading.Lock()  # _passed: counted in job threads, taken by the caller's
        if HASH_NAME != FAST_HASH:
            _warn_slow_hash()
        if watch_optimizers:
            step_hook.install()

    @classmethod
    def install(cls, group: Any = None, **kwargs: Any) -> ContractChecker:
        """Attach a checker to ``group`` (default: the default group), which must be entrenar."""
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        if not hasattr(pg, "checker") or not hasattr(pg, "submit_check"):
            raise TypeError(f"ContractChecker needs an entrenar process group, got {pg!r}")
        checker = cls(pg, **kwargs)
        pg.checker = checker
        return checker

    # ------------------------------------------------------------ the runtime's hooks

    def before(self, rt: Any, seq: int, req: Any, hosts: list[list[torch.Tensor]]) -> Any:
        """Measure a job's inputs (None: the request kind has no contract)."""
        marks = self._marks
        if marks and marks[0][0] < seq:  # a step was marked before this job
            start, cpu = time.perf_counter(), time.thread_time()
            self._catch_up(seq, rt.call(OpCode.CHECK, 0))
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu
        views_of = VIEWS.get(type(req))
        if views_of is None:
            return None
        start, cpu = time.perf_counter(), time.thread_time()
        # torch applies the process's thread settings (torch.set_num_threads:
        # OpenMP's and MKL's team sizes) to a thread it did not create only
        # once that thread asks for them. Until then a projection's matrix
        # product in the comm thread runs a team of every core, whose
        # spinning cost ~10x the product's own CPU (612 vs 62 us for a
        # 2.3 MiB bucket, measured here) and competes with the backward.
        torch.get_num_threads()
        op = req.op
        world = rt.mesh.world
        contract = CONTRACTS[op]
        views = views_of(req, hosts, rt.rank, world)
        bucket = self._since_step[op] + 1
        self._since_step[op] = bucket
        rec = records.begin(
            self._projection, contract, views, op, seq, world, bucket, self.step + 1
        )
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - cpu
        return Measuring(contract, views, rec)

    def after(
        self, rt: Any, seq: int, req: Any, hosts: list[list[torch.Tensor]], m: Measuring
    ) -> None:
        """Measure the outputs; judge the pending records when it is time (raises on violation)."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            if m.contract.rule is not Rule.FLUSH:
                records.finish(
                    self._projection, m.contract, m.views, m.record, rt.rank, rt.mesh.world
                )
                self._pending.append(m.record)
                if req.op is OpCode.ALLREDUCE:
                    self.allreduces_checked += 1  # measured: judged in this batch or the next
            due = len(self._pending) >= self._hold or m.contract.rule is Rule.FLUSH
            if due and self._due is not None:  # a step's batch waits: it takes these along
                self._settle(rt.call(OpCode.CHECK, 0))
            elif self._pending and due:
                self._batch(rt.call(OpCode.CHECK, 0), _NO_PARAMETERS, _AUX_BATCH)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu

    # ------------------------------------------------------------ batches

    def _batch(self, call: Call, parameters: list[int], aux: int) -> None:
        """Exchange the pending records (and a parameter record), then judge them in call order."""
        pending, self._pending = self._pending, []
        payload = list(parameters)
        for rec in pending:  # (extends: no generator frame per field)
            payload += rec
        rows = exchange(call, payload, aux)
        judge = Judge(call.rank, self.tolerance)
        at = len(parameters)
        for rec in pending:
            end = at + rec[records.LEN]
            self._count(judge.collective([row[at:end] for row in rows]))
            at = end
        steps = [row[: len(parameters)] for row in rows]
        if aux == _AUX_STEP:
            self._others_checked = any(map(_OTHERS_OF, steps))
        if parameters[_P_HAS]:
            _judge_parameters(call, steps)
            self._count([PARAMETERS_ID])
        violation = _violated_elsewhere(call.rank, self.step, steps)
        if violation is not None:  # the same on every rank (an account is the caller's)
            raise violation

    def _catch_up(self, seq: int, call: Call) -> None:
        """In job ``seq``: apply the steps marked before it, in order (``_step``): the
        records after a mark belong to the next step and are held, and the
        step's batch (``_due``) waits for the next step's pre-hook. ``call``: the
        job's CHECK call, for the exchange of two steps marked without a
        pre-hook between."""
        marks = self._marks
        while marks and marks[0][0] < seq:
            _, parameters = marks.popleft()
            if self._due is not None:  # two steps without a pre-hook between: the older now
                self._settle(call)
            self._stepped()
            self._due = parameters

    def _settle(self, call: Call) -> None:
        """In a job: exchange and judge the batch of the step that waits (its records
        and parameters), as the step's own job would have."""
        due, self._due = self._due, None
        assert due is not None
        self._batch(call, due, _AUX_STEP)

    def _count(self, held: Iterable[str]) -> None:
        with self._lock:
            for cid in held:
                self._passed[cid] += 1
                self.checked[cid] += 1

    def take_verdicts(self) -> dict[str, int]:
        """Checks that held since the previous call, by contract id (the ledger's column).

        After the optimizer step hook every collective issued before the step
        has been judged, so the counts are final for that step.
        """
        with self._lock:
            out = dict(self._passed)
            self._passed.clear()
        return out

    def _absorb(self, other: ContractChecker) -> None:
        """Count ``other``'s held checks as this checker's (one step's verdicts, all groups)."""
        self._count(Counter(other.take_verdicts()).elements())

    def flush(self) -> None:
        """Judge every pending record (and a step that waits) now. A collective: every
        rank of the group calls it."""
        self.group.submit_check(_Batch(self, _NO_PARAMETERS, _AUX_BATCH)).wait()

    # ------------------------------------------------------------ optimizer steps

    def watch(self, optimizer: Any) -> Any:
        """Check every step of ``optimizer`` (for groups that are not the default).

        Returns a handle whose ``remove()`` removes the checker's hooks; the
        global hooks then skip this optimizer.
        """
        step_hook.watched(optimizer)
        return _WatchHandles(
            optimizer.register_step_pre_hook(_BeforeStep(self)),
            optimizer.register_step_post_hook(_AfterStep(self)),
        )

    def before_optimizer_step(self, optimizer: Any = None) -> None:
        """The step pre-hook: judge the previous step's batch, which waited for it,
        with the records of this step's collectives so far (one exchange; raises
        before this step updates anything). Nothing when no batch waits."""
        if self._due is None and not self._marks:
            return
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            self.flush()
        except ContractViolation:
            account, self._account = self._account, None
            if account is None:
                raise
            raise account from None  # this rank's own, fuller account (a deferred step's)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu

    def after_optimizer_step(self, optimizer: Any) -> None:
        """The global hook's step (this is the default group's checker): every checked
        group of the process judges its pending records and compares its replicas'
        parameters, in group creation order (the same on every rank)."""
        plan = replicas.by_group(_params(optimizer), self.group)
        groups = _checked_groups(self.group)
        elsewhere = _step_other_groups(self, groups, plan)
        # With other checked groups the default group's exchange, at the step, is
        # what tells every rank of one group's violation: no deferral, once every
        # rank knows (a rank's own groups differ where a subgroup has some ranks).
        self._account = None if self._others_checked else elsewhere  # deferred: see the pre-hook
        try:
            own = plan.get(id(self.group), (self.group, []))[1]
            self._step(own, elsewhere, not self._others_checked, others=len(groups) > 1)
        except ContractViolation:
            if elsewhere is not None:
                raise elsewhere from None  # this rank's own, fuller account
            raise

    def check_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """One step of this group now: judge the pending records and C-DDP-001 for the
        parameters replicated across its ranks. A collective: every rank calls it."""
        self._step(
            replicas.by_group(params, self.group).get(id(self.group), (None, []))[1], defer=False
        )

    def _step(
        self,
        tensors: list[torch.Tensor],
        elsewhere: ContractViolation | None = None,
        defer: bool = False,
        others: bool = False,
    ) -> None:
        """One step: hash the parameters now (as they are after the update), then either
        exchange and judge the step's batch at once, or (``defer``: a step pre-hook
        will come) mark the step in job order and leave its batch to the next
        step's pre-hook, a flush, or the group's shutdown, whichever comes first
        (docs/contracts.md, "When verdicts come")."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            parameters = list(_NO_PARAMETERS)
            if tensors:
                hashed, nbytes = digest_sized(tensors)
                parameters[:_P_ELSEWHERE] = [1, hashed, len(tensors), nbytes, self.step + 1]
            if elsewhere is not None:
                culprit = elsewhere.culprit
                parameters[_P_ELSEWHERE] = 1 + culprit if culprit is not None else -1
            parameters[_P_OTHERS] = int(others)
            # A ledger's line needs the step's verdicts at the step.
            if defer and self.defer_steps and getattr(self.group, "ledger", None) is None:
                # Marked in issue order, no job: the group's next job applies it.
                self.group.mark_issue(self._marks, parameters)
            else:
                self.group.submit_check(_Batch(self, parameters, _AUX_STEP)).wait()
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu

    def _stepped(self) -> None:
        """In the step's job: the next records belong to the next step, and are held."""
        self.step += 1
        self.steps_checked += 1
        self._since_step.clear()
        self._hold = self.flush_every


def _judge_parameters(call: Call, rows: list[list[int]]) -> None:
    """C-DDP-001 on every rank's parameter record of one step (raises on divergence)."""
    step = rows[call.rank][_P_STEP]
    where = f"rank {call.rank}: {PARAMETERS_ID} violated after optimizer step {step}"
    steps = [row[_P_STEP] for row in rows]
    if len(set(steps)) > 1:
        raise ContractViolation(f"{where}: the ranks are at different steps ({steps} by rank)")
    shapes = [(row[_P_COUNT], row[_P_BYTES]) for row in rows]
    if len(set(shapes)) > 1:
        raise ContractViolation(
            f"{where}: the ranks hold different parameter sets ((count, bytes) by rank: {shapes})"
        )
    diverged, listing = minority([row[_P_HASH] for row in rows])
    if diverged:
        raise ContractViolation(
            f"{where}: the ranks hold different parameters (parameter {HASH_NAME} by "
            f"ranks: {listing}); rank(s) {diverged} diverged",
            culprit=diverged[0] if len(diverged) == 1 else None,
        )


def settle(checker: ContractChecker | None) -> None:
    """Judge the last step's batch if it still waits (the group's ``shutdown`` calls
    this, so a run's last step is judged). A collective on every rank alike:
    whether a step waits is decided in the group's jobs. Nothing without a
    checker or on a broken group (its failure has been raised already).
    Raises only a violation: a failure to exchange (a peer gone, or in
    another call, as when one rank destroys the group while handling an error
    of its own) is logged, and the step stays unjudged, so destroy never
    hides the caller's own error."""
    if (
        checker is None
        or (checker._due is None and not checker._marks)
        or checker.group.errored() is not None
    ):
        return
    try:
        checker.flush()
    except ContractViolation:
        raise
    except EntrenarError as e:
        log.warning(
            "contract checker: the last optimizer step (%d) could not be judged at shutdown: %s",
            checker.step,
            e,
        )


@dataclass(frozen=True, slots=True)
class _Batch:
    """The checker's job on its group: judge the pending records (a step's: and the parameters)."""

    checker: ContractChecker
    parameters: list[int]
    aux: int

    def __call__(self, call: Call) -> None:
        checker = self.checker
        if checker._marks:
            checker._catch_up(call.seq, call)
        if checker._due is not None:  # a step's batch waits: it goes first, in its own order
            checker._settle(call)
            if self.aux == _AUX_BATCH and not checker._pending:
                return  # a flush (settle): nothing more to judge
        if self.aux == _AUX_STEP:
            checker._stepped()
        checker._batch(call, self.parameters, self.aux)


@dataclass(frozen=True, slots=True)
class _BeforeStep:
    """A watched optimizer's step pre-hook."""

    checker: ContractChecker

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.checker.before_optimizer_step(optimizer)


@dataclass(frozen=True, slots=True)
class _AfterStep:
    """A watched optimizer's step post-hook: its parameters' step, deferred."""

    checker: ContractChecker

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        checker = self.checker
        params = replicas.by_group(_params(optimizer), checker.group)
        checker._step(params.get(id(checker.group), (None, []))[1], defer=True)


@dataclass(frozen=True, slots=True)
class _WatchHandles:
    """``watch``'s handle: removes both hooks."""

    before: Any
    after: Any

    def remove(self) -> None:
        self.before.remove()
        self.after.remove()


@functools.cache
def _warn_slow_hash() -> None:
    """Once per process: without xxhash every hash costs ~25x more (docs/contracts.md)."""
    log.warning(
        "contract checker: xxhash is not installed (pip install entrenar-pg[check]); "
        "hashing with %s, about 25x slower: a few ms more per step for a model of a "
        "million parameters",
        HASH_NAME,
    )


def _params(optimizer: Any) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _global_rank(group: Any, rank: int | None) -> int | None:
    if rank is None:
        return None
    try:
        return int(dist.get_global_rank(group, rank))
    except (RuntimeError, ValueError):  # not a group torch knows
        return rank


def _step_other_groups(
    default: ContractChecker, groups: list[Any], plan: dict[int, tuple[Any, list[torch.Tensor]]]
) -> ContractViolation | None:
    """The step of every checked group but the default one (``groups``, in creation
    order), their verdicts counted as the default checker's; the first violation.
    Other groups go first: a violation in one (an HSDP replicate group) is known to
    its ranks only; the default group's exchange, last, tells every rank."""
    elsewhere: ContractViolation | None = None
    for group in groups:
        if group is default.group:
            continue
        try:
            group.checker._step(plan.get(id(group), (group, []))[1], defer=False)
        except ContractViolation as e:
            if elsewhere is None:
                elsewhere = e
                e.culprit = _global_rank(group, e.culprit)
        default._absorb(group.checker)
    return elsewhere


def _violated_elsewhere(rank: int, step: int, steps: list[list[int]]) -> ContractViolation | None:
    """The violation that the exchanged parameter records ``steps`` report in
    another group (``_P_ELSEWHERE``), if any: every rank raises it."""
    reporters = [r for r, row in enumerate(steps) if row[_P_ELSEWHERE]]
    if not reporters:
        return None
    culprits = sorted({row[_P_ELSEWHERE] - 1 for row in steps if row[_P_ELSEWHERE] > 0})
    return ContractViolation(
        f"rank {rank}: a contract was violated at optimizer step {step} in "
        f"another group of rank(s) {reporters} (culprit rank(s) {culprits}); "
        "halting every rank",
        culprit=culprits[0] if len(culprits) == 1 else None,
    )


def _checked_groups(default: Any) -> list[Any]:
    """The process's checked entrenar groups in creation order (torch creates groups
    in the same order on every rank); the default group first."""
    try:
        groups = list(dist.distributed_c10d._world.pg_map)
    except AttributeError:  # pragma: no cover - torch internals moved
        groups = []
    if default not in groups:
        groups.insert(0, default)
    return [g for g in groups if getattr(g, "checker", None) is not None]

"""The contract checker: proves, as training runs, that the reductions were right.

Enabled by ``ENTRENAR_CHECK=1`` (``Options.check``) on a group, or in code with
``ContractChecker.install(group)``. Three contracts:

C-RING-001 (every allreduce): every rank holds the same output, and the
    output is the op applied to the inputs. Before the allreduce each rank
    projects its input on two random vectors ``r_k`` (``S_ik = r_k.x_i``) and
    takes its norm; afterwards it hashes its output and projects its 1/N share
    of it (the shares add up to ``r_k.y`` once the hashes prove the outputs
    identical). One small direct exchange (op CHECK, same sequence number)
    gives every rank every rank's record, and every rank runs the same verdict
    on the same records: the output hashes must all be equal, and for the
    linear ops (SUM, AVG, PREMUL_SUM)
    ``|r_k.y - f * sum_i S_ik| <= tau * |f| * sum_i ||x_i||`` for both k
    (``f`` = 1, 1/N or the PREMUL factor; ``tau`` = ``check_tolerance`` +
    (N + 1) x the dtype's unit roundoff). For integer dtypes the comparison is
    exact (modulo 2^bits, as the reduction itself wraps). Other ops (PRODUCT,
    MIN, MAX, bitwise, bool) get the identical-output check only.
F-DP-003 (every allreduce input): a NaN or infinity in any rank's input fails
    the same exchange, naming the rank(s), the allreduce's sequence number,
    the bucket and optimizer step it belongs to, and the first bad element.
C-DDP-001 (after every optimizer step): every rank holds identical
    parameters. A global optimizer step post-hook hashes the optimizer's
    parameters and exchanges the hashes through the group (so an unmodified
    DDP script is covered). Parameters that are sharded DTensors (FSDP2) are
    skipped: they are meant to differ.

A violation raises ``ContractViolation`` on every rank: the verdict runs inside
the group's job, so the engine breaks the group, publishes the error and every
later call on it fails with the same class; no rank is left waiting.

Float bound: with ``r`` of standard normal entries (a fixed 4096-entry
vector, each 4096-element block scaled by its own random weight, all from a
fixed seed so every rank has the same ``r``), ``r.delta`` for an error vector
``delta`` is a zero-mean variable of standard deviation ``||delta||``. The
reduction's rounding error obeys ``||delta|| <= (N - 1) u sum_i ||x_i||``
(``u`` the dtype's unit roundoff; N + 1 also covers AVG's division and
PREMUL's scaling), and block dot products are accumulated in float32 over 4096
elements then in float64 (relative error well under 1e-4), so the default
``check_tolerance`` of 1e-3 never fires on a correct float32 reduction, while
a corruption whose norm exceeds ~1e-3 of the inputs' is caught unless both
projections happen to be nearly orthogonal to it; a corruption on one rank
only is always caught by the hash.

The hash is xxHash's XXH3-64 (``xxhash``, the ``check`` extra): ~26 GB/s here
against ~1 GB/s for ``hashlib.blake2b``, which is the fallback when xxhash is
not installed. Measured costs are in docs/contracts.md.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import step_hook
from .api import requests
from .collectives.common import Call, bytes_of
from .errors import ContractViolation
from .reduce_ops import FLOAT_DTYPES, INT_DTYPES, Kind, Reduction
from .transport import Plan
from .wire import Algo, OpCode

_xxhash: Any
try:  # optional dependency (extra "check"); blake2b is the fallback
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - exercised only without the extra
    _xxhash = None

log = logging.getLogger(__name__)

HASH_NAME = "xxh3_64" if _xxhash is not None else "blake2b-64"

_BLOCK = 4096  # projection block: float32 accumulation over at most this many elements
_SLICE_ROWS = 256  # rows converted at a time for half/integer inputs (bounds scratch memory)
_SEED = 0x5EED_C0DE
_PROJECTIONS = 2  # independent random projections, computed in the same pass

# Unit roundoff of each float dtype.
_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
_INT_BITS = {
    torch.int8: 8,
    torch.uint8: 8,
    torch.int16: 16,
    torch.int32: 32,
    torch.int64: 64,
}
_LINEAR = (Kind.SUM, Kind.AVG, Kind.PREMUL_SUM)

# Record exchanged per allreduce: int64 fields (floats stored by their bits);
# _F_SIN and _F_SOUT are the first of _PROJECTIONS consecutive fields.
_F_FLAGS, _F_NORM, _F_HASH, _F_BAD, _F_NUMEL, _F_KIND, _F_SIN = range(7)
_F_SOUT = _F_SIN + _PROJECTIONS
_IN_NONFINITE = 1
_OUT_NONFINITE = 2
_PROJECTED = 4

# aux field of the CHECK header, so the two kinds of exchange can't be confused.
_AUX_ALLREDUCE = 1
_AUX_PARAMS = 2


# ---------------------------------------------------------------------- hashing


class _Blake2b64:
    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=8)

    def update(self, data: memoryview) -> None:
        self._h.update(data)

    def intdigest(self) -> int:
        return int.from_bytes(self._h.digest(), "little")


def _hasher() -> Any:
    return _xxhash.xxh3_64() if _xxhash is not None else _Blake2b64()


def _to_i64(u: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _finite(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) for v in values)


def _f2i(x: float) -> int:
    """A float64 as the int64 with the same bits (records are int64)."""
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _i2f(i: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", i))[0])


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor's values (a contiguous CPU copy if it is not one already)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return bytes_of(t.contiguous().reshape(-1))


def digest(tensors: Iterable[torch.Tensor]) -> int:
    """64-bit hash (XXH3, or blake2b) of the tensors' bytes, in order; as an int64."""
    h = _hasher()
    for t in tensors:
        h.update(tensor_bytes(t))
    return _to_i64(h.intdigest())


# ---------------------------------------------------------------------- projection


class _Projection:
    """Two random vectors r_k, the same on every rank (fixed seed), applied blockwise.

    r_k[j] = base[k, j mod 4096] * weight[k, j // 4096]: one matrix product
    over the (blocks x 4096) view of the data (both projections in one pass),
    then a float64 dot with the block weights. Distinct weights per block make
    aligned block swaps visible; two projections make a miss (a corruption
    whose projection happens to be tiny) the product of two small chances.
    """

    def __init__(self, seed: int = _SEED) -> None:
        g = torch.Generator().manual_seed(seed)
        base = torch.randn(_PROJECTIONS, _BLOCK, generator=g, dtype=torch.float64)
        base[base == 0] = 1.0
        self.r64 = base
        self.r32 = base.float()
        self.rint = torch.randint(
            1, 1 << 20, (_PROJECTIONS, _BLOCK), generator=g, dtype=torch.int64
        ) * (torch.randint(0, 2, (_PROJECTIONS, _BLOCK), generator=g, dtype=torch.int64) * 2 - 1)
        self._seed = seed
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def weights(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block weights (float64, int64) for >= ``blocks`` blocks: a function of the size only."""
        cap = 1 << max(blocks - 1, 0).bit_length()
        w = self._weights.get(cap)
        if w is None:
            g = torch.Generator().manual_seed(self._seed + cap)
            wf = torch.randn(_PROJECTIONS, cap, generator=g, dtype=torch.float64)
            wf[wf == 0] = 1.0
            wi = torch.randint(1, 1 << 20, (_PROJECTIONS, cap), generator=g, dtype=torch.int64)
            w = (wf, wi)
            self._weights[cap] = w
        return w

    @staticmethod
    def _range(n: int, part: tuple[int, int]) -> tuple[int, int, int, bool]:
        """Blocks [b0, f1) of a ``part = (i, parts)`` split of ``n`` elements, and the tail."""
        full, tail = divmod(n, _BLOCK)
        blocks = full + (1 if tail else 0)
        i, parts = part
        if parts == 0:  # no blocks at all (the norm only)
            return 0, 0, tail, False
        b0, b1 = blocks * i // parts, blocks * (i + 1) // parts
        return b0, min(b1, full), tail, bool(tail) and b0 <= full < b1

    def floats(
        self,
        x: torch.Tensor,
        *,
        wide: bool = False,
        norm: bool = True,
        part: tuple[int, int] = (0, 1),
    ) -> tuple[list[float], float]:
        """([r_k . x], ||x||_2) of a flat float tensor; non-finite if x is (or overflows).

        ``part = (i, parts)``: the projections over the i-th of ``parts`` block
        ranges only (summed over i they give the whole; ``parts = 0``: none);
        the norm is always of the whole tensor, and 0 unless ``norm``.
        """
        n = x.numel()
        b0, f1, tail, with_tail = self._range(n, part)
        wf, _ = self.weights(n // _BLOCK + (1 if tail else 0))
        work = torch.float64 if wide or x.dtype == torch.float64 else torch.float32
        r = self.r64 if work == torch.float64 else self.r32
        s = torch.zeros(_PROJECTIONS, dtype=torch.float64)
        if f1 > b0:
            rows = x[b0 * _BLOCK : f1 * _BLOCK].view(f1 - b0, _BLOCK)
            if rows.dtype == work:
                v = torch.mm(r, rows.t())
            else:
                v = torch.empty(_PROJECTIONS, f1 - b0, dtype=work)
                for a in range(0, f1 - b0, _SLICE_ROWS):
                    b = min(a + _SLICE_ROWS, f1 - b0)
                    torch.mm(r, rows[a:b].to(work).t(), out=v[:, a:b])
            s += (v.double() * wf[:, b0:f1]).sum(1)
        if with_tail:
            full = n // _BLOCK
            s += torch.mv(self.r64[:, :tail], x[full * _BLOCK :].double()) * wf[:, full]
        size = float(torch.linalg.vector_norm(x, dtype=work)) if n and norm else 0.0
        return s.tolist(), size

    def ints(self, x: torch.Tensor, *, part: tuple[int, int] = (0, 1)) -> list[int]:
        """[r_k . x] over int64 with wrap-around (exact modulo 2^64); ``part`` as in floats."""
        n = x.numel()
        b0, f1, tail, with_tail = self._range(n, part)
        _, wi = self.weights(n // _BLOCK + (1 if tail else 0))
        s = torch.zeros(_PROJECTIONS, dtype=torch.int64)
        if f1 > b0:
            rows = x[b0 * _BLOCK : f1 * _BLOCK].view(f1 - b0, _BLOCK)
            v = torch.empty(_PROJECTIONS, f1 - b0, dtype=torch.int64)
            for a in range(0, f1 - b0, _SLICE_ROWS):
                b = min(a + _SLICE_ROWS, f1 - b0)
                torch.mm(self.rint, rows[a:b].to(torch.int64).t(), out=v[:, a:b])
            s += (v * wi[:, b0:f1]).sum(1)
        if with_tail:
            full = n // _BLOCK
            s += torch.mv(self.rint[:, :tail], x[full * _BLOCK :].to(torch.int64)) * wi[:, full]
        return [int(v) for v in s.tolist()]


# ---------------------------------------------------------------------- exchange


def exchange_records(call: Call, record: torch.Tensor, aux: int) -> torch.Tensor:
    """All-gather one small int64 record per rank, directly (1 hop), op CHECK.

    Returns an (N, len(record)) int64 tensor; row i is rank i's record.
    Bytes on the wire per rank: (N - 1) x record bytes each way.
    """
    n, r = call.world, call.rank
    out = torch.empty((n, record.numel()), dtype=torch.int64)
    out[r] = record
    if n == 1:
        return out
    header = call.header(OpCode.CHECK, Algo.DIRECT, torch.int64, numel=out.numel(), aux=aux)
    plan = Plan(r)
    mine = bytes_of(out[r])
    for p in range(n):
        if p != r:
            plan.open(p, header)
            plan.send(p, mine)
            plan.recv(p, bytes_of(out[p]))
    call.mesh.run(plan, call.what(OpCode.CHECK))
    return out


def _groups(values: Sequence[int]) -> tuple[list[int], str]:
    """Ranks that disagree with the majority value (all ranks if there is no strict majority)."""
    counts = Counter(values)
    if len(counts) == 1:
        return [], ""
    top, top_n = counts.most_common(1)[0]
    ties = [v for v, c in counts.items() if c == top_n]
    by_value = ", ".join(
        f"{[i for i, v in enumerate(values) if v == val]}: {val & (2**64 - 1):016x}"
        for val in counts
    )
    if len(ties) > 1:
        return list(range(len(values))), by_value
    return [i for i, v in enumerate(values) if v != top], by_value


# ---------------------------------------------------------------------- the checker


class ContractChecker:
    """Checks C-RING-001 and F-DP-003 on every allreduce of ``group``, C-DDP-001 per step.

    The group calls ``before_allreduce``/``after_allreduce`` from its job (the
    comm thread) around every allreduce; the optimizer hook calls
    ``after_optimizer_step``. Counters (``allreduces_checked``,
    ``steps_checked``, ``seconds``, ``cpu_seconds``) say what it did and what it cost.
    """

    def __init__(
        self, group: Any, *, tolerance: float | None = None, watch_optimizers: bool = True
    ) -> None:
        self.group = group
        options = getattr(group, "options", None)
        self.tolerance = (
            tolerance
            if tolerance is not None
            else (options.check_tolerance if options is not None else 1e-3)
        )
        self.step = 0  # optimizer steps completed (and checked)
        self.allreduces_checked = 0
        self.steps_checked = 0
        self.seconds = 0.0  # wall time spent checking (projection, hashing, exchanges)
        self.cpu_seconds = 0.0  # CPU time of the checking threads in it (excludes waiting)
        self._since_step = 0  # allreduces since the last optimizer step: the bucket index
        self._projection = _Projection()
        self._pending: tuple[int, int, int, int, list[int]] | None = None
        self._warned_overflow = False
        self._verdicts_taken: dict[str, int] = {}
        if watch_optimizers:
            step_hook.install()

    @classmethod
    def install(cls, group: Any = None, **kwargs: Any) -> ContractChecker:
        """Attach a checker to ``group`` (default: the default group), which must be entrenar."""
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        if not hasattr(pg, "checker") or not hasattr(pg, "mesh"):
            raise TypeError(f"ContractChecker needs an entrenar process group, got {pg!r}")
        checker = cls(pg, **kwargs)
        pg.checker = checker
        return checker

    def take_verdicts(self) -> dict[str, int]:
        """Checks passed per contract id since the previous call (the run ledger records them).

        A failed check raises instead of returning, so every count is of passed checks.
        """
        now = {"C-RING-001": self.allreduces_checked, "C-DDP-001": self.steps_checked}
        taken = {k: v - self._verdicts_taken.get(k, 0) for k, v in now.items()}
        self._verdicts_taken = now
        return taken

    # ------------------------------------------------------------ allreduce

    def before_allreduce(self, call: Call, flat: torch.Tensor, red: Reduction) -> None:
        """Project and norm this rank's input (and find its first non-finite element)."""
        start, cpu = time.perf_counter(), time.thread_time()
        self._since_step += 1
        flags, norm, bad = 0, 0, -1
        s_in = [0] * _PROJECTIONS
        dtype = flat.dtype
        if dtype in FLOAT_DTYPES:
            # The norm is non-finite iff an element is (or it overflowed): F-DP-003
            # costs nothing beyond it. Non-linear ops need only that part.
            linear = red.kind in _LINEAR
            parts = (0, 1) if linear else (0, 0)
            s, nrm = self._projection.floats(flat, part=parts)
            if not (_finite(s) and math.isfinite(nrm)):
                nonfinite = (~torch.isfinite(flat)).nonzero()
                if nonfinite.numel():
                    flags |= _IN_NONFINITE
                    bad = int(nonfinite[0].item())
                else:  # finite but overflowed float32: redo wide
                    s, nrm = self._projection.floats(flat, wide=True, part=parts)
            if linear and not flags:
                flags |= _PROJECTED
            s_in, norm = [_f2i(v) for v in s], _f2i(nrm)
        elif dtype in INT_DTYPES and red.kind is Kind.SUM:
            # (Integer AVG truncates, so its output's checksum is not linear in
            # the inputs; the identical-output hash check still covers it.)
            flags |= _PROJECTED
            s_in = self._projection.ints(flat)
        self._pending = (call.seq, flags, norm, bad, s_in)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - cpu

    def after_allreduce(self, call: Call, flat: torch.Tensor, red: Reduction) -> None:
        """Hash and project the output, exchange the records, and judge (raises on violation)."""
        start, cpu = time.perf_counter(), time.thread_time()
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != call.seq:
            raise ContractViolation(
                f"rank {call.rank}: checker: allreduce #{call.seq} ended without having begun "
                "(before_allreduce was not called)"
            )
        _, flags, norm, bad, s_in = pending
        s_out = [0] * _PROJECTIONS
        if flags & _PROJECTED:
            # Each rank projects its 1/N of the output; the parts add up to the
            # projection of the output when the outputs are identical, which the
            # hashes prove (when they differ, that is the violation).
            part = (call.rank, call.world)
            if flat.dtype in FLOAT_DTYPES:
                s, _ = self._projection.floats(flat, norm=False, part=part)
                if not _finite(s):
                    flags |= _OUT_NONFINITE
                s_out = [_f2i(v) for v in s]
            else:
                s_out = self._projection.ints(flat, part=part)
        fields = [flags, norm, digest([flat]), bad, flat.numel(), int(red.kind), *s_in, *s_out]
        record = torch.tensor(fields, dtype=torch.int64)
        self.allreduces_checked += 1
        try:
            records = exchange_records(call, record, _AUX_ALLREDUCE)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu
        self._judge_allreduce(call, flat, red, records.tolist())

    def _where(self, call: Call, flat: torch.Tensor) -> str:
        dt = str(flat.dtype).removeprefix("torch.")
        return (
            f"allreduce #{call.seq} (bucket {self._since_step} of optimizer step "
            f"{self.step + 1}; {flat.numel()} x {dt})"
        )

    def _judge_allreduce(
        self, call: Call, flat: torch.Tensor, red: Reduction, recs: list[list[int]]
    ) -> None:
        """The verdict: a function of the gathered records only, so every rank reaches it."""
        n = len(recs)
        where = self._where(call, flat)
        sizes = {rec[_F_NUMEL] for rec in recs}
        kinds = {rec[_F_KIND] for rec in recs}
        if len(sizes) > 1 or len(kinds) > 1:  # the headers make this unreachable
            raise ContractViolation(
                f"rank {call.rank}: C-RING-001 violated at {where}: ranks disagree on the "
                f"call (numel {sorted(sizes)}, op {sorted(kinds)})"
            )
        bad_input = [i for i, rec in enumerate(recs) if rec[_F_FLAGS] & _IN_NONFINITE]
        if bad_input:
            what = "; ".join(f"rank {i}: element {recs[i][_F_BAD]}" for i in bad_input)
            raise ContractViolation(
                f"rank {call.rank}: F-DP-003 violated at {where}: non-finite value in the "
                f"input of rank(s) {bad_input} (first non-finite {what}); halting every rank"
            )
        problems: list[str] = []
        offenders: set[int] = set()
        minority, listing = _groups([rec[_F_HASH] for rec in recs])
        if minority:
            offenders.update(minority)
            problems.append(
                f"ranks hold different outputs (output {HASH_NAME} by ranks: {listing}); "
                f"rank(s) {minority} differ"
            )
        elif all(rec[_F_FLAGS] & _PROJECTED for rec in recs):
            wrong, detail = self._judge_checksum(flat.dtype, red, n, recs)
            if wrong:
                offenders.update(range(n))
                problems.append(
                    f"the output, identical on every rank, is not the {red.kind.name} of the "
                    f"inputs ({detail})"
                )
        if problems:
            raise ContractViolation(
                f"rank {call.rank}: C-RING-001 violated at {where}: "
                + "; ".join(problems)
                + f" [offending rank(s): {sorted(offenders)}]"
            )

    def _judge_checksum(
        self, dtype: torch.dtype, red: Reduction, n: int, recs: list[list[int]]
    ) -> tuple[bool, str]:
        """Whether the output's projections (the sum of every rank's part) miss the inputs'."""
        ks = range(_PROJECTIONS)
        if dtype in INT_DTYPES:
            mask = (1 << _INT_BITS[dtype]) - 1
            diffs = [sum(rec[_F_SOUT + k] - rec[_F_SIN + k] for rec in recs) & mask for k in ks]
            return any(diffs), f"exact checksums modulo 2^{_INT_BITS[dtype]} differ"
        if any(rec[_F_FLAGS] & _OUT_NONFINITE for rec in recs):
            # Finite inputs, non-finite output: the sum overflowed the dtype (IEEE
            # behaviour, e.g. float16); the hash check above still applies.
            if not self._warned_overflow:
                log.warning("checker: an allreduce output overflowed; checksum skipped")
                self._warned_overflow = True
            return False, ""
        if red.kind is Kind.AVG:
            f = 1.0 / n
        elif red.kind is Kind.PREMUL_SUM:
            f = red.factor
        else:
            f = 1.0
        got = [math.fsum(_i2f(rec[_F_SOUT + k]) for rec in recs) for k in ks]
        expected = [f * math.fsum(_i2f(rec[_F_SIN + k]) for rec in recs) for k in ks]
        tau = self.tolerance + (n + 1) * _ROUNDOFF[dtype]
        bound = tau * abs(f) * math.fsum(_i2f(rec[_F_NORM]) for rec in recs)
        wrong = not all(abs(got[k] - expected[k]) <= bound for k in ks)
        return wrong, (
            f"checksums r.y = {[float(f'{g:.6g}') for g in got]}, expected "
            f"{[float(f'{e:.6g}') for e in expected]} +- {bound:.3g}"
        )

    # ------------------------------------------------------------ parameters

    def watch(self, optimizer: Any) -> Any:
        """Check C-DDP-001 after every step of ``optimizer`` (for groups that are not the default).

        Returns the hook handle; the global hook then skips this optimizer.
        """
        step_hook.watched(optimizer)
        return optimizer.register_step_post_hook(
            lambda opt, args, kwargs: self.after_optimizer_step(opt)
        )

    def after_optimizer_step(self, optimizer: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.check_parameters(params)

    def check_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """C-DDP-001 now: every rank's ``params`` hash the same. Counts as one optimizer step.

        Every rank of the group must call it at the same point (it is a collective).
        """
        start, cpu = time.perf_counter(), time.thread_time()
        self.step += 1
        self._since_step = 0
        step = self.step
        tensors = [t for t in (_replicated(p) for p in params) if t is not None]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        record = torch.tensor([digest(tensors), len(tensors), nbytes, step], dtype=torch.int64)
        self.steps_checked += 1
        job = _ParametersCheck(self, record, step)
        work = self.group._runtime.submit(requests.custom(OpCode.CHECK, job))
        try:
            work.wait()
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu

    def _judge_parameters(self, call: Call, step: int, recs: list[list[int]]) -> None:
        steps = [rec[3] for rec in recs]
        if len(set(steps)) > 1:
            raise ContractViolation(
                f"rank {call.rank}: C-DDP-001 violated after optimizer step {step}: the ranks "
                f"are at different steps ({steps} by rank)"
            )
        shapes = [(rec[1], rec[2]) for rec in recs]
        if len(set(shapes)) > 1:
            raise ContractViolation(
                f"rank {call.rank}: C-DDP-001 violated after optimizer step {step}: the ranks "
                f"hold different parameter sets ((count, bytes) by rank: {shapes})"
            )
        minority, listing = _groups([rec[0] for rec in recs])
        if minority:
            raise ContractViolation(
                f"rank {call.rank}: C-DDP-001 violated after optimizer step {step}: the ranks "
                f"hold different parameters (parameter {HASH_NAME} by ranks: {listing}); "
                f"rank(s) {minority} diverged"
            )


@dataclass(frozen=True, slots=True)
class _ParametersCheck:
    """C-DDP-001's job on the group: exchange the records, then judge them."""

    checker: ContractChecker
    record: torch.Tensor
    step: int

    def __call__(self, call: Call) -> None:
        records = exchange_records(call, self.record, _AUX_PARAMS).tolist()
        self.checker._judge_parameters(call, self.step, records)


def _replicated(p: torch.Tensor) -> torch.Tensor | None:
    """The tensor to hash for parameter ``p``: None for a sharded DTensor (FSDP2)."""
    if type(p) is torch.Tensor or type(p) is torch.nn.Parameter:
        return p
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:  # pragma: no cover
        return p
    if isinstance(p, DTensor):
        if all(isinstance(pl, Replicate) for pl in p.placements):
            return p.to_local()
        return None
    return p

"""The verdict on one collective: a function of every rank's record only.

Every rank runs it on the same records, so every rank reaches the same
verdict and raises the same ``ContractViolation`` (naming the contract, the
collective, its sequence number and the offending ranks). The rules are the
contract's (checker/kinds.py); docs/contracts.md says what each can miss.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..collectives.common import op_name
from ..errors import ContractViolation
from ..reduce_ops import INT_DTYPES, Kind
from ..wire import CODE_DTYPE, OpCode
from . import records as R
from .hashing import HASH_NAME
from .kinds import CONTRACTS, NONFINITE_ID, Contract, Rule

# Unit roundoff of each float dtype.
ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
_INT_BITS = {torch.int8: 8, torch.uint8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}


@dataclass(frozen=True, slots=True)
class Judge:
    """What a verdict needs besides the records: who is judging, and the float tolerance."""

    rank: int
    tolerance: float

    def fail(self, what: str, offenders: Sequence[int], *, show: bool = True) -> None:
        culprit = offenders[0] if len(offenders) == 1 else None
        tail = f" [offending rank(s): {sorted(offenders)}]" if show else ""
        raise ContractViolation(f"rank {self.rank}: {what}{tail}", culprit=culprit)

    def collective(self, recs: list[list[int]]) -> list[str]:
        """Judge one collective (row i: rank i's record); the ids of the contracts that held."""
        first = recs[0]
        contract = _CONTRACT_OF[first[R.OPCODE]]
        # (The call's description, _where, is built only for a violation: a
        # verdict that holds costs a few comparisons; enum constructions and
        # generators are left out for the same reason, a few us each in a
        # loaded step.)
        code, seq = first[R.OPCODE], first[R.SEQ]
        for r in recs:  # (a loop, not a generator: no frame per record)
            if r[R.OPCODE] != code or r[R.SEQ] != seq:
                # The frame headers make this unreachable: the records are out of step.
                self.fail(
                    f"{contract.id} at {_where(first)}: the ranks' records are of different calls",
                    [],
                )
        if contract.rule is Rule.REDUCED:
            return self._reduced(contract, recs)
        if contract.rule is Rule.COPIED:
            return self._copied(contract, recs)
        return []

    # ------------------------------------------------------------ reductions

    def _reduced(self, contract: Contract, recs: list[list[int]]) -> list[str]:
        # Every rank's flags in one loop: any rank's (a non-finite input) and
        # every rank's (all projected), as the comprehensions they replace.
        any_flags, all_flags = 0, -1
        for r in recs:
            any_flags |= r[R.FLAGS]
            all_flags &= r[R.FLAGS]
        if any_flags & R.IN_NONFINITE:
            bad = [i for i, r in enumerate(recs) if r[R.FLAGS] & R.IN_NONFINITE]
            what = "; ".join(f"rank {i}: element {recs[i][R.BAD]}" for i in bad)
            self.fail(
                f"{NONFINITE_ID} violated at {_where(recs[0])}: non-finite value in the input of "
                f"rank(s) {bad} (first non-finite {what}); halting every rank",
                bad,
                show=False,
            )
        dtype = CODE_DTYPE.get(recs[0][R.DTYPE])
        held = [NONFINITE_ID] if dtype is not None and dtype.is_floating_point else []
        kind = _KIND_OF[recs[0][R.KIND]]
        if contract.replicated:
            differ, listing = minority([r[R.DIGEST] for r in recs])
            if differ:
                self.fail(
                    f"{contract.id} violated at {_where(recs[0])}: ranks hold different outputs "
                    f"(output {HASH_NAME} by ranks: {listing}); rank(s) {differ} differ",
                    differ,
                )
        if dtype is None or not all_flags & R.PROJECTED:
            return [*held, contract.id]  # the hash only (non-linear op): it held
        for s in range(contract.slots(len(recs))):
            at = R.slot_at(contract, s)
            detail = self._checksum(dtype, kind, recs, at, any_flags)
            if detail:
                holders = [i for i, r in enumerate(recs) if r[at + R.HAS_OUT]]
                whose = "the output" if contract.replicated else f"rank(s) {holders}' output"
                slot = f" (slot {s})" if contract.scattered else ""
                self.fail(
                    f"{contract.id} violated at {_where(recs[0])}: {whose}{slot} is not the "
                    f"{kind.name} of the inputs ({detail})",
                    holders,
                )
        return [*held, contract.id]

    def _checksum(
        self, dtype: torch.dtype, kind: Kind, recs: list[list[int]], at: int, any_flags: int
    ) -> str:
        """How a slot's output projections (summed over the ranks) miss its inputs'
        ("": they don't). ``any_flags``: the OR of the ranks' record flags."""
        ks = range(R.PROJECTIONS)
        n = len(recs)
        if dtype in INT_DTYPES:
            mask = (1 << _INT_BITS[dtype]) - 1
            diffs = [sum(r[at + R.S_OUT + k] - r[at + R.S_IN + k] for r in recs) & mask for k in ks]
            return f"exact checksums modulo 2^{_INT_BITS[dtype]} differ" if any(diffs) else ""
        if any_flags & R.OUT_NONFINITE:
            # Finite inputs, non-finite output: the sum overflowed the dtype (IEEE
            # behaviour, e.g. float16); a replicated output's hash still applies.
            return ""
        f = (
            1.0 / n
            if kind is Kind.AVG
            else R.i2f(recs[0][R.FACTOR])
            if kind is Kind.PREMUL_SUM
            else 1.0
        )
        # Each rank's slot fields as floats in one conversion (S_IN, NORM, S_OUT
        # are adjacent); the sums are the same fsums, over the same values in the
        # same order, as one i2f per field.
        # by_field[j]: field j of every rank, in rank order (one zip, no generator
        # per sum): the fsums are over the same values in the same order.
        by_field = list(zip(*map(R.slot_floats, recs, itertools.repeat(at, n)), strict=True))
        got = [math.fsum(by_field[R.S_OUT + k]) for k in ks]
        expected = [f * math.fsum(by_field[R.S_IN + k]) for k in ks]
        tau = self.tolerance + (n + 1) * ROUNDOFF[dtype]
        bound = tau * abs(f) * math.fsum(by_field[R.NORM])
        for k in ks:
            if not abs(got[k] - expected[k]) <= bound:
                break
        else:
            return ""
        return (
            f"checksums r.y = {[float(f'{g:.6g}') for g in got]}, expected "
            f"{[float(f'{e:.6g}') for e in expected]} +- {bound:.3g}"
        )

    # ------------------------------------------------------------ copies

    def _copied(self, contract: Contract, recs: list[list[int]]) -> list[str]:
        wrong: list[str] = []
        offenders: list[int] = []
        for q, rec in enumerate(recs):
            for p in range(len(recs)):
                got = R.slot_at(contract, p)
                if not rec[got + R.HAS_RECV]:
                    continue
                sent = R.slot_at(contract, q if contract.keyed else 0)
                if (
                    not recs[p][sent + R.HAS_IN]
                    or recs[p][sent + R.IN_HASH] != rec[got + R.RECV_HASH]
                ):
                    wrong.append(f"rank {q}'s slot from rank {p}")
                    if q not in offenders:
                        offenders.append(q)
        if wrong:
            self.fail(
                f"{contract.id} violated at {_where(recs[0])}: {', '.join(wrong)} differ(s) "
                f"from what was sent ({HASH_NAME})",
                offenders,
            )
        return [contract.id]


_CONTRACT_OF = {int(op): c for op, c in CONTRACTS.items()}  # by a record's OPCODE field
_KIND_OF = {int(k): k for k in Kind}


def _where(rec: list[int]) -> str:
    name = op_name(OpCode(rec[R.OPCODE]))
    dtype = CODE_DTYPE.get(rec[R.DTYPE])
    dt = str(dtype).removeprefix("torch.") if dtype is not None else "-"
    unit = "bucket" if rec[R.OPCODE] == int(OpCode.ALLREDUCE) else name
    return (
        f"{name} #{rec[R.SEQ]} ({unit} {rec[R.BUCKET]} of optimizer step {rec[R.STEP]}; "
        f"{rec[R.NUMEL]} x {dt})"
    )


def minority(values: Sequence[int]) -> tuple[list[int], str]:
    """Ranks that disagree with the majority value (all ranks if there is no strict majority)."""
    if values.count(values[0]) == len(values):  # the common case, without a Counter
        return [], ""
    counts = Counter(values)
    top, top_n = counts.most_common(1)[0]
    ties = [v for v, c in counts.items() if c == top_n]
    by_value = ", ".join(
        f"{[i for i, v in enumerate(values) if v == val]}: {val & (2**64 - 1):016x}"
        for val in counts
    )
    if len(ties) > 1:
        return list(range(len(values))), by_value
    return [i for i, v in enumerate(values) if v != top], by_value

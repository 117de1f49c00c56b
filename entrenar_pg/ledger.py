"""Check and compare run ledgers (``ENTRENAR_LEDGER``; the format: ledger_writer.py).

    python -m entrenar_pg.ledger verify PATH [--checkpoint FILE]
    python -m entrenar_pg.ledger diff A B

``verify`` checks every line's own hash and its link to the line before (the
first broken line is named), and with ``--checkpoint`` that the checkpoint's
weights hash to what the ledger recorded at the checkpoint's step. A
checkpoint is a plain ``torch.save`` of a dict holding ``step`` (optimizer
steps done) and ``ledger_parameters`` (the optimizer's parameters in its
order: ``ledger_writer.checkpoint_parameters(optimizer)``; the trainer's
checkpoints hold both). ``diff`` names the first step at which two runs hold
different parameters. Exit status: 0 when it holds, 1 when it does not, 2 on
unreadable input.

A step that appears more than once (a run resumed from a checkpoint older
than its ledger's end redoes steps) counts by its last line, as the run
continued from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .ledger_writer import GENESIS, HASH_NAME, line_hash, parameter_hash

OK, FAILED, UNREADABLE = 0, 1, 2


class LedgerError(Exception):
    """A ledger or checkpoint that cannot be read at all (exit status 2)."""


@dataclass(frozen=True)
class Line:
    number: int  # 1-based line number in the file
    fields: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.fields["step"])

    @property
    def param_hash(self) -> str:
        return str(self.fields["param_hash"])


def read_lines(path: Path) -> list[Line]:
    """The ledger's lines, parsed; a line that is not a JSON object with the fields: LedgerError."""
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise LedgerError(f"{path}: cannot read the ledger: {e}") from None
    lines = []
    for i, raw in enumerate(text.splitlines(), 1):
        try:
            fields = json.loads(raw)
        except ValueError as e:
            raise LedgerError(f"{path}: line {i} is not JSON ({e})") from None
        if not isinstance(fields, dict):
            raise LedgerError(f"{path}: line {i} is not a JSON object")
        missing = [k for k in ("step", "param_hash", "prev", "hash") if k not in fields]
        if missing:
            raise LedgerError(f"{path}: line {i} is not a ledger line (missing {missing})")
        lines.append(Line(i, fields))
    if not lines:
        raise LedgerError(f"{path}: the ledger is empty")
    return lines


def chain_errors(lines: list[Line]) -> str | None:
    """Why the chain breaks, naming the first broken line; None when it holds."""
    prev = GENESIS
    for line in lines:
        own = line_hash(line.fields)
        if line.fields["hash"] != own:
            return (
                f"line {line.number} (step {line.fields['step']}) was altered: its hash "
                f"{str(line.fields['hash'])[:16]}... is not the {HASH_NAME} of its fields "
                f"({own[:16]}...)"
            )
        if line.fields["prev"] != prev:
            before = "the genesis value" if line.number == 1 else f"line {line.number - 1}'s hash"
            return (
                f"line {line.number} (step {line.fields['step']}) does not chain to "
                f"{before}: its prev is {str(line.fields['prev'])[:16]}..., expected "
                f"{prev[:16]}... (a line before it was changed, removed or inserted)"
            )
        prev = own
    return None


def by_step(lines: list[Line]) -> dict[int, Line]:
    """Each step's last line (a resumed run's redone steps replace the earlier ones)."""
    return {line.step: line for line in lines}


def read_checkpoint(path: Path) -> tuple[int, str]:
    """(step, parameter hash) of a checkpoint holding ``step`` and ``ledger_parameters``."""
    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a bad file
        raise LedgerError(f"{path}: cannot load the checkpoint: {e}") from None
    if not isinstance(payload, dict):
        raise LedgerError(f"{path}: not a dict checkpoint (a {type(payload).__name__})")
    step, params = payload.get("step"), payload.get("ledger_parameters")
    if not isinstance(step, int) or isinstance(step, bool):
        raise LedgerError(f"{path}: no integer 'step' (optimizer steps done) in the checkpoint")
    if not isinstance(params, (list, tuple)) or not all(
        isinstance(t, torch.Tensor) for t in params
    ):
        raise LedgerError(
            f"{path}: no 'ledger_parameters' list of tensors in the checkpoint (save "
            "entrenar_pg.ledger_writer.checkpoint_parameters(optimizer) under that key)"
        )
    return step, parameter_hash(params)[0]


def verify(path: Path, checkpoint: Path | None) -> tuple[int, str]:
    lines = read_lines(path)
    broken = chain_errors(lines)
    if broken is not None:
        return FAILED, f"{path}: chain broken: {broken}"
    steps = by_step(lines)
    span = f"steps {min(steps)}..{max(steps)}"
    message = f"{path}: chain intact over {len(lines)} lines ({span})"
    if checkpoint is None:
        return OK, message
    step, got = read_checkpoint(checkpoint)
    line = steps.get(step)
    if line is None:
        return FAILED, f"{checkpoint}: step {step} is not in the ledger ({span})"
    if line.param_hash != got:
        return FAILED, (
            f"{checkpoint}: its weights do not match the ledger at step {step} (line "
            f"{line.number}): {HASH_NAME} {got[:16]}..., the ledger recorded "
            f"{line.param_hash[:16]}..."
        )
    return OK, f"{message}; {checkpoint} matches step {step} (line {line.number})"


def diff(a: Path, b: Path) -> tuple[int, str]:
    steps_a, steps_b = by_step(read_lines(a)), by_step(read_lines(b))
    common = sorted(steps_a.keys() & steps_b.keys())
    if not common:
        return FAILED, f"{a} and {b} have no step in common"
    for step in common:
        la, lb = steps_a[step], steps_b[step]
        if la.param_hash != lb.param_hash:
            return FAILED, (
                f"the runs differ first at step {step}: {a} line {la.number} (world size "
                f"{la.fields.get('world_size')}) {la.param_hash[:16]}..., {b} line "
                f"{lb.number} (world size {lb.fields.get('world_size')}) {lb.param_hash[:16]}..."
            )
    return OK, (
        f"the runs agree over {len(common)} common steps ({common[0]}..{common[-1]}; "
        f"world sizes {steps_a[common[-1]].fields.get('world_size')} and "
        f"{steps_b[common[-1]].fields.get('world_size')})"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m entrenar_pg.ledger",
        description="Check and compare entrenar run ledgers (ENTRENAR_LEDGER).",
        epilog="Exit status: 0 it holds, 1 it does not, 2 unreadable input.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check the hash chain (and a checkpoint against it)")
    v.add_argument("path", type=Path, help="the ledger (JSONL)")
    v.add_argument(
        "--checkpoint",
        type=Path,
        help="a torch checkpoint with 'step' and 'ledger_parameters': must match its step",
    )
    d = sub.add_parser("diff", help="the first step at which two runs differ")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "verify":
            status, message = verify(args.path, args.checkpoint)
        else:
            status, message = diff(args.a, args.b)
    except LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return UNREADABLE
    print(message if status == OK else f"FAILED: {message}", file=sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())

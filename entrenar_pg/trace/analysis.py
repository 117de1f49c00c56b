"""What went wrong, from the ranks' flight-recorder dumps: the analysis behind
``python -m entrenar_pg.trace DIR`` (``cli.py``) and its picture (``picture.py``).

Reads every ``<prefix><rank>`` dump in DIR (the files entrenar writes on a
break with ``TORCH_FR_DUMP_ON_TIMEOUT``, or ``dump_flight_recorder()``) and,
per process group, says:

- the first collective where the ranks disagree (its seq, and each rank's
  op, sizes and dtypes), and which ranks are the odd ones out;
- the first collective no rank completed: who joined it, which ranks never
  issued it (their records stop before it, at a completed call), which were
  still in an earlier call when the group broke, and the rank everyone was
  waiting on;
- p2p ops still pending.

It also runs torch's own analyzer (``torch.distributed.flight_recorder``'s
``build_db``) on the same records and adds what it found. That analyzer (2.13)
accepts only the operation prefixes of the backends it knows (nccl, gloo,
xccl, ...), so its copy of our records is renamed ``gloo:`` in memory, at
read time; the dumps themselves say ``entrenar:``. Output: a short report,
or ``--json``.

Dumps are pickles: read only dumps you trust (as torch's own tool does).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ..flight_recorder import BACKEND, COMPLETED

_RANK_SUFFIX = re.compile(r"^(.*?)(\d+)$")
# Why a rank has no record of a collective its peers recorded (``why_absent``)
NEVER_ISSUED = "never issued"  # its last call had completed: it went on doing something else
NOT_REACHED = "not reached"  # still in an earlier call when the group broke
NOT_RECORDED = "not recorded"  # older than the oldest record its ring kept
# Ops whose sizes legitimately differ between ranks (rooted or uneven):
# which of (input sizes, output sizes) are compared across ranks.
_COMPARED_SIZES = {
    "gather": (True, False),  # only the root has outputs
    "scatter": (False, True),  # only the root has inputs
    "all_to_all": (False, False),  # uneven splits
}


@dataclass
class Call:
    """One rank's record of one collective, as the report shows it."""

    op: str
    input_sizes: list[Any]
    input_dtypes: list[str]
    output_sizes: list[Any]
    output_dtypes: list[str]
    state: str

    def signature(self) -> tuple[str, str, str]:
        ins, outs = _COMPARED_SIZES.get(self.op, (True, True))
        sizes = (self.input_sizes if ins else None, self.output_sizes if outs else None)
        dtypes = sorted(set(self.input_dtypes) | set(self.output_dtypes))
        return self.op, repr(sizes), repr(dtypes)

    def describe(self) -> str:
        dtypes = ",".join(sorted(set(self.input_dtypes) | set(self.output_dtypes))) or "-"
        return f"{self.op} in={self.input_sizes} out={self.output_sizes} {dtypes}"


@dataclass
class GroupReport:
    """What went wrong in one process group."""

    group: str
    desc: str
    ranks: list[int]
    dumped: list[int]
    no_dump: list[int]
    first_mismatch: dict[str, Any] | None = None
    first_incomplete: dict[str, Any] | None = None
    waiting_on: list[int] = field(default_factory=list)
    waiting_on_source: str = ""
    culprits: dict[int, Any] = field(default_factory=dict)  # rank -> culprit its error names
    failures: dict[int, Any] = field(default_factory=dict)
    pending_p2p: dict[int, list[str]] = field(default_factory=dict)
    torch_analyzer: list[dict[str, Any]] | str = field(default_factory=list)


# ---------------------------------------------------------------------- loading


def load_dir(directory: str, prefix: str | None = None) -> dict[int, dict[str, Any]]:
    """Every dump in ``directory`` by the rank its file name ends with (torch's naming)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory}: not a directory")
    found: dict[str, dict[int, str]] = {}
    for name in sorted(os.listdir(directory)):
        m = _RANK_SUFFIX.match(name)
        if m is None or (prefix is not None and m.group(1) != prefix):
            continue
        found.setdefault(m.group(1), {})[int(m.group(2))] = os.path.join(directory, name)
    if not found:
        raise FileNotFoundError(f"{directory}: no dump files (<prefix><rank>)")
    if len(found) > 1:
        raise ValueError(f"{directory}: dumps with several prefixes {sorted(found)}: pass --prefix")
    dumps = {}
    for rank, path in next(iter(found.values())).items():
        with open(path, "rb") as f:
            dumps[rank] = pickle.load(f)
    return dumps


# ---------------------------------------------------------------------- analysis


def call_of(entry: dict[str, Any]) -> Call:
    op = entry["profiling_name"].split(":", 1)[-1]
    return Call(
        op,
        entry["input_sizes"],
        entry["input_dtypes"],
        entry["output_sizes"],
        entry["output_dtypes"],
        entry["state"],
    )


def diagnose(dumps: dict[int, dict[str, Any]]) -> list[GroupReport]:
    """One report per process group found in the dumps."""
    groups: dict[str, dict[str, Any]] = {}
    for dump in dumps.values():
        for name, cfg in dump["pg_config"].items():
            groups.setdefault(name, cfg)
    return [_diagnose_group(name, cfg, dumps) for name, cfg in sorted(groups.items())]


def _diagnose_group(name: str, cfg: dict[str, Any], dumps: dict[int, Any]) -> GroupReport:
    ranks = [int(r) for r in json.loads(cfg["ranks"])]
    dumped = sorted(r for r in ranks if r in dumps and name in dumps[r]["pg_config"])
    no_dump = [r for r in ranks if r not in dumped]
    rep = GroupReport(name, cfg.get("desc", ""), ranks, dumped, no_dump)
    calls: dict[int, dict[int, Call]] = {}
    for r in dumped:
        mine: dict[int, Call] = {}
        for e in group_entries(dumps[r], name):
            if e["is_p2p"]:
                if e["state"] != COMPLETED:
                    rep.pending_p2p.setdefault(r, []).append(
                        f"{e['profiling_name']} p2p#{e['p2p_seq_id']} {e['state']}"
                    )
                continue
            mine[e["collective_seq_id"]] = call_of(e)
        calls[r] = mine
        failure = dumps[r].get(BACKEND, {}).get("failures", {}).get(name)
        if failure is not None:
            rep.failures[r] = failure
            if failure.get("culprit") is not None:
                rep.culprits[r] = failure["culprit"]
    seqs = sorted({s for mine in calls.values() for s in mine})
    # records older than the latest first record of any rank were dropped by
    # some ring: compare only where every dumped rank still has its records
    start = max((min(mine) for mine in calls.values() if mine), default=0)
    for s in seqs:
        if s < start:
            continue
        here = {r: calls[r][s] for r in dumped if s in calls[r]}
        if rep.first_mismatch is None and len({c.signature() for c in here.values()}) > 1:
            rep.first_mismatch = _mismatch(s, here)
            # ranks with no record of it (they failed before issuing it)
            rep.first_mismatch["absent"] = _absent(rep, s, calls)
        # Never issued it: its last call before it had completed (it went on
        # doing something else). A rank whose last call had not completed
        # was interrupted there by the failure: it did not get as far.
        never = [r for r in dumped if why_absent(calls[r], s) == NEVER_ISSUED]
        behind = [r for r in dumped if why_absent(calls[r], s) == NOT_REACHED]
        # Completed by any rank means every rank took part (no rank completes
        # before every peer's header arrived: the header rule). A rank that
        # did not complete it then was interrupted by a later failure.
        completed = any(c.state == COMPLETED for c in here.values())
        if rep.first_incomplete is None and here and not completed:
            rep.first_incomplete = {
                "seq": s,
                "op": Counter(c.op for c in here.values()).most_common(1)[0][0],
                "joined": {r: c.state for r, c in sorted(here.items())},
                "never_joined": never,
                "interrupted_before": behind,
                "no_dump": rep.no_dump,
            }
    _who_was_waited_on(rep)
    rep.torch_analyzer = torch_analysis(dumps, name)
    return rep


def group_entries(dump: dict[str, Any], group: str) -> list[dict[str, Any]]:
    """One rank's records (collectives and p2p) of ``group``, oldest first."""
    return [e for e in dump["entries"] if e["process_group"][0] == group]


def why_absent(mine: dict[int, Call], seq: int) -> str | None:
    """Why a rank whose collectives by seq are ``mine`` has no record of ``seq``
    (None: it has one). After its last call: if that call had completed it
    went on doing something else and never issued ``seq``; if not, the
    failure interrupted it there, before ``seq``."""
    if seq in mine:
        return None
    if not mine or seq < min(mine):
        return NOT_RECORDED if mine else NEVER_ISSUED
    last = max(mine)
    if seq < last:
        return NOT_RECORDED
    return NEVER_ISSUED if mine[last].state == COMPLETED else NOT_REACHED


def _mismatch(seq: int, here: dict[int, Call]) -> dict[str, Any]:
    by_sig: dict[tuple[str, str, str], list[int]] = {}
    for r, c in sorted(here.items()):
        by_sig.setdefault(c.signature(), []).append(r)
    sizes = sorted((len(rs) for rs in by_sig.values()), reverse=True)
    odd: list[int] = []
    if len(sizes) > 1 and sizes[0] > sizes[1]:  # a majority: the others are the odd ones
        majority = max(by_sig.values(), key=len)
        odd = sorted(r for r in here if r not in majority)
    return {
        "seq": seq,
        "calls": {r: asdict(c) for r, c in sorted(here.items())},
        "odd_ranks": odd,
    }


def _absent(rep: GroupReport, seq: int, calls: dict[int, dict[int, Call]]) -> list[int]:
    return [r for r in rep.dumped if seq not in calls[r]]


def _who_was_waited_on(rep: GroupReport) -> None:
    """The rank(s) the others waited on, from the strongest evidence there is:
    the odd ones out of a disagreement, then ranks whose own records show they
    never issued the stuck collective, then the culprit every rank's error
    names, then ranks that left no dump."""
    mm = rep.first_mismatch
    stuck = rep.first_incomplete
    named = {int(c) for c in rep.culprits.values()}
    if mm is not None and mm["odd_ranks"]:
        rep.waiting_on = list(mm["odd_ranks"])
        rep.waiting_on_source = f"called something else at #{mm['seq']}"
    elif stuck is not None and stuck["never_joined"]:
        rep.waiting_on = list(stuck["never_joined"])
        rep.waiting_on_source = f"never issued #{stuck['seq']}"
    elif len(named) == 1:
        rep.waiting_on = sorted(named)
        rep.waiting_on_source = "named by every failed rank's error"
    elif stuck is not None and stuck["no_dump"]:
        rep.waiting_on = list(stuck["no_dump"])
        rep.waiting_on_source = "left no dump"


# ---------------------------------------------------------------------- torch's analyzer


def torch_analysis(dumps: dict[int, dict[str, Any]], group: str) -> list[dict[str, Any]] | str:
    """What ``torch.distributed.flight_recorder``'s analyzer finds in ``group``'s records.

    Its 2.13 ``Op`` accepts only known backend prefixes, so a copy of the
    records is renamed ``gloo:`` here (never in the dumps); ops outside its
    vocabulary (the contract checker's) are left out.
    """
    fr_log = logging.getLogger("Flight Recorder")
    was = fr_log.disabled
    fr_log.disabled = True  # it logs every step at INFO (and a missing tabulate) to stderr
    try:
        from torch.distributed.flight_recorder.components.builder import build_db
    except ImportError as e:  # pragma: no cover - torch without the analyzer
        return f"unavailable: {e}"
    finally:
        fr_log.disabled = was
    details = {}
    for rank, dump in dumps.items():
        if group not in dump["pg_config"]:
            continue
        entries = []
        for entry in dump["entries"]:
            # p2p entries are left out: its pairing takes a p2p seq equal to a
            # collective seq for one coalesced group (NCCL's batching), and fails
            name = entry["profiling_name"]
            if entry["process_group"][0] != group or entry["is_p2p"] or "contract_check" in name:
                continue
            entry = dict(entry, profiling_name="gloo:" + name.split(":", 1)[-1])
            entries.append(entry)
        details[str(rank)] = {
            "rank": rank,
            "entries": entries,
            "version": dump["version"],
            "pg_config": {group: dump["pg_config"][group]},
        }
    args = argparse.Namespace(
        verbose=False,
        just_print_entries=False,
        allow_incomplete_ranks=True,
        mismatch_cap=10,
        selected_ranks=None,
        pg_filters=None,
        print_stack_trace=False,
    )
    fr_log.disabled = True
    try:
        db = build_db(details, args, next(iter(details.values()))["version"])
    except Exception as e:  # its assertions on records it cannot pair
        return f"failed: {type(e).__name__}: {e}"
    finally:
        fr_log.disabled = was
    found = []
    for c in db.collectives:
        if c.pass_check:
            continue
        mismatches = {r: str(m.type_of_mismatch) for r, m in (c.mismatch_collectives or {}).items()}
        found.append(
            {
                "seq": c.collective_seq_id,
                "op": c.collective_name.split(":", 1)[-1],
                "missing_ranks": sorted(c.missing_ranks or ()),
                "mismatches": mismatches,
            }
        )
    return found


# ---------------------------------------------------------------------- output


def verdict(rep: GroupReport) -> str:
    """The one-line answer for a group: whom everyone waited on, or why no rank is named."""
    if rep.waiting_on:
        return f"everyone was waiting on: rank(s) {rep.waiting_on} ({rep.waiting_on_source})"
    if rep.first_mismatch is not None:
        return (
            f"the ranks disagree at collective #{rep.first_mismatch['seq']} with no majority:"
            " cannot tell which side is wrong"
        )
    if rep.first_incomplete is not None:
        return f"collective #{rep.first_incomplete['seq']} was not completed; no rank stands out"
    return "every recorded collective completed on every rank"


def report_text(reports: list[GroupReport]) -> str:
    lines = []
    for rep in reports:
        desc = f" ({rep.desc})" if rep.desc and rep.desc != "undefined" else ""
        lines.append(f"process group {rep.group}{desc}: ranks {rep.ranks}")
        if rep.no_dump:
            lines.append(f"  no dump from rank(s) {rep.no_dump} (dead, stalled, or not recording)")
        mm = rep.first_mismatch
        if mm is not None:
            lines.append(f"  first disagreement: collective #{mm['seq']}")
            for r, c in mm["calls"].items():
                call = Call(**c)
                lines.append(f"    rank {r}: {call.describe()} [{call.state}]")
            if mm["odd_ranks"]:
                lines.append(f"    odd one(s) out: rank(s) {mm['odd_ranks']}")
            else:
                lines.append("    no majority: cannot tell which side is wrong")
            if mm["absent"] or rep.no_dump:
                absent = sorted(set(mm["absent"]) | set(rep.no_dump))
                lines.append(f"    no record of it from rank(s) {absent}")
        stuck = rep.first_incomplete
        if stuck is not None:
            lines.append(f"  first collective not completed: {stuck['op']} #{stuck['seq']}")
            joined = ", ".join(f"rank {r} {st}" for r, st in stuck["joined"].items())
            lines.append(f"    joined: {joined or 'none'}")
            if stuck["never_joined"]:
                lines.append(f"    never joined: rank(s) {stuck['never_joined']}")
            if stuck["interrupted_before"]:
                lines.append(
                    f"    still in an earlier call when the group broke: "
                    f"rank(s) {stuck['interrupted_before']}"
                )
        elif mm is None:
            lines.append("  every recorded collective completed on every rank")
        if rep.waiting_on:
            lines.append(f"  {verdict(rep)}")
        for r, f in sorted(rep.failures.items()):
            lines.append(f"  rank {r} failed at {f['at']}: {f['error_class']}: {f['message']}")
        for r, ops in sorted(rep.pending_p2p.items()):
            lines.append(f"  rank {r} p2p still pending: {'; '.join(ops)}")
        ta = rep.torch_analyzer
        if isinstance(ta, str):
            lines.append(f"  torch's analyzer: {ta}")
        elif ta:
            first = ta[0]
            lines.append(
                f"  torch's analyzer: {first['op']} #{first['seq']} fails its check"
                f" (missing ranks {first['missing_ranks']}, mismatches {first['mismatches']})"
            )
    return "\n".join(lines)

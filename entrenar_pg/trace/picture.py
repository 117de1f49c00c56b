"""A picture of a hang: ``python -m entrenar_pg.trace DIR --html OUT.html``.

One self-contained HTML page (inline SVG and CSS: no script, nothing fetched)
per set of dumps. For each process group: one lane per rank, one box per
collective by seq, coloured by how far that rank got with it (completed,
started, scheduled, or no record: never issued, not reached, not recorded),
the p2p ops a rank issued after a collective as a tag under its box, the lane
of the rank everyone waited on and the first disagreement marked, and
``trace``'s verdict on top. Every box has a tooltip (an SVG ``<title>``) with
the call's op, sizes, dtypes, state and times.

What is marked comes from ``trace``'s analysis (``GroupReport``: its
``waiting_on``, ``first_mismatch``, ``first_incomplete``; ``why_absent`` for a
missing record); this module only lays it out. Long rings are cut to a
window around the first mismatch or stuck collective, saying how many
collectives were left out on each side.

Boxes and lanes carry ``data-rank``, ``data-seq`` and ``data-state``
attributes, so a test (or a script) can read the picture back.
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..flight_recorder import BACKEND, COMPLETED, SCHEDULED, STARTED
from .analysis import (
    NEVER_ISSUED,
    NOT_REACHED,
    NOT_RECORDED,
    Call,
    GroupReport,
    call_of,
    group_entries,
    report_text,
    verdict,
    why_absent,
)

# Collectives shown around the focus (the first mismatch or stuck one);
# the rest are counted, not drawn.
BEFORE = 6
AFTER = 3
NO_DUMP = "no dump"

# What each state means, for the legend and the tooltips.
MEANING = {
    COMPLETED: "completed on this rank",
    STARTED: "started, not completed",
    SCHEDULED: "issued, not started",
    NEVER_ISSUED: "never issued: its previous call had completed, it went on elsewhere",
    NOT_REACHED: "not reached: still in an earlier call when the group broke",
    NOT_RECORDED: "not recorded: older than its ring's oldest record",
    NO_DUMP: "no dump from this rank (dead, stopped before dumping, or not recording)",
}

# Geometry (px)
LABEL_W = 230
ELIDED_W = 86
BOX_W = 118
BOX_H = 52
GAP = 10
LANE_H = 80
HEADER_H = 58
P2P_H = 13

STYLE = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
       margin: 20px 28px; color: #212121; background: #fff; }
h1 { font-size: 20px; margin: 0 0 10px; }
h2 { font-size: 16px; margin: 22px 0 6px; }
.verdict { font-size: 17px; font-weight: 600; padding: 8px 12px; margin: 6px 0;
           border-left: 6px solid #2e7d32; background: #e8f5e9; }
.verdict.unsure { border-left-color: #e65100; background: #fff3e0; }
.verdict.blame { border-left-color: #c62828; background: #ffebee; color: #7f0000; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 18px; margin: 10px 0 4px; font-size: 13px; }
.legend span.sw { display: inline-block; width: 22px; height: 14px; vertical-align: -2px;
                  margin-right: 6px; border: 2px solid; box-sizing: border-box; }
.chart { overflow-x: auto; }
pre { background: #f5f5f5; padding: 10px; font-size: 12px; white-space: pre-wrap; }
svg text { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; }
.box rect.cell { stroke-width: 2; }
.box text { font-size: 11px; fill: #212121; }
.box text.seq { font-weight: 700; }
.box text.why { font-weight: 700; }
.box.mismatch rect.cell { stroke: #b71c1c; stroke-width: 4; }
.box text.badge { font-size: 18px; font-weight: 700; fill: #fff; text-anchor: middle; }
.box.mismatch text.size { fill: #b71c1c; font-weight: 700; }
.lane rect.bg { fill: #fafafa; stroke: #e0e0e0; }
.lane.culprit rect.bg { fill: #ffebee; stroke: #c62828; stroke-width: 2; }
.lane text.name { font-size: 15px; font-weight: 700; }
.lane.culprit text.name { fill: #b71c1c; }
.lane text.note { font-size: 11px; fill: #616161; }
.lane.culprit text.note { fill: #b71c1c; font-weight: 600; }
.col text { font-size: 12px; fill: #424242; text-anchor: middle; }
.col text.mark { font-weight: 700; fill: #b71c1c; }
.col rect.band { fill: #fff8e1; }
.col.mismatch rect.band { fill: #fde0dc; }
.elided { font-size: 11px; fill: #757575; text-anchor: middle; }
.p2p text { font-size: 10px; fill: #424242; }
.nodump rect { stroke: #9e9e9e; stroke-dasharray: 6 4; }
.nodump text { font-size: 13px; fill: #424242; font-weight: 600; }
"""

# (fill, stroke, dash) of each state: the SVG's CSS and the legend's swatches
COLOURS = {
    COMPLETED: ("#c8e6c9", "#2e7d32", ""),
    STARTED: ("#ffcc80", "#e65100", ""),
    SCHEDULED: ("#bbdefb", "#1565c0", ""),
    NEVER_ISSUED: ("#ffffff", "#c62828", "6 4"),
    NOT_REACHED: ("#eeeeee", "#757575", "6 4"),
    NOT_RECORDED: ("#ffffff", "#bdbdbd", "2 3"),
}


def _slug(state: str) -> str:
    return state.replace(" ", "-")


def _state_css() -> str:
    rules = []
    for state, (fill, stroke, dash) in COLOURS.items():
        dashing = f" stroke-dasharray: {dash};" if dash else ""
        rules.append(f".s-{_slug(state)} rect.cell {{ fill: {fill}; stroke: {stroke};{dashing} }}")
        if state == NEVER_ISSUED:
            rules.append(f".s-{_slug(state)} text.why {{ fill: {stroke}; }}")
    return "\n".join(rules)


# ---------------------------------------------------------------------- the model


@dataclass
class Box:
    """One rank's record of one collective (or why it has none)."""

    rank: int
    seq: int
    state: str  # a recorded state, or NEVER_ISSUED / NOT_REACHED / NOT_RECORDED
    op: str
    call: Call | None
    entry: dict[str, Any] | None
    mismatch: bool = False
    p2p: list[dict[str, Any]] = field(default_factory=list)  # issued after this collective


@dataclass
class Lane:
    """One rank of the group."""

    rank: int
    dumped: bool
    culprit: bool
    note: list[str]  # lines under the rank's name
    detail: str  # its tooltip: the rank's error
    boxes: list[Box]
    time_dumped_ns: int | None


@dataclass
class Chart:
    """One process group's picture."""

    report: GroupReport
    seqs: list[int]  # the columns
    left_out_before: int
    left_out_after: int
    col_ops: dict[int, str]
    lanes: list[Lane]
    t0_ns: int  # the earliest record: times are shown from it


def build_chart(rep: GroupReport, dumps: dict[int, dict[str, Any]]) -> Chart:
    """Lay out ``rep``'s group from the dumps it was made from."""
    entries = {r: group_entries(dumps[r], rep.group) for r in rep.dumped}
    raw = {
        r: {e["collective_seq_id"]: e for e in mine if not e["is_p2p"]}
        for r, mine in entries.items()
    }
    calls = {r: {s: call_of(e) for s, e in mine.items()} for r, mine in raw.items()}
    seqs, before, after = _window(sorted({s for mine in calls.values() for s in mine}), rep)
    col_ops = {
        s: Counter(c[s].op for c in calls.values() if s in c).most_common(1)[0][0] for s in seqs
    }
    marked = _mismatched_boxes(rep)
    lanes = []
    for r in rep.ranks:
        failure = rep.failures.get(r)
        lane = Lane(
            r,
            r in calls,
            r in rep.waiting_on,
            _lane_note(rep, r, r in calls),
            "" if failure is None else f"{failure['error_class']}: {failure['message']}",
            [],
            None,
        )
        if r in calls:
            lane.boxes = [_box(r, s, calls[r], raw[r], col_ops[s], marked) for s in seqs]
            by_seq = {b.seq: b for b in lane.boxes}
            for e in entries[r]:  # a p2p op carries the seq of the collective before it
                if e["is_p2p"] and e["collective_seq_id"] in by_seq:
                    by_seq[e["collective_seq_id"]].p2p.append(e)
            lane.time_dumped_ns = dumps[r].get(BACKEND, {}).get("time_dumped_ns")
        lanes.append(lane)
    times = [e.get("time_created_ns") or 0 for mine in entries.values() for e in mine]
    return Chart(rep, seqs, before, after, col_ops, lanes, min(times, default=0))


def _box(
    rank: int,
    seq: int,
    calls: dict[int, Call],
    raw: dict[int, dict[str, Any]],
    col_op: str,
    marked: set[tuple[int, int]],
) -> Box:
    call = calls.get(seq)
    if call is None:
        return Box(rank, seq, str(why_absent(calls, seq)), col_op, None, None)
    return Box(rank, seq, call.state, call.op, call, raw[seq], (rank, seq) in marked)


def _lane_note(rep: GroupReport, rank: int, dumped: bool) -> list[str]:
    """Under a rank's name: why everyone waited on it, or the error it saw."""
    failure = rep.failures.get(rank)
    if rank in rep.waiting_on:
        lines = ["everyone waited on it:", rep.waiting_on_source]
    elif failure is not None:
        lines = [failure["error_class"], f"at {failure['at']}"]
    else:
        lines = []
    return lines if dumped else [*lines, NO_DUMP]


def _window(every_seq: list[int], rep: GroupReport) -> tuple[list[int], int, int]:
    """The seqs drawn: up to BEFORE before the focus and AFTER after it."""
    if not every_seq:
        return [], 0, 0
    marks = [m["seq"] for m in (rep.first_mismatch, rep.first_incomplete) if m is not None]
    focus = min(marks) if marks else every_seq[-1]
    i = every_seq.index(focus) if focus in every_seq else len(every_seq) - 1
    lo, hi = max(0, i - BEFORE), min(len(every_seq), i + AFTER + 1)
    return every_seq[lo:hi], lo, len(every_seq) - hi


def _mismatched_boxes(rep: GroupReport) -> set[tuple[int, int]]:
    """The (rank, seq) boxes marked at the first mismatch: the odd ones out,
    or, with no majority, every rank that has a call there."""
    mm = rep.first_mismatch
    if mm is None:
        return set()
    ranks = mm["odd_ranks"] or [int(r) for r in mm["calls"]]
    return {(r, mm["seq"]) for r in ranks}


# ---------------------------------------------------------------------- drawing


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _shape(sizes: list[Any]) -> str:
    if not sizes:
        return "no tensors"
    shapes = ["×".join(str(d) for d in s) or "scalar" for s in sizes]
    text = ",".join(shapes) if len(set(shapes)) > 1 else shapes[0]
    if len(shapes) > 1 and len(set(shapes)) == 1:
        text = f"{len(shapes)}×[{text}]"
    return text if len(text) <= 15 else text[:14] + "…"


def _fit(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


def _ms(ns: int | None, t0: int) -> str:
    return "-" if ns is None else f"+{(ns - t0) / 1e6:.1f} ms"


def _box_title(box: Box, lane: Lane, t0: int) -> str:
    if box.call is None or box.entry is None:
        return f"rank {box.rank}, collective #{box.seq} ({box.op}): {MEANING[box.state]}"
    c, e = box.call, box.entry
    lines = [
        f"rank {box.rank}, collective #{box.seq}: {c.op}",
        f"state: {c.state}",
        f"input sizes {c.input_sizes} {c.input_dtypes}",
        f"output sizes {c.output_sizes} {c.output_dtypes}",
        f"issued {_ms(e.get('time_created_ns'), t0)}, started "
        f"{_ms(e.get('time_discovered_started_ns'), t0)}, completed "
        f"{_ms(e.get('time_discovered_completed_ns'), t0)}",
    ]
    since = e.get("time_discovered_started_ns") or e.get("time_created_ns")
    if c.state != COMPLETED and lane.time_dumped_ns is not None and since is not None:
        lines.append(f"{c.state} for {(lane.time_dumped_ns - since) / 1e9:.2f} s when dumped")
    if box.mismatch:
        lines.append("FIRST MISMATCH: differs from the other ranks' call")
    frames = e.get("frames") or []
    user = frames[2:3] or frames[:1]  # torch.distributed's function, its wrapper, then the user's
    for f in user:
        lines.append(f"called from {f['name']} ({f['filename']}:{f['line']})")
    return "\n".join(lines)


def _draw_box(box: Box, lane: Lane, x: int, y: int, t0: int) -> list[str]:
    classes = f"box s-{_slug(box.state)}" + (" mismatch" if box.mismatch else "")
    out = [
        f'<g class="{classes}" data-rank="{box.rank}" data-seq="{box.seq}" '
        f'data-state="{_esc(box.state)}" data-op="{_esc(box.op)}">',
        f"<title>{_esc(_box_title(box, lane, t0))}</title>",
        f'<rect class="cell" x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="5"/>',
    ]
    tx, ty = x + 7, y + 15
    if box.call is not None:
        dtypes = ",".join(sorted(set(box.call.input_dtypes) | set(box.call.output_dtypes)))
        size = _shape(box.call.input_sizes or box.call.output_sizes)
        out += [
            f'<text class="seq" x="{tx}" y="{ty}">#{box.seq} '
            f'<tspan font-weight="400">{_esc(_fit(box.op, 13))}</tspan></text>',
            f'<text class="size" x="{tx}" y="{ty + 15}">{_esc(_fit(size + " " + dtypes, 17))}'
            "</text>",
            f'<text x="{tx}" y="{ty + 30}">{_esc(box.state)}</text>',
        ]
    else:
        out += [
            f'<text class="seq" x="{tx}" y="{ty}">#{box.seq}</text>',
            f'<text class="why" x="{tx}" y="{ty + 15}">{_esc(box.state)}</text>',
            f'<text x="{tx}" y="{ty + 30}" fill="#757575">({_esc(_fit(box.op, 15))})</text>',
        ]
    if box.mismatch:
        cx, cy = x + BOX_W - 14, y + 26
        out += [
            f'<circle cx="{cx}" cy="{cy}" r="11" fill="#b71c1c"/>',
            f'<text class="badge" x="{cx}" y="{cy + 6}">≠</text>',
        ]
    out.append("</g>")
    if box.p2p:
        out += _draw_p2p(box.p2p, x, y + BOX_H + 3)
    return out


def _draw_p2p(ops: list[dict[str, Any]], x: int, y: int) -> list[str]:
    pending = [e for e in ops if e["state"] != COMPLETED]
    fill = "#ffcc80" if pending else "#e0e0e0"
    names = [_p2p_name(e) for e in ops]
    text = f"+{len(ops)} p2p" + (f", {len(pending)} pending" if pending else "")
    return [
        f'<g class="p2p" data-pending="{len(pending)}"><title>{_esc(chr(10).join(names))}</title>',
        f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{P2P_H}" rx="3" fill="{fill}"/>',
        f'<text x="{x + 6}" y="{y + 10}">{_esc(text)}</text></g>',
    ]


def _p2p_name(entry: dict[str, Any]) -> str:
    return f"{entry['profiling_name'].split(':', 1)[-1]} p2p#{entry['p2p_seq_id']} {entry['state']}"


def _draw_chart(chart: Chart, index: int) -> str:
    rep = chart.report
    x0 = LABEL_W + (ELIDED_W if chart.left_out_before else 0)
    col_x = {s: x0 + j * (BOX_W + GAP) for j, s in enumerate(chart.seqs)}
    width = x0 + len(chart.seqs) * (BOX_W + GAP) + (ELIDED_W if chart.left_out_after else 0) + 30
    height = HEADER_H + len(chart.lanes) * LANE_H + 6
    mm = rep.first_mismatch["seq"] if rep.first_mismatch else None
    stuck = rep.first_incomplete["seq"] if rep.first_incomplete else None
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="lanes" data-group="{_esc(rep.group)}" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{_esc(verdict(rep))}">',
        f'<defs><pattern id="hatch{index}" width="10" height="10" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="10" height="10" fill="#f5f5f5"/>'
        '<line x1="0" y1="0" x2="0" y2="10" stroke="#bdbdbd" stroke-width="4"/></pattern></defs>',
    ]
    for i, lane in enumerate(chart.lanes):  # lanes' backgrounds and names first
        out += _draw_lane(lane, HEADER_H + i * LANE_H, width)
    for s in chart.seqs:  # then a band over the marked columns, and the headers
        marks = [m for m, at in (("first mismatch", mm), ("first not completed", stuck)) if at == s]
        cls = "col" + (" mismatch" if s == mm else "") + (" stuck" if s == stuck else "")
        cx = col_x[s] + BOX_W // 2
        out.append(f'<g class="{cls}" data-seq="{s}">')
        if marks:
            out.append(
                f'<rect class="band" x="{col_x[s] - GAP // 2}" y="2" width="{BOX_W + GAP}" '
                f'height="{height - 4}" rx="6"/>'
            )
            for k, mark in enumerate(marks):
                out.append(f'<text class="mark" x="{cx}" y="{16 + 15 * k}">{_esc(mark)}</text>')
        out.append(f'<text x="{cx}" y="{HEADER_H - 8}">#{s} {_esc(chart.col_ops[s])}</text></g>')
    if chart.left_out_before:
        out.append(_elided(LABEL_W + ELIDED_W // 2, chart.left_out_before, "earlier"))
    if chart.left_out_after:
        out.append(_elided(width - 30 - ELIDED_W // 2, chart.left_out_after, "later"))
    for i, lane in enumerate(chart.lanes):  # then the boxes, over the bands
        y = HEADER_H + i * LANE_H
        if not lane.dumped:
            band_w = max(len(chart.seqs), 1) * (BOX_W + GAP) - GAP
            out += [
                f'<g class="nodump" data-rank="{lane.rank}">',
                f"<title>{_esc(MEANING[NO_DUMP])}</title>",
                f'<rect x="{x0}" y="{y + 8}" width="{band_w}" height="{BOX_H}" rx="5" '
                f'fill="url(#hatch{index})"/>',
                f'<text x="{x0 + 12}" y="{y + 8 + BOX_H // 2 + 5}">no dump from rank {lane.rank}:'
                " dead, stopped before it could write one, or not recording</text></g>",
            ]
        for box in lane.boxes:
            out += _draw_box(box, lane, col_x[box.seq], y + 8, chart.t0_ns)
    out.append("</svg>")
    return "\n".join(out)


def _draw_lane(lane: Lane, y: int, width: int) -> list[str]:
    cls = "lane" + (" culprit" if lane.culprit else "") + ("" if lane.dumped else " no-dump")
    out = [
        f'<g class="{cls}" data-rank="{lane.rank}">',
        f'<rect class="bg" x="2" y="{y + 2}" width="{width - 4}" height="{LANE_H - 4}" rx="6"/>',
        f"<title>{_esc(lane.detail or f'rank {lane.rank}')}</title>",
        f'<text class="name" x="14" y="{y + 26}">{"▶ " if lane.culprit else ""}'
        f"rank {lane.rank}</text>",
    ]
    for k, line in enumerate(lane.note):
        out.append(f'<text class="note" x="14" y="{y + 44 + 14 * k}">{_esc(_fit(line, 36))}</text>')
    out.append("</g>")
    return out


def _elided(x: int, n: int, which: str) -> str:
    return (
        f'<text class="elided" x="{x}" y="{HEADER_H + 30}">… {n} {which}</text>'
        f'<text class="elided" x="{x}" y="{HEADER_H + 44}">collective{"s" if n > 1 else ""}</text>'
    )


def _legend() -> str:
    items = []
    for state, (fill, stroke, dash) in COLOURS.items():
        border = "dashed" if dash else "solid"
        items.append(
            f'<span title="{_esc(MEANING[state])}"><span class="sw" style="background:{fill};'
            f'border-color:{stroke};border-style:{border}"></span>{_esc(state)}</span>'
        )
    items.append(
        '<span><span class="sw" style="background:repeating-linear-gradient(45deg,#f5f5f5 0 4px,'
        '#bdbdbd 4px 7px);border-color:#9e9e9e;border-style:dashed"></span>no dump</span>'
    )
    items.append(
        '<span><span class="sw" style="background:#fff;border-color:#b71c1c;border-width:4px">'
        "</span>≠ first mismatch (the odd one out)</span>"
    )
    items.append(
        '<span><span class="sw" style="background:#ffebee;border-color:#c62828"></span>'
        "▶ the rank everyone waited on</span>"
    )
    return f'<div class="legend">{"".join(items)}</div>'


def render_html(
    reports: list[GroupReport], dumps: dict[int, dict[str, Any]], source: str = ""
) -> str:
    """The page for ``reports`` (``trace.diagnose(dumps)``) and the dumps they read."""
    title = f"entrenar flight recorder: {source}" if source else "entrenar flight recorder"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_esc(title)}</title>",
        f"<style>{STYLE}{_state_css()}</style></head><body>",
        f"<h1>{_esc(title)}</h1>",
    ]
    for rep in reports:
        broken = rep.first_mismatch is not None or rep.first_incomplete is not None
        blame = " blame" if rep.waiting_on else " unsure" if broken else ""
        parts.append(
            f'<p class="verdict{blame}" data-group="{_esc(rep.group)}" '
            f'data-waiting-on="{_esc(",".join(map(str, rep.waiting_on)))}">'
            f"{_esc(_group_name(rep))}: {_esc(verdict(rep))}</p>"
        )
    parts.append(_legend())
    for index, rep in enumerate(reports):
        chart = build_chart(rep, dumps)
        parts += [
            f'<section class="group" data-group="{_esc(rep.group)}">',
            f"<h2>{_esc(_group_name(rep))}: ranks {_esc(rep.ranks)}</h2>",
            f'<div class="chart">{_draw_chart(chart, index)}</div></section>',
        ]
    parts += [
        "<h2>The report</h2>",
        f"<pre>{_esc(report_text(reports))}</pre>",
        "<p>Hover a box for its call: op, sizes, dtypes, state and times.</p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _group_name(rep: GroupReport) -> str:
    desc = f" ({rep.desc})" if rep.desc and rep.desc != "undefined" else ""
    return f"process group {rep.group}{desc}"

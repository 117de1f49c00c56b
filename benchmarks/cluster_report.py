"""The emulated-cluster report: a table (text or markdown), a plot, the files under ``--out``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from benchmarks.config import GLOO
from benchmarks.report import _fmt_time, _render, write_result_files
from benchmarks.sizes import format_bytes

HEADER = [
    "size",
    "variant",
    "median",
    "min",
    "max",
    "busbw GB/s",
    "time/gloo",
    "xhost B/call/host",
    "bound",
    "xhost/bound",
    "sockets/rank",
    "ranks' CPU (cores)",
]


_TC_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")


def link_ceiling_GBps(meta: dict[str, Any]) -> float | None:
    """The most busbw a link-bound allreduce can show: every host link moving the
    bound 2(H-1)/H x S each way at the rate (tc's units: kbit = 1000 bits)."""
    m = _TC_RATE.match((meta["rate"] or "").lower())
    if m is None:
        return None
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}[m.group(2)]
    bytes_per_s = float(m.group(1)) * scale / 8
    hosts, world = meta["hosts"], meta["hosts"] * meta["local"]
    return bytes_per_s * (2 * (world - 1) / world) / (2 * (hosts - 1) / hosts) / 1e9


def _title(meta: dict[str, Any]) -> str:
    links = f"links {meta['rate']} each way" if meta["rate"] else "links unshaped"
    delay = f", delay {meta['delay']}" if meta["delay"] else ""
    return f"{meta['hosts']} hosts x {meta['local']} ranks, {links}{delay}"


def table(result: dict[str, Any], markdown: bool = False) -> list[str]:
    """One row per size and variant."""
    gloo = {r["bytes"]: r["median_s"] for r in result["rows"] if r["variant"] == GLOO}
    body = []
    for r in result["rows"]:
        ratio = r["median_s"] / gloo[r["bytes"]] if r["bytes"] in gloo else None
        body.append(
            [
                format_bytes(r["bytes"]),
                r["variant"],
                _fmt_time(r["median_s"]),
                _fmt_time(r["min_s"]),
                _fmt_time(r["max_s"]),
                f"{r['busbw_GBps']:.3f}",
                "-" if ratio is None else f"{ratio:.2f}",
                f"{r['xhost_bytes_per_host']:.0f}",
                f"{r['bound_bytes_per_host']:.0f}",
                f"{r['xhost_bytes_per_host'] / r['bound_bytes_per_host']:.3f}",
                f"{r['sockets_per_rank']:.1f}",
                "-" if r.get("job_cores") is None else f"{r['job_cores']:.2f}",
            ]
        )
    return _render(HEADER, body, markdown)


def report_lines(result: dict[str, Any], markdown: bool = False) -> list[str]:
    """The whole report: title, conditions, the table, the notes."""
    meta = result["meta"]
    m = meta["machine"]
    lines = [
        ("### " if markdown else "") + _title(meta),
        "",
        f"git {meta['git']}, {meta['started']}, {m['nproc']} CPUs ({m['cpu']}), "
        f"load average {meta['loadavg_start'][0]:.1f} at start, "
        f"{meta['loadavg_end'][0]:.1f} at end; {meta['elapsed_s']:.0f} s.",
        "",
    ]
    background = meta.get("background_cores")
    if background is not None:
        lines[-1:-1] = [
            f"Other processes took {background:.2f} of the {m['nproc']} cores during the timed "
            "blocks (per row: cluster.json's background_cores).",
        ]
    lines += table(result, markdown)
    lines.append("")
    ceiling = link_ceiling_GBps(meta)
    if ceiling is not None:
        lines.append(
            f"link-bound ceiling: busbw {ceiling:.3f} GB/s (every host link carrying the "
            f"bound each way at {meta['rate']})"
        )
    lines += [f"note: {n}" for n in meta["notes"]]
    return lines


def write_plot(result: dict[str, Any], out: Path) -> Path:
    """cluster.png: time / gloo, busbw, and cross-host bytes / bound, against size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    gloo = {r["bytes"]: r["median_s"] for r in rows if r["variant"] == GLOO}
    panels = (
        ("median time / gloo's", lambda r: r["median_s"] / gloo[r["bytes"]] if gloo else None),
        ("busbw (GB/s)", lambda r: r["busbw_GBps"]),
        (
            "cross-host bytes per host / bound",
            lambda r: r["xhost_bytes_per_host"] / r["bound_bytes_per_host"],
        ),
    )
    ceiling = link_ceiling_GBps(result["meta"])
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.5))
    for ax, (label, value) in zip(axes, panels, strict=True):
        for name in dict.fromkeys(r["variant"] for r in rows):
            pts = [(r["bytes"], value(r)) for r in rows if r["variant"] == name]
            pts = sorted(p for p in pts if p[1] is not None)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=name)
        if label.startswith("cross"):
            ax.axhline(1.0, color="black", ls="--", lw=0.8, label="bound 2(H-1)/H x S")
        if label.startswith("busbw") and ceiling is not None:
            ax.axhline(ceiling, color="black", ls="--", lw=0.8, label="link-bound ceiling")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"allreduce float32, {_title(result['meta'])}")
    fig.tight_layout()
    path = out / "cluster.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    """cluster.json, results.md and cluster.png under ``out``."""
    markdown = "\n".join(report_lines(result, markdown=True)) + "\n"
    jpath, mpath = write_result_files(result, out, "cluster.json", markdown)
    return [jpath, mpath, write_plot(result, out)]

"""The report: text and markdown tables, plots, and the files under ``--out``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.config import BASELINE, DEEPSPEED, GLOO, MPI_SHM, MPI_TCP, RAW
from benchmarks.goals import METHOD, SHM, TCP
from benchmarks.sizes import format_bytes


def _fmt_time(s: float) -> str:
    """Seconds as a short µs/ms/s string."""
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fmt_rounds(ratios: list[float] | None) -> str:
    """Round-by-round ratios as their median and range: "0.71 (0.52-1.08)"."""
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def allreduce_table(result: dict[str, Any], world: int, markdown: bool = False) -> list[str]:
    """Rows (size x variant, raw TCP and MPI included) of one world size as text lines."""
    header = [
        "size",
        "variant",
        "median",
        "min",
        "max",
        "n",
        "algbw GB/s",
        "busbw GB/s",
        "time/gloo",
        "busbw/gloo",
        "busbw/raw",
    ]
    body: list[list[str]] = []
    rows = [r for r in result["allreduce"] + result["mpi"] if r["world_size"] == world]
    raws = {r["size_bytes"]: r for r in result["raw_tcp"] if r["world_size"] == world}
    for size in sorted({r["size_bytes"] for r in rows}):
        for r in (x for x in rows if x["size_bytes"] == size):
            body.append(
                [
                    format_bytes(size),
                    r["variant"],
                    _fmt_time(r["median_s"]),
                    _fmt_time(r["min_s"]),
                    _fmt_time(r["max_s"]),
                    str(r["n"]),
                    f"{r['algbw_GBps']:.3f}",
                    f"{r['busbw_GBps']:.3f}",
                    _fmt_ratio(r.get("time_vs_gloo")),
                    _fmt_ratio(r.get("busbw_vs_gloo")),
                    _fmt_ratio(r.get("busbw_vs_raw")),
                ]
            )
        if size in raws:
            w = raws[size]
            body.append(
                [
                    format_bytes(size),
                    RAW,
                    _fmt_time(w["median_s"]),
                    _fmt_time(w["min_s"]),
                    _fmt_time(w["max_s"]),
                    str(w["n"]),
                    f"{w['GBps_each_way']:.3f}",
                    f"{w['GBps_each_way']:.3f}",
                    "-",
                    "-",
                    "1.00",
                ]
            )
    return _render(header, body, markdown)


def summary_tables(result: dict[str, Any], world: int, markdown: bool = False) -> list[str]:
    """Two compact size x variant tables: median time (x gloo) and busbw GB/s (x raw TCP)."""
    rows = [r for r in result["allreduce"] + result["mpi"] if r["world_size"] == world]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    cell = {(r["variant"], r["size_bytes"]): r for r in rows}
    raws = {r["size_bytes"]: r for r in result["raw_tcp"] if r["world_size"] == world}
    sizes = sorted({r["size_bytes"] for r in rows})
    t_body, b_body = [], []
    for size in sizes:
        t_row, b_row = [format_bytes(size)], [format_bytes(size)]
        for name in names:
            r = cell.get((name, size))
            if r is None:
                t_row.append("-")
                b_row.append("-")
                continue
            ratio = r.get("time_vs_gloo")
            extra = "" if name == GLOO or ratio is None else f" ({ratio:.2f}x)"
            t_row.append(_fmt_time(r["median_s"]) + extra)
            vs_raw = r.get("busbw_vs_raw")
            b_row.append(f"{r['busbw_GBps']:.3f}" + ("" if vs_raw is None else f" ({vs_raw:.2f})"))
        b_row.append(f"{raws[size]['GBps_each_way']:.3f}" if size in raws else "-")
        t_body.append(t_row)
        b_body.append(b_row)
    lines = [f"N={world} median time per allreduce (time / gloo):", ""]
    lines += _render(["size", *names], t_body, markdown)
    lines += ["", f"N={world} busbw GB/s (busbw / raw TCP each way):", ""]
    lines += _render(["size", *names, RAW], b_body, markdown)
    return lines


def ddp_table(result: dict[str, Any], markdown: bool = False) -> list[str]:
    """DDP step rows as text lines."""
    header = ["N", "variant", "step median", "min", "max", "n", "tokens/s", "step/gloo", "- floor"]
    body = [
        [
            str(r["world_size"]),
            r["variant"],
            _fmt_time(r["median_s"]),
            _fmt_time(r["min_s"]),
            _fmt_time(r["max_s"]),
            str(r["n"]),
            f"{r['tokens_per_s']:.0f}",
            _fmt_ratio(r["step_vs_gloo"]),
            "-" if r.get("above_floor_s") is None else _fmt_time(r["above_floor_s"]),
        ]
        for r in result["ddp"]
    ]
    return _render(header, body, markdown)


def _fmt_spread(ratios: list[float] | None) -> str:
    """``"0.97-1.04 (4)"``: the lowest and highest of the rounds' ratios, and how many."""
    if not ratios:
        return "-"
    return f"{min(ratios):.2f}-{max(ratios):.2f} ({len(ratios)})"


def baseline_table(result: dict[str, Any], markdown: bool = False) -> list[str]:
    """Every entrenar variant against its ``@baseline`` twin (allreduce sizes, DDP step)."""
    header = [
        "N",
        "what",
        "variant",
        "new",
        "baseline",
        "new/baseline",
        "blocks",
        "rounds (min-max)",
        "pooled",
        "new/gloo",
        "base/gloo",
    ]
    body = []
    pairs = [(r, format_bytes(r["size_bytes"])) for r in result["allreduce"]]
    pairs += [(r, "DDP step") for r in result["ddp"]]
    rows = {(r["world_size"], what, r["variant"]): r for r, what in pairs}
    for r, what in pairs:
        if "time_vs_baseline" not in r:
            continue
        base = rows[(r["world_size"], what, r["variant"] + BASELINE)]
        gloo_key = "time_vs_gloo" if "time_vs_gloo" in r else "step_vs_gloo"
        body.append(
            [
                str(r["world_size"]),
                what,
                r["variant"],
                _fmt_time(r["median_s"]),
                _fmt_time(base["median_s"]),
                f"{r['time_vs_baseline']:.3f}",
                str(r.get("time_vs_baseline_blocks", "-")),
                _fmt_spread(r.get("time_vs_baseline_rounds")),
                f"{r.get('time_vs_baseline_pooled', r['time_vs_baseline']):.3f}",
                _fmt_ratio(r.get(gloo_key)),
                _fmt_ratio(base.get(gloo_key)),
            ]
        )
    return _render(header, body, markdown)


def goals_table(result: dict[str, Any], markdown: bool = False) -> list[str]:
    """The same-host goals' table: DeepSpeed, entrenar shm and tcp side by side, ratios,
    PASS/FAIL (benchmarks/goals.py)."""
    header = [
        "N",
        "size",
        DEEPSPEED,
        SHM,
        TCP,
        "shm/DS time",
        "shm/DS busbw",
        "tcp/DS time",
        "shm/tcp time",
        "method/DS time",
        "shm/DS by round",
        "goal vs DS",
        "vs DS",
        "vs tcp",
    ]
    body = []
    for g in result.get("goals", []):
        limit = g["ds_limit"]
        if limit is None:
            goal = "-"
        elif limit == 1.0:
            goal = "time <= DS (busbw >= DS)"  # the same test: same bytes, same N
        else:
            goal = f"time <= {limit}x DS"
        body.append(
            [
                str(g["world_size"]),
                format_bytes(g["size_bytes"]),
                *(
                    "-" if g[k] is None else _fmt_time(g[k])
                    for k in ("deepspeed_s", "shm_s", "tcp_s")
                ),
                _fmt_ratio(g["shm_vs_ds_time"]),
                _fmt_ratio(g["shm_vs_ds_busbw"]),
                _fmt_ratio(g["tcp_vs_ds_time"]),
                _fmt_ratio(g["shm_vs_tcp_time"]),
                _fmt_ratio(g.get("method_vs_ds_time")),
                _fmt_rounds(g.get("shm_vs_ds_rounds")),
                goal,
                g["vs_deepspeed"],
                g["vs_tcp"],
            ]
        )
    return _render(header, body, markdown)


def calls_table(result: dict[str, Any], markdown: bool = False) -> list[str]:
    """The Python calls one blocking 4 KiB allreduce makes, per transport."""
    header = [
        "variant",
        "ours",
        "torch",
        "other",
        "our files",
        "other threads",
        "repeatable",
        "ours, rank 0 first",
    ]
    body = [
        [
            name,
            str(r["ours"]),
            str(r["torch"]),
            str(r["other"]),
            str(r["our_files"]),
            str(r["other_threads"]),
            "yes" if r["deterministic"] else "no",
            ", ".join(str(n) for n in r.get("ours_caller_first", [])) or "-",
        ]
        for name, r in result.get("python_calls", {}).items()
    ]
    return _render(header, body, markdown)


def _render(header: list[str], body: list[list[str]], markdown: bool) -> list[str]:
    """A padded text table, or a markdown one."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return lines + ["| " + " | ".join(row) + " |" for row in body]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [
        fmt.format(*row) for row in body
    ]


def report_lines(result: dict[str, Any], markdown: bool = False) -> list[str]:
    """The full report (every world size, DDP, notes) as lines."""
    meta = result["meta"]
    m = meta["machine"]
    lines = [
        f"machine: {m['nproc']} CPUs, {m['cpu']}, kernel {m['kernel']}, torch {m['torch']}, "
        f"git {meta.get('git') or '?'}, {meta['started']}",
        f"timing: {meta['timing']}",
    ]
    if "loadavg_end" in meta:
        lines.append(
            "load average (1/5/15 min) at start "
            + "/".join(f"{x:.1f}" for x in meta["loadavg_start"])
            + ", at end "
            + "/".join(f"{x:.1f}" for x in meta["loadavg_end"])
            + f" on {m['nproc']} CPUs (other processes share this machine)"
        )
    if meta.get("mpi_library"):
        lines.append(
            f"MPI: {meta['mpi_library']} ({MPI_SHM}: default shared memory; {MPI_TCP}: "
            "MPIR_CVAR_NOLOCAL=1, libfabric tcp on lo; separate runs, not interleaved)"
        )
    for world in meta["config"]["world_sizes"]:
        lines += ["", f"allreduce float32, N={world}:", ""]
        lines += allreduce_table(result, world, markdown)
        lines += [""] + summary_tables(result, world, markdown)
    if result.get("python_calls"):
        lines += [
            "",
            "Python calls per 4 KiB allreduce (ours / torch), N=2, rank 0, blocking, idle "
            "group, the peer first (python -m benchmarks.calls; counted after the timed runs; "
            "the last column: rank 0 first, its wait included, varies):",
            "",
        ]
        lines += calls_table(result, markdown)
    if result["ddp"]:
        d = result["ddp"][0]
        lines += [
            "",
            f"DDP step ({d['model']}, {d['params']} params, batch {d['batch_per_rank']}"
            f" x seq {d['seq_len']} per rank):",
            "",
        ]
        lines += ddp_table(result, markdown)
        for r in result["ddp"]:
            st = r.get("checker_stats", {}).get(r["variant"])
            if st and st.get("steps_checked"):
                lines.append(
                    f"N={r['world_size']} {r['variant']}: rank 0's checker covered "
                    f"{st.get('allreduces_checked', 0):.0f} allreduces and "
                    f"{st['steps_checked']:.0f} optimizer steps, "
                    f"{1e3 * st.get('seconds', 0.0) / st['steps_checked']:.2f} ms per step"
                )
    if "baseline" in meta:
        b = meta["baseline"]
        lines += [
            "",
            f"this checkout (git {meta.get('git') or '?'}) vs baseline {b['tree']} "
            f"(git {b['git'] or '?'}): median time, new/baseline below 1 = new is faster; "
            f"{meta['config']['baseline_rounds']} rounds, each two fresh jobs at once taking "
            "turns block by block (A B A B ...); new/baseline: the median over every "
            "round of block k's median time over the other side's block k (blocks: how "
            "many such pairs); rounds: each round's median; pooled: of all samples"
            + ("; ranks pinned to a CPU each (--pin)" if meta["config"].get("pin") else ""),
            "",
        ]
        lines += baseline_table(result, markdown)
        for world, files in b.get("entrenar_pg_file", {}).items():
            lines.append(
                f"N={world} workers imported entrenar_pg from {files.get('new')} (new) and "
                f"{files.get('baseline')} (baseline copy)"
            )
    if result.get("goals") or meta.get("unavailable"):
        lines += [
            "",
            "same-host goals against DeepSpeed, issue 25 item 7 (median times of one job's "
            "interleaved rounds; n/a: a row is missing, see below; method/DS: the group's "
            "own method, without torch.distributed's wrapper, not judged):",
            "",
        ]
        lines += goals_table(result, markdown)
        for name, why in meta.get("unavailable", {}).items():
            lines.append(f"unavailable: {name}: {why}")
    for note in meta["notes"]:
        lines.append(f"note: {note}")
    return lines


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    """busbw-vs-size and latency-vs-size PNGs (one panel per world size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = result["meta"]["config"]["world_sizes"]
    paths = []
    for metric, ylabel, fname in (
        ("busbw_GBps", "busbw (GB/s)", "allreduce_busbw.png"),
        ("median_s", "latency (s, median)", "allreduce_latency.png"),
    ):
        fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
        for ax, world in zip(axes[0], worlds, strict=True):
            rows = [r for r in result["allreduce"] + result["mpi"] if r["world_size"] == world]
            for name in dict.fromkeys(r["variant"] for r in rows):
                pts = sorted((r["size_bytes"], r[metric]) for r in rows if r["variant"] == name)
                style = ":" if name.startswith("mpi") else "-"
                ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, label=name)
            raw = sorted(
                (r["size_bytes"], r["GBps_each_way"] if metric == "busbw_GBps" else r["median_s"])
                for r in result["raw_tcp"]
                if r["world_size"] == world
            )
            if raw:
                ax.plot(*zip(*raw, strict=True), "--", color="black", label=RAW)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"allreduce float32, N={world}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_goals_plot(result: dict[str, Any], out: Path) -> Path | None:
    """The same-host goals' ratios against size, one panel per world size, goal limits as steps."""
    goals = result.get("goals") or []
    if not goals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({g["world_size"] for g in goals})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        mine = sorted((g for g in goals if g["world_size"] == world), key=lambda g: g["size_bytes"])
        for key, label, style in (
            ("shm_vs_ds_time", f"{SHM} / {DEEPSPEED}", "-o"),
            ("tcp_vs_ds_time", f"{TCP} / {DEEPSPEED}", "-s"),
            ("shm_vs_tcp_time", f"{SHM} / {TCP}", "-^"),
            ("method_vs_ds_time", f"{METHOD} / {DEEPSPEED}", ":v"),
        ):
            pts = [(g["size_bytes"], g[key]) for g in mine if g[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, ms=4, label=label)
        limits = [(g["size_bytes"], g["ds_limit"]) for g in mine if g["ds_limit"] is not None]
        if limits:
            ax.step(
                *zip(*limits, strict=True),
                "--",
                color="red",
                where="mid",
                label="goal: shm / DS at most",
            )
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("median time ratio (below 1: first is faster)")
        ax.set_title(f"same host against DeepSpeed, allreduce float32, N={world}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "deepspeed_ratios.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_result_files(
    result: dict[str, Any], out: Path, json_name: str, markdown: str
) -> tuple[Path, Path]:
    """``json_name`` (the whole result) and ``results.md`` under ``out``: the two
    text files every benchmark leaves (bench, cluster, scale)."""
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / json_name
    jpath.write_text(json.dumps(result, indent=1))
    mpath = out / "results.md"
    mpath.write_text(markdown)
    return jpath, mpath


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    """bench.json, results.md and the PNGs under ``out``."""
    markdown = "\n".join(report_lines(result, markdown=True)) + "\n"
    jpath, mpath = write_result_files(result, out, "bench.json", markdown)
    goals_png = write_goals_plot(result, out)
    return [jpath, mpath, *write_plots(result, out), *([goals_png] if goals_png else [])]

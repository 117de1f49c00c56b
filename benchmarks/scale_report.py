"""``benchmarks/scale.py``'s results: figures per (backend, N), the 1,024-descriptor limit."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import write_result_files
from benchmarks.scale_ranks import is_entrenar

COMMON_SOFT_LIMIT = 1024  # the usual default soft RLIMIT_NOFILE


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _row(backend: str, world: int, jobs: list[dict[str, Any]], calls: int) -> dict[str, Any]:
    procs = [p for j in jobs for p in j["processes"]]
    ranks = [r for p in procs for r in p["ranks"]]
    per_proc = [p["sockets_after_setup"] / len(p["ranks"]) for p in procs]
    if is_entrenar(backend):
        per_rank = [float(r["held_sockets"]) for r in ranks]
        method = "held by each rank's group, checked against the process's sockets"
    else:
        per_rank = per_proc
        method = "the process's new sockets / its ranks"
    walls = [
        max(r["start"] + r["setup_s"] for p in j["processes"] for r in p["ranks"])
        - min(r["start"] for p in j["processes"] for r in p["ranks"])
        for j in jobs
    ]
    # What one rank alone in its process would hold before set-up: the
    # process's descriptors less the store clients of its other ranks.
    base = statistics.median(p["fds_before"] - len(p["ranks"]) + 1 for p in procs)
    timed: dict[str, Any] = {}
    if calls:
        # Wall per call on each rank; the job's CPU per call (every process).
        timed["allreduce_s"] = _spread([r["calls_s"] / calls for r in ranks])
        timed["allreduce_cpu_s"] = statistics.median(
            sum(p["calls_cpu_s"] for p in j["processes"]) / calls for j in jobs
        )
    return {
        **timed,
        "backend": backend,
        "world": world,
        "jobs": len(jobs),
        "processes": len(procs) // len(jobs),
        "ranks_per_process": _spread([len(p["ranks"]) for p in procs]),
        "allreduce_verified": sum(r["allreduce_ok"] for r in ranks),
        "rank_results": len(ranks),
        "sockets_per_rank": _spread(per_rank),
        "sockets_per_rank_method": method,
        "sockets_per_rank_process": _spread(per_proc),
        "sockets_per_peer": statistics.median(per_rank) / (world - 1),
        "sockets_unheld": sum(p["sockets_unheld"] for p in procs),
        "sockets_shared": sum(p["sockets_shared"] for p in procs),
        "sockets_after_destroy": sum(p["sockets_after_destroy"] for p in procs),
        "fds_after_destroy": sum(p["fds_after_destroy"] for p in procs),
        # Every descriptor set-up opened (sockets, and entrenar's shared-memory
        # mappings: CPython's mmap keeps a duplicate of the file's descriptor).
        "fds_per_rank": _spread([p["new_fds"] / len(p["ranks"]) for p in procs]),
        "fds_per_process": _spread([p["fds_after_setup"] for p in procs]),
        "fds_one_rank_before_setup": base,
        "create_s": _spread([r["create_s"] for r in ranks]),
        "first_allreduce_s": _spread([r["first_allreduce_s"] for r in ranks]),
        "setup_s": _spread([r["setup_s"] for r in ranks]),
        "setup_cpu_s_per_rank": _spread([p["setup_cpu_s"] / len(p["ranks"]) for p in procs]),
        "destroy_s": _spread([r["destroy_s"] for r in ranks]),
        "job_setup_wall_s": statistics.median(walls),
    }


def summarize(jobs: list[dict[str, Any]], calls: int = 0) -> dict[str, Any]:
    """Rows per (backend, N), each N's growth against the smallest N, and the 1,024 limit;
    ``calls``: the timed allreduces per rank (0: none)."""
    if not jobs:
        return {"rows": [], "limit_1024": {}}
    keys = sorted({(j["backend"], j["world"]) for j in jobs})
    rows = [
        _row(b, n, [j for j in jobs if (j["backend"], j["world"]) == (b, n)], calls)
        for b, n in keys
    ]
    limits: dict[str, Any] = {}
    for backend in sorted({b for b, _ in keys}):
        mine = [r for r in rows if r["backend"] == backend]
        first = mine[0]
        for r in mine:
            # 1.0: grows like N (from the smallest N measured); above: faster.
            r["setup_vs_linear"] = (r["setup_s"]["median"] / r["world"]) / (
                first["setup_s"]["median"] / first["world"]
            )
            r["wall_vs_linear"] = (r["job_setup_wall_s"] / r["world"]) / (
                first["job_setup_wall_s"] / first["world"]
            )
            r["cpu_vs_linear"] = (r["setup_cpu_s_per_rank"]["median"] / r["world"]) / (
                first["setup_cpu_s_per_rank"]["median"] / first["world"]
            )
        limits[backend] = fd_limit_projection(mine)
    return {"rows": rows, "limit_1024": limits}


def fd_limit_projection(rows: list[dict[str, Any]], limit: int = COMMON_SOFT_LIMIT) -> Any:
    """The largest N one rank per process could reach under ``limit`` descriptors.

    Descriptors a rank's set-up opens (sockets, and entrenar's shared-memory
    mappings when every rank is on one host, as here) as a line a*N + b
    through the two largest N measured; the rest of a rank process's
    descriptors (interpreter, torch, its store client) as measured before
    set-up. Steady state after set-up: during it a rank also holds its
    listener and its acceptor's selector for a moment.
    """
    if len(rows) < 2:
        return None
    r1, r2 = rows[-2], rows[-1]
    s1, s2 = r1["fds_per_rank"]["median"], r2["fds_per_rank"]["median"]
    a = (s2 - s1) / (r2["world"] - r1["world"])
    b = s2 - a * r2["world"]
    base = r2["fds_one_rank_before_setup"]
    n_max = math.floor((limit - base - b) / a) if a > 0 else None
    return {"limit": limit, "per_rank_slope": a, "per_rank_intercept": b, "base_fds": base,
            "n_max": n_max}  # fmt: skip


def _f(x: float, unit: str = "") -> str:
    if unit == "s":
        return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def table_lines(result: dict[str, Any]) -> list[str]:
    """The summary as a markdown table, and the 1,024-descriptor line per backend."""
    head = (
        "| backend | N | procs | sockets/rank min/med/max | per peer | fds/rank "
        "| set-up/rank med (max) | vs N | job set-up wall | vs N | set-up CPU/rank | vs N "
        "| fds/process med (max) | verified |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in result["summary"]["rows"]:
        s, t, f = r["sockets_per_rank"], r["setup_s"], r["fds_per_process"]
        lines.append(
            f"| {r['backend']} | {r['world']} | {r['processes']} "
            f"| {_f(s['min'])} / {_f(s['median'])} / {_f(s['max'])} | {r['sockets_per_peer']:.2f} "
            f"| {_f(r['fds_per_rank']['median'])} "
            f"| {_f(t['median'], 's')} ({_f(t['max'], 's')}) | {r['setup_vs_linear']:.2f} "
            f"| {_f(r['job_setup_wall_s'], 's')} | {r['wall_vs_linear']:.2f} "
            f"| {_f(r['setup_cpu_s_per_rank']['median'], 's')} | {r['cpu_vs_linear']:.2f} "
            f"| {_f(f['median'])} ({_f(f['max'])}) "
            f"| {r['allreduce_verified']}/{r['rank_results']} |"
        )
    for f in result.get("failures", []):
        first = f["error"].splitlines()[0]
        lines.append(f"| {f['backend']} | {f['world']} | failed: {first} |" + " |" * 11)
    lines.append("")
    lines += timed_lines(result)
    for backend, p in result["summary"]["limit_1024"].items():
        if p is None:
            continue
        lines.append(
            f"- {backend}: descriptors set-up opens per rank = {p['per_rank_slope']:.2f}·N + "
            f"{p['per_rank_intercept']:.1f}; with {p['base_fds']:.0f} other descriptors per rank "
            f"process, a soft limit of {p['limit']} stops a job (one rank per process) "
            f"above N = {p['n_max']}"
        )
    return lines


def timed_lines(result: dict[str, Any]) -> list[str]:
    """The timed allreduces (``--calls``) per (backend, N), against the first backend."""
    rows = [r for r in result["summary"]["rows"] if "allreduce_s" in r]
    if not rows:
        return []
    first = result["config"]["backends"][0]
    base = {r["world"]: r for r in rows if r["backend"] == first}
    lines = [
        f"{result['config']['calls']} timed 4 KiB allreduces per rank after set-up; "
        f"ratios against {first} at the same N:",
        "",
        "| backend | N | wall/call med (min-max over ranks) | job CPU/call | wall ratio "
        "| CPU ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        w, b = r["allreduce_s"], base.get(r["world"])
        ratio = f"{w['median'] / b['allreduce_s']['median']:.2f}" if b else "-"
        cpu = f"{r['allreduce_cpu_s'] / b['allreduce_cpu_s']:.2f}" if b else "-"
        lines.append(
            f"| {r['backend']} | {r['world']} | {w['median'] * 1e3:.2f} ms "
            f"({w['min'] * 1e3:.2f}-{w['max'] * 1e3:.2f}) | {r['allreduce_cpu_s'] * 1e3:.2f} ms "
            f"| {ratio} | {cpu} |"
        )
    return [*lines, ""]


def markdown(result: dict[str, Any]) -> str:
    cfg, lim = result["config"], result["fd_limit"]
    m = result["machine"]
    notes = [
        f"# Connections and set-up vs N ({result['when']}, git `{result['git']}`)",
        "",
        f"{m['nproc']} cores ({m['cpu']}), torch {m['torch']}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in result['loadavg'])}. Ranks {cfg['ranks']} over "
        f"{cfg['procs']} processes (threads), {cfg['repeats']} job(s) per backend and N, "
        f"entrenar transport {cfg['transport']}, allreduce {cfg['allreduce_bytes']} B. "
        f"RLIMIT_NOFILE soft {lim['soft_found']} raised to {lim['soft_used']} "
        f"(hard {lim['hard']}).",
        "",
    ]
    return "\n".join(notes + table_lines(result)) + "\n"


def write_plot(result: dict[str, Any], out: Path) -> Path | None:
    if not result["summary"]["rows"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["summary"]["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
    for i, backend in enumerate(sorted({r["backend"] for r in rows})):
        mine = [r for r in rows if r["backend"] == backend]
        n = [r["world"] for r in mine]
        c = f"C{i}"
        ax1.plot(n, [r["sockets_per_rank"]["median"] for r in mine], "o-", c=c,
                 label=f"{backend} sockets")  # fmt: skip
        ax1.plot(n, [r["fds_per_rank"]["median"] for r in mine], "s--", c=c,
                 label=f"{backend} all descriptors")  # fmt: skip
        ax2.plot(n, [r["setup_s"]["median"] for r in mine], "o-", c=c,
                 label=f"{backend} wall per rank (median)")  # fmt: skip
        ax2.plot(n, [r["setup_cpu_s_per_rank"]["median"] for r in mine], "^:", c=c,
                 label=f"{backend} CPU per rank")  # fmt: skip
    n_all = sorted({r["world"] for r in rows})
    first = rows[0]

    def guide(ax: Any, y0: float, power: int, label: str) -> None:
        ax.plot(n_all, [y0 * (x / n_all[0]) ** power for x in n_all], c="grey", lw=0.8,
                ls=(0, (1, 3)) if power == 1 else (0, (5, 3)), label=label)  # fmt: skip

    guide(ax1, first["sockets_per_rank"]["median"], 1, "∝ N")
    guide(ax2, first["setup_cpu_s_per_rank"]["median"], 1, "∝ N")
    guide(ax2, first["setup_s"]["median"], 2, "∝ N²")
    ax1.set(xscale="log", yscale="log", xlabel="ranks N", ylabel="per rank",
            title="sockets and descriptors per rank after set-up")  # fmt: skip
    ax2.set(xscale="log", yscale="log", xlabel="ranks N", ylabel="seconds",
            title="set-up (create + first 4 KiB allreduce)")  # fmt: skip
    for ax in (ax1, ax2):
        ax.set_xticks(n_all, [str(x) for x in n_all])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "scale.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(result: dict[str, Any], out: Path) -> list[str]:
    """Write scale.json, results.md and scale.png under ``out``; return the lines to print."""
    text = markdown(result)
    write_result_files(result, out, "scale.json", text)
    write_plot(result, out)
    return [*text.splitlines(), "", f"written: {out}/scale.json, results.md, scale.png"]

"""``python -m benchmarks.model {measure,fit,fit-wake,fit-dedicated,check,...}``: its commands.

- ``measure``: the 2-rank sweeps per link kind, then ``fit``; writes
  ``measurements.json`` and ``links.json`` in ``--out``.
- ``fit MEASUREMENTS.json``: the link table from measurements.
- ``fit-wake CLUSTER.json ...``: the ``wake`` and ``gloo-wake`` kinds (a
  hop's wait to be scheduled where ranks share a core: entrenar spins, gloo
  blocks) and, from rows a loaded machine recorded, ``load`` (a spinning
  hop's wait for other jobs' threads) fitted from cluster rows below 1 MiB,
  added to ``--links`` and saved to ``--out``.
- ``fit-dedicated CLUSTER.json ...``: gloo's cost per call (split off its
  alphas per message) and entrenar's per queued frame (a star's root takes
  its peers' frames one after another) fitted from cluster rows below 1 MiB
  whose ranks have a core each (``dedicated.py``), added to ``--links`` and
  saved to ``--out``.
- ``held-out A.json B.json ... [--also C.json ...] [--rooted R.json ...]``:
  ``fit-wake`` (ranks sharing cores) or ``fit-dedicated`` (a core per rank)
  on each layout's runs, ``check`` of the other's rows and of ``--also``'s
  (a third layout), both ways; each rooted run
  with the turn fitted on the rooted runs of the other layouts (e.g. 2 x 2,
  4 x 2 and 8 x 1: ``held_out.py``); ``--median-of-runs``: each layout's
  rows the median over its runs, one row per (variant, size).
- ``check CLUSTER.json ...``: predicted against measured (``python -m
  benchmarks.cluster``'s output), rows off by > 25 % flagged.
- ``plan``: the table and crossovers up to 1,024 hosts x 8, and the plots.
- ``flat``: the flat rows' small allreduce at large N, the star (its root's
  frames counted) against recursive doubling, and the N where doubling pays
  (``flat.py``).
- ``rooted``: barrier and broadcast, flat (as implemented) against host-aware
  candidates (``rooted.py``): the ratio table and where host-aware pays.
- ``measure-rooted``: the flat barrier and broadcast measured on emulated hosts
  (``rooted_measure.py``; root, namespaces), beside gloo and the model.
- ``predict --hosts H --local L [--sizes ...]``: every algorithm's time and
  the policy's pick (asked with the topology) for one shape.

Without ``--links`` the parameters committed beside this file
(``fitted_links.json``, fitted under load 14-30) are used; a quiet machine's
are ``data/quiet/links.json`` (docs/benchmarks.md, "Small messages on a
quiet machine").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.model import (
    check,
    costs,
    dedicated,
    fit,
    flat,
    held_out,
    measure,
    plan,
    rooted,
    rooted_measure,
    wake,
)
from benchmarks.model.links import LinkTable
from benchmarks.sizes import parse_sizes

FITTED = Path(__file__).with_name("fitted_links.json")
TODAY = ("direct", "star", "doubling", "ring")  # the flat algorithms the policy picks from
IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
DEFAULT_PLOT = IMG / "cost_model.png"
THRESHOLD_PLOT = "cost_model_threshold.png"  # beside --plot
CHECK_PLOT = IMG / "cost_model_check.png"
HELD_OUT_PLOT = IMG / "cost_model_held_out.png"


def _links(path: str | None) -> LinkTable:
    return LinkTable.load(Path(path) if path else FITTED)


def cmd_measure(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = measure.links_run(
        list(parse_sizes(args.local_sizes)),
        list(parse_sizes(args.net_sizes)),
        args.rate,
        args.rounds,
    )
    (out / "measurements.json").write_text(json.dumps(data, indent=1) + "\n")
    table = fit.fit(data["rows"], data["meta"])
    table.save(out / "links.json")
    _print_links(table)


def cmd_fit(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.measurements).read_text())
    table = fit.fit(data["rows"], data.get("meta"))
    table.save(Path(args.out))
    _print_links(table)


def cmd_fit_wake(args: argparse.Namespace) -> None:
    _fit_from_cluster(args, wake.fit_wake, "wake_fitted_from")


def cmd_fit_dedicated(args: argparse.Namespace) -> None:
    _fit_from_cluster(args, dedicated.fit_dedicated, "dedicated_fitted_from")


def _fit_from_cluster(
    args: argparse.Namespace,
    fit_terms: Callable[[Sequence[dict[str, Any]], LinkTable], LinkTable],
    meta_key: str,
) -> None:
    """``fit_terms`` on the cluster runs ``args.cluster``, added to ``--links``;
    the table saved to ``--out`` (its ``meta_key`` names the runs) and printed."""
    runs = [json.loads(Path(p).read_text()) for p in args.cluster]
    table = fit_terms(runs, _links(args.links))
    table.meta[meta_key] = [Path(p).name for p in args.cluster]
    table.save(Path(args.out))
    _print_links(table)


def _print_links(table: LinkTable) -> None:
    worst = table.meta.get("worst_relative_residual", {})
    print("| kind | alpha | beta | 1/beta | worst residual |\n|---|---|---|---|---|")
    for kind, p in table.params.items():
        rate = f"{1 / p.beta / 1e9:.3g} GB/s" if p.beta > 0 else "-"
        res = worst.get(kind)
        res_s = f"{res:.0%}" if res is not None else "-"
        print(f"| {kind} | {p.alpha * 1e6:.3g} us | {p.beta * 1e9:.3g} ns/B | {rate} | {res_s} |")


def cmd_check(args: argparse.Namespace) -> int:
    runs = [json.loads(Path(p).read_text()) for p in args.cluster]
    checked = check.check(runs, _links(args.links))
    print(check.report(checked))
    if args.plot:
        check.plot(checked, Path(args.plot))
        print(f"\nplot: {args.plot}")
    return 1 if args.strict and any(c.flagged for c in checked) else 0


def cmd_held_out(args: argparse.Namespace) -> None:
    runs = [held_out.load(p) for p in args.cluster]
    if args.median_of_runs:
        runs = held_out.median_over_runs(runs)
    also = [held_out.load(p) for p in args.also]
    directions = held_out.held_out(runs, _links(args.links), not args.no_load, also)
    print(held_out.report(directions, [held_out.load(p) for p in args.rooted]))
    if args.plot:
        rows = [c for d in directions for c in d.checked]
        check.plot(
            rows,
            Path(args.plot),
            "Cost model, held out: each layout predicted from the other's runs",
        )
        print(f"\nplot: {args.plot}")


def cmd_plan(args: argparse.Namespace) -> None:
    links = _links(args.links)
    ours = [n for n in costs.ALGORITHMS if n != "gloo ring" and n not in costs.PROPOSALS]
    print("Fastest of entrenar's algorithms (the code's) and its predicted time:\n")
    print(plan.table(links, ours))
    print("\nCrossovers (entrenar's algorithms, the code's):\n")
    print("\n".join(plan.crossover_lines(links, ours)))
    print("\nCrossovers with the proposals for large H (not code):\n")
    print("\n".join(plan.crossover_lines(links, [*ours, *costs.PROPOSALS])))
    print("\nCrossovers among today's algorithms (what the policy's thresholds should be):\n")
    print("\n".join(plan.crossover_lines(links, list(TODAY))))
    print("\nWhere HOST_SLICES beats HOST_LEADERS, per H:\n")
    print("\n".join(plan.threshold_lines(links)))
    print("\nAt scale: what the policy picks, against the flat ring (L = 8):\n")
    print(plan.scale_table(links))
    for h, local in ((4, 2), (64, 8), (1024, 8)):
        print(f"\nEvery algorithm, {h} x {local}:\n")
        print(plan.full_table(links, list(costs.ALGORITHMS), h, local))
    if args.plot:
        path = Path(args.plot)
        plan.plot(links, list(costs.ALGORITHMS), path)
        plan.plot_threshold(links, path.with_name(THRESHOLD_PLOT))
        print(f"\nplots: {path}, {path.with_name(THRESHOLD_PLOT)}")


def cmd_rooted(args: argparse.Namespace) -> None:
    links = _links(args.links)
    fabric = costs.ENTRENAR
    for op in ("barrier", "broadcast"):
        print(f"\n{op}: host-aware / flat (the fastest candidate), per frame cost:\n")
        print(rooted.ratio_table(op, links, fabric))
        if op == "broadcast":
            print("\nbroadcast, the candidates confirming along their own links only:\n")
            print(rooted.ratio_table(op, links, fabric, confirm=False))
        for frame in rooted.FRAME_CASES:
            print(f"\n{op}, where host-aware pays (frame {frame * 1e6:.0f} µs):\n")
            lines = rooted.crossover_lines(op, rooted.with_frame(links, frame), fabric)
            print("\n".join(lines))


def cmd_flat(args: argparse.Namespace) -> None:
    print(flat.report(_links(args.links)))


def cmd_measure_rooted(args: argparse.Namespace) -> None:
    sizes = list(parse_sizes(args.sizes))
    rows = rooted_measure.measure(args.hosts, args.local, args.rate, sizes, args.rounds)
    cores = os.cpu_count() or 1
    if args.out:
        run = {"rate": args.rate, "machine": {"nproc": cores}, "rows": rows}
        Path(args.out).write_text(json.dumps(run, indent=1) + "\n")
    print(rooted_measure.report(rows, _links(args.links), args.rate, cores))


def cmd_predict(args: argparse.Namespace) -> None:
    links = _links(args.links)
    for size in parse_sizes(args.sizes):
        pick = plan.policy_pick(args.hosts, args.local, size, links)
        print(
            f"\n{args.hosts} x {args.local}, {size} B: the policy picks {pick.algorithm}, "
            f"{check.duration(pick.seconds)}, {pick.link_bytes:.0f} B per host link"
        )
        t = plan.times(args.hosts, args.local, size, links, list(costs.ALGORITHMS))
        for name, seconds in sorted(t.items(), key=lambda kv: kv[1]):
            note = " (proposal)" if name in costs.PROPOSALS else ""
            print(f"  {name}{note}: {check.duration(seconds)}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.model", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="2-rank sweeps per link kind, then fit")
    m.add_argument("--out", default="bench_out/model")
    m.add_argument("--rate", default="1gbit", help="tc rate of the shaped link")
    m.add_argument("--local-sizes", default="4K:64M:x4")
    m.add_argument("--net-sizes", default="4K:16M:x4")
    m.add_argument("--rounds", type=int, default=4)
    f = sub.add_parser("fit", help="fit the link table from measurements.json")
    f.add_argument("measurements")
    f.add_argument("--out", default="links.json")
    w = sub.add_parser("fit-wake", help="fit the wake-up alphas from cluster rows below 1 MiB")
    w.add_argument("cluster", nargs="+")
    w.add_argument("--links", help="the table to add it to (default: the committed one)")
    w.add_argument("--out", default=str(FITTED))
    d = sub.add_parser(
        "fit-dedicated", help="fit the cost per call and per queued frame (a core per rank)"
    )
    d.add_argument("cluster", nargs="+")
    d.add_argument("--links", help="the 2-rank sweeps' table to add them to")
    d.add_argument("--out", required=True)
    k = sub.add_parser("check", help="predicted against measured cluster rows")
    k.add_argument("cluster", nargs="+")
    k.add_argument("--links")
    k.add_argument("--strict", action="store_true", help="exit 1 if a row is flagged")
    k.add_argument(
        "--plot", default="", help=f"PNG path, predicted against measured (e.g. {CHECK_PLOT})"
    )
    ho = sub.add_parser("held-out", help="fit the wake-ups on one layout, check the other")
    ho.add_argument("cluster", nargs="+", help="cluster.json files of two layouts (H x L)")
    ho.add_argument(
        "--also", nargs="*", default=[], help="cluster.json files of other layouts, checked only"
    )
    ho.add_argument("--rooted", nargs="*", default=[], help="measure-rooted JSON files")
    ho.add_argument("--links", help="the links (default: the committed table)")
    ho.add_argument(
        "--no-load", action="store_true", help="ignore the runs' recorded load (no load term)"
    )
    ho.add_argument(
        "--median-of-runs",
        action="store_true",
        help="each layout's rows as the median over its runs (fit on one, check the other)",
    )
    ho.add_argument("--plot", default="", help=f"PNG path (e.g. {HELD_OUT_PLOT})")
    pr = sub.add_parser("predict", help="every algorithm and the policy's pick for H x L, sizes")
    pr.add_argument("--hosts", type=int, required=True)
    pr.add_argument("--local", type=int, required=True)
    pr.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    pr.add_argument("--links")
    ro = sub.add_parser("rooted", help="barrier and broadcast: flat against host-aware")
    ro.add_argument("--links")
    fl = sub.add_parser("flat", help="the flat small allreduce at large N: star against doubling")
    fl.add_argument("--links")
    mr = sub.add_parser("measure-rooted", help="flat barrier and broadcast on emulated hosts")
    mr.add_argument("--hosts", type=int, default=2)
    mr.add_argument("--local", type=int, default=2)
    mr.add_argument("--rate", default="1gbit", help="tc rate of every host link ('' unshaped)")
    mr.add_argument("--sizes", default="4K,1M")
    mr.add_argument("--rounds", type=int, default=15)
    mr.add_argument("--links")
    mr.add_argument("--out", default="", help="JSON path for the rows")
    pl = sub.add_parser("plan", help="table, crossovers and plot up to 1,024 x 8")
    pl.add_argument("--links")
    pl.add_argument("--plot", default=str(DEFAULT_PLOT), help="PNG path ('' for none)")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parser().parse_args(argv)
    if args.cmd == "check":
        return cmd_check(args)
    commands = {
        "measure": cmd_measure,
        "fit": cmd_fit,
        "fit-wake": cmd_fit_wake,
        "fit-dedicated": cmd_fit_dedicated,
        "held-out": cmd_held_out,
        "plan": cmd_plan,
        "predict": cmd_predict,
        "rooted": cmd_rooted,
        "flat": cmd_flat,
        "measure-rooted": cmd_measure_rooted,
    }
    commands[args.cmd](args)
    return 0

"""``python -m entrenar_pg.trace DIR [--json] [--html OUT.html]``: the command line."""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from dataclasses import asdict

from .analysis import diagnose, load_dir, report_text
from .picture import render_html


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m entrenar_pg.trace",
        description="Say what went wrong from entrenar's flight-recorder dumps (one per rank).",
    )
    parser.add_argument("trace_dir", help="directory of <prefix><rank> dump files")
    parser.add_argument("-p", "--prefix", default=None, help="file name prefix (if several)")
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")
    parser.add_argument(
        "--html",
        metavar="OUT.html",
        default=None,
        help="also write a picture: one lane per rank, one box per collective (one HTML file)",
    )
    args = parser.parse_args(argv)
    try:
        dumps = load_dir(args.trace_dir, args.prefix)
    except (OSError, ValueError, pickle.UnpicklingError) as e:
        print(f"entrenar_pg.trace: {e}", file=sys.stderr)
        return 2
    reports = diagnose(dumps)
    if args.html is not None:
        try:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(render_html(reports, dumps, source=args.trace_dir))
        except OSError as e:
            print(f"entrenar_pg.trace: --html: {e}", file=sys.stderr)
            return 2
        print(f"entrenar_pg.trace: wrote {args.html}", file=sys.stderr)
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1, default=str))
    else:
        print(report_text(reports))
    return 0

"""Reading flight-recorder dumps: ``python -m entrenar_pg.trace DIR`` (``cli``),
its analysis (``analysis``) and its picture (``picture``)."""

from .analysis import Call, GroupReport, diagnose, load_dir, report_text, verdict
from .cli import main

__all__ = ["Call", "GroupReport", "diagnose", "load_dir", "main", "report_text", "verdict"]

"""TEMPORARY (drop at merge): p2p.py and _bench_floor.py still import ``.work``; now api/work.py."""

from .api.work import EntrenarWork

__all__ = ["EntrenarWork"]

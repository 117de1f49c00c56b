"""TEMPORARY (drop at merge): p2p.py imports ``.algorithms.common.bytes_of``; now collectives/."""

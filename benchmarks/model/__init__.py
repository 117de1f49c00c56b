"""The cost model of issue 26: alpha-beta per link kind, fitted, checked, and used to plan.

``python -m benchmarks.model measure|fit|check|plan`` (``cli.py``). The modules:

- ``links.py``: the link kinds and their fitted (alpha, beta), saved as JSON.
- ``costs.py``: each algorithm's time for (hosts H, local ranks L, bytes S).
- ``fit.py``: least squares of alpha and beta from 2-rank measurements.
- ``measure.py``, ``rank.py``: the measurements (shared memory, loopback TCP,
  a tc-shaped link between emulated hosts), run as the emulated cluster's jobs
  (``benchmarks/netns_job.py``, ``benchmarks/cluster_rank.py``).
- ``check.py``: predicted against measured cluster rows (``cluster.json``).
- ``plan.py``: the table, crossovers and plot up to 1,024 hosts x 8.
"""

"""Benchmarks of the entrenar backend: programs, not part of the installed package.

``python -m benchmarks.bench`` (from the repository root; docs/benchmarks.md).
Imports nothing, so that a spawned worker can put another source tree's
``entrenar_pg`` first on ``sys.path`` before torch is imported.
"""

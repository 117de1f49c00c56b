"""The cross-core probe that says which state a benchmark run met (benchmarks/cross_core)."""

from __future__ import annotations

import math
import os

import pytest

from benchmarks.cross_core import round_trip_ns


@pytest.mark.timeout(60)
@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_round_trip_is_measured_between_cpus_0_and_1_and_the_mask_comes_back() -> None:
    mask = os.sched_getaffinity(0)
    ns = round_trip_ns(trips=2_000)
    assert ns is not None and math.isfinite(ns)
    # two stores and two loads across cores: more than a nanosecond, far less than a timeslice
    assert 1 < ns < 1e6, ns
    assert os.sched_getaffinity(0) == mask


@pytest.mark.timeout(60)
@pytest.mark.skipif(0 not in os.sched_getaffinity(0), reason="needs CPU 0")
def test_no_round_trip_without_cpu_1() -> None:
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        assert round_trip_ns(trips=2_000) is None
        assert os.sched_getaffinity(0) == {0}
    finally:
        os.sched_setaffinity(0, mask)

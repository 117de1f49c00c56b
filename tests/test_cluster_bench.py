"""The emulated-cluster benchmark (``python -m benchmarks.cluster``): its arithmetic, and
one real quick run, 2 hosts x 2 ranks over tbf-shaped veth links (skipped where
network namespaces cannot be made). No timing is asserted: what the run must
get right is the results, the bytes on the links and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import netns_allowed

from benchmarks import cluster, netns
from benchmarks.cluster import bound_bytes, combine
from benchmarks.cluster_config import (
    CLUSTER_VARIANTS,
    DEFAULT_VARIANTS,
    ENTRENAR,
    ENTRENAR_FLAT,
    FLAT_OVERRIDES,
    ClusterConfig,
    resolve_variants,
)
from benchmarks.cluster_report import link_ceiling_GBps
from benchmarks.config import GLOO
from benchmarks.spawn import BenchError

META_KEYS = {"hosts", "local", "rate", "delay", "git", "machine"}
ROW_KEYS = {
    "variant": str,
    "hosts": int,
    "local": int,
    "bytes": int,
    "median_s": float,
    "min_s": float,
    "max_s": float,
    "busbw_GBps": float,
    "xhost_bytes_per_host": float,
    "bound_bytes_per_host": float,
    "sockets_per_rank": float,
    "background_cores": float,
    "job_cores": float,
    "samples_s": list,
}


def test_bound_and_link_ceiling() -> None:
    assert bound_bytes(2, 1000) == 1000
    assert bound_bytes(4, 1000) == 1500
    # 1 Gbit/s = 125 MB/s each way; busbw = S/t x 2(n-1)/n, t >= bound / 125 MB/s
    assert link_ceiling_GBps({"rate": "1gbit", "hosts": 2, "local": 2}) == 0.125 * 1.5
    assert link_ceiling_GBps({"rate": "100mbit", "hosts": 4, "local": 2}) == pytest.approx(
        0.0125 * 1.75 / 1.5
    )
    assert link_ceiling_GBps({"rate": None, "hosts": 2, "local": 2}) is None


def test_flat_override_dropped_and_noted_where_options_lack_it() -> None:
    names = DEFAULT_VARIANTS
    without, notes = resolve_variants(names, {"algorithm"})
    flat = next(v for v in without if v.name == ENTRENAR_FLAT)
    assert flat.options == {} and len(notes) == 1 and ENTRENAR_FLAT in notes[0]
    assert {v.name for v in CLUSTER_VARIANTS} >= set(names)
    field = next(iter(FLAT_OVERRIDES))
    with_field, notes = resolve_variants(names, {field})
    assert next(v for v in with_field if v.name == ENTRENAR_FLAT).options == FLAT_OVERRIDES
    assert notes == []


def _rank(rank: int, host: int, local_rank: int, verified: bool = True) -> dict:
    size = 1000
    rec = {
        "rank": rank,
        "host": host,
        "local_rank": local_rank,
        "times": {f"{GLOO}|{size}": [1.0 + rank, 2.0], f"{ENTRENAR}|{size}": [0.5, 0.5 + rank]},
        "verified": [f"{GLOO}|{size}", f"{ENTRENAR}|{size}"] if verified else [],
        "sockets": {GLOO: 3 + rank, ENTRENAR: 9},
        "links": [],
        "calibration": [],
        # one block per variant: 0.25 s of this rank's CPU in 1 s; rank 0 read the machine
        # busy 1.5 s (gloo: 0.5 s beyond the 4 ranks' 1.0 s) and 0.9 s (entrenar: none)
        "load": [
            {"variant": v, "bytes": size, "wall_s": 1.0, "cpu_s": 0.25}
            | ({"busy_s": busy} if rank == 0 else {})
            for v, busy in ((GLOO, 1.5), (ENTRENAR, 0.9))
        ],
    }
    if local_rank == 0:
        # two blocks of 5 calls each, each block carrying 100 fence bytes per direction
        per_call = {GLOO: (1500 + 10 * host, 1400), ENTRENAR: (2000, 2100 + host)}
        rec["links"] = [
            {"variant": v, "bytes": size, "calls": 5, "tx": 5 * tx + 100, "rx": 5 * rx + 100}
            for v, (tx, rx) in per_call.items()
            for _ in range(2)
        ]
        rec["calibration"] = [{"tx": 100, "rx": 100}, {"tx": 90, "rx": 110}, {"tx": 110, "rx": 95}]
    return rec


def test_combine_max_over_ranks_fences_subtracted_busiest_link() -> None:
    cfg = ClusterConfig(hosts=2, local=2, sizes=(1000,), variants=(GLOO, ENTRENAR))
    ranks = [_rank(r, r // 2, r % 2) for r in range(4)]
    part = combine(cfg, ranks)
    rows = {r["variant"]: r for r in part["rows"]}
    assert set(rows[GLOO]) == set(ROW_KEYS)
    assert rows[GLOO]["median_s"] == 3.0  # per-iteration max over ranks: [4.0, 2.0]
    assert rows[GLOO]["samples_s"] == [4.0, 2.0]  # every call, in order (bimodal rows)
    assert rows[ENTRENAR]["max_s"] == 3.5
    assert rows[GLOO]["xhost_bytes_per_host"] == 1510  # host 1's tx
    assert rows[ENTRENAR]["xhost_bytes_per_host"] == 2101  # host 1's rx
    assert rows[GLOO]["sockets_per_rank"] == 4.5
    assert rows[GLOO]["busbw_GBps"] == pytest.approx(1000 / 3.0 / 1e9 * 1.5)
    # the cores other processes took: gloo's block 0.5 of 1 s, entrenar's none (never < 0)
    assert rows[GLOO]["background_cores"] == pytest.approx(0.5)
    assert rows[ENTRENAR]["background_cores"] == 0.0
    assert part["background_cores"] == pytest.approx(0.2)  # (2.4 - 2.0) busy s over 2 s
    # the cores the job's own ranks took: 4 x 0.25 s of CPU in each 1 s block
    assert rows[GLOO]["job_cores"] == rows[ENTRENAR]["job_cores"] == pytest.approx(1.0)
    ranks[3] = _rank(3, 1, 1, verified=False)
    with pytest.raises(BenchError, match="rank 3: results never checked"):
        combine(cfg, ranks)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_run_two_hosts_of_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real harness: one job of 2 x 2 ranks in namespaces, links at 1 Gbit/s.

    Every variant's results were checked on every rank; each host link carried
    at least the bound (no allreduce can move less) and not absurdly more;
    every group holds TCP sockets; cluster.json has the schema the cost model
    reads; nothing is left behind."""
    if not netns_allowed():
        pytest.skip("cannot create network namespaces here (needs root and `ip netns`)")
    out = tmp_path / "out"
    sizes = (4096, 65536)
    # In this process (torch is imported already); the ranks are torchrun's
    # processes in the namespaces, bounded by --timeout, then killed.
    args = [
        "--hosts", "2", "--local", "2", "--sizes", "4K,64K", "--repeats", "3",
        "--min-repeats", "2", "--rounds", "2", "--rate", "1gbit", "--timeout", "90",
        "--out", str(out),
    ]  # fmt: skip
    assert cluster.main(args) == 0
    result = json.loads((out / "cluster.json").read_text())
    meta = result["meta"]
    assert META_KEYS <= set(meta)
    assert (meta["hosts"], meta["local"], meta["rate"], meta["delay"]) == (2, 2, "1gbit", None)
    names = list(DEFAULT_VARIANTS)
    assert sorted(meta["verified"]) == sorted(f"{v}|{s}" for v in names for s in sizes)
    rows = result["rows"]
    assert sorted((r["variant"], r["bytes"]) for r in rows) == sorted(
        (v, s) for v in names for s in sizes
    )
    for r in rows:
        assert {k: type(r[k]) for k in r} == ROW_KEYS, r
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"] < 60
        assert r["bound_bytes_per_host"] == r["bytes"]  # 2(H-1)/H x S at H = 2
        assert r["bound_bytes_per_host"] <= r["xhost_bytes_per_host"], r
        assert r["xhost_bytes_per_host"] <= 6 * r["bound_bytes_per_host"], r
        assert r["sockets_per_rank"] > 0, r
    assert len(result["links"]) == 2 * len(rows)  # both hosts, every row
    for r in rows:  # the law is on the mean over hosts: 2(H-1) x S must cross, in all
        mine = [
            x for x in result["links"] if (x["variant"], x["bytes"]) == (r["variant"], r["bytes"])
        ]
        for d in ("tx_per_call", "rx_per_call"):
            assert sum(x[d] for x in mine) / len(mine) >= r["bound_bytes_per_host"], (d, mine)
    assert (out / "cluster.png").stat().st_size > 0
    assert "| 64 KiB | entrenar |" in (out / "results.md").read_text()
    assert "xhost/bound" in capsys.readouterr().out
    assert netns.namespaces_left(meta["netns_prefix"]) == []


@pytest.mark.timeout(30)
def test_delay_without_netem_is_refused_before_anything_runs() -> None:
    if not netns_allowed():
        pytest.skip("cannot create network namespaces here (needs root and `ip netns`)")
    if netns.qdisc_available("netem", "delay", "1ms")[0]:
        pytest.skip("this kernel has sch_netem: --delay works here")
    cfg, _ = cluster.parse_args(["--delay", "1ms"])
    with pytest.raises(BenchError, match="--delay: this kernel cannot add a netem qdisc"):
        cluster.check_shaping(cluster.shaping_of(cfg))
    assert cluster.check_shaping(cluster.shaping_of(ClusterConfig(rate="1gbit"))) is None

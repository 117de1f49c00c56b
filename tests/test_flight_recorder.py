"""The flight recorder (docs/debugging.md): records, dumps, and their diagnosis.

- Three broken jobs at N = 3, one process per rank, every rank recording and
  dumping on the break: a desynchronised call (rank 2 allreduces 512 floats
  where the others allreduce 1024), a stalled rank (SIGSTOP; it wrote its
  dump on demand first) and a killed rank (SIGKILL; no dump from it).
  ``python -m entrenar_pg.trace`` must name the collective, its seq, and rank 2,
  and its ``--html`` picture must show each rank's records as the dumps
  have them, with rank 2's lane and the mismatching box marked.
- In one process: the dump has every field of torch 2.13's (taken from a
  real gloo dump), torch's loader reads it, the ring keeps only the last N,
  p2p ops are recorded, and nothing is recorded when off.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from conftest import free_port, kill_sessions, make_groups, rank_env, run_ranks
from preloaded import start_script

import entrenar_pg
from entrenar_pg import Options, flight_recorder, trace
from entrenar_pg.trace import diagnose, load_dir, report_text
from entrenar_pg.trace.picture import BEFORE, render_html

REPO = Path(__file__).resolve().parents[1]
SCENARIO = REPO / "tests" / "scripts" / "fr_scenario.py"
K = 3  # the step that goes wrong; its collective seq is K + 2 (barrier = 1)
VICTIM = 2


@dataclass
class Picture:
    """What a ``--html`` page shows, read back from its SVG's data attributes."""

    lanes: list[int] = field(default_factory=list)  # ranks, top to bottom
    culprit_lanes: list[int] = field(default_factory=list)
    no_dump_lanes: list[int] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)  # collective seqs, left to right
    boxes: dict[tuple[int, int], str] = field(default_factory=dict)  # (rank, seq) -> state
    ops: dict[tuple[int, int], str] = field(default_factory=dict)
    mismatch_boxes: list[tuple[int, int]] = field(default_factory=list)
    mismatch_columns: list[int] = field(default_factory=list)
    stuck_columns: list[int] = field(default_factory=list)
    waiting_on: list[str] = field(default_factory=list)  # each verdict's data-waiting-on
    text: list[str] = field(default_factory=list)
    tags: set[str] = field(default_factory=set)


class PictureReader(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.pic = Picture()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        pic = self.pic
        pic.tags.add(tag)
        for attr in ("src", "href"):  # self-contained: nothing to fetch
            assert attr not in a, (tag, a)
        if tag == "g" and "lane" in classes:
            rank = int(a["data-rank"])
            pic.lanes.append(rank)
            if "culprit" in classes:
                pic.culprit_lanes.append(rank)
            if "no-dump" in classes:
                pic.no_dump_lanes.append(rank)
        elif tag == "g" and "box" in classes:
            key = (int(a["data-rank"]), int(a["data-seq"]))
            assert key not in pic.boxes, f"two boxes for {key}"
            pic.boxes[key] = a["data-state"]
            pic.ops[key] = a["data-op"]
            if "mismatch" in classes:
                pic.mismatch_boxes.append(key)
        elif tag == "g" and "col" in classes:
            pic.columns.append(int(a["data-seq"]))
            if "mismatch" in classes:
                pic.mismatch_columns.append(int(a["data-seq"]))
            if "stuck" in classes:
                pic.stuck_columns.append(int(a["data-seq"]))
        elif tag == "p" and "verdict" in classes:
            pic.waiting_on.append(a["data-waiting-on"])

    def handle_data(self, data: str) -> None:
        self.pic.text.append(data)


def read_picture(page: Path) -> Picture:
    return parse_picture(page.read_text(encoding="utf-8"))


def parse_picture(text: str) -> Picture:
    reader = PictureReader()
    reader.feed(text)
    reader.close()
    assert "script" not in reader.pic.tags
    return reader.pic


def unrecorded_boxes(pic: Picture, dumps: dict[int, dict]) -> dict[tuple[int, int], str]:
    """Checks that every recorded collective of every dump has its box, in its
    state and op, and that every dumped rank has one box per column; returns
    the boxes of calls a rank has no record of, with the reason they show."""
    recorded = {}
    for rank, dump in dumps.items():
        for e in dump["entries"]:
            if not e["is_p2p"]:
                key = (rank, e["collective_seq_id"])
                recorded[key] = e["state"]
                assert pic.boxes[key] == e["state"], key
                assert pic.ops[key] == e["profiling_name"].split(":", 1)[1], key
    assert set(pic.boxes) == {(r, s) for r in dumps for s in pic.columns}
    return {k: state for k, state in pic.boxes.items() if k not in recorded}


@dataclass
class Scenario:
    results: dict[int, str]  # each rank's RESULT
    report: dict  # the trace's report, as JSON
    picture: Picture  # its --html page, read back
    dumps: dict[int, dict]
    said: str  # each rank's error message and stderr (shown when ``results`` differ)


def run_scenario(mode: str, tmp_path: Path, cli: bool = False) -> Scenario:
    """Run fr_scenario.py on 3 processes, then ``entrenar_pg.trace DIR --json
    --html OUT`` on the dumps (in a new process with ``cli``)."""
    dumps = tmp_path / "dumps"
    page = tmp_path / "trace.html"
    port = free_port()
    extra = dict(
        TIMEOUT_S="2",
        TORCH_FR_BUFFER_SIZE="50",
        TORCH_FR_DUMP_ON_TIMEOUT="1",
        TORCH_FR_DUMP_TEMP_FILE=str(dumps / "rank_"),
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    # forked with torch imported (tests/preloaded.py), each in a session of its own
    procs = [
        start_script(
            [str(SCENARIO), mode, str(VICTIM), str(K)],
            env=rank_env(r, 3, port, **extra),
            new_session=True,
        )
        for r in range(3)
    ]
    results: dict[int, str] = {}
    said: dict[int, str] = {}  # each rank's error message and stderr, for a failing assertion
    try:
        for r, p in enumerate(procs):
            if r == VICTIM and mode != "desync":
                continue
            try:
                out, err = p.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} hung in the {mode} scenario")
            lines = [ln.split(maxsplit=3) for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert lines, f"rank {r} printed no result:\n{out[-2000:]}\n{err[-3000:]}"
            results[int(lines[0][1])] = lines[0][2]
            said[r] = f"rank {r}: {' '.join(lines[0][2:])}\n{err[-3000:]}"
    finally:
        kill_sessions(procs)
    argv = [str(dumps), "--json", "--html", str(page)]
    if cli:
        run = subprocess.run(
            [sys.executable, "-m", "entrenar_pg.trace", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=extra["PYTHONPATH"]),
        )
        assert run.returncode == 0, run.stderr
        stdout = run.stdout
    else:  # the same, without starting torch once more
        with contextlib.redirect_stdout(io.StringIO()) as captured:
            assert trace.main(argv) == 0
        stdout = captured.getvalue()
    reports = json.loads(stdout)
    assert len(reports) == 1, reports
    return Scenario(
        results, reports[0], read_picture(page), load_dir(str(dumps)), "\n".join(said.values())
    )


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_desynchronised_rank_is_diagnosed(tmp_path: Path) -> None:
    sc = run_scenario("desync", tmp_path, cli=True)
    results, rep = sc.results, sc.report
    assert results == dict.fromkeys(range(3), "CollectiveMismatchError"), sc.said
    assert rep["no_dump"] == []
    mm = rep["first_mismatch"]
    assert mm["seq"] == K + 2
    assert mm["odd_ranks"] == [VICTIM]
    for r in (0, 1):
        assert mm["calls"][str(r)]["op"] == "all_reduce"
        assert mm["calls"][str(r)]["input_sizes"] == [[1024]]
    assert mm["calls"][str(VICTIM)]["input_sizes"] == [[512]]
    assert mm["calls"][str(VICTIM)]["input_dtypes"] == ["Float"]
    assert rep["waiting_on"] == [VICTIM]
    # torch's own analyzer, on the same records, finds the same collective
    assert rep["torch_analyzer"][0]["seq"] == K + 2
    assert "SIZE_OR_SYNTAX_MISMATCH" in rep["torch_analyzer"][0]["mismatches"][str(VICTIM)]
    # the picture: rank 2's lane, and its box at #5, are the ones marked
    pic = sc.picture
    assert pic.lanes == [0, 1, 2] and pic.no_dump_lanes == []
    assert pic.culprit_lanes == [VICTIM] and pic.waiting_on == [str(VICTIM)]
    assert pic.columns == list(range(1, K + 3))
    assert unrecorded_boxes(pic, sc.dumps) == {}
    assert pic.mismatch_boxes == [(VICTIM, K + 2)]
    assert pic.mismatch_columns == [K + 2] and pic.stuck_columns == [K + 2]
    assert "everyone was waiting on: rank(s) [2] (called something else at #5)" in "".join(pic.text)


@pytest.mark.timeout(150)
def test_a_stalled_rank_is_diagnosed(tmp_path: Path) -> None:
    sc = run_scenario("stall", tmp_path)
    results, rep = sc.results, sc.report
    assert results == {0: "PeerConnectionError", 1: "PeerConnectionError"}, sc.said
    assert rep["no_dump"] == []  # the victim dumped on demand before it stopped
    assert rep["first_mismatch"] is None
    stuck = rep["first_incomplete"]
    assert stuck["seq"] == K + 2 and stuck["op"] == "all_reduce"
    assert stuck["joined"] == {"0": "started", "1": "started"}
    assert stuck["never_joined"] == [VICTIM]
    assert rep["waiting_on"] == [VICTIM]
    assert rep["culprits"] == {"0": VICTIM, "1": VICTIM}
    # the picture: rank 2's lane stops before #5, where the others are stuck
    pic = sc.picture
    assert pic.lanes == [0, 1, 2] and pic.culprit_lanes == [VICTIM]
    assert pic.columns == list(range(1, K + 3))
    assert unrecorded_boxes(pic, sc.dumps) == {(VICTIM, K + 2): "never issued"}
    assert pic.boxes[(0, K + 2)] == pic.boxes[(1, K + 2)] == "started"
    assert pic.mismatch_boxes == [] and pic.mismatch_columns == []
    assert pic.stuck_columns == [K + 2]


@pytest.mark.timeout(150)
def test_a_killed_rank_is_diagnosed(tmp_path: Path) -> None:
    sc = run_scenario("kill", tmp_path)
    results, rep = sc.results, sc.report
    assert results == {0: "PeerConnectionError", 1: "PeerConnectionError"}, sc.said
    why = f"report: {json.dumps(rep)}\n{sc.said}"  # shown by a failing assertion
    assert rep["no_dump"] == [VICTIM], why
    stuck = rep["first_incomplete"]
    assert stuck["seq"] == K + 2 and stuck["op"] == "all_reduce", why
    # A survivor is in it; the other may still have been finishing the
    # previous call (shared memory: the two are alike) when the first one's
    # abort reached it, and is then "interrupted before"
    joined = stuck["joined"]
    assert joined and set(joined.values()) == {"started"} and stuck["never_joined"] == [], why
    assert set(stuck["joined"]) | {str(r) for r in stuck["interrupted_before"]} == {"0", "1"}, why
    assert rep["waiting_on"] == [VICTIM], why
    # the text report says it too
    text = flight_recorder_text(tmp_path / "dumps")
    assert f"all_reduce #{K + 2}" in text and f"waiting on: rank(s) [{VICTIM}]" in text
    # the picture: rank 2's lane is marked, with no boxes (it left no dump)
    pic = sc.picture
    assert pic.lanes == [0, 1, 2] and pic.culprit_lanes == pic.no_dump_lanes == [VICTIM]
    # A rank interrupted before the stuck call has no record of it: "not reached".
    # (The report's JSON keeps these ranks as ints; only "joined"'s keys are strings.)
    assert unrecorded_boxes(pic, sc.dumps) == {
        (r, K + 2): "not reached" for r in stuck["interrupted_before"]
    }


def flight_recorder_text(dumps: Path) -> str:
    return report_text(diagnose(load_dir(str(dumps))))


# ---------------------------------------------------------------------- in one process


GLOO_DUMP = """
import os, pickle, sys, torch, torch.distributed as dist
import torch._C._distributed_c10d as c10d
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
d = pickle.loads(c10d._dump_fr_trace())
print(sorted(d), sorted(d["entries"][0]), sorted(d["entries"][0]["frames"][0]), sep="\\n")
"""


def gloo_dump_keys() -> list[list[str]]:
    """torch 2.13's own dump keys (top level, entry, frame), from a real gloo group."""
    out = subprocess.run(
        [sys.executable, "-c", GLOO_DUMP, str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, TORCH_FR_BUFFER_SIZE="10"),
    )
    assert out.returncode == 0, out.stderr
    return [ast.literal_eval(line) for line in out.stdout.splitlines()[-3:]]


@pytest.mark.timeout(90)
def test_dumps_have_torchs_fields_and_its_loader_reads_them(tmp_path: Path) -> None:
    from torch.distributed.flight_recorder.components.loader import read_dump

    groups = make_groups(2, Options(fr_buffer_size=16))
    try:

        def work(rank: int, g) -> int:
            t = torch.ones(256)
            line = sys._getframe().f_lineno + 1
            g.allreduce([t]).wait()
            g.broadcast([t]).wait()
            if rank == 0:
                g.send([t], 1, 7).wait()
            else:
                g.recv([t], 0, 7).wait()
            return line

        line = run_ranks(2, work, groups=groups)[1]
        path = entrenar_pg.dump_flight_recorder(groups[1], str(tmp_path / "trace_rank_1"))
    finally:
        for g in groups:
            g.shutdown()
    with open(path, "rb") as f:
        dump = pickle.load(f)
    top, entry_keys, frame_keys = gloo_dump_keys()
    assert set(top) <= set(dump) and set(dump) - set(top) == {"entrenar"}
    for e in dump["entries"]:
        assert set(e) == set(entry_keys)
        for frame in e["frames"]:
            assert set(frame) == set(frame_keys)
    assert dump["version"] == "2.10"
    assert all(cfg["backend"] == "entrenar" for cfg in dump["pg_config"].values())
    names = [e["profiling_name"] for e in dump["entries"]]
    assert names == ["entrenar:all_reduce", "entrenar:broadcast", "entrenar:recv 1<-0"]
    recv = dump["entries"][-1]
    assert recv["is_p2p"] and recv["p2p_seq_id"] == 1 and recv["collective_seq_id"] == 2
    assert [e["state"] for e in dump["entries"]] == ["completed"] * 3
    assert dump["entries"][0]["input_sizes"] == [[256]]
    caller = dump["entries"][0]["frames"][0]  # the caller's frame first, its line
    assert (caller["name"], caller["filename"], caller["line"]) == ("work", __file__, line)
    loaded = read_dump("trace_rank_", path)
    assert loaded["rank"] == 1 and len(loaded["entries"]) == 3


@pytest.mark.timeout(60)
def test_the_ring_keeps_the_last_n() -> None:
    def work(rank: int, g) -> list[int]:
        for _ in range(10):
            g.allreduce([torch.ones(8)]).wait()
        return [e.seq for e in g._runtime.recorder.entries()]

    seqs = run_ranks(2, work, options=Options(fr_buffer_size=4))
    assert seqs == [[7, 8, 9, 10]] * 2


@pytest.mark.timeout(60)
def test_nothing_is_recorded_when_off(tmp_path: Path) -> None:
    before = set(flight_recorder._recorders)
    groups = make_groups(2, Options())
    try:
        run_ranks(2, lambda r, g: g.allreduce([torch.ones(8)]).wait(), groups=groups)
        assert all(g._runtime.recorder is None for g in groups)
        assert set(flight_recorder._recorders) <= before
        with pytest.raises(ValueError, match="keeps no flight recorder"):
            entrenar_pg.dump_flight_recorder(groups[0], str(tmp_path / "x0"))
    finally:
        for g in groups:
            g.shutdown()


def test_options_read_torchs_names() -> None:
    env = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "7",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/old_",
    }
    o = Options.from_env(env)
    assert (o.fr_buffer_size, o.fr_dump_on_timeout, o.dump_prefix()) == (7, True, "/x/old_")
    o = Options.from_env(dict(env, TORCH_FR_BUFFER_SIZE="9", TORCH_FR_DUMP_TEMP_FILE="/y/new_"))
    assert (o.fr_buffer_size, o.dump_prefix()) == (9, "/y/new_")
    assert Options.from_env({"HOME": "/h"}).fr_dump_prefix == ""
    with pytest.raises(ValueError, match="TORCH_FR_BUFFER_SIZE"):
        Options.from_env({"TORCH_FR_BUFFER_SIZE": "lots"})
    with pytest.raises(ValueError, match="fr_buffer_size"):
        Options(fr_buffer_size=-1)


def _dump(rank: int, calls: list[tuple[int, list[int], str]], culprit: int | None) -> dict:
    """A dump in torch's format: ``calls`` are (seq, input size, state) of all_reduce."""
    entries = [
        {
            "record_id": seq,
            "process_group": ("0", "default_pg"),
            "collective_seq_id": seq,
            "p2p_seq_id": 0,
            "profiling_name": "entrenar:all_reduce",
            "input_sizes": [size],
            "input_dtypes": ["Float"],
            "output_sizes": [size],
            "output_dtypes": ["Float"],
            "state": state,
            "time_created_ns": seq * 1000,
            "time_discovered_started_ns": seq * 1000 + 10,
            "time_discovered_completed_ns": seq * 1000 + 20 if state == "completed" else None,
            "is_p2p": False,
        }
        for seq, size, state in calls
    ]
    failures = {}
    if culprit is not None:
        failure = {
            "culprit": culprit,
            "at": "x",
            "message": "",
            "error_class": "PeerConnectionError",
        }
        failures["0"] = failure
    return {
        "version": "2.10",
        "pg_config": {"0": {"desc": "default_pg", "ranks": "[0, 1, 2]"}},
        "entries": entries,
        "entrenar": {"failures": failures},
    }


def test_a_rank_interrupted_in_an_earlier_call_is_not_the_one_waited_on() -> None:
    """Rank 0 (a star's root) completed #4 and is in #5; leaf 1 was still
    reading #4's result when the failure reached it; rank 2 left no dump."""
    dumps = {
        0: _dump(0, [(4, [4], "completed"), (5, [4], "started")], culprit=2),
        1: _dump(1, [(4, [4], "started")], culprit=2),
    }
    (rep,) = diagnose(dumps)
    stuck = rep.first_incomplete
    assert stuck is not None
    assert (stuck["seq"], stuck["joined"], stuck["never_joined"]) == (5, {0: "started"}, [])
    assert stuck["interrupted_before"] == [1]
    assert rep.no_dump == [2] and rep.waiting_on == [2]


def test_a_disagreement_without_majority_names_no_side() -> None:
    dumps = {
        0: _dump(0, [(5, [4], "started")], culprit=None),
        1: _dump(1, [(4, [4], "started")], culprit=None),
        2: _dump(2, [(5, [8], "started")], culprit=None),
    }
    (rep,) = diagnose(dumps)
    mm = rep.first_mismatch
    assert mm is not None and mm["seq"] == 5
    assert mm["odd_ranks"] == [] and mm["absent"] == [1]
    assert "no majority" in report_text([rep])
    # the picture marks both sides, and rank 1 (still in #4) did not reach #5
    pic = parse_picture(render_html([rep], dumps))
    assert pic.mismatch_boxes == [(0, 5), (2, 5)] and pic.culprit_lanes == []
    assert pic.boxes[(1, 5)] == "not reached" and pic.mismatch_columns == [5]


def test_the_picture_of_a_long_ring_shows_the_calls_around_the_stuck_one() -> None:
    """21 collectives: rank 0 is in #21, rank 1 still in #20, rank 2 (the
    culprit) completed #20 and never issued #21. The picture draws the last few
    and says the earlier ones were left out; what it marks comes from the
    analysis. The group's name is markup, drawn as text."""
    done = [(s, [4], "completed") for s in range(1, 20)]
    dumps = {
        0: _dump(0, [*done, (20, [4], "completed"), (21, [4], "started")], culprit=2),
        1: _dump(1, [*done, (20, [4], "started")], culprit=2),
        2: _dump(2, [*done, (20, [4], "completed")], culprit=None),
    }
    for d in dumps.values():
        d["pg_config"]["0"]["desc"] = "<img src=x>"
    reports = diagnose(dumps)
    page = render_html(reports, dumps, source="<dir>")
    pic = parse_picture(page)
    assert pic.lanes == [0, 1, 2] and pic.culprit_lanes == [2] and pic.waiting_on == ["2"]
    assert pic.columns == list(range(21 - BEFORE, 22)) and pic.stuck_columns == [21]
    assert unrecorded_boxes(pic, {r: trim(d, 21 - BEFORE) for r, d in dumps.items()}) == {
        (1, 21): "not reached",
        (2, 21): "never issued",
    }
    assert f"… {20 - BEFORE} earlier" in pic.text and pic.mismatch_boxes == []
    assert "process group 0 (<img src=x>): everyone was waiting on: rank(s) [2]" in "".join(
        pic.text
    )


def trim(dump: dict, first_seq: int) -> dict:
    """``dump`` without the collectives before ``first_seq`` (the picture's window)."""
    entries = [e for e in dump["entries"] if e["collective_seq_id"] >= first_seq]
    return dict(dump, entries=entries)

"""The wait-for walk on its own (transport/wait_for.py): tables of answers, no sockets."""

from __future__ import annotations

from dataclasses import dataclass, field

from entrenar_pg.transport.wait_for import Gone, PeerState, walk


@dataclass
class Table:
    """A WaitForGraph from fixed answers; records who was asked, in which rounds."""

    states: dict[int, PeerState | None]
    ends: dict[int, Gone] = field(default_factory=dict)
    rounds: list[list[int]] = field(default_factory=list)
    late: dict[int, PeerState] = field(default_factory=dict)  # answers only when asked again
    # (origin, culprit): a rank heard to fail, once the walk waits for a verdict
    failed: tuple[int, int] | None = None
    verdict_waits: list[float] = field(default_factory=list)

    def ask(self, peers: list[int], answer_s: float) -> dict[int, PeerState | None]:
        self.rounds.append(list(peers))
        got = {q: self.states.get(q) for q in peers}
        self.states.update(self.late)  # a slow rank's answer is in by the next ask
        return got

    def gone(self, peer: int) -> Gone | None:
        return self.ends.get(peer)

    def verdict(self, wait_s: float) -> tuple[int, int] | None:
        self.verdict_waits.append(wait_s)
        return self.failed


def test_the_walk_follows_waiters_to_the_silent_rank():
    g = Table({1: PeerState("allreduce #3", (2,)), 2: PeerState("allreduce #3", (3,)), 3: None})
    b = walk(g, 0, [1], "allreduce #3", 0.5)
    assert b.culprit == 3
    assert "rank 3 does not answer within 0.5s" in b.story
    assert "rank 1 is in allreduce #3 waiting on rank(s) [2]" in b.story
    assert g.rounds == [[1], [2], [3], [3]]  # one hop per round; only silence is asked twice


def test_a_rank_outside_the_collective_is_blamed():
    g = Table({1: PeerState(None, ())})
    b = walk(g, 0, [1, 1], "broadcast #7", 0.5)
    assert b.culprit == 1 and "not inside any collective" in b.story
    assert "broadcast #7" in b.story


def test_an_ended_rank_names_its_own_culprit_or_itself():
    g = Table(
        {1: None, 2: None}, {1: Gone("failed: boom", culprit=5), 2: Gone("has left the group")}
    )
    assert walk(g, 0, [1], "x", 0.1).culprit == 5
    left = walk(g, 0, [2], "x", 0.1)
    assert left.culprit == 2 and "rank 2 has left the group" in left.story
    self_blamed = Table({1: None}, {1: Gone("failed: its own error", culprit=1)})
    assert walk(self_blamed, 0, [1], "x", 0.1).culprit == 1


def test_a_peers_own_verdict_is_taken():
    g = Table({1: PeerState("allreduce #1", (2,), blamed=4)})
    b = walk(g, 0, [1], "allreduce #1", 0.1)
    assert b.culprit == 4 and "rank 1 found rank 4 stalled" in b.story


def test_a_cycle_blames_nobody_and_no_waiting_starts_no_walk():
    g = Table({1: PeerState("a", (0, 2)), 2: PeerState("a", (1,))})
    b = walk(g, 0, [1], "a", 0.1)
    assert b.culprit is None and "a cycle" in b.story
    assert walk(Table({}), 0, [], "a", 0.1).culprit is None


def test_in_one_round_an_answer_outweighs_silence():
    """Regression (the suite under load, N=8: rank 3 blamed rank 0, alive but
    slow to answer, where rank 5, asked in the same round, answered that it
    is not in the collective; every other rank blamed 5): the strongest
    evidence of a round wins, whatever the ranks' order."""
    g = Table(
        {
            2: PeerState("allreduce #1", (1, 3, 6)),
            4: PeerState("allreduce #1", (0, 3, 5, 6)),
            0: None,  # alive, but its answer came too late
            1: PeerState("allreduce #1", (0, 2, 5)),
            5: PeerState(None, ()),
            6: PeerState("allreduce #1", (5,)),
        }
    )
    b = walk(g, 3, [2, 4], "allreduce #1", 0.5)
    assert b.culprit == 5 and "rank 5 is not inside any collective" in b.story, b
    assert g.rounds == [[2, 4], [0, 1, 5, 6]]
    # A peer's own verdict outweighs both; an ended rank outweighs silence.
    g.states[6] = PeerState("allreduce #1", (5,), blamed=7)
    assert walk(g, 3, [2, 4], "allreduce #1", 0.5).culprit == 7
    ended = Table({1: None, 2: None}, {2: Gone("has left the group")})
    assert walk(ended, 0, [1, 2], "x", 0.1).culprit == 2
    # Silence alone still blames the silent rank.
    assert walk(Table({1: PeerState("x", (2,)), 2: None}), 0, [1], "x", 0.1).culprit == 2


def test_a_rank_silent_once_is_asked_again_before_it_is_blamed():
    """Regression (CI under load, N=8 own hosts, a gather rank 5 never joins:
    rank 3 blamed rank 0, alive and waiting on 5 but slow to answer within
    0.5 s, while every other rank named 5): silence is asked twice."""
    g = Table({0: None, 5: PeerState(None, ())}, late={0: PeerState("gather #1", (5,))})
    b = walk(g, 3, [0], "gather #1", 0.5)
    assert b.culprit == 5 and "rank 0 is in gather #1 waiting on rank(s) [5]" in b.story, b
    assert g.rounds == [[0], [0], [5]]
    # An answer in the first ask needs no second one.
    quick = Table({0: PeerState("gather #1", (5,)), 5: PeerState(None, ())})
    assert walk(quick, 3, [0], "gather #1", 0.5).culprit == 5
    assert quick.rounds == [[0], [5]]


def test_a_rank_silent_twice_yields_to_another_ranks_verdict():
    """Regression guard (the same gather, rank 5 never joining, failed once
    more in a local suite under load; its message was lost): before blaming
    silence, the walk waits one more window for any rank's verdict (here
    rank 2's, which found rank 5) and takes it; with none, silence blames the
    silent rank, as before."""
    g = Table({0: None}, failed=(2, 5))
    b = walk(g, 3, [0], "gather #1", 0.5)
    assert b.culprit == 5, b
    assert "rank(s) 0 did not answer; rank 2 failed naming rank 5" in b.story, b
    assert g.rounds == [[0], [0]] and g.verdict_waits == [0.5]
    alone = Table({0: None})
    b = walk(alone, 3, [0], "gather #1", 0.5)
    assert b.culprit == 0 and "does not answer within 0.5s, asked twice" in b.story, b
    assert alone.verdict_waits == [0.5]
    # Stronger evidence in the walk itself never waits for one.
    ended = Table({0: PeerState("gather #1", (5,)), 5: PeerState(None, ())}, failed=(2, 7))
    assert walk(ended, 3, [0], "gather #1", 0.5).culprit == 5
    assert ended.verdict_waits == []

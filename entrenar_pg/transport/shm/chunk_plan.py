"""Where a two-rank large shm allreduce puts its chunks, chosen by rank 0 from the calls' own times.

Two ranks only (``SlotArea.chunk_plan``; three or more keep every chunk at
the slots' start in 4 MiB slots: rotating measured slower there at N=4,
docs/benchmarks.md). The large path (``collectives/shm_allreduce.py``)
moves a message through the slots in 4 MiB chunks, either each chunk at the start of the slots
(*in place*: the lines a chunk writes were read by the peers two phases
ago) or the chunks *rotating* over the four 4 MiB quarters of the 16 MiB
slots (a quarter is written again four chunks later). Which is faster
depends on the machine's state, and the state changes under a running
job: this 2-vCPU VM alternates, for seconds to minutes, between a state
where a line written on one vCPU reaches the other fast (a C ping-pong's
round trip ~110 ns) and one where it is slow (~500 ns; docs/benchmarks.md,
"the two states"). In the first, in place wins (the chunks stay in the
caches); in the second, rewriting lines the peer has just read costs
more than the cache footprint of rotating, and in place falls behind
DeepSpeed's 32 MiB chunks. Neither wins in both, and no rank can see the
state, so rank 0 measures:

- ``ChunkChoice`` keeps, per message size class (its power of two) and
  placement of the chunks, a moving estimate of the seconds per byte of
  rank 0's CPU time in the call from the first meeting (every rank has
  arrived: a late peer is no property of the placement) to the end. CPU
  time, not the clock's: on a loaded machine a preempted call's wall time
  says nothing of its placement (measured: with wall times the choice went
  wrong at load 2-4, 16 MiB at 1.30x the previous release in the near
  state). A cheaper call sets the estimate, a dearer one moves it halfway
  (and counts as at most twice it); the first call of each is not counted
  (its page faults). It picks the placement with the lower estimate, and
  now and then (``EXPLORE_EVERY``) the other one, so a stale estimate is
  renewed after a change of state.
- ``ChunkPlan`` makes every rank run the same placement without a message
  of its own: rank 0 writes its choice for the *next* chunked call into one of two
  words of its slot area's control page (tagged with that call's number),
  before its first publish of this call. A rank reads the word for its call
  at the call's start; it got there only after seeing rank 0's publishes of
  the previous call, so (x86-64: stores are seen in program order) the
  word is there, and rank 0 cannot rewrite it (two calls later) before
  every rank has published in this call, after reading it. An untagged
  word (the first call) means in place on every rank alike.
"""

from __future__ import annotations

# One call in EXPLORE_EVERY runs the placement not chosen; each such call
# that does not change the choice doubles the gap (to EXPLORE_MAX). An
# explored call costs 1.5-1.7x in the near state (docs/benchmarks.md): ~4 %
# of a steady state's time at 16, ~0.5 % at 128. The choice follows a state
# that slows the placement chosen within a few calls, one that only speeds
# up the other within EXPLORE_MAX calls.
EXPLORE_EVERY = 16
EXPLORE_MAX = 128
# After a change of choice the placement left is tried again CONFIRM_AFTER
# calls later (then the gap doubles as above): a burst of other work that
# inflated the chosen placement's estimate (a disturbed call counts up to
# twice it) could flip the choice to the slower one, which then ran until
# the next exploration: measured, 16 calls at 1.5x in a near state (64 MiB,
# 6.4 -> 10 ms). A real change of state costs a few explored calls instead.
CONFIRM_AFTER = 2
_WEIGHT = 0.5  # of a new time in a size's estimate (states last seconds: follow fast)


class ChunkChoice:
    """Rank 0's record of the calls' times per (size class, placement), and its choice."""

    def __init__(self) -> None:
        self._per_byte: dict[tuple[int, bool], float] = {}
        # (size class, placement) seen once: a first call touches its slot pages
        # first (page faults: measured, it kept rotating's estimate high for ~120
        # calls in a far state), so the first call of each is not counted
        self._warm: set[tuple[int, bool]] = set()
        self._size_class = 0  # of the latest call: the next one is likely the same
        self._chosen = False  # the placement the estimates favour
        self._gap = EXPLORE_EVERY  # calls between explorations now
        self._since = 0  # calls since the last exploration

    def record(self, rotate: bool, nbytes: int, seconds: float) -> None:
        """A call of ``nbytes``, its chunks rotating (or in place), took ``seconds`` of its own."""
        self._size_class = nbytes.bit_length()
        key = (self._size_class, rotate)
        if key not in self._warm:
            self._warm.add(key)
            return
        now = seconds / max(nbytes, 1)
        old = self._per_byte.get(key)
        if old is None or now < old:
            # Down at once: a disturbance only adds time, so a cheaper call is
            # the placement's cost now (one explored call undoes an estimate
            # that a burst of other work inflated: measured, ~20 calls in place
            # in a far state otherwise).
            self._per_byte[key] = now
        else:  # up by half, and one disturbed call by at most half the estimate
            self._per_byte[key] = old + _WEIGHT * (min(now, 2 * old) - old)

    def next_rotates(self) -> bool:
        """Rotate the next call's chunks? The faster estimate; the other while
        it has no estimate, and once per gap (see ``EXPLORE_EVERY``,
        ``CONFIRM_AFTER``)."""
        in_place = self._per_byte.get((self._size_class, False))
        rotating = self._per_byte.get((self._size_class, True))
        if in_place is None or rotating is None:
            return in_place is not None  # try the one not measured yet (in place first)
        faster = rotating < in_place
        if faster != self._chosen:  # the state changed (or the noise did): check it soon
            self._chosen, self._gap, self._since = faster, CONFIRM_AFTER, 0
        self._since += 1
        if self._since < self._gap:
            return faster
        self._since, self._gap = 0, min(2 * self._gap, EXPLORE_MAX)
        return not faster


class ChunkPlan:
    """Every rank's view of rank 0's chunk-size words (see the module).

    ``words``: rank 0's control page as 'q'; ``index``: the first of its
    two plan words; ``choice``: rank 0's ``ChunkChoice`` (None elsewhere).
    """

    def __init__(self, words: memoryview, index: int, choice: ChunkChoice | None) -> None:
        self._words = words
        self._index = index
        self._choice = choice
        self._calls = 0  # chunked calls begun on this group (the same count on every rank)

    def begin(self) -> bool:
        """Whether this chunked call's chunks rotate, the same on every rank.
        Rank 0 also writes its choice for the next chunked call, before it
        publishes anything of this one."""
        call = self._calls
        self._calls = call + 1
        word = self._words[self._index + (call & 1)]
        rotate = word == (call << 1) | 1
        if self._choice is not None:
            nxt = call + 1
            self._words[self._index + (nxt & 1)] = (nxt << 1) | int(self._choice.next_rotates())
        return rotate

    def record(self, rotate: bool, nbytes: int, seconds: float) -> None:
        """Rank 0 learns what the call cost (elsewhere nothing)."""
        if self._choice is not None:
            self._choice.record(rotate, nbytes, seconds)

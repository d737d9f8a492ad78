"""Expected peaks: how much device memory a rank will reach in the slot turn it is about to start.

A rank grows while it holds a slot (the first micro-batches' activations, optimizer state at the
first step), so admitting it by what it held when it last blocked lets it outgrow the device. Each
rank reports, as it blocks, the peak of the turn that just ended (``staging.footprint_and_peak``);
turns are keyed by (iteration, position): the iteration counts the program's ``iteration`` begin
marks (0: set-up before the first), the position counts turns begun in it. A training iteration
repeats what the last one did, but not always from the same base: state created at the end of
iteration 1 (the optimizer's) is held through iteration 2's turns, which iteration 1's did not
hold. So a turn is remembered by its peak and by its rise (peak less what the rank held as it
began), and the expected peak is the larger of that peak and what the rank holds now plus that
rise. Those figures come, in this order, from:

1. the rank's own peak at the same position of its previous iteration (positions within
   ``SLACK`` of it, since a turn more or less in an iteration shifts the rest; the whole iteration's
   peak where the position is past that iteration's end);
2. its class's peak at this position of this iteration, where another member already ran it
   (members of a class run the same program on the same shapes: data-parallel replicas, one
   pipeline stage role);
3. the class's peak at this position of the previous iteration, else the peak of any member's
   complete iteration;
4. nothing known (None): the caller uses a bound it can defend (``MemoryGovernor``: the device, or
   the target GPU's cap when the allocator is capped).

Figures are the ranks' reports (allocator reserved + context estimate); the governor adds each
rank's NVML offset. Only the last two iterations are kept per rank and class.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

SLACK = 1  # positions either side of a turn's own whose peaks also bound it

Key = tuple[int, int]  # (iteration, position)
Turn = tuple[int, int]  # (peak, rise) bytes


class PeakTracker:
    def __init__(self, class_of: Callable[[int], Hashable] | None = None) -> None:
        self.class_of: Callable[[int], Hashable] = class_of or (lambda r: r)
        self._iteration: dict[int, int] = {}  # rank -> iteration marks begun (0: set-up)
        self._position: dict[int, int] = {}  # rank -> turns begun in that iteration
        self._turn: dict[int, tuple[Key, int]] = {}  # rank -> (key, bytes held at its start) of its turn
        self._own: dict[int, dict[Key, Turn]] = {}  # rank -> its turns
        self._class: dict[Hashable, dict[Key, Turn]] = {}  # class -> max over members per turn
        self._complete: dict[Hashable, Turn] = {}  # class -> max over any member's complete iterations
        self._finished: dict[int, int] = {}  # rank -> last iteration of its own counted complete

    def next_key(self, rank: int) -> Key:
        return self._iteration.get(rank, 0), self._position.get(rank, 0)

    def turn_began(self, rank: int, held: int = 0) -> None:
        """``rank`` was admitted holding ``held`` bytes: its turn is the next key."""
        self._turn[rank] = (self.next_key(rank), held)
        self._position[rank] = self._position.get(rank, 0) + 1

    def iteration_began(self, rank: int) -> None:
        self._iteration[rank] = self._iteration.get(rank, 0) + 1
        self._position[rank] = 0

    def turn_ended(self, rank: int, peak: int) -> None:
        """``rank`` blocked: ``peak`` bytes was the most it held in the turn that just ended."""
        key, held = self._turn.pop(rank, (self.next_key(rank), peak))  # no admitted turn: nothing known of a rise
        turn = (peak, max(peak - held, 0))
        own = self._own.setdefault(rank, {})
        own[key] = _max(own.get(key), turn)
        c = self.class_of(rank)
        members = self._class.setdefault(c, {})
        members[key] = _max(members.get(key), turn)
        # every turn of the iterations before this one has ended (a rank runs one turn at a time)
        done = [i for i in {k[0] for k in own} if 1 <= i < key[0] and i > self._finished.get(rank, 0)]
        for i in sorted(done):
            self._complete[c] = _max(self._complete.get(c), _iteration_max(own, i))
            self._finished[rank] = i
        keep = key[0] - 1
        for table in (own, members):
            for k in [k for k in table if k[0] < keep]:
                del table[k]

    def expected(self, rank: int, held: int = 0) -> tuple[int | None, str]:
        """Expected peak of ``rank``'s next turn, which it begins holding ``held`` bytes, and where it
        comes from ('own', 'class', or '' when nothing is known)."""
        turn, source = self._expected_turn(rank)
        if turn is None:
            return None, ""
        return max(turn[0], held + turn[1]), source

    def _expected_turn(self, rank: int) -> tuple[Turn | None, str]:
        it, pos = self.next_key(rank)
        own = self._own.get(rank, {})
        if it >= 2 and _has_iteration(own, it - 1):
            return _around(own, it - 1, pos), "own"
        c = self.class_of(rank)
        members = self._class.get(c, {})
        if (it, pos) in members:
            return _window(members, it, pos), "class"
        if it >= 2 and _has_iteration(members, it - 1):
            return _around(members, it - 1, pos), "class"
        if c in self._complete:
            return self._complete[c], "class"
        return None, ""

    def next_iteration_peak(self, rank: int, held: int) -> int:
        """What ``rank``, holding ``held`` bytes now, may reach in its next iteration by its latest one: that
        iteration's peak, or what it holds now plus the most a turn of it rose, whichever is more (state
        made at an iteration's end, the optimizer's, is held through the next one's turns). 0 if nothing
        is known of it."""
        own = self._own.get(rank, {})
        latest = max((k[0] for k in own), default=0)
        turns = [t for k, t in own.items() if k[0] == latest]
        if not turns:
            return 0
        return max(max(t[0] for t in turns), held + max(t[1] for t in turns))

    def peak_so_far(self, rank: int) -> int:
        """The most ``rank`` reported in the turns kept (its last two iterations); 0 if none."""
        return max((t[0] for t in self._own.get(rank, {}).values()), default=0)

    def forget(self, rank: int) -> None:
        self._turn.pop(rank, None)


def _max(a: Turn | None, b: Turn) -> Turn:
    return b if a is None else (max(a[0], b[0]), max(a[1], b[1]))


def _has_iteration(table: dict[Key, Turn], it: int) -> bool:
    return any(k[0] == it for k in table)


def _iteration_max(table: dict[Key, Turn], it: int) -> Turn:
    out = None
    for k, v in table.items():
        if k[0] == it:
            out = _max(out, v)
    return out


def _window(table: dict[Key, Turn], it: int, pos: int) -> Turn:
    out = None
    for p in range(pos - SLACK, pos + SLACK + 1):
        if (it, p) in table:
            out = _max(out, table[(it, p)])
    return out


def _around(table: dict[Key, Turn], it: int, pos: int) -> Turn:
    """The turns of iteration ``it`` within SLACK of ``pos``; the whole iteration's past its end."""
    return _window(table, it, pos) if (it, pos) in table else _iteration_max(table, it)

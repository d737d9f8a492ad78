"""Expected peaks: how much device memory a rank will reach in the slot turn it is about to start.

A rank grows while it holds a slot (the first micro-batches' activations, optimizer state at the
first step), so admitting it by what it held when it last blocked lets it outgrow the device. Each
rank reports, as it blocks, the peak of the turn that just ended (``staging.footprint_and_peak``);
turns are keyed by (iteration, position): the iteration counts the program's ``iteration`` begin
marks (0: set-up before the first), the position counts turns begun in it. A training iteration
repeats what the last one did, so the expected peak of a turn is, in this order:

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


class PeakTracker:
    def __init__(self, class_of: Callable[[int], Hashable] | None = None) -> None:
        self.class_of: Callable[[int], Hashable] = class_of or (lambda r: r)
        self._iteration: dict[int, int] = {}  # rank -> iteration marks begun (0: set-up)
        self._position: dict[int, int] = {}  # rank -> turns begun in that iteration
        self._turn: dict[int, Key] = {}  # rank -> key of the turn it is computing
        self._own: dict[int, dict[Key, int]] = {}  # rank -> peak per turn
        self._class: dict[Hashable, dict[Key, int]] = {}  # class -> max over members per turn
        self._complete: dict[Hashable, int] = {}  # class -> peak of any member's complete iteration
        self._finished: dict[int, int] = {}  # rank -> last iteration of its own counted complete

    def next_key(self, rank: int) -> Key:
        return self._iteration.get(rank, 0), self._position.get(rank, 0)

    def turn_began(self, rank: int) -> None:
        """``rank`` was admitted: its turn is the next key."""
        self._turn[rank] = self.next_key(rank)
        self._position[rank] = self._position.get(rank, 0) + 1

    def iteration_began(self, rank: int) -> None:
        self._iteration[rank] = self._iteration.get(rank, 0) + 1
        self._position[rank] = 0

    def turn_ended(self, rank: int, peak: int) -> None:
        """``rank`` blocked: ``peak`` bytes was the most it held in the turn that just ended."""
        key = self._turn.pop(rank, None)
        if key is None:  # a report with no admitted turn (not under the governor's grants)
            key = self.next_key(rank)
        own = self._own.setdefault(rank, {})
        own[key] = max(own.get(key, 0), peak)
        c = self.class_of(rank)
        members = self._class.setdefault(c, {})
        members[key] = max(members.get(key, 0), peak)
        # every turn of the iterations before this one has ended (a rank runs one turn at a time)
        done = [i for i in {k[0] for k in own} if 1 <= i < key[0] and i > self._finished.get(rank, 0)]
        for i in sorted(done):
            self._complete[c] = max(self._complete.get(c, 0), _iteration_peak(own, i))
            self._finished[rank] = i
        keep = key[0] - 1
        for table in (own, members):
            for k in [k for k in table if k[0] < keep]:
                del table[k]

    def expected(self, rank: int) -> tuple[int | None, str]:
        """Expected peak of ``rank``'s next turn and where it comes from ('own', 'class', or '' when
        nothing is known)."""
        it, pos = self.next_key(rank)
        own = self._own.get(rank, {})
        if it >= 2 and _has_iteration(own, it - 1):
            return _around(own, it - 1, pos), "own"
        c = self.class_of(rank)
        members = self._class.get(c, {})
        if (it, pos) in members:
            return max(members.get((it, p), 0) for p in range(pos - SLACK, pos + SLACK + 1)), "class"
        if it >= 2 and _has_iteration(members, it - 1):
            return _around(members, it - 1, pos), "class"
        if c in self._complete:
            return self._complete[c], "class"
        return None, ""

    def peak_so_far(self, rank: int) -> int:
        """The most ``rank`` reported in the turns kept (its last two iterations); 0 if none."""
        return max(self._own.get(rank, {}).values(), default=0)

    def forget(self, rank: int) -> None:
        self._turn.pop(rank, None)


def _has_iteration(table: dict[Key, int], it: int) -> bool:
    return any(k[0] == it for k in table)


def _iteration_peak(table: dict[Key, int], it: int) -> int:
    return max(v for k, v in table.items() if k[0] == it)


def _around(table: dict[Key, int], it: int, pos: int) -> int:
    """The peaks of iteration ``it`` within SLACK of ``pos``; the iteration's peak past its end."""
    if (it, pos) not in table:
        return _iteration_peak(table, it)
    return max(table.get((it, p), 0) for p in range(pos - SLACK, pos + SLACK + 1))

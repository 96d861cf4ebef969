"""Which rank takes a request: per-rank load snapshots and in-flight id sets, in one object.

Theory of operation
-------------------
One object holds both the last load each rank reported and the ids this client has in
flight on each rank, because every decision reads both and the SMG connector learned the
hard way that two separately locked maps deadlock (see docs/design.md). Here there
are no locks at all: the object is used from one trio task at a time.

* `select` scores every up rank as
  ``max(own_inflight, waiting + running) + waiting * 6 * max(0, kv - 0.5)``
  and reserves the winner in the same call. The in-flight floor makes a burst between
  two load reports spread out instead of piling onto one stale minimum. The winner is
  the first strictly lowest score in rotated order: from a start index that moves by one
  per unpinned pick (even one that raises; pinned picks leave it alone), wrapping. So
  ties (a cold start) go round-robin. No up rank, or none with a finite score:
  `NoEngineAvailable`.
* Below `TREE_MIN_SIZE` ranks the winner is found by scanning every rank. From there on
  an index keeps a pick at O(log N) instead of O(N): a min segment tree (an implicit
  binary tree in one list; node i has children 2i and 2i + 1, node 1 is the root) whose
  leaf r holds rank r's score, +inf for a down rank and for the padding up to a power of
  two. The winner is the first leaf at or after the start, wrapping, that equals the
  root: climb from the start leaf to the first subtree to its right whose minimum is
  the root's and descend into it, or, if there is none, descend from the root (the first
  minimum of all). That is the scan's choice exactly, ties included, and an up rank with
  an infinite score is skipped by both. Every change to a score (the reservation in
  `select`, `release` and the load zeroing in it, `observe_load`, `set_up`, `take_down`)
  rewrites its leaf with what `score` returns, so both compare the same floats (never
  NaN: an unknown KV usage adds nothing). tests/core/test_routing.py runs the two
  side by side.
* Admission: a rank may have an in-flight cap (`set_cap`). A rank at its cap is not a
  candidate (its leaf is +inf, as for a down rank); a request pinned to it, or an
  unpinned one when every up rank is at its cap, raises `Overloaded`, distinct from
  `NoEngineAvailable` (no rank up at all). A cap lowered below what a rank holds takes
  nothing away: the rank just gets no more until it is under the cap.
* In-flight slots are held **by id**, never by count. A request can end along several
  racing paths (terminal output, `finished`, abort, rollback) and `release` is called on
  more than one of them; removing an id twice must free one slot, not two.
* A rank's last report was sampled before its last request finished. So when its set
  becomes empty, its reported queue counts are stale by construction and are zeroed
  (KV usage is kept: cache pages outlive requests). For the same reason a report that
  arrives while the set is empty is stored with zero queue counts.
* Reports carry a per-incarnation `seq`; one older than a report already applied is
  ignored. Taking a rank down forgets its snapshot and returns the ids it held.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar

from .errors import InvalidRank, NoEngineAvailable, Overloaded
from .messages import Load

__all__ = ["KV_THRESHOLD", "KV_WEIGHT", "Routing"]

KV_WEIGHT = 6.0
KV_THRESHOLD = 0.5
_IDLE = Load()


class Routing:
    """Least-loaded selection with in-flight reservations, for ranks ``0 .. size-1``.

    `tree` forces the selection index on (True) or off (False); by default it is used
    when `size` is at least `TREE_MIN_SIZE`. Both choose the same ranks."""

    __slots__ = (
        "_cap",
        "_inflight",
        "_leaves",
        "_load",
        "_next_start",
        "_seq",
        "_tree",
        "_up",
        "size",
    )

    TREE_MIN_SIZE: ClassVar[int] = 8
    """The smallest group that selects through the index. A select + release pair breaks
    even at 3 to 4 ranks, but the index also adds about 0.35 µs to every load report;
    at 8 a pair is about 1.2 µs cheaper than the scan (benchmarks/bench_p6_selection.py)."""

    def __init__(self, size: int, *, up: bool = False, tree: bool | None = None) -> None:
        if size < 1:
            raise ValueError(f"a group needs at least one rank, got {size}")
        self.size = size
        self._up = [up] * size
        self._inflight: list[set[str]] = [set() for _ in range(size)]
        self._load: list[Load] = [_IDLE] * size
        self._seq: list[int | None] = [None] * size
        self._cap: list[int | None] = [None] * size
        self._next_start = 0
        if tree is None:
            tree = size >= self.TREE_MIN_SIZE
        # The min segment tree: node i has children 2i and 2i + 1, node 1 is the root,
        # leaf `leaves + r` is rank r's score (+inf if down). None: select by scanning.
        self._leaves = 1 << (size - 1).bit_length()
        self._tree: list[float] | None = None
        if tree:
            nodes = [math.inf] * (2 * self._leaves)
            for r in range(size):
                nodes[self._leaves + r] = self.score(r) if up else math.inf
            for i in range(self._leaves - 1, 0, -1):
                left, right = nodes[2 * i], nodes[2 * i + 1]
                nodes[i] = left if left <= right else right
            self._tree = nodes

    # -- rank lifecycle ---------------------------------------------------------------

    def is_up(self, rank: int) -> bool:
        return 0 <= rank < self.size and self._up[rank]

    def set_up(self, rank: int) -> None:
        """Make `rank` selectable, with a fresh incarnation: no load, no seq."""
        self._up[rank] = True
        self._load[rank] = _IDLE
        self._seq[rank] = None
        if self._tree is not None:
            self._rescore(rank)

    def take_down(self, rank: int) -> set[str]:
        """Stop selecting `rank`; return (and forget) the ids it held."""
        self._up[rank] = False
        held = self._inflight[rank]
        self._inflight[rank] = set()
        self._load[rank] = _IDLE
        self._seq[rank] = None
        if self._tree is not None:
            self._rescore(rank)
        return held

    def set_cap(self, rank: int, cap: int | None) -> None:
        """`rank` takes at most `cap` requests in flight (None: no cap)."""
        if cap is not None and (type(cap) is not int or cap < 1):
            raise ValueError(f"an in-flight cap must be a positive int or None, got {cap!r}")
        self._cap[rank] = cap
        if self._tree is not None:
            self._rescore(rank)

    def cap(self, rank: int) -> int | None:
        return self._cap[rank]

    def has_room(self, rank: int) -> bool:
        """Whether `rank` is up and under its in-flight cap."""
        if not self._up[rank]:
            return False
        cap = self._cap[rank]
        return cap is None or len(self._inflight[rank]) < cap

    # -- selection and release --------------------------------------------------------

    def score(self, rank: int) -> float:
        """The least-loaded score of `rank` (lower is better)."""
        load = self._load[rank]
        score = float(max(len(self._inflight[rank]), load.waiting + load.running))
        if load.waiting:
            kv = load.kv
            if kv > KV_THRESHOLD:  # False for NaN: an unknown KV usage adds nothing
                score += load.waiting * KV_WEIGHT * (kv - KV_THRESHOLD)
        return score

    def select(self, request_id: str, rank: int | None = None, *, name: str | None = None) -> int:
        """Choose a rank for `request_id` and reserve it there.

        A pinned `rank` is taken as is if it exists and is up (else `InvalidRank`) and
        under its cap (else `Overloaded`), and does not move the rotation. Raises
        `NoEngineAvailable` if no rank is up, `Overloaded` if every up rank is at its
        cap. Errors name the request `name` (default: `request_id`).
        """
        if rank is not None:
            if not 0 <= rank < self.size:
                raise InvalidRank(
                    rank, self.size, name or request_id, f"out of range for a group of {self.size}"
                )
            if not self._up[rank]:
                raise InvalidRank(rank, self.size, name or request_id, "the rank is down")
            cap = self._cap[rank]
            if cap is not None and len(self._inflight[rank]) >= cap:
                raise Overloaded(name or request_id, rank, cap)
            self._inflight[rank].add(request_id)
            if self._tree is not None:
                self._rescore(rank)
            return rank
        size = self.size
        start = self._next_start
        self._next_start = start + 1 if start + 1 < size else 0
        if self._tree is not None:
            best = self._first_minimum(start)
            if best < 0:
                raise self._none_free(name or request_id)
            self._inflight[best].add(request_id)
            self._rescore(best)
            return best
        best = -1
        best_score = math.inf
        for offset in range(size):
            r = start + offset
            if r >= size:
                r -= size
            if self._up[r]:
                cap = self._cap[r]
                if cap is not None and len(self._inflight[r]) >= cap:
                    continue
                s = self.score(r)
                if s < best_score:
                    best, best_score = r, s
        if best < 0:
            raise self._none_free(name or request_id)
        self._inflight[best].add(request_id)
        return best

    def _none_free(self, name: str) -> Exception:
        """Why an unpinned pick found no rank: none up, or every up rank full."""
        if any(self._up):
            return Overloaded(name)
        return NoEngineAvailable(name, self.size)

    def release(self, rank: int, request_ids: Iterable[str]) -> None:
        """Free the slots of these ids on `rank`. Idempotent by id."""
        held = self._inflight[rank]
        if not held:
            return
        held.difference_update(request_ids)
        if not held:
            load = self._load[rank]
            if load.waiting or load.running:
                self._load[rank] = Load(0, 0, load.kv)
        if self._tree is not None:
            self._rescore(rank)

    # -- load reports -----------------------------------------------------------------

    def observe_load(self, rank: int, load: Load, seq: int | None = None) -> bool:
        """Store `load` as rank's newest snapshot unless `seq` says it is older than one
        already applied (or the rank is down). Returns whether it was applied."""
        if not self._up[rank]:
            return False
        if seq is not None:
            last = self._seq[rank]
            if last is not None and seq < last:
                return False
            self._seq[rank] = seq
        if not self._inflight[rank] and (load.waiting or load.running):
            load = Load(0, 0, load.kv)
        self._load[rank] = load
        if self._tree is not None:
            self._rescore(rank)
        return True

    # -- the selection index ----------------------------------------------------------

    def _rescore(self, rank: int) -> None:
        """Write rank's current score (+inf if down) into its leaf and the minima above
        it, up to the first that does not change. Only called with the index on."""
        tree = self._tree
        assert tree is not None
        if rank < 0:  # the lists took it as an index from the end: so does the tree
            rank += self.size
        value = self.score(rank) if self.has_room(rank) else math.inf
        i = self._leaves + rank
        if tree[i] == value:
            return
        tree[i] = value
        i >>= 1
        while i:
            left = tree[2 * i]
            right = tree[2 * i + 1]
            least = left if left <= right else right
            if tree[i] == least:
                return
            tree[i] = least
            i >>= 1

    def _first_minimum(self, start: int) -> int:
        """The first rank at or after `start`, wrapping, whose leaf equals the minimum
        of all (-1 if that is +inf: no rank up, or none with a finite score)."""
        tree = self._tree
        assert tree is not None
        least = tree[1]
        if least == math.inf:
            return -1
        leaves = self._leaves
        i = leaves + start
        while tree[i] > least:  # nothing in this subtree: go to the next one to its right
            while i & 1:  # a right child: its parent's next subtree is the next one
                i >>= 1
            if not i:  # i was the last at its depth: no minimum at or after `start`
                i = 1  # so wrap: the first minimum of all
                break
            i += 1
        while i < leaves:  # descend to the first minimum in subtree i
            i <<= 1
            if tree[i] > least:
                i += 1
        return i - leaves

    # -- inspection -------------------------------------------------------------------

    def load(self, rank: int) -> Load:
        return self._load[rank]

    def inflight_count(self, rank: int) -> int:
        return len(self._inflight[rank])

    def inflight_ids(self, rank: int) -> frozenset[str]:
        return frozenset(self._inflight[rank])

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
  two load reports spread out instead of piling onto one stale minimum. The scan starts
  at an index that rotates by one per unpinned pick and keeps the first strictly lowest
  score, so ties (a cold start) go round-robin.
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

from .errors import InvalidRank, NoEngineAvailable
from .messages import Load

__all__ = ["KV_THRESHOLD", "KV_WEIGHT", "Routing"]

KV_WEIGHT = 6.0
KV_THRESHOLD = 0.5
_IDLE = Load()


class Routing:
    """Least-loaded selection with in-flight reservations, for ranks ``0 .. size-1``."""

    __slots__ = ("_inflight", "_load", "_next_start", "_seq", "_up", "size")

    def __init__(self, size: int, *, up: bool = False) -> None:
        if size < 1:
            raise ValueError(f"a group needs at least one rank, got {size}")
        self.size = size
        self._up = [up] * size
        self._inflight: list[set[str]] = [set() for _ in range(size)]
        self._load: list[Load] = [_IDLE] * size
        self._seq: list[int | None] = [None] * size
        self._next_start = 0

    # -- rank lifecycle ---------------------------------------------------------------

    def is_up(self, rank: int) -> bool:
        return 0 <= rank < self.size and self._up[rank]

    def set_up(self, rank: int) -> None:
        """Make `rank` selectable, with a fresh incarnation: no load, no seq."""
        self._up[rank] = True
        self._load[rank] = _IDLE
        self._seq[rank] = None

    def take_down(self, rank: int) -> set[str]:
        """Stop selecting `rank`; return (and forget) the ids it held."""
        self._up[rank] = False
        held = self._inflight[rank]
        self._inflight[rank] = set()
        self._load[rank] = _IDLE
        self._seq[rank] = None
        return held

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
        does not move the rotation. Raises `NoEngineAvailable` if no rank is up. Errors
        name the request `name` (default: `request_id`).
        """
        if rank is not None:
            if not 0 <= rank < self.size:
                raise InvalidRank(
                    rank, self.size, name or request_id, f"out of range for a group of {self.size}"
                )
            if not self._up[rank]:
                raise InvalidRank(rank, self.size, name or request_id, "the rank is down")
            self._inflight[rank].add(request_id)
            return rank
        size = self.size
        start = self._next_start
        self._next_start = start + 1 if start + 1 < size else 0
        best = -1
        best_score = math.inf
        for offset in range(size):
            r = start + offset
            if r >= size:
                r -= size
            if self._up[r]:
                s = self.score(r)
                if s < best_score:
                    best, best_score = r, s
        if best < 0:
            raise NoEngineAvailable(name or request_id, size)
        self._inflight[best].add(request_id)
        return best

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
        return True

    # -- inspection -------------------------------------------------------------------

    def load(self, rank: int) -> Load:
        return self._load[rank]

    def inflight_count(self, rank: int) -> int:
        return len(self._inflight[rank])

    def inflight_ids(self, rank: int) -> frozenset[str]:
        return frozenset(self._inflight[rank])

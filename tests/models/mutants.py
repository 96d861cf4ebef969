"""Deliberately broken variants of the core. Each must be caught by a property test.

They live with the tests, never in the package: `test_mutants.py` runs the state
machines and the exhaustive wave search against each and requires a failure.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from typing import Any

from zmqdp._core.codec import EntryCursor
from zmqdp._core.errors import ProtocolError
from zmqdp._core.liveness import ConnectionWatch
from zmqdp._core.messages import OutputBatch
from zmqdp._core.outbox import Outbox
from zmqdp._core.prefix import PrefixIndex, pick
from zmqdp._core.requests import RequestBook
from zmqdp._core.routing import SPEED_BAND, SPEED_SPREAD, STEP_RUN, STEP_WEIGHT, Routing
from zmqdp._core.state import BatchRest, GroupCore, RankHealth
from zmqdp._core.waves import WaveClock
from zmqdp._core.wire import Incoming, NativeWire

# -- request lifecycle (caught by tests/models/lifecycle.py) ----------------------------


class IgnoresEpoch(GroupCore[Any]):
    """Applies batches of any incarnation, as revision 1 did (§2.3 broken)."""

    def _is_stale(self, health: RankHealth, batch: OutputBatch) -> bool:
        return False


class ReusingWireIdBook(RequestBook[Any]):
    """Puts the application's id on the wire, as revision 1 did (§3 broken)."""

    def new_wire_id(self, request_id: str) -> str:
        return request_id


class ReusesWireIds(GroupCore[Any]):
    book_cls = ReusingWireIdBook


class _DropsBatchOnBadEntryWire(NativeWire):
    def decode_batch(
        self, body: bytes, slice_entries: int
    ) -> tuple[OutputBatch, EntryCursor | None]:
        batch, rest = super().decode_batch(body, slice_entries)
        if batch.bad_entries:
            raise ProtocolError(f"malformed entry: {batch.bad_entries[0].cause}")
        return batch, rest


class WithWire:
    """The real core given a broken `Wire` (codec mutants are wire variants). It stands
    where a core class does (`core_cls`): an instance, not a function, so that as a
    class attribute it is not bound as a method."""

    def __init__(self, name: str, wire: type[NativeWire], doc: str) -> None:
        self.__name__ = name
        self.__doc__ = doc
        self._wire = wire

    def __call__(self, *args: Any, **kwargs: Any) -> GroupCore[Any]:
        return GroupCore(*args, wire=self._wire(), **kwargs)


DropsBatchOnBadEntry = WithWire(
    "DropsBatchOnBadEntry",
    _DropsBatchOnBadEntryWire,
    "A codec that treats one malformed entry as a bad batch (§7 entry scope broken).",
)


class _CapBlindRouting(Routing):
    def set_cap(self, rank: int, cap: int | None) -> None:
        pass


class IgnoresCaps(GroupCore[Any]):
    """Admission control forgotten: a rank takes requests past its in-flight cap."""

    routing_cls = _CapBlindRouting


class IgnoresDeadlines(GroupCore[Any]):
    """Request deadlines never expire (a stuck engine holds the request forever)."""

    def _expire(self, now: float) -> None:
        pass


class ContinuesStaleBatch(GroupCore[Any]):
    """Keeps a dead rank's long batch in hand and applies its rest, as if its
    incarnation had not ended."""

    def _drop_held(self, rank: int) -> None:
        rest = self._long.get(rank)
        super()._drop_held(rank)
        if rest is not None:
            self._long[rank] = rest

    def _continue(self, rest: BatchRest, now: float) -> BatchRest | None:
        rest.health = self.health[rest.rank]  # pretend it is still the current one
        if not self.is_up(rest.rank):
            self.routing.set_up(rest.rank)
        return super()._continue(rest, now)


# -- the hold queue behind a long batch (caught by tests/models/long_batches.py) ------


class AppliesHeldAtOnce(GroupCore[Any]):
    """Applies a message of a rank whose long batch is in hand at once, ahead of the
    rest of that batch: the rank's order is lost."""

    def _take(self, msg: Incoming, now: float) -> None:
        rest = self._incoming(msg, now)
        if rest is not None and rest.rank not in self._long:
            self._long[rest.rank] = rest


class UncountedHeld(GroupCore[Any]):
    """Holds messages behind a long batch without counting their bytes: a rank that
    floods while its batch is applied is never stopped (`held_limit`)."""

    def _hold(self, rank: int, msg: Incoming) -> None:
        self._held.setdefault(rank, collections.deque()).append(msg)


class _SkippingCursor(EntryCursor):
    """Loses the first entry of every slice after the first."""

    __slots__ = ()

    def next_slice(self, n: int) -> Any:
        super().next_slice(1)
        return super().next_slice(n)


class _LosesSliceBoundariesWire(NativeWire):
    def decode_batch(
        self, body: bytes, slice_entries: int
    ) -> tuple[OutputBatch, EntryCursor | None]:
        batch, rest = super().decode_batch(body, slice_entries)
        if rest is not None:
            rest.__class__ = _SkippingCursor
        return batch, rest


LosesSliceBoundaries = WithWire(
    "LosesSliceBoundaries",
    _LosesSliceBoundariesWire,
    "A codec that drops an entry at each slice boundary of a long batch.",
)


class NoSizeCheck(GroupCore[Any]):
    """Sends an ADD of any size (§1 broken)."""

    def _fits(self, rank: int, frames: tuple[bytes, bytes]) -> bool:
        return True


# -- the outbox (caught by tests/models/outbox.py) ----------------------------------------


class HeadOfLineOutbox(Outbox[Any]):
    """One rank whose pipe is full holds back every rank after it, as a single FIFO
    did (the hostile-peers issue's 9.5 s delay)."""

    def sendable(self, now: float) -> list[int]:
        out = []
        for rank, q in enumerate(self._queues):
            if q.items and q.blocked_since is not None:
                break
            if q.items:
                out.append(rank)
        return out


# -- waves (caught by tests/models/waves.py) ---------------------------------------------


class BumpingClock(WaveClock):
    """SMG's rule: every wake names c + 1."""

    def start_wave(self, wave: int) -> int:
        self._wave = max(self._wave, wave) + 1
        return self._wave

    def wake_after_adds(self) -> int:
        self._wave += 1
        return self._wave


class IgnoresStartWave(WaveClock):
    """Never answers an engine's start_wave (still wakes after ADDs)."""

    def start_wave(self, wave: int) -> int | None:  # type: ignore[override]
        self._wave = max(self._wave, wave)
        return None


class BelievedParkedClock(WaveClock):
    """Wakes only after ADDs, and only while it believes the group parked (it has not
    woken the group since the last wave_complete it saw); never answers start_wave.
    This is SMG #2078's design, which docs/protocol.md §5 rules out."""

    def __init__(self, start: int = 0) -> None:
        super().__init__(start)
        self.believed_running = False

    def wave_complete(self, wave: int) -> None:
        super().wave_complete(wave)
        self.believed_running = False

    def start_wave(self, wave: int) -> int | None:  # type: ignore[override]
        self._wave = max(self._wave, wave)
        return None

    def wake_after_adds(self) -> int | None:  # type: ignore[override]
        if self.believed_running:
            return None
        self.believed_running = True
        return self._wave


class StaleCloseKills(ConnectionWatch):
    """Remembers only which rank each connection carried, not which incarnation's it
    is: a restarted engine dies of its predecessor's late close."""

    def claim(self, fd: int, rank: int) -> None:
        self._owner[fd] = rank
        self._conns.setdefault(rank, set()).add(fd)

    def disconnected(self, fd: int) -> int | None:
        rank = self._owner.pop(fd, None)
        if rank is not None:
            self._conns.pop(rank, None)
        return rank


class AnyCloseKills(ConnectionWatch):
    """The first close of any of a rank's connections kills it: a stray connection to
    its socket (a port probe) that closes is taken for the engine's death."""

    def disconnected(self, fd: int) -> int | None:
        rank = self._owner.pop(fd, None)
        if rank is not None and fd in self._conns.get(rank, ()):
            for other in self._conns.pop(rank):
                self._owner[other] = None
            return rank
        return None


class ReleaseForgotten(ConnectionWatch):
    """A rank declared dead for another reason keeps its connection as current: its
    later close is a second death (natively, of the next incarnation's rank)."""

    def release(self, rank: int) -> None:
        pass


# -- speed-aware routing (caught by tests/models/routing.py) -----------------------------


class UnconfirmedTiming(Routing):
    """Times a rank by the cadence of its outputs alone, as 362b651 did: each run of
    `STEP_RUN` steps is averaged in at once, whether or not any request finishes."""

    def observe_outputs(
        self, rank: int, now: float, outputs: int = 1, running: int | None = None
    ) -> None:
        timing = self._timing[rank]
        if timing is None:
            if self._inflight[rank]:
                self._timing[rank] = (now, 0.0)
            return
        since, steps = timing
        held = len(self._inflight[rank]) if running is None else running
        capacity = self._capacity[rank]
        if capacity is not None and held > capacity:
            held = capacity
        if held >= 1 and outputs > 0:
            steps += outputs / held if outputs < held else 1.0
        if steps < STEP_RUN or now <= since:
            self._timing[rank] = (since, steps)
            return
        self._timing[rank] = (now, 0.0) if self._inflight[rank] else None
        sample = (now - since) / steps
        old = self._step[rank]
        self._step[rank] = sample if not old else old + STEP_WEIGHT * (sample - old)
        self._refresh_fastest(rank)


class UnboundedLead(Routing):
    """Scores by claimed speed however far past its fair share a rank is, as 362b651
    did: no lead bound."""

    def speed_score(self, rank: int) -> float:
        fastest = self._reference
        step = self._step[rank]
        if step < fastest * (1.0 + SPEED_BAND):
            step = fastest
        held = self.load_score(rank)
        capacity = self.effective_capacity(rank)
        if capacity is None:
            return step * (held + 1.0)
        queued = held + 1.0 - capacity
        wait = queued / capacity if queued > 0 else 0.0
        return step * (1.0 + wait + SPEED_SPREAD * held / capacity)


class CadenceOnlyRouting(UnconfirmedTiming, UnboundedLead):
    """362b651's speed-aware routing: cadence-only timing, no lead bound."""


# -- prefix affinity (caught by tests/models/prefix.py) ----------------------------------


class RootFirstIndex(PrefixIndex):
    """Touches a prompt's blocks root first, so its leaves are the most recent and the
    root is evicted first: a chain's rest is kept where its start is gone."""

    def insert(self, rank: int, hashes: Sequence[int], incarnation: int | None = None) -> None:
        super().insert(rank, list(reversed(hashes)), incarnation)


class UnchainedIndex(PrefixIndex):
    """Hashes each block alone: a block cached under another prefix counts as a match."""

    def chain(self, tokens: Sequence[int], root: int = 0) -> list[int]:
        b = self.block_size
        return [hash(tuple(tokens[end - b : end])) for end in range(b, len(tokens) + 1, b)]


class UsageBlindIndex(PrefixIndex):
    """Ignores reported KV usage: a busy rank is assumed to keep its whole capacity."""

    def observe_usage(self, rank: int, kv: float) -> None:
        pass


class UncappedIndex(PrefixIndex):
    """No global cap: memory grows with the ranks' claimed capacities."""

    def insert(self, rank: int, hashes: Sequence[int], incarnation: int | None = None) -> None:
        max_blocks = self.max_blocks
        self.max_blocks = 1 << 62
        try:
            super().insert(rank, hashes, incarnation)
        finally:
            self.max_blocks = max_blocks


class LeakyIndex(PrefixIndex):
    """Evicts a rank's entry but keeps its hash in the hash-to-ranks map when no rank
    holds it any more: memory grows with every prompt ever sent."""

    def _evict(self, rank: int, count: int) -> None:
        blocks = self._blocks[rank]
        holders = self._holders
        for _ in range(count):
            h, _ = (blocks or self._stored[rank]).popitem(last=False)
            holders[h] &= ~(1 << rank)
        self._total -= count


class KeepsForgottenIndex(PrefixIndex):
    """A replaced rank keeps its predecessor's entries."""

    def forget(self, rank: int, incarnation: int | None = None) -> None:
        current = self.incarnation(rank)
        self._incarnation[rank] = current + 1 if incarnation is None else incarnation


class StaleInsertIndex(PrefixIndex):
    """Indexes a prompt sent to a rank's previous incarnation."""

    def insert(self, rank: int, hashes: Sequence[int], incarnation: int | None = None) -> None:
        super().insert(rank, hashes)


def pick_unbanded(loads: Sequence[float], cached: Sequence[int], prompt: int, **kw: Any) -> int:
    """Affinity with no load guard (sgl-project/sglang#21199)."""
    return pick(loads, cached, prompt, **{**kw, "band": 1e18, "slack": math.inf})


def pick_pending_blind(
    loads: Sequence[float], cached: Sequence[int], prompt: int, **kw: Any
) -> int:
    """Lockstep by uncached tokens alone: a rank made hot by affinity keeps winning."""
    if kw.get("pending") is not None:
        kw["pending"] = [0.0] * len(loads)
    return pick(loads, cached, prompt, **kw)


def pick_cache_blind(loads: Sequence[float], cached: Sequence[int], prompt: int, **kw: Any) -> int:
    """No affinity: the load decision whatever the ranks cache."""
    return pick(loads, [0] * len(loads), prompt, **kw)


def pick_trusting(loads: Sequence[float], cached: Sequence[int], prompt: int, **kw: Any) -> int:
    """Counts a rank's cached tokens as claimed, past the prompt: a liar outbids a whole
    hit. (Only clamping reads `prompt` besides the constant in every lockstep cost.)"""
    return pick(loads, cached, max([prompt, *cached]), **kw)


# -- prefix affinity, exact mode (KV events; caught by tests/models/prefix.py) -----------


class StaleStoreIndex(PrefixIndex):
    """Applies a BlockStored of a rank's previous incarnation."""

    def store(self, rank: int, keys: Sequence[int], incarnation: int | None = None) -> None:
        super().store(rank, keys)


class HoldBlindIndex(PrefixIndex):
    """Reports a rank's entries while a replay holds them."""

    def hold(self, rank: int, held: bool, incarnation: int | None = None) -> None:
        pass


class UnboundedStoreIndex(PrefixIndex):
    """Exact entries count toward neither the rank's limit nor the global cap: a
    flooding engine grows the index without bound."""

    def store(self, rank: int, keys: Sequence[int], incarnation: int | None = None) -> None:
        limit, max_blocks = self.rank_blocks, self.max_blocks
        self.max_blocks = 1 << 62
        capacity = self._capacity[rank]
        self._capacity[rank] = self.rank_blocks = 1 << 62
        try:
            super().store(rank, keys, incarnation)
        finally:
            self.rank_blocks, self.max_blocks = limit, max_blocks
            self._capacity[rank] = capacity


class LongPredictionsIndex(PrefixIndex):
    """Keeps every approximate entry once events are live: what the engine evicted
    without telling (or never stored) stays believed."""

    def set_exact(self, rank: int, on: bool, incarnation: int | None = None) -> None:
        predicted = self.predicted_blocks
        self.predicted_blocks = 1 << 62
        try:
            super().set_exact(rank, on, incarnation)
        finally:
            self.predicted_blocks = predicted

    def insert(self, rank: int, hashes: Sequence[int], incarnation: int | None = None) -> None:
        predicted = self.predicted_blocks
        self.predicted_blocks = 1 << 62
        try:
            super().insert(rank, hashes, incarnation)
        finally:
            self.predicted_blocks = predicted


class DropForgetsIndex(PrefixIndex):
    """Treats AllBlocksCleared as a new incarnation: the rank's next events are stale."""

    def drop(self, rank: int, incarnation: int | None = None) -> None:
        if incarnation is None or incarnation == self.incarnation(rank):
            self.forget(rank)


class UsageShrinksExactIndex(PrefixIndex):
    """Shrinks an exact rank by its KV usage, as an approximate one: blocks the engine
    said it holds are forgotten while it is busy."""

    def limit(self, rank: int) -> int:
        exact = self._exact[rank]
        self._exact[rank] = False
        try:
            return super().limit(rank)
        finally:
            self._exact[rank] = exact


class RemoveKeepsPredictedIndex(PrefixIndex):
    """A BlockRemoved removes only stored entries: a predicted one the engine evicted
    stays believed."""

    def remove(self, rank: int, keys: Sequence[int], incarnation: int | None = None) -> None:
        stored = self._stored[rank]
        super().remove(rank, [k for k in keys if k in stored], incarnation)


# -- prefix affinity in `Routing.select` (caught by tests/models/prefix.py) --------------


class UnbandedPrefixRouting(Routing):
    """Affinity with no load guard: the rank caching most wins however loaded
    (sgl-project/sglang#21199)."""

    def _affinity(self, cached: Sequence[int], prompt: int, start: int) -> int:
        if not any(cached):
            return -1
        loads = [0.0 if self.has_room(r) else math.inf for r in range(self.size)]
        pending = self._prefill_pending if self._lockstep else None
        return pick(loads, cached, prompt, start=start, pending=pending)


class NoFallbackPrefixRouting(Routing):
    """`pick` decides even when nothing in the band is cached: least-loaded by load
    score, not the routing's own load decision (speed-aware routing lost)."""

    def _affinity(self, cached: Sequence[int], prompt: int, start: int) -> int:
        loads = [self.load_score(r) if self.has_room(r) else math.inf for r in range(self.size)]
        pending = self._prefill_pending if self._lockstep else None
        return pick(loads, cached, prompt, start=start, pending=pending)


class UnindexedRouting(Routing):
    """Never indexes the prompts it sends: no session finds its prefix again."""

    def _index_prompt(self, rank: int, hashes: Sequence[int]) -> None:
        pass


class PrefillLeakRouting(Routing):
    """A request that ends before its first output keeps its pending prefill: a lockstep
    rank looks busier and busier."""

    def _prefill_done(self, request_ids: Iterable[str]) -> None:
        pass

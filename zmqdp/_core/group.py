"""The whole client state of one engine group, sans-IO: what the dispatcher consults.

Theory of operation
-------------------
`GroupCore` ties together the routing state, the request lifecycle, the wave clock
(lockstep groups only) and per-rank health. The trio layer feeds it events with the
current time and carries out what it returns; it never decides anything itself.

Per output batch, in this order (the order matters, see each module):

1. the batch's `rank` must equal the sender's identity, else it is a protocol error;
2. the load snapshot is stored (seq-aware, `Routing.observe_load`);
3. wave events are applied: `wave_complete` folds the clock, `start_wave` folds it and
   asks for a WAKE to every rank (`BatchResult.wake`);
4. outputs are routed to their requests;
5. terminal outputs and `finished` ids end their requests;
6. their slots are released (`RequestBook.apply_batch` does 4-6);
7. a `dead` announcement is applied last, after everything else the batch carried.

Health, per rank (PROTOCOL.md §6): a rank is declared dead when it announces `dead`,
says HELLO again, sends `max_decode_errors` undecodable or invalid batches in a row,
fails a send, or holds requests and stays silent past `silence_timeout`. Silence is
measured from the later of its last batch and the moment it went from holding nothing
to holding something, so an idle rank is never "silent". In a lockstep group a rank
that reports waiting work and makes no output for `stall_timeout` is sent WAKE(c)
again (never above the clock, so always safe); `stall_wakes` counts these, because a
correct group never needs one.

Death of a rank ends its requests with FAILED. Whether the whole group then fails
(lockstep) or only that rank leaves selection (independent) is the caller's policy;
`fail_all` ends everything for the first case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .codec import decode_batch
from .errors import ProtocolError
from .messages import Reply
from .requests import BatchEffects, Ended, Outcome, RequestBook
from .routing import Routing
from .waves import WaveClock

__all__ = ["BatchResult", "GroupCore", "RankHealth"]

H = TypeVar("H")


@dataclass(slots=True)
class RankHealth:
    up: bool = False
    last_heard: float = 0.0
    decode_errors_in_a_row: int = 0
    protocol_errors: int = 0
    last_output: float = 0.0
    stall_woken: bool = False
    batches: int = 0


@dataclass(slots=True)
class BatchResult(Generic[H]):
    """What one received message asks the trio layer to do."""

    effects: BatchEffects[H] | None = None
    wake: int | None = None
    """Send WAKE(wake) to every rank."""
    replies: tuple[Reply, ...] = ()
    dead: str | None = None
    """The rank is dead, for this reason: call `rank_dead` (and apply the policy)."""
    error: ProtocolError | None = None
    """The message was rejected (counted); it did nothing else."""


@dataclass(slots=True)
class GroupCounters:
    submitted: int = 0
    finished: int = 0
    truncated: int = 0
    aborted: int = 0
    rolled_back: int = 0
    failed: int = 0
    protocol_errors: int = 0
    late_outputs: int = 0
    unknown_outputs: int = 0
    wakes: int = 0
    stall_wakes: int = 0
    by_outcome: dict[Outcome, str] = field(
        default_factory=lambda: {
            Outcome.FINISHED: "finished",
            Outcome.TRUNCATED: "truncated",
            Outcome.ABORTED: "aborted",
            Outcome.ROLLED_BACK: "rolled_back",
            Outcome.FAILED: "failed",
        }
    )

    def count(self, ended: list[Ended[H]] | tuple[Ended[H], ...]) -> None:
        for e in ended:
            name = self.by_outcome[e.outcome]
            setattr(self, name, getattr(self, name) + 1)


class GroupCore(Generic[H]):
    """Sans-IO state of one engine group; `H` is the trio layer's per-request handle."""

    def __init__(
        self,
        size: int,
        *,
        lockstep: bool,
        silence_timeout: float = 30.0,
        stall_timeout: float = 5.0,
        max_decode_errors: int = 3,
        wave: int = 0,
    ) -> None:
        self.size = size
        self.lockstep = lockstep
        self.silence_timeout = silence_timeout
        self.stall_timeout = stall_timeout
        self.max_decode_errors = max_decode_errors
        self.routing = Routing(size)
        self.book: RequestBook[H] = RequestBook(self.routing)
        self.clock: WaveClock | None = WaveClock(wave) if lockstep else None
        self.health = [RankHealth() for _ in range(size)]
        self.counters = GroupCounters()

    # -- ranks ------------------------------------------------------------------------

    def rank_up(self, rank: int, now: float, hello_wave: int | None = None) -> None:
        self.book.rank_up(rank)
        self.health[rank] = RankHealth(up=True, last_heard=now, last_output=now)
        if self.clock is not None:
            self.clock.observe_hello(hello_wave)

    def rank_dead(self, rank: int, cause: str) -> list[Ended[H]]:
        """Declare `rank` dead: end what it held. Idempotent."""
        self.health[rank].up = False
        ended = self.book.rank_down(rank, cause)
        self.counters.count(ended)
        return ended

    def fail_all(self, cause: str) -> list[Ended[H]]:
        """End every live request (the lockstep policy, or closing the group)."""
        ended: list[Ended[H]] = []
        for rank in range(self.size):
            self.health[rank].up = False
            ended += self.book.rank_down(rank, cause)
        self.counters.count(ended)
        return ended

    # -- submit path ------------------------------------------------------------------

    def submit(self, request_id: str, handle: H, rank: int | None, now: float) -> int:
        """Register and reserve (see `RequestBook.submit`); returns the rank."""
        chosen = self.book.submit(request_id, handle, rank)
        self.counters.submitted += 1
        if self.routing.inflight_count(chosen) == 1:  # it held nothing: silence starts now
            self.health[chosen].last_heard = now
        return chosen

    def rollback(self, request_id: str, handle: H, cause: str) -> Ended[H] | None:
        ended = self.book.rollback(request_id, handle, cause)
        if ended is not None:
            self.counters.count((ended,))
        return ended

    def abort(self, request_id: str, handle: H | None = None) -> Ended[H] | None:
        """End a request from the client side; send ABORT to `Ended.rank`."""
        ended = self.book.abort(request_id, handle)
        if ended is not None:
            self.counters.count((ended,))
        return ended

    def wake_after_adds(self) -> int | None:
        """Lockstep: the WAKE to send to every rank after ADDs (None: independent)."""
        if self.clock is None:
            return None
        self.counters.wakes += 1
        return self.clock.wake_after_adds()

    # -- dispatcher -------------------------------------------------------------------

    def on_batch(self, rank: int, body: bytes, now: float) -> BatchResult[H]:
        """One output message from identity `rank` (already checked to be in range)."""
        health = self.health[rank]
        if not health.up:
            self.counters.unknown_outputs += 1
            return BatchResult()
        health.last_heard = now
        health.batches += 1
        try:
            batch = decode_batch(body)
            if batch.rank != rank:
                raise ProtocolError(
                    f"batch says rank {batch.rank} but was sent by identity rank {rank}"
                )
        except ProtocolError as exc:
            return self._protocol_error(rank, exc)
        health.decode_errors_in_a_row = 0
        result: BatchResult[H] = BatchResult(replies=batch.replies)
        if batch.load is not None:
            self.routing.observe_load(rank, batch.load, batch.seq)
        clock = self.clock
        if clock is not None:
            if batch.wave_complete is not None:
                clock.wave_complete(batch.wave_complete)
            if batch.start_wave is not None:
                result.wake = clock.start_wave(batch.start_wave)
                self.counters.wakes += 1
        if batch.outputs or batch.finished:
            fx = self.book.apply_batch(rank, batch.outputs, batch.finished)
            if fx.deliveries:
                health.last_output = now
                health.stall_woken = False
            self.counters.count(fx.ended)
            self.counters.late_outputs += fx.late
            self.counters.unknown_outputs += fx.unknown
            result.effects = fx
        if batch.dead is not None:
            result.dead = f"announced dead: {batch.dead}"
        return result

    def _protocol_error(self, rank: int, exc: ProtocolError) -> BatchResult[H]:
        health = self.health[rank]
        health.decode_errors_in_a_row += 1
        health.protocol_errors += 1
        self.counters.protocol_errors += 1
        error = exc.at(rank=rank)
        result: BatchResult[H] = BatchResult(error=error)
        if health.decode_errors_in_a_row >= self.max_decode_errors:
            result.dead = (
                f"{health.decode_errors_in_a_row} invalid batches in a row (last: {exc.cause})"
            )
        return result

    # -- time -------------------------------------------------------------------------

    def next_deadline(self) -> float:
        """The earliest time `on_timeout` has something to do (inf: nothing)."""
        deadline = math.inf
        for rank, health in enumerate(self.health):
            if not health.up or not self.routing.inflight_count(rank):
                continue
            deadline = min(deadline, health.last_heard + self.silence_timeout)
            if self.lockstep and not health.stall_woken and self.routing.load(rank).waiting:
                deadline = min(deadline, health.last_output + self.stall_timeout)
        return deadline

    def on_timeout(self, now: float) -> tuple[list[tuple[int, str]], int | None]:
        """Deaths by silence, and (lockstep) a WAKE for stalled ranks."""
        dead: list[tuple[int, str]] = []
        wake: int | None = None
        for rank, health in enumerate(self.health):
            held = self.routing.inflight_count(rank)
            if not health.up or not held:
                continue
            if now - health.last_heard >= self.silence_timeout:
                dead.append(
                    (
                        rank,
                        f"silent for {now - health.last_heard:.1f} s while holding "
                        f"{held} request(s) (silence_timeout={self.silence_timeout:g} s)",
                    )
                )
            elif (
                self.clock is not None
                and not health.stall_woken
                and self.routing.load(rank).waiting
                and now - health.last_output >= self.stall_timeout
            ):
                health.stall_woken = True
                self.counters.stall_wakes += 1
                wake = self.clock.wave
        return dead, wake

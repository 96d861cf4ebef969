"""Output messages, sans-IO: the rules that apply one batch, in slices if it is long,
and the queue of messages held behind it. A part of `GroupCore` (`state.py`), which
mixes `BatchReader` in and supplies the state it declares.

Theory of operation
-------------------
Per output message (`on_output`), in this order (the order matters, see each module):

0. a message of a rank whose long batch is in hand is held behind it (`held_limit`
   bytes at most, else the rank is dead), and applied, in order, once that batch ends;
1. the identity must name a rank; a message with the wrong frame count from a rank is a
   *connection error* (§7): the rank is dead at once;
2. a message from a rank that is not up is stale: counted, nothing else;
3. the body is decoded; any failure of the batch as a whole is a connection error;
4. a batch whose `epoch` is not the rank's current one is stale (§2.3): counted, never
   applied (no outputs, no load, no seq, no dead, and it does not count as heard);
5. malformed entries end the requests they name with a protocol error (§7 entry
   errors), so that request's other entries in the batch are then late;
6. the load snapshot is stored (seq-aware, `Routing.observe_load`);
7. wave events are applied: `wave_complete` folds the clock, `start_wave` folds it and
   asks for a WAKE to every rank, sent once at the end of the pass
   (`GroupCore.end_pass`);
8. outputs are routed, terminal outputs and `finished` ids end their requests, their
   slots are released (`RequestBook.apply_batch`);
9. a `dead` announcement is applied last, after everything else the batch carried.

A batch with more than `slice_entries` entries (or a body of `incremental_bytes` or
more, decoded in steps) is applied in slices: its rest is *in hand* (`in_hand`), and the
dispatcher checkpoints between two slices (`advance`). If the rank's incarnation ends
meanwhile, the rest and what was held behind it are dropped (counted as stale). A
batch of mostly junk (`stray_limit`) is a connection error, judged as it is decoded.

Each rule writes its effects into the core's `Effects` record (`_fx`) and returns the
rest of a long batch still to do (None: done, or dropped); a death it finds goes
through `GroupCore.on_rank_dead`, the one place that applies the group's policy.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .codec import BatchDecoder, EntryCursor
from .effects import Effects
from .errors import EngineDead, ProtocolError, StreamTruncated, ZmqdpError, quote
from .messages import BadEntry, Output, OutputBatch, Reply
from .requests import BatchEffects, Ended, Outcome, RequestBook
from .routing import Routing
from .waves import WAVE_MAX, WaveClock
from .wire import Incoming, Wire

if TYPE_CHECKING:
    from .state import GroupCounters, RankHealth

__all__ = ["EARLY_BODY", "BatchReader", "BatchRest"]

H = TypeVar("H")

EARLY_BODY = 4096
"""Bytes: a batch of a rank that is not up is read for its `seq` only up to this size
(a first load report; a flood of large ones is dropped unread)."""


@dataclass(slots=True, eq=False)
class BatchRest:
    """The part of a long batch still to do (`BatchReader.in_hand`): the body is still
    being decoded (`decoder`), or its entries are still to be applied (`cursor`).
    Opaque to the trio layer."""

    rank: int
    health: RankHealth
    """The incarnation the batch came from: if it is not current any more when the
    batch continues, the rest is dropped."""
    decoder: BatchDecoder | None = None
    cursor: EntryCursor | None = None
    dead: str | None = None
    """The batch's `dead`, applied after its last entry."""
    lost: str | None = None
    """Batches before this one never arrived (a gap in `seq`) while the rank held
    requests: a connection error of the rank, after this batch's last entry."""
    tallied: bool = False
    """The decoder judged every entry already (`unknown`/`known` are final)."""
    unknown: int = 0
    """Entries so far that are junk: naming a wire id not issued to that rank (or ended
    long ago), or malformed and naming nothing live."""
    known: int = 0
    """Entries so far naming a wire id live or recently ended on that rank."""


def _held_cost(msg: Incoming) -> int:
    """Bytes a message held behind a long batch counts against `held_limit`."""
    return len(msg.body or b"") + 2


class BatchReader(Generic[H]):
    """The output-message rules of `GroupCore` (module docstring)."""

    # Supplied by `GroupCore`.
    size: int
    wire: Wire[Any]
    routing: Routing
    book: RequestBook[H]
    clock: WaveClock | None
    health: list[RankHealth]
    counters: GroupCounters
    slice_entries: int
    incremental_bytes: int
    stray_limit: int
    held_limit: int
    strays_closed: int
    _fx: Effects[H]
    _early: dict[int, tuple[int, int]]
    _wake_due: bool
    _long: dict[int, BatchRest]
    _held: dict[int, collections.deque[Incoming]]
    _held_bytes: dict[int, int]

    def is_up(self, rank: int) -> bool:
        """The one source of truth for "rank is up" (kept by `Routing`)."""
        return type(rank) is int and self.routing.is_up(rank)

    def on_rank_dead(self, rank: int, cause: str, *, rejoin: bool = False) -> None:
        raise NotImplementedError  # GroupCore's

    def on_close(self, cause: str = "the engine group was closed") -> None:
        raise NotImplementedError  # GroupCore's

    def _encode_abort(self, wire_ids: tuple[str, ...]) -> tuple[bytes, bytes]:
        raise NotImplementedError  # GroupCore's

    # -- the hold queue (step 0) -------------------------------------------------------

    def has_work(self) -> bool:
        """A long batch is in hand: the dispatcher should not park."""
        return bool(self._long)

    def in_hand(self) -> list[int]:
        """The ranks whose long batch is in hand now: `advance` them after this pass's
        messages (a batch started in this pass waits for the next)."""
        return list(self._long)

    def on_output(self, frames: list[bytes], now: float) -> None:
        """One output-socket message: applied now, or held behind its rank's long batch
        (`held_limit`), to keep that rank's order."""
        self._take(self.wire.read(frames, self.size), now)

    def advance(self, ranks: list[int], now: float) -> None:
        """One slice of the long batch of each of `ranks` (from `in_hand`); a rank whose
        batch is done gets the messages held behind it applied, in order."""
        for rank in ranks:
            rest = self._long.get(rank)
            if rest is None:
                continue  # it died meanwhile
            more = self._continue(rest, now)
            if more is not None:
                self._long[rank] = more
                continue
            self._long.pop(rank, None)  # (gone already if the rank died in that slice)
            held = self._held.pop(rank, None)
            self._held_bytes.pop(rank, None)
            while held:
                self._take(held.popleft(), now)
                if rank in self._long and held:  # a held one is long too: the rest waits
                    self._held[rank] = held
                    self._held_bytes[rank] = sum(map(_held_cost, held))
                    break

    def _take(self, msg: Incoming, now: float) -> None:
        rank = msg.rank
        if rank is not None and rank in self._long:
            self._hold(rank, msg)
            return
        rest = self._incoming(msg, now)
        if rest is not None:
            self._long[rest.rank] = rest

    def _hold(self, rank: int, msg: Incoming) -> None:
        """Step 0: `msg` waits behind `rank`'s long batch; past `held_limit` bytes
        waiting, the rank sends faster than it can be applied, and is dead."""
        self._held.setdefault(rank, collections.deque()).append(msg)
        held = self._held_bytes.get(rank, 0) + _held_cost(msg)
        self._held_bytes[rank] = held
        if held > self.held_limit:
            self.on_rank_dead(
                rank,
                f"it sent {held} bytes faster than its batches could be applied "
                f"(over {self.held_limit}, 4 x max_message_size)",
            )

    def _drop_held(self, rank: int) -> None:
        """`rank` died: the rest of its long batch and what was held behind it belong to
        the incarnation that is gone (counted as stale, never applied)."""
        self._long.pop(rank, None)
        self._held_bytes.pop(rank, None)
        held = self._held.pop(rank, None)
        if held:
            self.counters.stale_messages += len(held)

    # -- the rules of one message (steps 1-9) ---------------------------------------

    def _incoming(self, msg: Incoming, now: float) -> BatchRest | None:
        rank = msg.rank
        if rank is None:
            if msg.group_dead is not None:
                self._fx.log(logging.ERROR, f"{msg.group_dead}: the whole group fails")
                self.on_close(f"the engine group failed: {msg.group_dead}")
                return None
            self.counters.protocol_errors += 1
            if msg.error is not None:
                self._fx.warn(str(msg.error), "output-message")
            return None
        if msg.body is not None:
            return self._batch(rank, msg.body, now)
        if not self.is_up(rank):
            self.counters.stale_messages += 1
            return None
        if msg.error is not None:
            self._connection_error(rank, msg.error)
            return None
        if msg.junk is not None:
            self.health[rank].protocol_errors += 1
            self.counters.protocol_errors += 1
            self._fx.warn(str(msg.junk.at(rank=rank)))
            return None
        batch = msg.batch
        assert batch is not None
        health = self.health[rank]
        for name, wave in (
            ("wave_complete", batch.wave_complete),
            ("start_wave", batch.start_wave),
        ):
            if wave is not None and not 0 <= wave <= WAVE_MAX:
                # A wave the clock would adopt and WAKE everyone with, past what the wire
                # can carry (docs/protocol.md §1): the message is invalid.
                self._connection_error(rank, ProtocolError(f"{name} {wave} is outside 0..2**63-1"))
                return None
        rest = BatchRest(rank, health, dead=batch.dead)
        return self._apply(rank, health, batch, rest, now)

    def _batch(self, rank: int, body: bytes, now: float) -> BatchRest | None:
        """One output batch body from identity `rank` (already checked to be in range)."""
        health = self.health[rank]
        if not self.is_up(rank):
            self.counters.stale_messages += 1
            if len(body) <= EARLY_BODY:
                self._note_early(rank, body)
            return None
        if len(body) >= self.incremental_bytes:
            try:
                decoder = self.wire.batch_decoder(body, self._junk_judge(rank))
            except ProtocolError as exc:
                self._connection_error(rank, exc)
                return None
            return self._continue(BatchRest(rank, health, decoder=decoder), now)
        try:
            batch, cursor = self._decode(body)
        except ProtocolError as exc:
            self._connection_error(rank, exc)
            return None
        return self._decoded(rank, health, batch, cursor, now)

    def _continue(self, rest: BatchRest, now: float) -> BatchRest | None:
        """The next step of a long batch: decode more of it, or apply its next
        `slice_entries` entries (malformed ones first, as for a whole batch). If the
        rank's incarnation ended meanwhile, the rest is dropped (counted as stale)."""
        rank = rest.rank
        health = rest.health
        if not self.is_up(rank) or self.health[rank] is not health:
            self.counters.stale_messages += 1
            return None
        decoder = rest.decoder
        if decoder is not None:
            health.last_heard = now  # a long body is arriving: the rank is not silent
            try:
                done = decoder.step()
                if decoder.junk > self.stray_limit and decoder.junk > decoder.known:
                    epoch = decoder.seen("epoch")
                    if type(epoch) is int and epoch != health.epoch:  # a dead one's (§2.3)
                        self.counters.stale_messages += 1
                        return None
                    raise self._strays(decoder.junk, decoder.known)
                if not done:
                    return rest
                batch, cursor = decoder.result(self.slice_entries)
            except ProtocolError as exc:
                self._connection_error(rank, exc)
                return None
            return self._decoded(rank, health, batch, cursor, now, tallied=True)
        assert rest.cursor is not None
        outputs, finished, replies, bad = rest.cursor.next_slice(self.slice_entries)
        health.last_heard = now
        be: BatchEffects[H] | None = None
        calls: tuple[tuple[int, str], ...] = ()
        if bad:
            be, calls = self._bad_entries(rank, bad, rest)
        return self._entries(rank, health, outputs, finished, be, replies, calls, rest, now)

    def _note_early(self, rank: int, body: bytes) -> None:
        """A small batch of a rank that is not up: an incarnation's first load report
        can arrive before its REGISTER does. Its `seq` is remembered with its epoch, so
        that the incarnation, once up, does not take it for a lost batch."""
        try:
            batch, _ = self._decode(body)
        except ProtocolError:
            return
        if batch.seq is None or batch.epoch is None:
            return
        seen = self._early.get(rank)
        if seen is None or seen[0] != batch.epoch or seen[1] < batch.seq:
            self._early[rank] = (batch.epoch, batch.seq)

    def _decode(self, body: bytes) -> tuple[OutputBatch, EntryCursor | None]:
        """Raises `ProtocolError` only for a connection error (§7)."""
        return self.wire.decode_batch(body, self.slice_entries)

    def _decoded(
        self,
        rank: int,
        health: RankHealth,
        batch: OutputBatch,
        cursor: EntryCursor | None,
        now: float,
        *,
        tallied: bool = False,
    ) -> BatchRest | None:
        if batch.rank != rank:
            self._connection_error(
                rank,
                ProtocolError(f"batch says rank {batch.rank} but was sent by identity rank {rank}"),
            )
            return None
        if self._is_stale(health, batch):
            self.counters.stale_messages += 1
            return None
        rest = BatchRest(rank, health, cursor=cursor, dead=batch.dead, tallied=tallied)
        return self._apply(rank, health, batch, rest, now)

    def _is_stale(self, health: RankHealth, batch: OutputBatch) -> bool:
        """§2.3: a batch of another incarnation (a body without an epoch is current)."""
        return batch.epoch is not None and batch.epoch != health.epoch

    def _apply(
        self, rank: int, health: RankHealth, batch: OutputBatch, rest: BatchRest, now: float
    ) -> BatchRest | None:
        """Apply a batch (its first slice, if long): steps 5-9 of the module docstring."""
        health.last_heard = now
        health.batches += 1
        seq = batch.seq
        if seq is not None:
            if (
                seq > health.next_seq
                and self.strays_closed > health.strays_closed
                and self.routing.inflight_count(rank)
            ):
                rest.lost = self._lost_batches(health.next_seq, seq)
                health.protocol_errors += 1
                self.counters.protocol_errors += 1
            health.next_seq = max(health.next_seq, seq + 1)
        be: BatchEffects[H] | None = None
        calls: tuple[tuple[int, str], ...] = ()
        if batch.bad_entries:
            be, calls = self._bad_entries(rank, batch.bad_entries, rest)
        if batch.load is not None:
            self.routing.observe_load(rank, batch.load, batch.seq)
        clock = self.clock
        if clock is not None:
            if batch.wave_complete is not None:
                clock.wave_complete(batch.wave_complete)
            if batch.start_wave is not None and clock.start_wave(batch.start_wave) is not None:
                self._wake_due = True  # answered once, at the end of the pass (`end_pass`)
        return self._entries(
            rank, health, batch.outputs, batch.finished, be, batch.replies, calls, rest, now
        )

    def _entries(
        self,
        rank: int,
        health: RankHealth,
        outputs: tuple[Output, ...],
        finished: tuple[str, ...],
        be: BatchEffects[H] | None,
        replies: tuple[Reply, ...],
        calls: tuple[tuple[int, str], ...],
        rest: BatchRest,
        now: float,
    ) -> BatchRest | None:
        """Route one slice's outputs and `finished` ids, end what they end, settle its
        replies (`calls`: malformed ones); then either more to do (the rest), or the
        batch's end: its `dead`, applied last."""
        if outputs or finished:
            routing = self.routing
            running = routing.inflight_count(rank)  # before this slice frees its slots
            before = len(be.deliveries) if be is not None else 0
            be = self.book.apply_batch(rank, outputs, finished, be)
            if outputs:  # step timing (speed-aware routing) counts delivered outputs only
                routing.observe_outputs(rank, now, len(be.deliveries) - before, running)
            self.counters.late_outputs += be.late
            self.counters.unknown_outputs += be.unknown
            if not rest.tallied:
                rest.unknown += be.unknown
                rest.known += len(outputs) + len(finished) - be.unknown
        fx = self._fx
        if be is not None:
            if be.deliveries or be.ended:
                health.last_output = now
                health.stall_woken_at = None
            if be.deliveries:
                fx.deliver(be.deliveries)
            if be.ended:
                self.counters.count(be.ended)
                for ended in be.ended:
                    fx.end(ended, self._ending_error(ended))
                if self.wire.abort_malformed:
                    # The engine would run a request its malformed entry ended on to
                    # max_tokens (zmqdp's slot is already free): stop it.
                    broken = tuple(
                        e.wire_id for e in be.ended if e.outcome is Outcome.PROTOCOL_ERROR
                    )
                    if broken:
                        fx.send(rank, self._encode_abort(broken))
        for reply in replies:
            fx.reply(reply.call, rank, reply.error, reply.result)
        for call_id, cause in calls:
            fx.reply(call_id, rank, cause, None)
        if rest.unknown > self.stray_limit and rest.unknown > rest.known:
            self._connection_error(rank, self._strays(rest.unknown, rest.known))
            return None
        if rest.cursor is not None and rest.cursor.remaining():
            return rest
        if rest.dead is not None:
            self.on_rank_dead(rank, f"announced dead: {quote(rest.dead)}")
        elif rest.lost is not None:
            self.on_rank_dead(rank, rest.lost)
        return None

    def _lost_batches(self, expected: int, seq: int) -> str:
        missing = f"seq {expected}" if seq == expected + 1 else f"seq {expected} to {seq - 1}"
        return (
            f"its batches {missing} never arrived (the next one said seq {seq}), so outputs "
            "of its requests may be lost: a message over the client's max_message_size is "
            "dropped with its connection, and the engine reconnects as if nothing happened"
        )

    def _bad_entries(
        self, rank: int, bad: tuple[BadEntry, ...], rest: BatchRest
    ) -> tuple[BatchEffects[H], tuple[tuple[int, str], ...]]:
        """§7 entry errors: end each request a malformed entry names; count the rest
        (and tally them as junk for the stray rule, `stray_limit`)."""
        fx: BatchEffects[H] = BatchEffects()
        calls = []
        self.counters.malformed_entries += len(bad)
        self.health[rank].protocol_errors += len(bad)
        for entry in bad:
            cause = f"malformed entry of {entry.key!r}: {entry.cause}"
            if entry.key == "replies":
                if type(entry.id) is int:
                    calls.append((entry.id, cause))
                    continue
            elif type(entry.id) is str:
                ended = self.book.fail_entry(rank, entry.id, cause)
                if ended is not None:
                    fx.ended.append(ended)
                if self.book.known_on(entry.id, rank):
                    continue
            if not rest.tallied:
                rest.unknown += 1  # names nothing live: junk, as a stray
        return fx, tuple(calls)

    def _strays(self, junk: int, known: int) -> ProtocolError:
        return ProtocolError(
            f"{junk} entries name no request of this rank or are malformed, against "
            f"{known} that do: a batch of mostly strays"
        )

    def _junk_judge(self, rank: int) -> Callable[[Any], bool | None]:
        """For `BatchDecoder`: is one decoded entry from `rank` junk (True), known (False)
        or neither (None) for the stray rule? Exactly as `_entries` and `_bad_entries`
        tally the entries of a batch they apply."""
        known_on = self.book.known_on

        def judge(entry: Any) -> bool | None:
            kind = type(entry)
            if kind is Output:
                return not known_on(entry.request_id, rank)
            if kind is str:
                return not known_on(entry, rank)
            if kind is BadEntry:
                if entry.key == "replies":
                    return None if type(entry.id) is int else True
                if type(entry.id) is str and known_on(entry.id, rank):
                    return None  # it names a request of this rank: it fails that one
                return True
            return None  # a reply

        return judge

    def _connection_error(self, rank: int, exc: ProtocolError) -> None:
        """§7: the message is not valid, so its rank is dead (after a warning)."""
        self.health[rank].protocol_errors += 1
        self.counters.protocol_errors += 1
        self._fx.warn(str(exc.at(rank=rank)))
        self.on_rank_dead(rank, f"invalid message (connection error): {exc.cause}")

    def _ending_error(self, ended: Ended[H]) -> ZmqdpError | None:
        """What the stream of a request that ended on the engine's side raises after its
        outputs (None: a clean end)."""
        if ended.outcome is Outcome.TRUNCATED:
            return StreamTruncated(ended.rank, ended.request_id)
        if ended.outcome is Outcome.PROTOCOL_ERROR:
            return ProtocolError(
                ended.cause or "malformed entry", rank=ended.rank, request_id=ended.request_id
            )
        if ended.outcome is Outcome.FAILED:
            return EngineDead(ended.rank, ended.cause or "dead", ended.request_id)
        return None

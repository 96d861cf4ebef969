"""The whole client state of one engine group, sans-IO: what the dispatcher consults.

Theory of operation
-------------------
`GroupCore` ties together the routing state, the request lifecycle, the wave clock
(lockstep groups only) and per-rank health. The trio layer feeds it events with the
current time and carries out what it returns.

The submit path (`submit`), in this order:

0. a closed group raises `GroupClosed`, a draining one `GroupDraining`;
1. validate the application id (a non-empty string of at most `MAX_ID_LENGTH`
   characters with a UTF-8 form), the pinned rank (an int or None) and the timeout;
2. take a fresh wire id (§3) and encode the ADD; any failure to encode raises
   `InvalidRequest` before anything is registered or reserved;
3. register and reserve (`RequestBook.submit`: a live duplicate raises first; then
   `Routing.select`, where admission control raises `Overloaded` when the pinned rank,
   or every up rank, is at its in-flight cap);
4. refuse an ADD larger than the chosen rank's `max_message_size` (§1), rolling the
   reservation back: the caller gets `InvalidRequest`, nothing is sent or kept;
5. record the request's deadline, if it has a timeout (`expire` ends it TIMED_OUT);
6. hand back the rank, the wire id and the frames to send.

Per output message (`on_message`), in this order (the order matters, see each module):

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
   asks for a WAKE to every rank (`BatchResult.wake`);
8. outputs are routed, terminal outputs and `finished` ids end their requests, their
   slots are released (`RequestBook.apply_batch`);
9. a `dead` announcement is applied last, after everything else the batch carried.

Health, per rank (docs/protocol.md §6, §7, §6): a rank is declared dead when it
announces `dead`, says HELLO again, sends one message that is not a valid batch, fails
a send, or holds requests and stays silent past `silence_timeout`. Silence is measured
from the later of its last batch and the moment it went from holding nothing to holding
something, so an idle rank is never "silent". In a lockstep group, a rank that holds
requests, reports waiting work and delivers no output for `stall_timeout` (measured
from the later of its last output and the moment it started holding requests) makes the
client send WAKE(c) again (never above the clock, so always safe; `stall_wakes` counts
these, because a correct group never needs one). If it then delivers no output for
`silence_timeout`, it is dead ("no progress"), even if it keeps sending load reports.

Death of a rank ends its requests with FAILED. Whether the whole group then fails
(lockstep) or only that rank leaves selection (independent) is decided by `rank_dead`,
which says so in its result.

Recovery (`recover=True`). A lockstep group that fails does not close for good: every
live request ends as above, every rank is forgotten (natively RESYNCed, so that a
survivor that is still healthy starts a new incarnation; a restarted group simply says
HELLO), and `closed` is a `GroupRecovering`, which `submit` and `check_call` raise.
Each rank that completes a new handshake is up again; once all are, the wave clock
starts afresh from their HELLOs and the group serves (`recoveries` counts these).
Messages of the failed incarnation cannot reach the new one: they carry a dead epoch
(natively), or come on a connection of a previous incarnation (vLLM: dropped by the
transport), or name wire ids that ended. A rank that dies while the group waits is
simply forgotten again. `close()` ends the wait, and so does `recover_timeout`: a
group whose ranks have not all come back that long after it failed is closed for good
(`health().live` turns False, so a liveness probe restarts the host instead of it
answering 503 forever). Its clock starts at the first time the core is told after the
failure (`on_deadline`: `next_deadline` asks for one at once).
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

from .codec import BatchDecoder, EntryCursor
from .effects import Effects
from .errors import (
    EngineDead,
    GroupClosed,
    GroupDraining,
    GroupRecovering,
    InvalidRank,
    InvalidRequest,
    Overloaded,
    ProtocolError,
    RequestAborted,
    RequestTimeout,
    StreamOverflow,
    StreamTruncated,
    ZmqdpError,
    quote,
)
from .handshake import RankUp
from .messages import (  # re-exported: their old home
    DEFAULT_MAX_MESSAGE_SIZE,
    BadEntry,
    Output,
    OutputBatch,
    Reply,
    check_timeout,
)
from .metrics import Histogram
from .requests import BatchEffects, Ended, Outcome, RequestBook
from .routing import Routing
from .waves import WAVE_MAX, WaveClock
from .wire import Incoming, NativeWire, Wire

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "MAX_ID_LENGTH",
    "BatchRest",
    "BatchResult",
    "GroupCore",
    "RankHealth",
    "Submitted",
]

H = TypeVar("H")

MAX_ID_LENGTH = 512
"""Longest application id accepted, in characters: ids appear in every log line."""

_ABORT_BUDGET = 64 * 1024  # bytes per ABORT at close: keeps each message small
EARLY_BODY = 4096
"""Bytes: a batch of a rank that is not up is read for its `seq` only up to this size
(a first load report; a flood of large ones is dropped unread)."""
ORPHANS_KEPT = 4096
"""Wire ids kept per dead rank, to ABORT if its process comes back (`Wire.resumes`)."""


@dataclass(slots=True)
class RankHealth:
    """The watchdog state of one incarnation (whether the rank is up is `Routing`'s)."""

    epoch: int | None = None
    """The current incarnation's epoch (§2.3); None for a revision-1 engine."""
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    last_heard: float = 0.0
    last_output: float = 0.0
    stall_woken_at: float | None = None
    protocol_errors: int = 0
    batches: int = 0
    next_seq: int = 0
    """The `seq` the next batch should carry (§4: from 0 at each HELLO, +1 per batch)."""
    strays_closed: int = 0
    """`GroupCore.strays_closed` when this incarnation came up."""


class Submitted(NamedTuple):
    """What `GroupCore.submit` decided: send `frames` to `rank`."""

    rank: int
    wire_id: str
    frames: tuple[bytes, bytes]


@dataclass(slots=True, eq=False)
class BatchRest:
    """The part of a long batch still to do (`GroupCore.continue_batch`): the body is
    still being decoded (`decoder`), or its entries are still to be applied (`cursor`).
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


@dataclass(slots=True)
class BatchResult(Generic[H]):
    """What one received message (or one slice of a long one) asks the trio layer to do."""

    effects: BatchEffects[H] | None = None
    wake: int | None = None
    """Send WAKE(wake) to every rank."""
    replies: tuple[Reply, ...] = ()
    bad_replies: tuple[tuple[int, str], ...] = ()
    """(call id, cause) of malformed reply entries: fail those calls."""
    dead: str | None = None
    """The rank is dead, for this reason: call `rank_dead`."""
    error: ProtocolError | None = None
    """What was wrong with the message, to log (counted already)."""
    rest: BatchRest | None = None
    """A long batch is not done: checkpoint, then `GroupCore.continue_batch(rest)`."""


@dataclass(slots=True)
class Failure(Generic[H]):
    """What declaring a rank dead, or closing the group, decided; the trio layer
    carries it out in this order."""

    rank: int | None
    """The rank that died (None: the group was closed)."""
    cause: str
    ended: list[tuple[Ended[H], ZmqdpError]] = field(default_factory=list)
    """Each request that ended, and the error its stream raises."""
    aborts: list[tuple[int, tuple[bytes, bytes]]] = field(default_factory=list)
    """ABORT frames to send, per rank (§9): the requests of ranks still up."""
    forget: int | None = None
    """This rank's handshake starts over (it must say HELLO again)."""
    resync: bool = False
    """RESYNC `forget` until it says HELLO (§2.5)."""
    also_forget: tuple[int, ...] = ()
    """Recovery: these ranks' handshakes start over too (RESYNCed)."""
    closed: GroupClosed | None = None
    """The group is closed: every rank is down, every later submit fails (or, if it is
    a `GroupRecovering`, fails until the ranks are back)."""


@dataclass(slots=True)
class GroupCounters:
    submitted: int = 0
    finished: int = 0
    truncated: int = 0
    aborted: int = 0
    rolled_back: int = 0
    protocol_failed: int = 0
    failed: int = 0
    protocol_errors: int = 0
    malformed_entries: int = 0
    stale_messages: int = 0
    late_outputs: int = 0
    unknown_outputs: int = 0
    stall_wakes: int = 0
    overflowed: int = 0
    timed_out: int = 0
    overloaded: int = 0
    """Submits refused by admission control (not requests: nothing was registered)."""
    by_outcome: dict[Outcome, str] = field(
        default_factory=lambda: {
            Outcome.FINISHED: "finished",
            Outcome.TRUNCATED: "truncated",
            Outcome.ABORTED: "aborted",
            Outcome.ROLLED_BACK: "rolled_back",
            Outcome.PROTOCOL_ERROR: "protocol_failed",
            Outcome.FAILED: "failed",
            Outcome.OVERFLOWED: "overflowed",
            Outcome.TIMED_OUT: "timed_out",
        }
    )

    def count(self, ended: list[Ended[H]] | tuple[Ended[H], ...]) -> None:
        for e in ended:
            name = self.by_outcome[e.outcome]
            setattr(self, name, getattr(self, name) + 1)


def check_request_id(request_id: Any) -> str:
    """Return `request_id` if it is a usable application id, else raise
    `InvalidRequest` saying why."""
    if type(request_id) is not str:
        raise InvalidRequest(
            quote(request_id), f"the id must be a str, got {type(request_id).__name__}"
        )
    if not request_id:
        raise InvalidRequest(request_id, "the id must not be empty")
    if len(request_id) > MAX_ID_LENGTH:
        raise InvalidRequest(
            request_id, f"the id is {len(request_id)} characters long; at most {MAX_ID_LENGTH}"
        )
    try:
        request_id.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            request_id, f"the id has no UTF-8 form (lone surrogate at {exc.start})"
        ) from None
    return request_id


def check_rank(request_id: str, rank: Any) -> int | None:
    """A pinned rank must be an int (not a bool, float or string) or None."""
    if rank is None or type(rank) is int:
        return rank
    raise InvalidRequest(
        request_id, f"rank must be an int or None, got {type(rank).__name__} {quote(rank)}"
    )


class GroupCore(Generic[H]):
    """Sans-IO state of one engine group; `H` is the trio layer's per-request handle.

    Each rule that a property test guards is one small method (`_decode`, `_is_stale`,
    `_fits`), so that tests/models/mutants.py can break exactly that rule.
    """

    routing_cls: type[Routing] = Routing
    book_cls: type[RequestBook[Any]] = RequestBook
    slice_entries = 4096
    """Entries of a batch applied between two checkpoints of the dispatcher."""
    incremental_bytes = 512 * 1024
    """Bodies at least this large are decoded in steps (`BatchDecoder`)."""
    stray_limit = 1024
    """A batch with more junk entries than this (wire ids not issued to its rank, or
    malformed entries naming nothing live), and more junk than other entries, is a
    connection error (§7)."""

    def __init__(
        self,
        size: int,
        *,
        lockstep: bool,
        silence_timeout: float = 30.0,
        stall_timeout: float = 5.0,
        wave: int = 0,
        wire: Wire[Any] | None = None,
        held_limit: int = 4 * DEFAULT_MAX_MESSAGE_SIZE,
        recover: bool = False,
        recover_timeout: float = 60.0,
        speed: bool = False,
    ) -> None:
        self.size = size
        self.recover = recover
        """A failed lockstep group waits for its ranks instead of closing (docstring)."""
        self.recover_timeout = recover_timeout
        """Seconds a failed lockstep group waits for every rank before closing for good."""
        self.strays_closed = 0
        """Output connections no rank had claimed that closed (`on_output_stray_closed`)."""
        self._early: dict[int, tuple[int, int]] = {}
        """Rank (not up) -> (epoch, highest seq) of its small batches seen (`_note_early`)."""
        self._orphans: dict[int, list[str]] = {}
        """Rank -> wire ids that ended with its last death (`Wire.resumes`)."""
        self._recover_by: float | None = None
        """While recovering: when the wait ends (None: its clock has not started)."""
        self.recoveries = 0
        """Times the group came back after failing as a whole."""
        self.wire: Wire[Any] = NativeWire() if wire is None else wire
        """The engine protocol (`_core/wire.py`): the codec and its capability flags."""
        self.held_limit = held_limit
        """Bytes one rank may have waiting behind its long batch before it is dead."""
        self.lockstep = lockstep
        self.silence_timeout = silence_timeout
        self.stall_timeout = stall_timeout
        self.routing = self.routing_cls(size, speed=speed)
        """Selection; `speed`: by step time and capacity (`Routing.speed_score`)."""
        self.book: RequestBook[H] = self.book_cls(self.routing)
        self.clock: WaveClock | None = WaveClock(wave) if lockstep else None
        self.health = [RankHealth() for _ in range(size)]
        self.counters = GroupCounters()
        self.closed: GroupClosed | None = None
        """Why the group is closed or failed; None while it serves."""
        self.draining = False
        """`drain()` was called: `submit` raises `GroupDraining`."""
        self._adds_since_wake = False
        # Request deadlines, earliest first: (deadline, wire id, timeout). An entry whose
        # request ended meanwhile is dropped when it reaches the top (lazily).
        self._expiry: list[tuple[float, str, float]] = []
        self.ttft = [Histogram() for _ in range(size)]
        """Per rank: seconds from submit to the first output."""
        self.latency = [Histogram() for _ in range(size)]
        """Per rank: seconds from submit to the terminal output (FINISHED requests)."""
        self._fx: Effects[H] = Effects()
        self.wake_rounds = 0
        """WAKE rounds sent to the whole group (not counting stall WAKEs)."""
        self._wake_due = False  # a start_wave of this dispatcher pass awaits its WAKE
        self._wave_seen = wave
        # the long batches in hand, and the messages held behind them, per rank
        self._long: dict[int, BatchRest] = {}
        self._held: dict[int, collections.deque[Incoming]] = {}
        self._held_bytes: dict[int, int] = {}
        self._losses: list[tuple[float, int, int | None, str]] = []
        """Connection losses reported and not judged yet: (when to judge, rank, the
        incarnation whose connection closed, cause), in the order reported."""

    # -- ranks ------------------------------------------------------------------------

    def rank_up(
        self,
        rank: int,
        now: float,
        *,
        epoch: int | None = None,
        hello_wave: int | None = None,
        max_message_size: int | None = None,
    ) -> None:
        """A new incarnation of `rank` finished its handshake."""
        self.book.rank_up(rank)
        self.health[rank] = RankHealth(
            epoch=epoch,
            max_message_size=DEFAULT_MAX_MESSAGE_SIZE
            if max_message_size is None
            else max_message_size,
            last_heard=now,
            last_output=now,
        )
        self.health[rank].strays_closed = self.strays_closed
        early = self._early.pop(rank, None)
        if early is not None and early[0] == epoch:
            self.health[rank].next_seq = early[1] + 1
        if self.clock is not None:
            self.clock.observe_hello(hello_wave)

    def is_up(self, rank: int) -> bool:
        """The one source of truth for "rank is up" (kept by `Routing`)."""
        return type(rank) is int and self.routing.is_up(rank)

    def rank_down(self, rank: int, cause: str, *, rejoin: bool = False) -> Failure[H] | None:
        """Declare `rank` dead (§6) and apply the group's policy; None if it was not up.

        Independent: its requests end with `EngineDead`; unless it already said HELLO
        again (`rejoin`), its handshake starts over and it is RESYNCed until it does.
        Lockstep: its peers cannot progress without it, so the whole group fails.
        """
        if not self.is_up(rank):
            return None
        if self.recovering:  # a new incarnation died before the others came back
            self.book.rank_down(rank, cause)  # it holds nothing: submits are refused
            return Failure(rank=rank, cause=cause, forget=None if rejoin else rank, resync=True)
        if self.lockstep:
            dead = EngineDead(rank, cause)
            if self.recover:
                reason: GroupClosed = GroupRecovering(
                    f"the lockstep group failed ({dead}) and waits for every rank to "
                    "complete a new handshake"
                )
            else:
                reason = GroupClosed(f"the lockstep group failed: {dead}")
            return self._fail_group(reason, dead_rank=rank, cause=cause, rejoin=rejoin)
        ended = self.book.rank_down(rank, cause)
        self.counters.count(ended)
        if self.wire.resumes and ended:  # ABORTed if the same process comes back
            self._orphans[rank] = [e.wire_id for e in ended][-ORPHANS_KEPT:]
        return Failure(
            rank=rank,
            cause=cause,
            ended=[(e, EngineDead(rank, cause, e.request_id)) for e in ended],
            forget=None if rejoin else rank,
            resync=not rejoin,
        )

    def close(self, cause: str = "the engine group was closed") -> Failure[H] | None:
        """Close the group: end every live request and ABORT it on its rank (§9).
        None if it was closed already."""
        return self._fail_group(GroupClosed(cause))

    def _fail_group(
        self,
        reason: GroupClosed,
        *,
        dead_rank: int | None = None,
        cause: str = "",
        rejoin: bool = False,
    ) -> Failure[H] | None:
        """End every live request; `dead_rank` (if any) died of `cause`. A `rejoin`
        (its HELLO again) keeps the handshake that HELLO started."""
        recovering = isinstance(reason, GroupRecovering)
        if self.closed is not None and (recovering or not self.recovering):
            return None  # closed already (a close ends a recovery, nothing else does)
        self.closed = reason
        if recovering:
            self._recover_by = None
            self._restart_clock()
        up = [self.is_up(r) and r != dead_rank for r in range(self.size)]
        ended: list[Ended[H]] = []
        for rank in range(self.size):
            ended += self.book.rank_down(rank, reason.cause)
        self.counters.count(ended)
        by_rank: dict[int, list[str]] = {}
        for e in ended:
            if up[e.rank]:
                by_rank.setdefault(e.rank, []).append(e.wire_id)
        return Failure(
            rank=dead_rank,
            cause=cause or reason.cause,
            ended=[
                (
                    e,
                    EngineDead(e.rank, cause, e.request_id)
                    if e.rank == dead_rank
                    else GroupClosed(reason.cause, request_id=e.request_id),
                )
                for e in ended
            ],
            aborts=[
                (rank, frames)
                for rank, wids in by_rank.items()
                for frames in self._abort_frames(rank, wids)
            ],
            forget=None if rejoin else dead_rank,
            resync=recovering,
            also_forget=tuple(r for r in range(self.size) if up[r]) if recovering else (),
            closed=reason,
        )

    def _abort_frames(self, rank: int, wire_ids: list[str]) -> list[tuple[bytes, bytes]]:
        """ABORTs of these wire ids, each small enough for the rank to accept (§1)."""
        budget = min(self.health[rank].max_message_size, _ABORT_BUDGET) - 16
        out = []
        chunk: list[str] = []
        size = 0
        for wid in wire_ids:
            cost = len(wid.encode()) + 9  # the string and its longest CBOR head
            if chunk and size + cost > budget:
                out.append(self.encode_abort(tuple(chunk)))
                chunk, size = [], 0
            chunk.append(wid)
            size += cost
        if chunk:
            out.append(self.encode_abort(tuple(chunk)))
        return out

    # -- the wire ---------------------------------------------------------------------

    def encode_add(self, wire_id: str, body: Any) -> tuple[bytes, bytes]:
        """The frames of an ADD; raises `ProtocolError` if `body` has no wire form."""
        clock = self.clock
        return self.wire.encode_add(wire_id, body, clock.wave if clock is not None else 0)

    def encode_abort(self, wire_ids: tuple[str, ...]) -> tuple[bytes, bytes]:
        """The frames of an ABORT of these wire ids."""
        return self.wire.encode_abort(wire_ids)

    def check_call(self, rank: Any, method: Any) -> None:
        """A utility call can go to `rank` now, or raise `InvalidRank`,
        `InvalidRequest`, `GroupClosed` or `EngineDead` (the rank is not up)."""
        if type(rank) is not int or not 0 <= rank < self.size:
            raise InvalidRank(rank, self.size, None, "CALL needs an int rank of the group")
        if type(method) is not str:
            raise InvalidRequest(quote(method), "the CALL method must be a str")
        if self.closed is not None:
            raise self._refusal(None)
        if not self.is_up(rank):
            raise EngineDead(rank, f"CALL {method!r}: the rank is not up")

    def call_frames(
        self, rank: int, call_id: int, method: str, args: tuple[Any, ...]
    ) -> Sequence[bytes]:
        """The call's frames; `InvalidRequest` if it has no wire form or is larger than
        the rank accepts (§1)."""
        try:
            frames = self.wire.encode_call(call_id, method, args)
        except ProtocolError as exc:
            raise InvalidRequest(f"CALL {method}", exc.cause) from None
        limit = self.health[rank].max_message_size
        if sum(map(len, frames)) > limit:
            raise InvalidRequest(
                f"CALL {method}", f"larger than rank {rank} accepts ({limit} bytes)"
            )
        return frames

    def ending_error(self, ended: Ended[H]) -> ZmqdpError | None:
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

    # -- submit path ------------------------------------------------------------------

    def submit(
        self,
        request_id: Any,
        body: Any,
        handle: H,
        rank: Any,
        now: float,
        timeout: float | None = None,
    ) -> Submitted:
        """Validate, encode, register and reserve (module docstring, steps 1-6).

        Raises `InvalidRequest`, `DuplicateRequestId`, `InvalidRank`, `Overloaded`,
        `NoEngineAvailable`, `GroupDraining` or `GroupClosed`; after any of them nothing
        is registered or reserved. With `timeout`, the request ends TIMED_OUT if it has
        no terminal output by `now + timeout` (`expire`).
        """
        if self.closed is not None:
            raise self._refusal(str(request_id))
        if self.draining:
            raise GroupDraining(str(request_id))
        request_id = check_request_id(request_id)
        pinned = check_rank(request_id, rank)
        timeout = check_timeout(request_id, timeout)
        wire_id = self.book.new_wire_id(request_id)
        try:
            frames = self.encode_add(wire_id, body)
        except ProtocolError as exc:
            self.counters.rolled_back += 1
            raise InvalidRequest(request_id, exc.cause) from None
        try:
            chosen = self.book.submit(request_id, wire_id, handle, pinned)
        except Overloaded:
            self.counters.overloaded += 1
            raise
        if not self._fits(chosen, frames):
            self.book.rollback(request_id, handle, "too large")
            self.counters.rolled_back += 1
            raise InvalidRequest(
                request_id,
                f"the ADD is {len(frames[0]) + len(frames[1])} bytes, more than rank "
                f"{chosen} accepts ({self.health[chosen].max_message_size} bytes, its "
                "max_message_size)",
            )
        self.counters.submitted += 1
        self._adds_since_wake = self.lockstep
        if self.routing.inflight_count(chosen) == 1:  # it held nothing: the clocks start now
            health = self.health[chosen]
            health.last_heard = now
            health.last_output = now
            health.stall_woken_at = None
        if timeout is not None:
            heapq.heappush(self._expiry, (now + timeout, wire_id, timeout))
        return Submitted(chosen, wire_id, frames)

    def _refusal(self, request_id: str | None) -> GroupClosed:
        """What a submit or a call raises while the group is closed or recovering."""
        closed = self.closed
        assert closed is not None
        kind = GroupRecovering if isinstance(closed, GroupRecovering) else GroupClosed
        return kind(closed.cause, request_id=request_id)

    @property
    def recovering(self) -> bool:
        """The group failed as a whole and waits for its ranks (`recover`)."""
        return isinstance(self.closed, GroupRecovering)

    def _fits(self, rank: int, frames: tuple[bytes, bytes]) -> bool:
        """§1: the engine accepts a message this large."""
        return len(frames[0]) + len(frames[1]) <= self.health[rank].max_message_size

    def abort(
        self, request_id: str, handle: H | None = None, *, outcome: Outcome = Outcome.ABORTED
    ) -> Ended[H] | None:
        """End a request from the client side; send ABORT of `Ended.wire_id` to
        `Ended.rank`."""
        ended = self.book.abort(request_id, handle, outcome=outcome)
        if ended is not None:
            self.counters.count((ended,))
        return ended

    def overflow(self, request_id: str, handle: H) -> Ended[H] | None:
        """A stream's consumer fell `max_buffered` outputs behind: end its request
        (OVERFLOWED) and return it, so the caller sends ABORT, if it is still live. It is
        counted in `overflowed` either way (it may have just ended in the same batch)."""
        ended = self.abort(request_id, handle, outcome=Outcome.OVERFLOWED)
        if ended is None:
            self.counters.overflowed += 1
        return ended

    def after_flush(self) -> int | None:
        """The input task sent a run of messages: in a lockstep group that sent ADDs,
        the wave to WAKE every rank with (§5: one WAKE for several ADDs), else None."""
        if not self._adds_since_wake or self.clock is None:
            return None
        self._adds_since_wake = False
        return self.clock.wake_after_adds()

    # -- dispatcher -------------------------------------------------------------------

    def on_message(self, frames: list[bytes], now: float) -> tuple[int | None, BatchResult[H]]:
        """One message from the output socket, as the wire reads it (`Wire.read`).
        Returns the rank it came from (None if it names none) and what to do."""
        return self.on_incoming(self.wire.read(frames, self.size), now)

    def on_incoming(self, msg: Incoming, now: float) -> tuple[int | None, BatchResult[H]]:
        rank = msg.rank
        if rank is None:
            if msg.group_dead is not None:
                return None, BatchResult(dead=msg.group_dead)
            self.counters.protocol_errors += 1
            return None, BatchResult(error=msg.error)
        if msg.body is not None:
            return rank, self.on_batch(rank, msg.body, now)
        if not self.is_up(rank):
            self.counters.stale_messages += 1
            return rank, BatchResult()
        if msg.error is not None:
            return rank, self._connection_error(rank, msg.error)
        if msg.junk is not None:
            self.health[rank].protocol_errors += 1
            self.counters.protocol_errors += 1
            return rank, BatchResult(error=msg.junk.at(rank=rank))
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
                return rank, self._connection_error(
                    rank, ProtocolError(f"{name} {wave} is outside 0..2**63-1")
                )
        rest = BatchRest(rank, health, dead=batch.dead)
        return rank, self._apply(rank, health, batch, rest, now)

    def on_batch(self, rank: int, body: bytes, now: float) -> BatchResult[H]:
        """One output batch body from identity `rank` (already checked to be in range).
        A long one comes back with `rest` set: see `continue_batch`."""
        health = self.health[rank]
        if not self.is_up(rank):
            self.counters.stale_messages += 1
            if len(body) <= EARLY_BODY:
                self._note_early(rank, body)
            return BatchResult()
        if len(body) >= self.incremental_bytes:
            try:
                decoder = self.wire.batch_decoder(body, self._junk_judge(rank))
            except ProtocolError as exc:
                return self._connection_error(rank, exc)
            return self.continue_batch(BatchRest(rank, health, decoder=decoder), now)
        try:
            batch, cursor = self._decode(body)
        except ProtocolError as exc:
            return self._connection_error(rank, exc)
        return self._decoded(rank, health, batch, cursor, now)

    def continue_batch(self, rest: BatchRest, now: float) -> BatchResult[H]:
        """The next step of a long batch: decode more of it, or apply its next
        `slice_entries` entries (malformed ones first, as for a whole batch). If the
        rank's incarnation ended meanwhile, the rest is dropped (counted as stale)."""
        rank = rest.rank
        health = rest.health
        if not self.is_up(rank) or self.health[rank] is not health:
            self.counters.stale_messages += 1
            return BatchResult()
        decoder = rest.decoder
        if decoder is not None:
            health.last_heard = now  # a long body is arriving: the rank is not silent
            try:
                done = decoder.step()
                if decoder.junk > self.stray_limit and decoder.junk > decoder.known:
                    epoch = decoder.seen("epoch")
                    if type(epoch) is int and epoch != health.epoch:  # a dead one's (§2.3)
                        self.counters.stale_messages += 1
                        return BatchResult()
                    raise self._strays(decoder.junk, decoder.known)
                if not done:
                    return BatchResult(rest=rest)
                batch, cursor = decoder.result(self.slice_entries)
            except ProtocolError as exc:
                return self._connection_error(rank, exc)
            return self._decoded(rank, health, batch, cursor, now, tallied=True)
        assert rest.cursor is not None
        outputs, finished, replies, bad = rest.cursor.next_slice(self.slice_entries)
        health.last_heard = now
        result: BatchResult[H] = BatchResult(replies=replies)
        fx: BatchEffects[H] | None = None
        if bad:
            fx, result.bad_replies = self._bad_entries(rank, bad, rest)
        return self._entries(rank, health, outputs, finished, fx, result, rest, now)

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
    ) -> BatchResult[H]:
        if batch.rank != rank:
            return self._connection_error(
                rank,
                ProtocolError(f"batch says rank {batch.rank} but was sent by identity rank {rank}"),
            )
        if self._is_stale(health, batch):
            self.counters.stale_messages += 1
            return BatchResult()
        rest = BatchRest(rank, health, cursor=cursor, dead=batch.dead, tallied=tallied)
        return self._apply(rank, health, batch, rest, now)

    def _is_stale(self, health: RankHealth, batch: OutputBatch) -> bool:
        """§2.3: a batch of another incarnation (a body without an epoch is current)."""
        return batch.epoch is not None and batch.epoch != health.epoch

    def _apply(
        self, rank: int, health: RankHealth, batch: OutputBatch, rest: BatchRest, now: float
    ) -> BatchResult[H]:
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
        result: BatchResult[H] = BatchResult(replies=batch.replies)
        fx: BatchEffects[H] | None = None
        if batch.bad_entries:
            fx, result.bad_replies = self._bad_entries(rank, batch.bad_entries, rest)
        if batch.load is not None:
            self.routing.observe_load(rank, batch.load, batch.seq)
        clock = self.clock
        if clock is not None:
            if batch.wave_complete is not None:
                clock.wave_complete(batch.wave_complete)
            if batch.start_wave is not None:
                result.wake = clock.start_wave(batch.start_wave)
        return self._entries(rank, health, batch.outputs, batch.finished, fx, result, rest, now)

    def _entries(
        self,
        rank: int,
        health: RankHealth,
        outputs: tuple[Output, ...],
        finished: tuple[str, ...],
        fx: BatchEffects[H] | None,
        result: BatchResult[H],
        rest: BatchRest,
        now: float,
    ) -> BatchResult[H]:
        """Route one slice's outputs and `finished` ids; then either more to do
        (`result.rest`), or the batch's end: its `dead`, applied last."""
        if outputs or finished:
            routing = self.routing
            running = routing.inflight_count(rank)  # before this slice frees its slots
            before = len(fx.deliveries) if fx is not None else 0
            fx = self.book.apply_batch(rank, outputs, finished, fx)
            if outputs:  # step timing (speed-aware routing) counts delivered outputs only
                routing.observe_outputs(rank, now, len(fx.deliveries) - before, running)
            self.counters.late_outputs += fx.late
            self.counters.unknown_outputs += fx.unknown
            if not rest.tallied:
                rest.unknown += fx.unknown
                rest.known += len(outputs) + len(finished) - fx.unknown
        if fx is not None:
            if fx.deliveries or fx.ended:
                health.last_output = now
                health.stall_woken_at = None
            self.counters.count(fx.ended)
            result.effects = fx
        if rest.unknown > self.stray_limit and rest.unknown > rest.known:
            stop = self._connection_error(rank, self._strays(rest.unknown, rest.known))
            result.error, result.dead = stop.error, stop.dead
            return result
        if rest.cursor is not None and rest.cursor.remaining():
            result.rest = rest
        elif rest.dead is not None:
            result.dead = f"announced dead: {quote(rest.dead)}"
        elif rest.lost is not None:
            result.dead = rest.lost
        return result

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

    def _connection_error(self, rank: int, exc: ProtocolError) -> BatchResult[H]:
        health = self.health[rank]
        health.protocol_errors += 1
        self.counters.protocol_errors += 1
        error = exc.at(rank=rank)
        return BatchResult(error=error, dead=f"invalid message (connection error): {exc.cause}")

    # -- time -------------------------------------------------------------------------

    def _deadlines(self, rank: int) -> tuple[float, float]:
        """(silence or no-progress deadline, stall deadline) of an up rank that holds
        requests."""
        health = self.health[rank]
        dead_at = health.last_heard + self.silence_timeout
        stall_at = math.inf
        if self.lockstep:
            if health.stall_woken_at is not None:
                dead_at = min(dead_at, health.stall_woken_at + self.silence_timeout)
            elif self.routing.load(rank).waiting:
                stall_at = health.last_output + self.stall_timeout
        return dead_at, stall_at

    def next_deadline(self) -> float:
        """The earliest time `on_timeout` or `expire` has something to do (inf: nothing)."""
        deadline = self.next_expiry()
        if self._losses:
            deadline = min(deadline, self.next_loss())
        if self.recovering:
            deadline = min(deadline, -math.inf if self._recover_by is None else self._recover_by)
        for rank in range(self.size):
            if self.is_up(rank) and self.routing.inflight_count(rank):
                deadline = min(deadline, *self._deadlines(rank))
        return deadline

    def observe_first_output(self, rank: int, seconds: float) -> None:
        self.ttft[rank].observe(seconds)

    def observe_finished(self, rank: int, seconds: float) -> None:
        self.latency[rank].observe(seconds)

    def next_expiry(self) -> float:
        """The earliest deadline of a live request (inf: none)."""
        expiry = self._expiry
        while expiry and not self.book.is_live(expiry[0][1]):
            heapq.heappop(expiry)
        return expiry[0][0] if expiry else math.inf

    def expire(self, now: float) -> list[tuple[Ended[H], RequestTimeout]]:
        """End every live request whose deadline is at or before `now` (TIMED_OUT); the
        caller sends ABORT of each `Ended.wire_id` to `Ended.rank` and fails its stream
        with the error."""
        out = []
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, wire_id, timeout = heapq.heappop(expiry)
            ended = self.book.expire(wire_id)
            if ended is not None:
                self.counters.count((ended,))
                out.append((ended, RequestTimeout(ended.rank, ended.request_id, timeout)))
        return out

    def on_timeout(self, now: float) -> tuple[list[tuple[int, str]], int | None]:
        """Deaths by silence or (lockstep) no progress, and a WAKE for stalled ranks."""
        dead: list[tuple[int, str]] = []
        wake: int | None = None
        for rank, health in enumerate(self.health):
            held = self.routing.inflight_count(rank)
            if not self.is_up(rank) or not held:
                continue
            dead_at, stall_at = self._deadlines(rank)
            if now >= dead_at:
                if now - health.last_heard >= self.silence_timeout:
                    cause = (
                        f"silent for {now - health.last_heard:.1f} s while holding "
                        f"{held} request(s) (silence_timeout={self.silence_timeout:g} s)"
                    )
                else:
                    cause = (
                        f"no progress: no output for {now - health.last_output:.1f} s while "
                        f"holding {held} request(s), despite a stall WAKE "
                        f"(silence_timeout={self.silence_timeout:g} s)"
                    )
                dead.append((rank, cause))
            elif now >= stall_at:
                assert self.clock is not None
                health.stall_woken_at = now
                self.counters.stall_wakes += 1
                wake = self.clock.wave
        return dead, wake

    # -- the facade: facts in, one `Effects` out -----------------------------------------
    #
    # The trio layer calls only these (and `submit`, whose one effect, the ADD, it
    # returns directly: the hot path), then carries out `take_effects()`. The methods
    # above are the rules they are built from; the property tests drive those directly.

    def take_effects(self) -> Effects[H]:
        """What the facts since the last call decided (module `effects`)."""
        fx = self._fx
        self._fx = Effects()
        return fx

    def on_rank_up(self, up: RankUp, now: float, *, cap: int | str | None = None) -> None:
        """A new incarnation of `up.rank` finished its handshake: it takes requests, up
        to `cap` in flight (`max_inflight`: an int, None for no cap, or "info" for the
        `max_num_seqs` of its handshake `info`)."""
        rank = up.rank
        if self.closed is not None and not self.recovering:
            return
        if self.is_up(rank):  # its predecessor's end (a closed connection) is not judged yet
            # as a rejoin: the predecessor ends with the reported cause, the handshake
            # just completed is kept (it must not be forgotten and RESYNCed, which would
            # make the engine start over)
            cause = self.pending_cause(rank)
            self.on_rank_dead(
                rank,
                cause or "a new incarnation completed its handshake: this one is gone",
                rejoin=True,
            )
            if self.closed is not None and not self.recovering:
                return
        self.rank_up(
            rank,
            now,
            epoch=up.epoch,
            hello_wave=up.hello_wave,
            max_message_size=up.max_message_size,
        )
        if (orphans := self._orphans.pop(rank, None)) is not None:
            for frames in self._abort_frames(rank, orphans):
                self._fx.send(rank, frames)
        info = up.info
        self.routing.set_cap(rank, self._cap(rank, cap, info))
        seqs = info.get("max_num_seqs")
        self.routing.set_capacity(rank, seqs if type(seqs) is int else None)
        self._fx.rank_state(rank, True)
        if self.recovering and all(self.is_up(r) for r in range(self.size)):
            self.closed = None
            self.recoveries += 1
            self._fx.log(
                logging.WARNING,
                f"the engine group is back (recovery #{self.recoveries}): every rank "
                "completed a new handshake",
            )

    def _cap(self, rank: int, cap: int | str | None, info: Mapping[str, Any]) -> int | None:
        if cap != "info":
            return cap if type(cap) is int else None
        seqs = info.get("max_num_seqs")
        if type(seqs) is int and seqs > 0:
            return seqs
        self._fx.warn(
            f"rank {rank}: max_inflight='info' but its handshake info has no positive int "
            f"'max_num_seqs' ({quote(seqs)}): no in-flight cap for it"
        )
        return None

    def room_for(self, rank: int | None) -> bool:
        """Whether a request pinned to `rank` (None: unpinned) is worth trying now: a
        pinned rank that is up and full is not; anything else is (it fits, or its
        submit raises the error the waiter should get)."""
        routing = self.routing
        if rank is None:
            return any(routing.has_room(r) for r in range(self.size)) or not any(
                routing.is_up(r) for r in range(self.size)
            )
        return not (type(rank) is int and routing.is_up(rank) and not routing.has_room(rank))

    def on_rank_dead(self, rank: int, cause: str, *, rejoin: bool = False) -> None:
        """`rank` is dead (a failed send, a rejoin, a displaced identity, silence, an
        invalid message, its own announcement): apply the group's policy (`rank_down`)
        and everything it entails."""
        failure = self.rank_down(rank, cause, rejoin=rejoin)
        if failure is not None:
            self._fx.log(logging.ERROR, f"rank {rank}: dead: {cause}")
            self._carry(failure)

    def _restart_clock(self) -> None:
        """Recovery: the group's next incarnation starts its waves afresh (each rank's
        HELLO wave is folded in as it comes up)."""
        if self.clock is not None:
            self.clock = WaveClock(0)
            self._adds_since_wake = False
            self._wake_due = False

    def on_close(self, cause: str = "the engine group was closed") -> None:
        """Close the group (§9): every live request ends, ABORTs go to ranks still up."""
        failure = self.close(cause)
        if failure is not None:
            self._carry(failure)

    def on_drain(self) -> bool:
        """Stop taking requests; False if the group was closed or draining already."""
        if (self.closed is not None and not self.recovering) or self.draining:
            return False
        self.draining = True
        return True

    def _carry(self, failure: Failure[H]) -> None:
        fx = self._fx
        for ended, error in failure.ended:
            fx.end(ended, error)
        if failure.rank is not None:
            fx.drop(failure.rank)  # its queued messages are for an incarnation gone
            self._drop_held(failure.rank)
        for rank, frames in failure.aborts:
            fx.send(rank, frames)
        # Each forget names the incarnation that ended (its epoch; vLLM: an incarnation
        # count): one the transport has already replaced with a newer HELLO is kept.
        if failure.forget is not None:
            fx.forget(failure.forget, failure.resync, self.health[failure.forget].epoch)
        for rank in failure.also_forget:
            self._drop_held(rank)
            fx.drop(rank)  # what is queued for it belongs to the failed incarnation
            fx.forget(rank, True, self.health[rank].epoch)
        if failure.rank is not None:
            fx.fail_calls(failure.rank, EngineDead(failure.rank, failure.cause))
        if failure.closed is not None:
            fx.fail_calls(None, failure.closed)
            fx.closed = failure.closed
        for rank in range(self.size):
            if not self.is_up(rank):
                fx.rank_state(rank, False)

    def on_abort(self, request_id: str, handle: H | None) -> Ended[H] | None:
        """The client aborts a request (only `handle`'s submission, if given): it ends
        ABORTED and its rank is sent ABORT. A user's `abort()` (no handle) makes a
        reader see `RequestAborted`; a stream closed early has nobody to tell."""
        ended = self.abort(request_id, handle)
        if ended is not None:
            error = RequestAborted(ended.rank, request_id) if handle is None else None
            self._fx.end(ended, error)
            self._fx.send(ended.rank, self.encode_abort((ended.wire_id,)))
        return ended

    def on_overflow(self, request_id: str, handle: H, rank: int, limit: int) -> None:
        """A stream's buffer is at `limit` (`max_buffered`): its consumer does not keep
        up. The request is aborted on its rank and the stream fails with
        `StreamOverflow` after the outputs it holds."""
        ended = self.overflow(request_id, handle)
        error = StreamOverflow(rank, request_id, limit, aborted=ended is not None)
        if ended is not None:
            self._fx.send(ended.rank, self.encode_abort((ended.wire_id,)))
        else:
            ended = Ended(request_id, rank, handle, Outcome.OVERFLOWED, None, "")
        self._fx.log(logging.WARNING, str(error), "overflow")
        self._fx.end(ended, error)

    def on_send_failed(self, rank: int, cause: str) -> None:
        """A send to `rank` failed or timed out (the transport dropped its queue)."""
        self.on_rank_dead(rank, cause)

    def on_output_stray_closed(self) -> None:
        """An output connection no rank had claimed, opened after an INIT, closed. A
        rank's first message over max_message_size is dropped with such a connection,
        and nothing but the next `seq` can say whose it was: a gap in a rank's `seq`
        while it holds requests, after such a close, is its connection error (a gap
        alone is not: §4 asks +1 per batch only as a SHOULD)."""
        self.strays_closed += 1

    def on_flushed(self) -> None:
        """The input task sent a run of messages: one WAKE after a run of ADDs (§5)."""
        wave = self.after_flush()
        if wave is not None:
            self._wake(wave)

    def _wake(self, wave: int, *, stall: bool = False) -> None:
        if not stall:  # stall WAKEs are counted as such (`stall_wakes`)
            self.wake_rounds += 1
        frames = self.wire.encode_wake(wave)
        if self.wire.wake_published:
            self._fx.publish(frames)
            return
        for rank in range(self.size):
            if self.is_up(rank):
                self._fx.send(rank, frames)

    # -- the dispatcher's facts ------------------------------------------------------

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
        self._advance(ranks, now)

    def on_outputs(self, messages: list[list[bytes]], now: float, *, advance: bool = True) -> None:
        """`on_output` for each of a drained batch of messages, then `advance` the long
        batches that were in hand before them (one rank's long batch holds up nobody
        else). `advance=False`: only take the messages (reading ahead before judging
        silence)."""
        in_hand = list(self._long) if self._long and advance else None
        for frames in messages:
            self._take(self.wire.read(frames, self.size), now)
        if in_hand:
            self._advance(in_hand, now)

    def _take(self, msg: Incoming, now: float) -> None:
        rank = msg.rank
        if rank is not None and rank in self._long:
            self._held.setdefault(rank, collections.deque()).append(msg)
            held = self._held_bytes.get(rank, 0) + len(msg.body or b"") + 2
            self._held_bytes[rank] = held
            if held > self.held_limit:
                self.on_rank_dead(
                    rank,
                    f"it sent {held} bytes faster than its batches could be applied "
                    f"(over {self.held_limit}, 4 x max_message_size)",
                )
            return
        rank, result = self.on_incoming(msg, now)
        if rank is None:
            if result.dead is not None:
                self._fx.log(logging.ERROR, f"{result.dead}: the whole group fails")
                self.on_close(f"the engine group failed: {result.dead}")
            elif result.error is not None:
                self._fx.warn(str(result.error), "output-message")
            return
        self._carry_batch(rank, result)
        if result.rest is not None:
            self._long[rank] = result.rest

    def _advance(self, ranks: list[int], now: float) -> None:
        for rank in ranks:
            rest = self._long.get(rank)
            if rest is None:
                continue  # it died meanwhile
            result = self.continue_batch(rest, now)
            self._carry_batch(rank, result)
            if result.rest is not None:
                self._long[rank] = result.rest
                continue
            self._long.pop(rank, None)  # (gone already if the rank died in that slice)
            held = self._held.pop(rank, None)
            self._held_bytes.pop(rank, None)
            while held:
                self._take(held.popleft(), now)
                if rank in self._long and held:
                    self._held[rank] = held
                    self._held_bytes[rank] = sum(len(m.body or b"") + 1 for m in held)
                    break

    def _drop_held(self, rank: int) -> None:
        """`rank` died: the rest of its long batch and what was held behind it belong to
        the incarnation that is gone (counted as stale, never applied)."""
        self._long.pop(rank, None)
        self._held_bytes.pop(rank, None)
        held = self._held.pop(rank, None)
        if held:
            self.counters.stale_messages += len(held)

    def _carry_batch(self, rank: int, result: BatchResult[H]) -> None:
        fx = self._fx
        be = result.effects
        if be is not None:
            if be.deliveries:
                fx.deliver(be.deliveries)
            for ended in be.ended:
                fx.end(ended, self.ending_error(ended))
            if be.ended and self.wire.abort_malformed and self.is_up(rank):
                # The engine would run a request its malformed entry ended on to
                # max_tokens (zmqdp's slot is already free): stop it.
                broken = tuple(e.wire_id for e in be.ended if e.outcome is Outcome.PROTOCOL_ERROR)
                if broken:
                    fx.send(rank, self.encode_abort(broken))
        if result.wake is not None:
            self._wake_due = True  # answered once, at the end of the pass
        for reply in result.replies:
            fx.reply(reply.call, rank, reply.error, reply.result)
        for call_id, cause in result.bad_replies:
            fx.reply(call_id, rank, cause, None)
        if result.error is not None:
            fx.warn(str(result.error))
        if result.dead is not None:
            self.on_rank_dead(rank, result.dead)

    def end_pass(self) -> None:
        """The dispatcher is done with a pass: one WAKE(c) answers every `start_wave`
        of it (docs/protocol.md §5; the wave model checks this, `coalesce`)."""
        clock = self.clock
        if clock is None:
            return
        if self._wake_due:
            self._wake_due = False
            self._wake(clock.wave)
        if clock.wave != self._wave_seen:
            self._wave_seen = self._fx.wave = clock.wave

    # -- connection losses: the one place that decides a death by a closed connection --
    #
    # The transport only reports (`on_connection_lost`): it forgets nothing itself once
    # the group exists. The report is judged here, later (`on_deadline`; the caller
    # reads what is queued first: an engine that sent a request's last output and then
    # exited must not see that request fail), against the incarnation it names.

    def on_connection_lost(
        self, rank: int, incarnation: int | None, cause: str, now: float, grace: float = 0.0
    ) -> None:
        """The connection of `rank`'s incarnation `incarnation` (its handshake epoch;
        vLLM: its incarnation count) closed: judged by `on_deadline` at `now + grace` or
        later (a grace lets a report of its other connections, naming the plain cause,
        come first)."""
        self._losses.append((now + grace, rank, incarnation, cause))

    def next_loss(self) -> float:
        """When the earliest unjudged connection loss is due (inf: none). Asked once
        per dispatcher pass: cheap when there is none."""
        if not self._losses:
            return math.inf
        return min(loss[0] for loss in self._losses)

    def pending_cause(self, rank: int) -> str | None:
        """The cause of an unjudged loss of `rank`'s current incarnation, if any."""
        if not self.is_up(rank):
            return None
        epoch = self.health[rank].epoch
        for _, r, incarnation, cause in self._losses:
            if r == rank and incarnation == epoch:
                return cause
        return None

    def _judge_losses(self, now: float) -> None:
        """Judge every loss due by `now`, in order: the rank's current incarnation is
        dead, once (a second report, of its other connection, changes nothing);
        otherwise a handshake of that incarnation under way starts over (the forget
        names it: the transport keeps a newer one, so a report about an incarnation
        that is gone changes nothing)."""
        due = sorted((loss for loss in self._losses if loss[0] <= now), key=lambda e: e[0])
        if not due:
            return
        self._losses = [loss for loss in self._losses if loss[0] > now]
        for _, rank, incarnation, cause in due:
            if self.health[rank].epoch != incarnation:  # it never came up: its handshake
                self._fx.forget(rank, True, incarnation)
            elif self.is_up(rank):
                self.on_rank_dead(rank, cause)
            # else its death was judged already, and its forget ordered then

    def on_deadline(self, now: float) -> None:
        """A deadline passed: judge the connection losses that are due, expire
        requests, judge silence, WAKE stalled ranks, and end a recovery that waited
        `recover_timeout`."""
        fx = self._fx
        if self._losses:
            self._judge_losses(now)
        if self.recovering:
            if self._recover_by is None:
                self._recover_by = now + self.recover_timeout
            elif now >= self._recover_by:
                assert self.closed is not None
                missing = [r for r in range(self.size) if not self.is_up(r)]
                self.on_close(
                    f"{self.closed.cause}; rank(s) {', '.join(map(str, missing))} did not "
                    f"complete a new handshake within recover_timeout={self.recover_timeout:g} "
                    "s, so it is closed for good (restart the engines, then this client)"
                )
        for ended, error in self.expire(now):
            fx.end(ended, error)
            fx.send(ended.rank, self.encode_abort((ended.wire_id,)))
            fx.log(logging.INFO, str(error))
        dead, wake = self.on_timeout(now)
        if wake is not None:
            fx.warn(f"lockstep group: a rank has waiting work and no progress; WAKE({wake}) again")
            self._wake(wake, stall=True)
        for rank, cause in dead:
            self.on_rank_dead(rank, cause)

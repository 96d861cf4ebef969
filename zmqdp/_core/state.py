"""The whole client state of one engine group, sans-IO: what the dispatcher consults.

Theory of operation
-------------------
`GroupCore` ties together the routing state, the request lifecycle, the wave clock
(lockstep groups only) and per-rank health. The trio layer tells it facts (`on_*`: a
rank up or dead, output messages, a deadline, an abort, a close), with the current
time, and carries out what they call for: one `Effects` record (`take_effects`), the
core's only result shape. The rules behind the facts write that record directly.

The submit path (`submit`), in this order:

0. a closed group raises `GroupClosed`, a draining one `GroupDraining`;
1. validate the application id (a non-empty string of at most `MAX_ID_LENGTH`
   characters with a UTF-8 form), the pinned rank (an int or None) and the timeout
   (`_core/messages.py`);
2. take a fresh wire id (§3) and encode the ADD; any failure to encode raises
   `InvalidRequest` before anything is registered or reserved;
3. register and reserve (`RequestBook.submit`: a live duplicate raises first; then
   `Routing.select`, where admission control raises `Overloaded` when the pinned rank,
   or every up rank, is at its in-flight cap; with prefix affinity, the prompt's token
   ids (`Prepared.prefix`) weigh in within the load band and are indexed on the rank
   chosen: `prefix`, which the core feeds with the ranks' handshakes, load reports and
   deaths);
4. refuse an ADD larger than the chosen rank's `max_message_size` (§1), rolling the
   reservation back: the caller gets `InvalidRequest`, nothing is sent or kept;
5. record the request's deadline, if it has a timeout (`on_deadline` ends it TIMED_OUT);
6. hand back the rank, the wire id and the frames to send (`Submitted`: the hot path
   returns its one effect directly).

Per output message (`on_output`, `advance`): the rules of `batches.py`, which
`GroupCore` mixes in (`BatchReader`), in the order its docstring gives. A long batch is
applied in slices, and the messages of its rank that come meanwhile are held behind
it. After a pass, one WAKE answers every `start_wave` of it (`end_pass`).

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
(lockstep) or only that rank leaves selection (independent) is decided by
`on_rank_dead`, which writes every consequence (ends, ABORTs, forgets, failed calls).

Recovery (`recover=True`). A lockstep group that fails does not close for good: every
live request ends as above, every rank is forgotten (natively RESYNCed, so that a
survivor that is still healthy starts a new incarnation; a restarted group simply says
HELLO), and `closed` is a `GroupRecovering`, which `submit` and `check_call` raise.
Each rank that completes a new handshake is up again; once all are, the wave clock
starts afresh from their HELLOs and the group serves (`recoveries` counts these).
Messages of the failed incarnation cannot reach the new one: they carry a dead epoch
(natively), or come on a connection of a previous incarnation (vLLM: dropped by the
transport), or name wire ids that ended. A rank that dies while the group waits is
simply forgotten again. `on_close` ends the wait, and so does `recover_timeout`: a
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from .batches import BatchReader, BatchRest
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
    quote,
)
from .handshake import RankUp
from .messages import (
    DEFAULT_MAX_MESSAGE_SIZE,
    MAX_ID_LENGTH,
    check_rank,
    check_request_id,
    check_timeout,
)
from .metrics import Histogram
from .prefix import PrefixIndex
from .requests import Ended, Outcome, RequestBook
from .routing import Routing
from .waves import WaveClock
from .wire import Incoming, NativeWire, Wire

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "MAX_ID_LENGTH",
    "BatchRest",
    "GroupCore",
    "RankHealth",
    "Submitted",
    "check_rank",
    "check_request_id",
    "check_timeout",
]

H = TypeVar("H")

_ABORT_BUDGET = 64 * 1024  # bytes per ABORT at close: keeps each message small
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


class GroupCore(BatchReader[H]):
    """Sans-IO state of one engine group; `H` is the trio layer's per-request handle.

    Its surface is the facts (`on_*`, `submit`, `advance`, `end_pass`), what the
    dispatcher asks (`next_deadline`, `has_work`, `in_hand`, `room_for`, `is_up`,
    `check_call`, `call_frames`) and `take_effects`. Each rule that a property test
    guards is one small private method (`_decode`, `_is_stale`, `_fits`, `_expire`,
    `_continue`, `_hold`), so that tests/models/mutants.py can break exactly that rule;
    the models drive the facts, as production does.
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
        prefix: bool | PrefixIndex = False,
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
        if prefix is True:
            prefix = PrefixIndex(size)
        self.prefix: PrefixIndex | None = prefix or None
        """Prefix affinity's index (`routing="prefix"`; None: off): fed with the ranks'
        handshakes (block size, capacity), load reports (KV usage), deaths (forgotten)
        and the prompts sent; on vLLM's wire, with their KV events too."""
        self.kv_events: dict[str, int] = {}
        """KV-event counters summed over the ranks (vLLM's wire, exact mode: its KV
        task adds to them); `GroupStatistics.prefix`."""
        self.routing = self.routing_cls(size, speed=speed, prefix=self.prefix, lockstep=lockstep)
        """Selection; `speed`: by step time and capacity (`Routing.speed_score`);
        `prefix`: with prefix affinity (`Routing.select`)."""
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

    def take_effects(self) -> Effects[H]:
        """What the facts since the last call decided (module `effects`)."""
        fx = self._fx
        self._fx = Effects()
        return fx

    # -- ranks ------------------------------------------------------------------------

    def on_rank_up(self, up: RankUp, now: float, *, cap: int | str | None = None) -> None:
        """A new incarnation of `up.rank` finished its handshake (the record the
        handshake built): it takes requests, up to `cap` in flight (`max_inflight`: an
        int, None for no cap, or "info" for the `max_num_seqs` of its handshake `info`)."""
        rank, epoch = up.rank, up.epoch
        if self.closed is not None and not self.recovering:
            return
        if self.is_up(rank):  # its predecessor's end (a closed connection) is not judged yet
            # as a rejoin: the predecessor ends with the reported cause, the handshake
            # just completed is kept (it must not be forgotten and RESYNCed, which would
            # make the engine start over)
            self.on_rank_dead(
                rank,
                self._pending_cause(rank)
                or "a new incarnation completed its handshake: this one is gone",
                rejoin=True,
            )
            if self.closed is not None and not self.recovering:
                return
        if any(r == rank and i == epoch for _, r, i, _ in self._losses):
            # its connection closed before its READY was read: it is gone, not up (the
            # judgement forgets its handshake by name)
            return
        self.book.rank_up(rank)
        health = self.health[rank] = RankHealth(
            epoch=epoch,
            max_message_size=DEFAULT_MAX_MESSAGE_SIZE
            if up.max_message_size is None
            else up.max_message_size,
            last_heard=now,
            last_output=now,
        )
        health.strays_closed = self.strays_closed
        early = self._early.pop(rank, None)
        if early is not None and early[0] == epoch:
            health.next_seq = early[1] + 1
        if self.clock is not None:
            self.clock.observe_hello(up.hello_wave)
        if (orphans := self._orphans.pop(rank, None)) is not None:
            for frames in self._abort_frames(rank, orphans):
                self._fx.send(rank, frames)
        info = up.info
        self.routing.set_cap(rank, self._cap(rank, cap, info))
        seqs = info.get("max_num_seqs")
        self.routing.set_capacity(rank, seqs if type(seqs) is int else None)
        if self.prefix is not None:  # (forgotten by `Routing.set_up` already)
            block_size = info.get("block_size")
            if type(block_size) is int and block_size > 0:
                self.prefix.set_block_size(block_size)
            self.prefix.set_capacity(rank, info.get("num_gpu_blocks"))
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

    def on_rank_dead(self, rank: int, cause: str, *, rejoin: bool = False) -> None:
        """`rank` is dead (a failed send, a rejoin, a displaced identity, silence, an
        invalid message, its own announcement): apply the group's policy (§6); nothing
        if it was not up.

        Independent: its requests end with `EngineDead`; unless it already said HELLO
        again (`rejoin`), its handshake starts over and it is RESYNCed until it does.
        Lockstep: its peers cannot progress without it, so the whole group fails.
        """
        if not self.is_up(rank):
            return
        fx = self._fx
        fx.log(logging.ERROR, f"rank {rank}: dead: {cause}")
        if self.lockstep and not self.recovering:
            dead = EngineDead(rank, cause)
            if self.recover:
                reason: GroupClosed = GroupRecovering(
                    f"the lockstep group failed ({dead}) and waits for every rank to "
                    "complete a new handshake"
                )
            else:
                reason = GroupClosed(f"the lockstep group failed: {dead}")
            self._fail_group(reason, dead_rank=rank, cause=cause, rejoin=rejoin)
            return
        # Independent, or a new incarnation that died while the group recovers (it holds
        # nothing then: submits are refused).
        ended = self.book.rank_down(rank, cause)
        if ended:
            self.counters.count(ended)
            if self.wire.resumes:  # ABORTed if the same process comes back
                self._orphans[rank] = [e.wire_id for e in ended][-ORPHANS_KEPT:]
            for e in ended:
                fx.end(e, EngineDead(rank, cause, e.request_id))
        fx.drop(rank)  # its queued messages are for an incarnation gone
        self._drop_held(rank)
        if not rejoin:
            self._forget(rank)
        fx.fail_calls(rank, EngineDead(rank, cause))
        self._ranks_down()

    def _forget(self, rank: int) -> None:
        """`rank`'s handshake starts over, RESYNCed until it says HELLO (§2.5). The
        forget names the incarnation that ended (its epoch; vLLM: an incarnation count):
        one the transport has already replaced with a newer HELLO is kept."""
        self._fx.forget(rank, True, self.health[rank].epoch)

    def _ranks_down(self) -> None:
        for rank in range(self.size):
            if not self.is_up(rank):
                self._fx.rank_state(rank, False)

    def on_close(self, cause: str = "the engine group was closed") -> None:
        """Close the group (§9): every live request ends, ABORTs go to ranks still up.
        Nothing if it was closed already (a close ends a recovery, though)."""
        self._fail_group(GroupClosed(cause))

    def on_drain(self) -> bool:
        """Stop taking requests; False if the group was closed or draining already."""
        if (self.closed is not None and not self.recovering) or self.draining:
            return False
        self.draining = True
        return True

    def _fail_group(
        self,
        reason: GroupClosed,
        *,
        dead_rank: int | None = None,
        cause: str = "",
        rejoin: bool = False,
    ) -> None:
        """End every live request and ABORT it on its rank if that rank is still up;
        `dead_rank` (if any) died of `cause`. A `rejoin` (its HELLO again) keeps the
        handshake that HELLO started. A `GroupRecovering` forgets every rank."""
        recovering = isinstance(reason, GroupRecovering)
        if self.closed is not None and (recovering or not self.recovering):
            return  # closed already (a close ends a recovery, nothing else does)
        self.closed = reason
        if recovering:
            self._recover_by = None
            self._restart_clock()
        up = [self.is_up(r) and r != dead_rank for r in range(self.size)]
        ended: list[Ended[H]] = []
        for rank in range(self.size):
            ended += self.book.rank_down(rank, reason.cause)
        self.counters.count(ended)
        fx = self._fx
        by_rank: dict[int, list[str]] = {}
        for e in ended:
            if e.rank == dead_rank:
                fx.end(e, EngineDead(e.rank, cause, e.request_id))
            else:
                fx.end(e, GroupClosed(reason.cause, request_id=e.request_id))
            if up[e.rank]:
                by_rank.setdefault(e.rank, []).append(e.wire_id)
        if dead_rank is not None:
            fx.drop(dead_rank)
            self._drop_held(dead_rank)
        for rank, wids in by_rank.items():
            for frames in self._abort_frames(rank, wids):
                fx.send(rank, frames)
        if dead_rank is not None and not rejoin:
            fx.forget(dead_rank, recovering, self.health[dead_rank].epoch)
        if recovering:
            for rank in range(self.size):
                if up[rank]:
                    self._drop_held(rank)
                    fx.drop(rank)  # what is queued for it belongs to the failed incarnation
                    self._forget(rank)
        if dead_rank is not None:
            fx.fail_calls(dead_rank, EngineDead(dead_rank, cause))
        fx.fail_calls(None, reason)
        fx.closed = reason
        self._ranks_down()

    def _restart_clock(self) -> None:
        """Recovery: the group's next incarnation starts its waves afresh (each rank's
        HELLO wave is folded in as it comes up)."""
        if self.clock is not None:
            self.clock = WaveClock(0)
            self._adds_since_wake = False
            self._wake_due = False

    def _abort_frames(self, rank: int, wire_ids: list[str]) -> list[tuple[bytes, bytes]]:
        """ABORTs of these wire ids, each small enough for the rank to accept (§1)."""
        budget = min(self.health[rank].max_message_size, _ABORT_BUDGET) - 16
        out = []
        chunk: list[str] = []
        size = 0
        for wid in wire_ids:
            cost = len(wid.encode()) + 9  # the string and its longest CBOR head
            if chunk and size + cost > budget:
                out.append(self._encode_abort(tuple(chunk)))
                chunk, size = [], 0
            chunk.append(wid)
            size += cost
        if chunk:
            out.append(self._encode_abort(tuple(chunk)))
        return out

    # -- the wire ---------------------------------------------------------------------

    def _encode_add(self, wire_id: str, body: Any) -> tuple[bytes, bytes]:
        """The frames of an ADD; raises `ProtocolError` if `body` has no wire form."""
        clock = self.clock
        return self.wire.encode_add(wire_id, body, clock.wave if clock is not None else 0)

    def _encode_abort(self, wire_ids: tuple[str, ...]) -> tuple[bytes, bytes]:
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

    # -- submit path ------------------------------------------------------------------

    def submit(
        self,
        request_id: Any,
        body: Any,
        handle: H,
        rank: Any,
        now: float,
        timeout: float | None = None,
        prefix: tuple[Sequence[int], int] | None = None,
    ) -> Submitted:
        """Validate, encode, register and reserve (module docstring, steps 1-6).
        `prefix`: `Prepared.prefix`, the prompt's token ids (checked by the wire) and
        the root of their chain, for prefix affinity.

        Raises `InvalidRequest`, `DuplicateRequestId`, `InvalidRank`, `Overloaded`,
        `NoEngineAvailable`, `GroupDraining` or `GroupClosed`; after any of them nothing
        is registered or reserved. With `timeout`, the request ends TIMED_OUT if it has
        no terminal output by `now + timeout` (`on_deadline`).
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
            frames = self._encode_add(wire_id, body)
        except ProtocolError as exc:
            self.counters.rolled_back += 1
            raise InvalidRequest(request_id, exc.cause) from None
        try:
            chosen = self.book.submit(request_id, wire_id, handle, pinned, prefix)
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

    def _end_by_client(
        self, request_id: str, handle: H | None, outcome: Outcome = Outcome.ABORTED
    ) -> Ended[H] | None:
        """End a live request from the client side (counted); the caller ABORTs it."""
        ended = self.book.abort(request_id, handle, outcome=outcome)
        if ended is not None:
            self.counters.count((ended,))
        return ended

    def on_abort(self, request_id: str, handle: H | None) -> Ended[H] | None:
        """The client aborts a request (only `handle`'s submission, if given): it ends
        ABORTED and its rank is sent ABORT; returned, or None if it was not live. A
        user's `abort()` (no handle) makes a reader see `RequestAborted`; a stream
        closed early has nobody to tell."""
        ended = self._end_by_client(request_id, handle)
        if ended is not None:
            error = RequestAborted(ended.rank, request_id) if handle is None else None
            self._fx.end(ended, error)
            self._fx.send(ended.rank, self._encode_abort((ended.wire_id,)))
        return ended

    def on_overflow(self, request_id: str, handle: H, rank: int, limit: int) -> None:
        """A stream's buffer is at `limit` (`max_buffered`): its consumer does not keep
        up. The request is aborted on its rank (OVERFLOWED) if it is still live, and
        the stream fails with `StreamOverflow` after the outputs it holds. It is counted
        in `overflowed` either way (it may have just ended in the same batch)."""
        ended = self._end_by_client(request_id, handle, Outcome.OVERFLOWED)
        error = StreamOverflow(rank, request_id, limit, aborted=ended is not None)
        if ended is not None:
            self._fx.send(ended.rank, self._encode_abort((ended.wire_id,)))
        else:
            self.counters.overflowed += 1
            ended = Ended(request_id, rank, handle, Outcome.OVERFLOWED, None, "")
        self._fx.log(logging.WARNING, str(error), "overflow")
        self._fx.end(ended, error)

    def on_flushed(self) -> None:
        """The input task sent a run of messages: in a lockstep group that sent ADDs,
        one WAKE for the run (§5: one WAKE for several ADDs)."""
        if not self._adds_since_wake or self.clock is None:
            return
        self._adds_since_wake = False
        wave = self.clock.wake_after_adds()
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

    def on_output_stray_closed(self) -> None:
        """An output connection no rank had claimed, opened after an INIT, closed. A
        rank's first message over max_message_size is dropped with such a connection,
        and nothing but the next `seq` can say whose it was: a gap in a rank's `seq`
        while it holds requests, after such a close, is its connection error (a gap
        alone is not: §4 asks +1 per batch only as a SHOULD)."""
        self.strays_closed += 1

    # -- the dispatcher's pass --------------------------------------------------------

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
        """The earliest time `on_deadline` has something to do (inf: nothing)."""
        deadline = self._next_expiry()
        if self._losses:
            deadline = min(deadline, self.next_loss())
        if self.recovering:
            deadline = min(deadline, -math.inf if self._recover_by is None else self._recover_by)
        for rank in range(self.size):
            if self.is_up(rank) and self.routing.inflight_count(rank):
                deadline = min(deadline, *self._deadlines(rank))
        return deadline

    def _next_expiry(self) -> float:
        """The earliest deadline of a live request (inf: none)."""
        expiry = self._expiry
        while expiry and not self.book.is_live(expiry[0][1]):
            heapq.heappop(expiry)
        return expiry[0][0] if expiry else math.inf

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

    def _pending_cause(self, rank: int) -> str | None:
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
                # starts over (RESYNCed only while the group serves or waits for it)
                self._fx.forget(rank, self.closed is None or self.recovering, incarnation)
            elif self.is_up(rank):
                self.on_rank_dead(rank, cause)
            # else its death was judged already, and its forget ordered then

    def on_deadline(self, now: float) -> None:
        """A deadline passed: judge the connection losses that are due, expire
        requests, judge silence, WAKE stalled ranks, and end a recovery that waited
        `recover_timeout`."""
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
        self._expire(now)
        self._watch(now)

    def _expire(self, now: float) -> None:
        """End every live request whose deadline is at or before `now` (TIMED_OUT): its
        stream fails with `RequestTimeout` and its rank is sent ABORT."""
        fx = self._fx
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, wire_id, timeout = heapq.heappop(expiry)
            ended = self.book.expire(wire_id)
            if ended is not None:
                self.counters.count((ended,))
                error = RequestTimeout(ended.rank, ended.request_id, timeout)
                fx.end(ended, error)
                fx.send(ended.rank, self._encode_abort((ended.wire_id,)))
                fx.log(logging.INFO, str(error))

    def _watch(self, now: float) -> None:
        """Deaths by silence or (lockstep) no progress, and one WAKE for stalled ranks
        (sent before the deaths are applied: they were all judged at `now`)."""
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
        if wake is not None:
            self._fx.warn(
                f"lockstep group: a rank has waiting work and no progress; WAKE({wake}) again"
            )
            self._wake(wake, stall=True)
        for rank, cause in dead:
            self.on_rank_dead(rank, cause)

"""The request lifecycle: every submitted request ends exactly once.

Theory of operation
-------------------
A request has two names. The *application id* is the caller's (`Request.id`): unique
among live requests, reusable as soon as the request ends, and the only id the API
shows. The *wire id* is this book's (docs/protocol.md §3): ``f"{app_id}#{serial}"`` with a
serial that never repeats for the life of the book, so no two requests ever share a
wire id, even when the application reuses its id right after an abort. Engines only
ever see wire ids; every output is keyed by one.

A request is *live* from `submit` until it *ends*. It ends along exactly one of these
paths, whichever comes first; every later arrival of any of them is a no-op:

==============  ===========================================================  ==============
path            trigger                                                      outcome
==============  ===========================================================  ==============
terminal        an output with a `finish` string, from the rank holding it   FINISHED
finished        its wire id in a batch's `finished`, with no client abort    TRUNCATED
abort           `abort()`: the user's abort, or the stream closed early      ABORTED
overflow        its consumer fell `max_buffered` outputs behind (an abort)   OVERFLOWED
deadline        its `timeout` passed before its terminal output (an abort)   TIMED_OUT
rollback        the submit was refused after the reservation (size)          ROLLED_BACK
entry error     a malformed output entry names its wire id (§7)            PROTOCOL_ERROR
rank death      `rank_down()`: the rank died, rejoined or was declared dead  FAILED
==============  ===========================================================  ==============

Ordering rules the code relies on:

* **Register before reserve.** `submit` rejects a live duplicate application id before
  it touches the routing state. Reserving first would make the duplicate's rollback
  free the slot of the live request that owns the id (the SMG connector's bug; see docs/design.md).
* **Outputs follow the owner.** An output or `finished` entry only counts if it names a
  live wire id and comes from the rank that request was sent to. Anything else is
  dropped and counted: *late* if it names one of the last `RECENT_ENDED` requests that
  ended, sent to that same rank (an output racing an abort, a confirmation in
  `finished`), *unknown* otherwise. The memory of ended requests is what tells a real
  late entry from a stray that merely looks like a wire id (`x#0`); it is bounded.
  Because wire ids are never reused, a late output can never reach a newer request,
  whatever an engine puts in one batch. That is why revision 1's per-(rank, id)
  "unconfirmed abort" counts are gone.
* **Release by id, on every path.** A slot is held by wire id and released by the path
  that ends the request. Release is idempotent by id.
* **Rank death** ends every request the rank held; a new incarnation of the rank
  starts with no state (docs/protocol.md §2).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .errors import DuplicateRequestId
from .messages import Output
from .routing import Routing

__all__ = ["RECENT_ENDED", "BatchEffects", "Ended", "Outcome", "RequestBook"]

RECENT_ENDED = 65536
"""How many ended requests the book remembers (wire id and rank), to tell late entries
from strays: a few MiB."""

H = TypeVar("H")


class Outcome(enum.Enum):
    """How a request ended (`RequestStream.outcome`): every request ends exactly once,
    with one of these, and `GroupStatistics` counts each."""

    FINISHED = "finished"
    """Its terminal output arrived (`GroupStatistics.finished`)."""
    TRUNCATED = "truncated"
    """The engine listed it in `finished` with no terminal output: `StreamTruncated`."""
    ABORTED = "aborted"
    """`abort()`, or its stream's block was left early or cancelled: `RequestAborted`."""
    ROLLED_BACK = "rolled back"
    """`submit` refused it after all (no wire form, an ADD too large): nothing was sent."""
    PROTOCOL_ERROR = "protocol error"
    """A malformed entry named it (docs/protocol.md §7): `ProtocolError`."""
    OVERFLOWED = "overflowed"
    """Its reader fell `max_buffered` outputs behind; aborted: `StreamOverflow`."""
    TIMED_OUT = "timed out"
    """Its deadline passed; aborted on its rank: `RequestTimeout`."""
    FAILED = "failed"
    """Its rank died or the group closed: `EngineDead` or `GroupClosed`."""


@dataclass(frozen=True, slots=True)
class Ended(Generic[H]):
    """A request that has just ended. `rank` is where it was sent; `request_id` is the
    application's id and `wire_id` the one the engine knew it by."""

    request_id: str
    rank: int
    handle: H
    outcome: Outcome
    cause: str | None = None
    wire_id: str = ""


@dataclass(slots=True)
class BatchEffects(Generic[H]):
    """What one output batch did: outputs to deliver in order (renamed to the
    application's id), then requests that ended."""

    deliveries: list[tuple[H, Output]] = field(default_factory=list)
    ended: list[Ended[H]] = field(default_factory=list)
    late: int = 0
    """Entries naming a request that ended recently on this rank."""
    unknown: int = 0
    """Entries naming a wire id that was never issued, or not to this rank, or ended
    long ago."""


@dataclass(slots=True)
class _Live(Generic[H]):
    rank: int
    handle: H
    request_id: str
    wire_id: str


class RequestBook(Generic[H]):
    """Live requests by wire id and by application id, each with the rank it went to
    and an opaque `handle` (the trio layer's stream). Owns the in-flight reservations
    in `routing`, which are held by wire id."""

    __slots__ = ("_by_app", "_live", "_recent", "_recent_order", "_serial", "routing")

    def __init__(self, routing: Routing) -> None:
        self.routing = routing
        self._live: dict[str, _Live[H]] = {}  # wire id -> entry
        self._by_app: dict[str, _Live[H]] = {}  # application id -> entry
        self._serial = 0
        self._recent: dict[str, int] = {}  # wire id -> rank, of the latest ended requests
        self._recent_order: deque[str] = deque()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        """Whether an *application* id is live."""
        return request_id in self._by_app

    def live_on(self, rank: int) -> list[str]:
        """Wire ids live on `rank` (linear scan; for statistics and tests)."""
        return [wid for wid, e in self._live.items() if e.rank == rank]

    def wire_id(self, request_id: str) -> str | None:
        """The wire id of a live application id."""
        entry = self._by_app.get(request_id)
        return None if entry is None else entry.wire_id

    # -- client side ------------------------------------------------------------------

    def new_wire_id(self, request_id: str) -> str:
        """A wire id for `request_id` that this book has never issued (§3)."""
        serial = self._serial
        self._serial = serial + 1
        return f"{request_id}#{serial}"

    def known_on(self, wire_id: str, rank: int) -> bool:
        """Whether `wire_id` names a request live on `rank` or recently ended there: an
        entry for it is no stray."""
        entry = self._live.get(wire_id)
        return entry.rank == rank if entry is not None else self._recent.get(wire_id) == rank

    def _remember(self, wire_id: str, rank: int) -> None:
        self._recent[wire_id] = rank
        order = self._recent_order
        order.append(wire_id)
        if len(order) > RECENT_ENDED:
            del self._recent[order.popleft()]

    def submit(
        self,
        request_id: str,
        wire_id: str,
        handle: H,
        rank: int | None = None,
        prefix: tuple[Sequence[int], int] | None = None,
    ) -> int:
        """Register `request_id` under `wire_id`, then choose and reserve its rank
        (`prefix`: the prompt's token ids and chain root, for prefix affinity).

        Raises `DuplicateRequestId` (nothing reserved) if the application id is live,
        and whatever `Routing.select` raises (`InvalidRank`, `NoEngineAvailable`;
        nothing kept).
        """
        live = self._by_app.get(request_id)
        if live is not None:
            raise DuplicateRequestId(request_id, live.rank)
        chosen = self.routing.select(wire_id, rank, name=request_id, prefix=prefix)
        entry = _Live(chosen, handle, request_id, wire_id)
        self._live[wire_id] = entry
        self._by_app[request_id] = entry
        return chosen

    def abort(
        self,
        request_id: str,
        handle: H | None = None,
        *,
        outcome: Outcome = Outcome.ABORTED,
        cause: str | None = None,
    ) -> Ended[H] | None:
        """End a live request from the client side; the caller then sends ABORT of
        `Ended.wire_id` to `Ended.rank`. With `handle`, only that submission is ended
        (a stream closing late must not abort a newer request that reuses its id).
        Returns None, and the caller sends nothing, if there is nothing live to end."""
        entry = self._by_app.get(request_id)
        if entry is None or (handle is not None and entry.handle is not handle):
            return None
        return self._end(entry, outcome, cause)

    def expire(self, wire_id: str) -> Ended[H] | None:
        """End a live request whose deadline passed (TIMED_OUT); the caller sends ABORT.
        None if it already ended."""
        entry = self._live.get(wire_id)
        if entry is None:
            return None
        return self._end(entry, Outcome.TIMED_OUT, "deadline")

    def is_live(self, wire_id: str) -> bool:
        return wire_id in self._live

    def rollback(self, request_id: str, handle: H, cause: str) -> Ended[H] | None:
        """End a request whose ADD never reached the wire."""
        return self.abort(request_id, handle, outcome=Outcome.ROLLED_BACK, cause=cause)

    def _end(self, entry: _Live[H], outcome: Outcome, cause: str | None) -> Ended[H]:
        del self._live[entry.wire_id]
        del self._by_app[entry.request_id]
        self._remember(entry.wire_id, entry.rank)
        self.routing.release(entry.rank, (entry.wire_id,))
        return Ended(entry.request_id, entry.rank, entry.handle, outcome, cause, entry.wire_id)

    # -- engine side ------------------------------------------------------------------

    def fail_entry(self, rank: int, wire_id: str, cause: str) -> Ended[H] | None:
        """A malformed entry on `rank` names `wire_id` (§7): end that request with a
        protocol error if it is live there. None (the caller counts it) otherwise."""
        entry = self._live.get(wire_id)
        if entry is None or entry.rank != rank:
            return None
        return self._end(entry, Outcome.PROTOCOL_ERROR, cause)

    def apply_batch(
        self,
        rank: int,
        outputs: Sequence[Output],
        finished: Sequence[str] = (),
        fx: BatchEffects[H] | None = None,
    ) -> BatchEffects[H]:
        """Route one batch from `rank`: deliver outputs, end terminal and `finished`
        requests, release their slots. Adds to `fx` if given. Consumes `outputs`: each
        one delivered is the same object, its `request_id` rewritten to the app's id."""
        if fx is None:
            fx = BatchEffects()
        live = self._live
        by_app = self._by_app
        released: list[str] = []
        deliver = fx.deliveries.append
        routing = self.routing
        prefill = routing.prefilling  # lockstep prefix affinity: prefills not started
        for out in outputs:
            wid = out.request_id
            entry = live.get(wid)
            if entry is None or entry.rank != rank:
                self._stray(fx, wid, rank)
                continue
            if prefill:
                routing.started(wid)
            out.request_id = entry.request_id  # the wire id becomes the app's: no copy
            deliver((entry.handle, out))
            if out.finish is not None:
                del live[wid]
                del by_app[entry.request_id]
                self._remember(wid, rank)
                released.append(wid)
                fx.ended.append(
                    Ended(entry.request_id, rank, entry.handle, Outcome.FINISHED, None, wid)
                )
        for wid in finished:
            entry = live.get(wid)
            if entry is None or entry.rank != rank:
                self._stray(fx, wid, rank)
                continue
            del live[wid]
            del by_app[entry.request_id]
            self._remember(wid, rank)
            released.append(wid)
            fx.ended.append(
                Ended(entry.request_id, rank, entry.handle, Outcome.TRUNCATED, None, wid)
            )
        if released:
            self.routing.release(rank, released)
        return fx

    def _stray(self, fx: BatchEffects[H], wire_id: str, rank: int) -> None:
        if self._recent.get(wire_id) == rank:
            fx.late += 1
        else:
            fx.unknown += 1

    # -- rank lifecycle ---------------------------------------------------------------

    def rank_down(self, rank: int, cause: str) -> list[Ended[H]]:
        """The rank is gone: end every request it held (FAILED) and forget it."""
        self.routing.take_down(rank)
        ended = []
        for wid in self.live_on(rank):
            entry = self._live.pop(wid)
            del self._by_app[entry.request_id]
            self._remember(wid, rank)
            ended.append(Ended(entry.request_id, rank, entry.handle, Outcome.FAILED, cause, wid))
        return ended

    def rank_up(self, rank: int) -> None:
        """A new incarnation of `rank` finished its handshake: select it again."""
        self.routing.set_up(rank)

"""The request lifecycle: every submitted request ends exactly once.

Theory of operation
-------------------
A request is *live* from `submit` until it *ends*. It ends along exactly one of these
paths, whichever comes first; every later arrival of any of them is a no-op:

==============  ===========================================================  ============
path            trigger                                                      outcome
==============  ===========================================================  ============
terminal        an output with a `finish` string, from the rank holding it   FINISHED
finished        its id in a batch's `finished`, with no client abort         TRUNCATED
abort           `abort()`: the user's abort, or the stream closed early      ABORTED
rollback        encode, send or wake failed while submitting                 ROLLED_BACK
rank death      `rank_down()`: the rank died, rejoined or was declared dead  FAILED
==============  ===========================================================  ============

Ordering rules the code relies on:

* **Register before reserve.** `submit` rejects a live duplicate id before it touches
  the routing state. Reserving first would make the duplicate's rollback free the slot
  of the live request that owns the id (smg_connector.md §3.4).
* **Outputs follow the owner.** An output or `finished` entry only counts if it comes
  from the rank the request was sent to. Anything else is counted as stray and dropped.
* **Ids can be reused, and late outputs must not leak into the new request.** When the
  client aborts a request it sends ABORT to the rank, and the engine answers with either
  the request's terminal output (it had already finished) or its id in `finished`. Until
  that confirmation arrives, outputs for that id from that rank belong to the aborted
  incarnation, even if the id is live again on the same rank: ZeroMQ keeps each pipe in
  order, so ABORT reaches the engine before the new ADD, and every old output reaches
  the client before the new ones. The book counts unconfirmed aborts per (rank, id).
  An id that has a terminal output in a batch is not looked up again in that batch's
  `finished` (vLLM-style engines list it in both).
* **Release by id, from every path.** After routing a batch, every id the batch named
  as terminal is released on the reporting rank unless it is live there again (a new
  incarnation). Aborts and rollbacks release their own slot. Release is idempotent by
  id, so the overlap (an abort and its later confirmation) frees one slot, not two.
* **Rank death** ends every request the rank held and forgets its unconfirmed aborts:
  a new incarnation of the rank starts with no state (PROTOCOL.md §2).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .errors import DuplicateRequestId
from .messages import Output
from .routing import Routing

__all__ = ["BatchEffects", "Ended", "Outcome", "RequestBook"]

H = TypeVar("H")


class Outcome(enum.Enum):
    """How a request ended."""

    FINISHED = "finished"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    ROLLED_BACK = "rolled back"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Ended(Generic[H]):
    """A request that has just ended. `rank` is where it was (or would have been) sent."""

    request_id: str
    rank: int
    handle: H
    outcome: Outcome
    cause: str | None = None


@dataclass(slots=True)
class BatchEffects(Generic[H]):
    """What one output batch did: outputs to deliver in order, then requests that ended."""

    deliveries: list[tuple[H, Output]] = field(default_factory=list)
    ended: list[Ended[H]] = field(default_factory=list)
    late: int = 0
    """Outputs or `finished` entries of requests the client had already aborted."""
    unknown: int = 0
    """Outputs or `finished` entries that match no request on that rank."""


@dataclass(slots=True)
class _Live(Generic[H]):
    rank: int
    handle: H


class RequestBook(Generic[H]):
    """Live requests by id, each with the rank it went to and an opaque `handle`
    (the trio layer's stream). Owns the in-flight reservations in `routing`."""

    __slots__ = ("_live", "_unconfirmed", "routing")

    def __init__(self, routing: Routing) -> None:
        self.routing = routing
        self._live: dict[str, _Live[H]] = {}
        # rank -> {request id: aborts sent to that rank and not yet confirmed}
        self._unconfirmed: list[dict[str, int]] = [{} for _ in range(routing.size)]

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def live_on(self, rank: int) -> list[str]:
        """Ids live on `rank` (linear scan; for statistics and tests)."""
        return [rid for rid, e in self._live.items() if e.rank == rank]

    def unconfirmed(self, rank: int) -> dict[str, int]:
        return dict(self._unconfirmed[rank])

    # -- client side ------------------------------------------------------------------

    def submit(self, request_id: str, handle: H, rank: int | None = None) -> int:
        """Register `request_id`, then choose and reserve its rank; return the rank.

        Raises `DuplicateRequestId` (nothing reserved) if the id is live, and whatever
        `Routing.select` raises (`InvalidRank`, `NoEngineAvailable`; nothing kept).
        """
        live = self._live.get(request_id)
        if live is not None:
            raise DuplicateRequestId(request_id, live.rank)
        chosen = self.routing.select(request_id, rank)
        self._live[request_id] = _Live(chosen, handle)
        return chosen

    def abort(
        self,
        request_id: str,
        handle: H | None = None,
        *,
        outcome: Outcome = Outcome.ABORTED,
        cause: str | None = None,
    ) -> Ended[H] | None:
        """End a live request from the client side; the caller then sends ABORT to
        `Ended.rank`. With `handle`, only that incarnation is aborted (a stream closing
        late must not abort a newer request that reuses its id). Returns None, and the
        caller sends nothing, if there is nothing live to abort."""
        entry = self._live.get(request_id)
        if entry is None or (handle is not None and entry.handle is not handle):
            return None
        del self._live[request_id]
        pending = self._unconfirmed[entry.rank]
        pending[request_id] = pending.get(request_id, 0) + 1
        self.routing.release(entry.rank, (request_id,))
        return Ended(request_id, entry.rank, entry.handle, outcome, cause)

    def rollback(self, request_id: str, handle: H, cause: str) -> Ended[H] | None:
        """End a request whose ADD never reached the wire (encode or send failed)."""
        entry = self._live.get(request_id)
        if entry is None or entry.handle is not handle:
            return None
        del self._live[request_id]
        self.routing.release(entry.rank, (request_id,))
        return Ended(request_id, entry.rank, entry.handle, Outcome.ROLLED_BACK, cause)

    # -- engine side ------------------------------------------------------------------

    def apply_batch(
        self, rank: int, outputs: Sequence[Output], finished: Sequence[str] = ()
    ) -> BatchEffects[H]:
        """Route one batch from `rank`: deliver outputs, end terminal and `finished`
        requests, release their slots."""
        fx: BatchEffects[H] = BatchEffects()
        live = self._live
        pending = self._unconfirmed[rank]
        terminal: set[str] = set()
        for out in outputs:
            rid = out.request_id
            if pending and rid in pending:
                fx.late += 1
                if out.finish is not None:
                    _confirm(pending, rid)
                    terminal.add(rid)
                continue
            entry = live.get(rid)
            if entry is None or entry.rank != rank:
                fx.unknown += 1
                continue
            fx.deliveries.append((entry.handle, out))
            if out.finish is not None:
                del live[rid]
                terminal.add(rid)
                fx.ended.append(Ended(rid, rank, entry.handle, Outcome.FINISHED))
        for rid in finished:
            if rid in terminal:
                continue
            if pending and rid in pending:
                fx.late += 1
                _confirm(pending, rid)
                continue
            entry = live.get(rid)
            if entry is None or entry.rank != rank:
                fx.unknown += 1
                continue
            del live[rid]
            fx.ended.append(Ended(rid, rank, entry.handle, Outcome.TRUNCATED))
        if terminal or finished:
            terminal.update(finished)
            self.routing.release(rank, self._not_live_on(rank, terminal))
        return fx

    def _not_live_on(self, rank: int, ids: Iterable[str]) -> list[str]:
        live = self._live
        out = []
        for rid in ids:
            entry = live.get(rid)
            if entry is None or entry.rank != rank:
                out.append(rid)
        return out

    # -- rank lifecycle ---------------------------------------------------------------

    def rank_down(self, rank: int, cause: str) -> list[Ended[H]]:
        """The rank is gone: end every request it held (FAILED) and forget it."""
        self._unconfirmed[rank] = {}
        self.routing.take_down(rank)
        ended = []
        for rid in self.live_on(rank):
            entry = self._live.pop(rid)
            ended.append(Ended(rid, rank, entry.handle, Outcome.FAILED, cause))
        return ended

    def rank_up(self, rank: int) -> None:
        """A new incarnation of `rank` finished its handshake: select it again."""
        self._unconfirmed[rank] = {}
        self.routing.set_up(rank)


def _confirm(pending: dict[str, int], rid: str) -> None:
    left = pending[rid] - 1
    if left:
        pending[rid] = left
    else:
        del pending[rid]

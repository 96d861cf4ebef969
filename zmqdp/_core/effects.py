"""`Effects`: everything `GroupCore` decided since the trio layer last looked, in one record.

The core takes facts (a submit, an abort, output messages, a deadline, a failed send, a
rank up, a close) and adds what they call for here; the trio layer takes the record
(`GroupCore.take_effects`) and carries it out in one place (`_carry.Carrier.apply`), in
the order of the fields below. A field nobody touched stays an empty tuple shared by
all records, so a record costs one small allocation, not one list per field: the
dispatcher takes one per pass, and most passes only deliver.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from .errors import GroupClosed, ZmqdpError
from .messages import Output
from .requests import Ended

__all__ = ["Effects"]

H = TypeVar("H")

_NONE: tuple[()] = ()


class Effects(Generic[H]):
    """What to do, in this order (each is a list, or the shared empty tuple)."""

    deliveries: list[tuple[H, Output]] = _NONE  # type: ignore[assignment]
    """Outputs to hand to their streams, in order (the hot path: taken in bulk)."""
    ended: list[tuple[Ended[H], ZmqdpError | None]] = _NONE  # type: ignore[assignment]
    """Requests that ended, after their outputs, and what their stream raises (None:
    a clean end)."""
    sends: list[tuple[int, Sequence[bytes]]] = _NONE  # type: ignore[assignment]
    """Messages for a rank's input pipe (ABORTs, WAKEs), in order."""
    publications: list[list[bytes]] = _NONE  # type: ignore[assignment]
    """Messages for every rank at once (vLLM's coordinator XPUB: START_DP_WAVE)."""
    replies: list[tuple[int, int, str | None, Any]] = _NONE  # type: ignore[assignment]
    """(call id, rank, error, result) of utility-call replies."""
    call_failures: list[tuple[int | None, ZmqdpError]] = _NONE  # type: ignore[assignment]
    """Fail every call in flight on that rank (None: every call) with the error."""
    dropped: list[int] = _NONE  # type: ignore[assignment]
    """Ranks whose queued input messages belong to an incarnation that is gone."""
    forgets: list[tuple[int, bool, int | None]] = _NONE  # type: ignore[assignment]
    """(rank, resync, incarnation): that incarnation's handshake starts over (RESYNC it
    until it says HELLO); a newer one the transport has accepted since is kept."""
    ranks: list[tuple[int, bool]] = _NONE  # type: ignore[assignment]
    """(rank, up) for each rank that came up or went down."""
    logs: list[tuple[int, str | None, str]] = _NONE  # type: ignore[assignment]
    """(level, rate-limit key or None, message) to log."""
    room: bool = False
    """Requests ended or a rank came up: admit waiters, wake a drain."""
    closed: GroupClosed | None = None
    """The group closed: fail waiters and calls with this."""
    wave: int | None = None
    """The wave clock moved to this value (lockstep groups)."""

    def deliver(self, deliveries: list[tuple[H, Output]]) -> None:
        if self.deliveries:
            self.deliveries.extend(deliveries)
        else:
            self.deliveries = deliveries  # the first batch of a pass: no copy

    def end(self, ended: Ended[H], error: ZmqdpError | None) -> None:
        if not self.ended:
            self.ended = []
        self.ended.append((ended, error))
        self.room = True

    def send(self, rank: int, frames: Sequence[bytes]) -> None:
        if not self.sends:
            self.sends = []
        self.sends.append((rank, frames))

    def publish(self, frames: list[bytes]) -> None:
        if not self.publications:
            self.publications = []
        self.publications.append(frames)

    def reply(self, call_id: int, rank: int, error: str | None, result: Any) -> None:
        if not self.replies:
            self.replies = []
        self.replies.append((call_id, rank, error, result))

    def fail_calls(self, rank: int | None, error: ZmqdpError) -> None:
        if not self.call_failures:
            self.call_failures = []
        self.call_failures.append((rank, error))

    def drop(self, rank: int) -> None:
        if not self.dropped:
            self.dropped = []
        self.dropped.append(rank)

    def forget(self, rank: int, resync: bool, epoch: int | None = None) -> None:
        if not self.forgets:
            self.forgets = []
        self.forgets.append((rank, resync, epoch))

    def rank_state(self, rank: int, up: bool) -> None:
        if not self.ranks:
            self.ranks = []
        self.ranks.append((rank, up))
        self.room = True

    def log(self, level: int, message: str, key: str | None = None) -> None:
        if not self.logs:
            self.logs = []
        self.logs.append((level, key, message))

    def warn(self, message: str, key: str | None = None) -> None:
        self.log(logging.WARNING, message, key)

"""What the input task still has to send, one queue per rank, sans-IO.

Theory of operation
-------------------
Every message for an engine (ADD, ABORT, WAKE, CALL) is queued here by the task that
decided to send it, and sent by the one task that owns the input ROUTER. The queues are
**per rank** so that one rank that stops reading delays only itself: with a single FIFO,
the head message for a full rank held up every message behind it, for every rank
(docs/design.md, "Nobody blocks anybody").

A send can find a rank's pipe full (ZeroMQ's high-water mark). ZeroMQ cannot tell us when
that one peer has room again: a ROUTER's POLLOUT means "some peer has room", so waiting
on it spins while any other rank is healthy. So a full rank is *blocked*: it is skipped
by `sendable` and retried on a timer that backs off from `retry_first` to `retry_max`
seconds, and once it has been blocked for `send_timeout` seconds it is `overdue` and the
caller gives up on it (§6: the rank is dead). A successful send unblocks it.

Order within a rank is kept (the head is sent first, and put back if it could not be);
there is no order across ranks, which the protocol never needed (each rank has its own
pipe). Time is passed in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["Outbox"]

T = TypeVar("T")


@dataclass(slots=True)
class _Queue(Generic[T]):
    items: deque[T] = field(default_factory=deque)
    blocked_since: float | None = None
    retry_at: float = -math.inf
    backoff: float = 0.0


class Outbox(Generic[T]):
    """Per-rank FIFO queues with blocked-rank retry timers."""

    __slots__ = ("_queues", "_total", "retry_first", "retry_max", "send_timeout")

    def __init__(
        self,
        size: int,
        *,
        send_timeout: float = 10.0,
        retry_first: float = 0.001,
        retry_max: float = 0.02,
    ) -> None:
        self._queues: list[_Queue[T]] = [_Queue() for _ in range(size)]
        self._total = 0
        self.send_timeout = send_timeout
        self.retry_first = retry_first
        self.retry_max = retry_max

    def __len__(self) -> int:
        return self._total

    def queued(self, rank: int) -> int:
        return len(self._queues[rank].items)

    def put(self, rank: int, item: T) -> bool:
        """Queue `item` for `rank`. Returns whether the rank can be sent to now (False
        while it is blocked: waking the sender for it would be wasted)."""
        q = self._queues[rank]
        q.items.append(item)
        self._total += 1
        return q.blocked_since is None

    def sendable(self, now: float) -> list[int]:
        """Ranks with queued messages that are not blocked, or whose retry is due."""
        return [r for r, q in enumerate(self._queues) if q.items and q.retry_at <= now]

    def head(self, rank: int) -> T | None:
        items = self._queues[rank].items
        return items[0] if items else None

    def sent(self, rank: int) -> None:
        """The head of `rank`'s queue was sent: drop it; the rank is not blocked."""
        q = self._queues[rank]
        q.items.popleft()
        self._total -= 1
        if q.blocked_since is not None:
            q.blocked_since = None
            q.retry_at = -math.inf
            q.backoff = 0.0

    def blocked(self, rank: int, now: float) -> None:
        """The head of `rank`'s queue could not be sent (its pipe is full): retry later,
        backing off."""
        q = self._queues[rank]
        if q.blocked_since is None:
            q.blocked_since = now
            q.backoff = self.retry_first
        else:
            q.backoff = min(q.backoff * 2, self.retry_max)
        q.retry_at = now + q.backoff

    def overdue(self, now: float) -> list[int]:
        """Blocked ranks that have not taken a message for `send_timeout` seconds."""
        return [
            r
            for r, q in enumerate(self._queues)
            if q.blocked_since is not None and now - q.blocked_since >= self.send_timeout
        ]

    def next_retry(self) -> float:
        """When a blocked rank is next due (inf: none is). A rank that is overdue is due
        at once, so the caller can give up on it."""
        due = math.inf
        for q in self._queues:
            if q.blocked_since is not None and q.items:
                due = min(due, q.retry_at, q.blocked_since + self.send_timeout)
        return due

    def drop(self, rank: int) -> int:
        """Forget everything queued for `rank` (it died, or is being given up on);
        returns how many messages were dropped."""
        q = self._queues[rank]
        dropped = len(q.items)
        self._total -= dropped
        self._queues[rank] = _Queue()
        return dropped

    def take_all(self, rank: int) -> list[T]:
        """Everything queued for `rank`, in order, leaving its queue empty (at close)."""
        q = self._queues[rank]
        items = list(q.items)
        self.drop(rank)
        return items

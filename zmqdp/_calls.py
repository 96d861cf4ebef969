"""Utility calls in flight (`EngineGroup.call`), keyed by call id.

A call waits on its own `trio.Event`; the dispatcher settles it with the engine's reply
(`settle`), a malformed reply or an error text (`fail`), or the rank's death
(`rank_dead`). Each call is settled at most once: the first outcome wins, later ones
(a reply after a timeout, a reply from another rank) are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import trio

from ._core.errors import CallFailed, ZmqdpError

__all__ = ["PendingCall", "PendingCalls"]


@dataclass(slots=True, eq=False)
class PendingCall:
    rank: int
    method: str
    done: trio.Event = field(default_factory=trio.Event)
    value: Any = None
    error: ZmqdpError | None = None

    def result(self) -> Any:
        """The reply's result, or raise why there is none (call once `done` is set)."""
        if self.error is not None:
            raise self.error
        return self.value


class PendingCalls:
    """Every call in flight. Call ids come from the wire (`Wire.new_call_id`: natively
    counting from 0, never reused; vLLM's random 64-bit ints), never one in flight."""

    def __init__(self, new_id: Callable[[Container[int]], int]) -> None:
        self._calls: dict[int, PendingCall] = {}
        self._new_id = new_id

    def open(self, rank: int, method: str) -> tuple[int, PendingCall]:
        call_id = self._new_id(self._calls)
        call = self._calls[call_id] = PendingCall(rank, method)
        return call_id, call

    def forget(self, call_id: int) -> None:
        self._calls.pop(call_id, None)

    def _take(self, call_id: int, rank: int) -> PendingCall | None:
        call = self._calls.get(call_id)
        if call is None or call.rank != rank:
            return None  # late, or another rank's reply to a call it was not sent
        del self._calls[call_id]
        return call

    def settle(self, call_id: int, rank: int, value: Any) -> None:
        call = self._take(call_id, rank)
        if call is not None:
            call.value = value
            call.done.set()

    def fail(self, call_id: int, rank: int, error: str) -> None:
        call = self._take(call_id, rank)
        if call is not None:
            call.error = CallFailed(rank, call.method, error)
            call.done.set()

    def fail_all(self, error: ZmqdpError, rank: int | None = None) -> None:
        """End every call (on `rank`, if given) with `error`."""
        for call_id, call in list(self._calls.items()):
            if rank is None or call.rank == rank:
                del self._calls[call_id]
                call.error = error
                call.done.set()

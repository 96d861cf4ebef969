"""Requests waiting for room (`EngineGroup.wait_submit`), admitted in arrival order.

Theory of operation
-------------------
A waiter is a parked task and its request. Whenever room may have appeared (a request
ended, a rank came up) the group calls `admit`, which walks the queue in arrival order
and submits, *on the waiter's behalf and synchronously*, every request that now fits,
then reschedules its task with the stream (or with the error its submit raised).
Submitting in the waker, not in the woken task, is what makes the order fair: trio runs
woken tasks in no particular order, so "wake them and let them race" would not be
first come, first served.

A waiter pinned to a rank that is full waits without holding up unpinned waiters behind
it; once one unpinned waiter finds no room, the later unpinned ones are not tried in
that pass. A cancelled waiter is only marked (`task = None`) and skipped: nothing was
submitted for it, so cancelling is always clean. A waiter that was admitted gets its
stream even if a cancellation arrives after that: it then owns a live request, which
its `async with` aborts as usual.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import outcome
import trio

from ._core.errors import Overloaded, ZmqdpError
from .stream import RequestStream

__all__ = ["WaitQueue"]

R = TypeVar("R")


class _Waiter(Generic[R]):
    __slots__ = ("rank", "request", "task")

    def __init__(self, request: R, rank: int | None, task: trio.lowlevel.Task) -> None:
        self.request = request
        self.rank = rank
        self.task: trio.lowlevel.Task | None = task


class WaitQueue(Generic[R]):
    """The tasks in `EngineGroup.wait_submit`, first come, first served."""

    __slots__ = ("_queue", "_waiting")

    def __init__(self) -> None:
        self._queue: deque[_Waiter[R]] = deque()
        self._waiting = 0

    def __len__(self) -> int:
        """Waiters still waiting (cancelled ones are not counted)."""
        return self._waiting

    async def wait(self, request: R, rank: int | None) -> RequestStream:
        """Park until `admit` submits `request` (pinned to `rank`; its stream) or its
        submit fails (that error). Cancellation: if cancelled while parked, nothing was
        submitted."""
        waiter = _Waiter(request, rank, trio.lowlevel.current_task())
        self._queue.append(waiter)
        self._waiting += 1

        def abort(_: Any) -> trio.lowlevel.Abort:
            waiter.task = None
            self._waiting -= 1
            return trio.lowlevel.Abort.SUCCEEDED

        stream: RequestStream = await trio.lowlevel.wait_task_rescheduled(abort)
        return stream

    def admit(
        self, submit: Callable[[R], RequestStream], room: Callable[[int | None], bool]
    ) -> None:
        """Submit, in arrival order, every waiting request that fits now. `room(rank)`
        says whether a request pinned to `rank` (None: unpinned) could be taken; if it
        says no, the waiter is not tried."""
        queue, keep = self._queue, deque[_Waiter[R]]()
        unpinned_blocked = False
        while queue:
            waiter = queue.popleft()
            task = waiter.task
            if task is None:
                continue
            rank = waiter.rank
            if (rank is None and unpinned_blocked) or not room(rank):
                unpinned_blocked |= rank is None
                keep.append(waiter)
                continue
            result: outcome.Outcome[RequestStream]
            try:
                result = outcome.Value(submit(waiter.request))
            except Overloaded:
                unpinned_blocked |= rank is None
                keep.append(waiter)
                continue
            except ZmqdpError as exc:
                result = outcome.Error(exc)
            waiter.task = None
            self._waiting -= 1
            trio.lowlevel.reschedule(task, result)
        self._queue = keep

    def fail_all(self, error: Callable[[R], BaseException]) -> None:
        """Wake every waiter with `error(request)` (the group is draining or closed)."""
        queue, self._queue = self._queue, deque()
        for waiter in queue:
            task = waiter.task
            if task is not None:
                waiter.task = None
                self._waiting -= 1
                trio.lowlevel.reschedule(task, outcome.Error(error(waiter.request)))

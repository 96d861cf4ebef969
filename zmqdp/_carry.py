"""Carrying out: `Carrier.apply` does what one `Effects` record says, in its order.

The one place where the core's decisions turn into I/O and wake-ups: outputs into
stream buffers (the hot loop, `RequestStream.deliver_all`, or `deliver_all_held` with a
stream interval, whose held streams wait in `holding` for the dispatcher to release them
when their time comes), streams finished, frames queued on the transport, calls
settled, rank states and the wave clock published, lines logged, waiters failed or
admitted. No decisions are taken here: a stream found full
goes back to the core as a fact (`GroupCore.on_overflow`), whose effects are carried
out at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import trio

from ._admission import WaitQueue
from ._calls import PendingCalls
from ._core.effects import Effects
from ._core.errors import GroupClosed, GroupRecovering
from ._core.requests import Outcome
from ._core.state import GroupCore
from ._transport import Transport
from ._util import LogLimiter
from .stream import RequestStream
from .values import RankState

__all__ = ["Carrier"]

log = logging.getLogger("zmqdp")


class Carrier:
    """Carries out a group's effects (module docstring)."""

    def __init__(
        self,
        core: GroupCore[RequestStream],
        transport: Transport,
        calls: PendingCalls,
        states: list[Any],
        wave: Any,
        waiters: WaitQueue[Any],
        on_room: Callable[[], None],
        max_buffered: int | None,
        stream_interval: int = 1,
        stream_max_delay: float | None = None,
    ) -> None:
        self._core = core
        self._transport = transport
        self._calls = calls
        self._states = states  # trio-util AsyncValues, one per rank
        self._wave = wave
        self._waiters = waiters
        self._on_room = on_room
        self._max_buffered = max_buffered
        self._logs = LogLimiter(log)
        self._firsts: list[RequestStream] = []  # streams given their first output
        self.interval = stream_interval
        """1 while no stream has a stream interval (`deliver_all`), else `deliver_all_held`."""
        self._max_delay = math.inf if stream_max_delay is None else stream_max_delay
        self.holding: dict[RequestStream, float] = {}
        """Streams holding outputs (stream interval) -> when to release them, in order."""

    def apply(self, fx: Effects[RequestStream], dirty: set[RequestStream] | None = None) -> None:
        """Carry out what the core decided, in the order of `Effects`' fields."""
        core = self._core
        if fx.deliveries:
            firsts = self._firsts
            if dirty is None:
                dirty = set()
            if self.interval == 1:
                full = RequestStream.deliver_all(fx.deliveries, dirty, firsts)
            else:
                due = trio.current_time() + self._max_delay
                full = RequestStream.deliver_all_held(
                    fx.deliveries, dirty, firsts, self.holding, due
                )
            if firsts:
                now = trio.current_time()
                for stream in firsts:
                    if stream.first_output_at is None:
                        stream.first_output_at = now
                        core.ttft[stream.rank].observe(now - stream.submitted_at)
                firsts.clear()
            if full:
                limit = self._max_buffered or 0
                for stream in full:  # (repeated if it overflowed more than once)
                    if stream.outcome is None:
                        core.on_overflow(stream.request_id, stream, stream.rank, limit)
                        self.apply(core.take_effects(), dirty)
        if fx.ended:
            now = trio.current_time()
            for ended, error in fx.ended:
                stream = ended.handle
                stream.finish(ended.outcome, error)  # (releases what it held)
                if self.holding:
                    self.holding.pop(stream, None)
                if ended.outcome is Outcome.FINISHED:
                    core.latency[stream.rank].observe(now - stream.submitted_at)
        transport = self._transport
        for rank, frames in fx.sends:
            transport.send(rank, frames)
        for frames in fx.publications:
            transport.publish(frames)
        for call_id, replier, why, result in fx.replies:
            if why is not None:
                self._calls.fail(call_id, replier, why)
            else:
                self._calls.settle(call_id, replier, result)
        for on_rank, exc in fx.call_failures:
            self._calls.fail_all(exc, on_rank)
        for rank in fx.dropped:
            transport.drop_queued(rank)
        for rank, resync, epoch in fx.forgets:
            transport.forget(rank, resync=resync, epoch=epoch)
        for rank, up in fx.ranks:
            self._states[rank].value = RankState.UP if up else RankState.DOWN
        for level, key, message in fx.logs:
            if key is None:
                log.log(level, "%s", message)
            else:
                self._logs.log(level, key, "%s", message)
        if fx.closed is not None:
            closed = fx.closed
            kind = GroupRecovering if isinstance(closed, GroupRecovering) else GroupClosed
            self._waiters.fail_all(lambda r: kind(closed.cause, str(getattr(r, "id", r))))
        if fx.wave is not None:
            self._wave.value = fx.wave
        if fx.room:
            self._on_room()

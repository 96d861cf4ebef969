"""`RequestStream`: the outputs of one request, from the dispatcher to one consumer.

Theory of operation
-------------------
Two sides, one task each, and no back-reference between stream and group:

* the **dispatcher** (the package side: the carrier, `_carry.py`, on the dispatcher's
  task) delivers every output of a drained batch of messages (`deliver_all`, the hot
  loop; `deliver` one at a time), then calls `notify()` once per stream it delivered
  to, and `finish(outcome, error)` when the request ends. Nothing here blocks or awaits: a slow
  consumer only grows its own buffer, and the dispatcher never waits for it. Waking a
  trio task costs about ten times the decode of an output, hence one `notify()` per
  batch rather than per output.
* the **consumer** calls `receive()` (or iterates), `receive_nowait()`, or
  `receive_batch()` / `drain_nowait()` to take everything buffered at once (a gateway
  writes several tokens per HTTP write). After the last buffered output they raise
  `trio.EndOfChannel` for a clean end (the terminal output was delivered), or the error
  the request ended with.

Leaving the `async with` block, or being cancelled inside it, calls `on_close(stream)`
exactly once unless the request had already ended: the group then aborts the request on
its own rank. That call is synchronous (a queue operation), so it cannot be interrupted
and needs no shield.

Threads. A stream belongs to the thread that submitted it (the group's). Waiting on it
from another thread would park on a loop the dispatcher never wakes, so it raises
`RuntimeError` instead; leaving the `async with` from another thread hands the abort to
the group's thread (`EngineGroup._close_stream`), so the engine still gets its ABORT.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType

import trio

from ._core.messages import Output
from ._core.requests import Outcome
from ._util import NoPublicConstructor

__all__ = ["RequestStream"]


class RequestStream(metaclass=NoPublicConstructor):
    """The outputs of one request. Use as `async with` and iterate it.

    Iteration yields `Output`s in order and stops after the terminal one. It raises
    `EngineDead`, `GroupClosed`, `StreamTruncated`, `RequestAborted` or `ProtocolError`
    (after yielding every output that arrived first) if the request ends any other way.
    Made by `EngineGroup.submit`, never directly.
    """

    __slots__ = (
        "_buffer",
        "_done",
        "_error",
        "_held",
        "_interval",
        "_limit",
        "_on_close",
        "_thread",
        "_waiter",
        "first_output_at",
        "outcome",
        "rank",
        "request_id",
        "submitted_at",
        "wire_id",
    )

    def __init__(
        self,
        request_id: str,
        on_close: Callable[[RequestStream], None],
        max_buffered: int | None = None,
    ) -> None:
        self.request_id = request_id
        """The application's id (`Request.id`)."""
        self.rank = -1
        """The rank the request was sent to."""
        self.wire_id = ""
        """The id the engine knows this request by (docs/protocol.md §3), for its logs."""
        self.outcome: Outcome | None = None
        """How the request ended; None while it is live."""
        self.submitted_at = 0.0
        """`trio.current_time()` when it was submitted."""
        self.first_output_at: float | None = None
        """`trio.current_time()` of the dispatcher pass that delivered its first output."""
        self._on_close = on_close
        self._limit = sys.maxsize if max_buffered is None else max_buffered
        # Made at the first output: an empty deque costs ~750 bytes, more than all the
        # rest of a request's state (benchmarks/bench_p4_memory.py).
        self._buffer: deque[Output] | None = None
        self._interval = 1  # outputs per wake-up (the group's `stream_interval`)
        self._held: list[Output] | None = None  # delivered, not yet released (interval)
        self._waiter: trio.lowlevel.Task | None = None
        self._done = False
        self._error: BaseException | None = None
        self._thread = threading.get_ident()

    # -- the dispatcher's side (package-internal; synchronous) ------------------------

    def deliver(self, out: Output) -> bool:
        """Buffer one output (call `notify()` once the batch is delivered). Returns False,
        buffering nothing, if `max_buffered` outputs are already waiting: the caller
        ends the request (`StreamOverflow`)."""
        buffer = self._buffer
        if buffer is None:
            buffer = self._buffer = deque()
        if len(buffer) >= self._limit:
            return False
        buffer.append(out)
        return True

    def notify(self) -> None:
        """Wake the consumer if it is waiting."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter)

    def finish(self, outcome: Outcome, error: BaseException | None = None) -> None:
        """The request ended (`error` is raised after the buffered outputs, the held ones
        released first); idempotent."""
        if self._done:
            return
        if self._held:
            self.release()
        self._done = True
        self.outcome = outcome
        self._error = error
        self.notify()

    def release(self) -> None:
        """Move the held outputs to the buffer, in order (call `notify()` after)."""
        held = self._held
        if held:
            buffer = self._buffer
            assert buffer is not None  # made at the first output, which is never held
            buffer.extend(held)
            held.clear()

    @staticmethod
    def release_due(
        holding: dict[RequestStream, float], now: float, dirty: set[RequestStream]
    ) -> None:
        """Release the held outputs of every stream in `holding` whose release time is
        `now` or earlier (they are in due order), adding those streams to `dirty`."""
        while holding:
            stream, due = next(iter(holding.items()))
            if due > now:
                return
            del holding[stream]
            if stream._held:
                stream.release()
                dirty.add(stream)

    @classmethod
    def deliver_all(
        cls,
        deliveries: list[tuple[RequestStream, Output]],
        dirty: set[RequestStream],
        firsts: list[RequestStream],
    ) -> list[RequestStream]:
        """`deliver` each (stream, output) pair, adding the streams fed to `dirty` and
        those that got their first output to `firsts` (for time to first output);
        returns the streams that were full (in order, possibly repeated). One call per
        batch instead of one method call per output: this is the hottest loop."""
        full = []
        add = dirty.add
        for stream, out in deliveries:
            if type(stream) is RequestStream:  # inlined `deliver`
                buffer = stream._buffer
                if buffer is None:  # made at the first output (see __init__)
                    buffer = stream._buffer = deque()
                    firsts.append(stream)
                if len(buffer) < stream._limit:
                    buffer.append(out)
                    add(stream)
                    continue
            elif stream.deliver(out):
                if stream.first_output_at is None:
                    firsts.append(stream)
                add(stream)
                continue
            full.append(stream)
        return full

    @classmethod
    def deliver_all_held(
        cls,
        deliveries: list[tuple[RequestStream, Output]],
        dirty: set[RequestStream],
        firsts: list[RequestStream],
        holding: dict[RequestStream, float],
        due: float,
    ) -> list[RequestStream]:
        """`deliver_all` for streams with a stream interval (module docstring): an output
        that is neither the first nor terminal is held until `_interval` are; a stream
        that starts holding is entered in `holding` with release time `due`. The held
        outputs count against `max_buffered`."""
        full = []
        add = dirty.add
        for stream, out in deliveries:
            buffer = stream._buffer
            held = stream._held
            if buffer is None:  # the first output: at once
                buffer = stream._buffer = deque()
                firsts.append(stream)
            elif len(buffer) + (len(held) if held else 0) >= stream._limit:
                full.append(stream)
                continue
            elif out.finish is None and stream._interval > 1:
                if held is None:
                    held = stream._held = []
                held.append(out)
                if len(held) < stream._interval:
                    if len(held) == 1:  # (re-entered: `holding` stays in due order)
                        holding.pop(stream, None)
                        holding[stream] = due
                    continue
                buffer.extend(held)
                held.clear()
                holding.pop(stream, None)
                add(stream)
                continue
            elif held:  # the terminal output: the held ones first
                buffer.extend(held)
                held.clear()
                holding.pop(stream, None)
            buffer.append(out)
            add(stream)
        return full

    # -- the consumer's side ----------------------------------------------------------

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leaving early aborts the request on its rank and frees its slot, once.

        Cancellation: the abort is a synchronous queue operation; it always happens.
        """
        self.close_nowait()

    def close_nowait(self) -> None:
        """What leaving the `async with` does: abort the request on its rank if it is
        still live (once; a no-op after it ended)."""
        if not self._done:
            self._on_close(self)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Output:
        """`receive()`, ending the iteration at the clean end of the stream."""
        buffer = self._buffer
        if buffer:  # the common case, inlined: a cancellation check, no schedule point
            await trio.lowlevel.checkpoint_if_cancelled()
            if buffer:
                return buffer.popleft()
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def _end_of_stream(self) -> BaseException:
        return self._error if self._error is not None else trio.EndOfChannel()

    def receive_nowait(self) -> Output:
        """The next buffered output. Raises `trio.WouldBlock` if none is buffered yet,
        and at the end of the stream `trio.EndOfChannel` or the request's error."""
        buffer = self._buffer
        if buffer:
            return buffer.popleft()
        if self._done:
            raise self._end_of_stream()
        raise trio.WouldBlock

    def drain_nowait(self) -> list[Output]:
        """Every buffered output, possibly none; at the end of the stream, with nothing
        left, raises `trio.EndOfChannel` or the request's error."""
        buffer = self._buffer
        if buffer:
            out = list(buffer)
            buffer.clear()
            return out
        if self._done:
            raise self._end_of_stream()
        return []

    def _check_thread(self) -> None:
        """Waiting from a thread other than the group's would never be woken."""
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                f"request {self.request_id!r}: its stream is read from another thread than "
                "the engine group's; read it in the group's thread (or hand it over with "
                "trio.from_thread)"
            )

    def _busy(self) -> trio.BusyResourceError:
        """One stream, one reader (as a trio channel's receive side)."""
        return trio.BusyResourceError(
            f"request {self.request_id!r}: another task is already reading this stream"
        )

    async def _wait(self) -> None:
        """Park the reader until `notify()` (a trio.Event per wait cost more than the
        rest of delivering a token)."""
        self._check_thread()
        if self._waiter is not None:
            raise self._busy()
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._buffer and not self._done:
            if self._waiter is not None:  # another reader took our output and parked
                raise self._busy()
            self._waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)

    def _abort_wait(self, _raise_cancel: object) -> trio.lowlevel.Abort:
        self._waiter = None  # cancelled: the same task may read again
        return trio.lowlevel.Abort.SUCCEEDED

    async def receive(self) -> Output:
        """The next output, waiting for it if needed; `trio.EndOfChannel` after the
        terminal one, or the error the request ended with.

        Cancellation: if cancelled while waiting, no output is lost and the request
        stays live (leave the `async with` to abort it). When an output is already
        buffered it is returned after a cancellation check but without a schedule
        point, so a fast stream is not slowed down by one trio checkpoint per token.

        Raises `trio.BusyResourceError` if another task is already waiting on this
        stream: one stream has one consumer, as a trio channel's receive side.
        """
        await self._wait()
        buffer = self._buffer
        if buffer:
            return buffer.popleft()
        raise self._end_of_stream()

    async def receive_batch(self) -> list[Output]:
        """Every buffered output (at least one), waiting for the first; at the end
        `trio.EndOfChannel` or the request's error. Cancellation: as `receive()`."""
        await self._wait()
        return self.drain_nowait()

"""`AsyncioEngineGroup`: the `EngineGroup` API for asyncio hosts (asyncio, uvloop), with
trio running as a guest on the host's event loop.

    async with AsyncioEngineGroup.connect("ipc:///tmp/zmqdp-g1/g", engines=2) as group:
        async with group.submit(Request("r1", body)) as stream:
            async for out in stream:
                ...

Theory of operation
-------------------
One thread. `connect` starts a trio *guest run* (`trio.lowlevel.start_guest_run`) on the
running asyncio loop; its main task opens an ordinary `EngineGroup`. Every step of a trio
task (the dispatcher, the input and handshake tasks, the waiting calls below) runs as an
asyncio callback on the loop's thread, never at the same time as asyncio code; only
trio's wait for I/O (epoll) runs in a helper thread, which hands its result back with
`call_soon_threadsafe`. A trio step and an asyncio step never overlap, so neither side
needs a lock.

Synchronous calls go straight in. For the whole guest run, trio's synchronous API works
on the loop's thread between trio steps, and whatever makes a trio task runnable there
(rescheduling it, cancelling its scope, moving a deadline earlier) wakes the guest at
once. So `submit`, `abort`, `health`, `statistics` and leaving a stream's `async with`
run the `EngineGroup`'s own synchronous code: a submit's ADD is queued and the input
task woken before `submit` returns, and its errors are raised right there.

Waiting calls (`wait_submit` when it has to wait, `call`, `drain`, `wait_rank_state`)
run the `EngineGroup` coroutine as a trio task, in a nursery of the guest's main task;
the asyncio caller awaits a future that the task resolves with its result or its
exception. Cancelling the caller cancels the task's scope; what that leaves behind is in
each method's docstring.

Streams. `AsyncioRequestStream` is a `RequestStream` whose consumer side waits on an
asyncio future instead of parking a trio task. The dispatcher fills its buffer and, once
per drained batch of messages (not per output), resolves that future; the consumer task
runs after the trio step, at the loop's next turn. A slow consumer only grows its own
buffer, as in trio.

Ordering. Things happen in the order of the calls on the loop's thread: two submits
reach their rank in call order, an abort after the submit of its request, the outputs
of a request in the order the engine sent them. A stream's `receive` and `async for`
return a buffered output without yielding to the loop, as `asyncio.Queue.get` does
when the queue is not empty.

Closing. Leaving `connect`'s block sets an event the guest's main task waits on: it
leaves the `EngineGroup` block (ABORT for every live request, live streams end with
`GroupClosed`, sockets closed), cancels the waiting calls still running (they raise
`GroupClosed`), and the guest run ends; the block is left only after that. Cancelled
while connecting, `connect` cancels the trio side and waits for it to finish before it
raises `CancelledError`. A thread holds one trio run at a time, so an event loop has one
`AsyncioEngineGroup` open at a time (a second `connect` raises `RuntimeError`).

A blocked host loop blocks trio too, since trio runs inside the loop. libzmq keeps
receiving in its own threads meanwhile; when the loop runs again, the dispatcher reads
what arrived before it judges silence, so a rank that kept sending (outputs, load
reports) during the block is not declared dead, however long the block was. Deadlines
that passed meanwhile (`Request.timeout`, a rank that was silent for real) fire at once,
and nothing is sent to the engines during the block.

Signals. `asyncio.run` and `uvloop.run` turn Ctrl-C into a cancellation of the main
task: the group closes as when its block is left, then the runner raises
`KeyboardInterrupt`. Under a host that installs no SIGINT handler (plain
`loop.run_until_complete` on the main thread), trio installs its own for the guest run:
`KeyboardInterrupt` is then raised in whatever code runs, asyncio's or trio's; if it ends
the guest run, it is raised again from the loop callback that saw the run end, which
stops the loop as a `KeyboardInterrupt` in any asyncio callback does. trio's signal API
(`trio.open_signal_receiver`) does not work in the guest; zmqdp does not use it.

Errors are the `EngineGroup`'s, of the same types; streams raise `trio.EndOfChannel`,
`trio.WouldBlock` and `trio.BusyResourceError` where `RequestStream` does. Errors of
zmqdp's own trio tasks come out as one plain exception, never an `ExceptionGroup`: from
`connect` while connecting; after that the group closes at once (streams and waiting
calls raise `GroupClosed`, the error is logged) and the error is raised when the block
is left.

Use the group and its streams from the loop's thread only (the group's methods check).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar, Unpack, cast

import outcome
import trio

from ._core.errors import GroupClosed
from ._core.messages import Output
from ._sockets import NATIVE
from ._transport import GroupDialect
from ._util import NoPublicConstructor, collapse, open_service_nursery
from .client import EngineGroup
from .stream import RequestStream
from .values import (
    ConnectKeywords,
    ConnectOptions,
    EngineInfo,
    GroupHealth,
    GroupStatistics,
    RankState,
    connect_options,
    with_connect_options,
)

__all__ = ["AsyncioEngineGroup", "AsyncioRequestStream"]

log = logging.getLogger("zmqdp")

T = TypeVar("T")
R = TypeVar("R")


class AsyncioRequestStream(RequestStream):
    """The outputs of one request, read from asyncio. Use as `async with` and iterate it.

    Iteration yields `Output`s in order and stops after the terminal one. It raises
    `EngineDead`, `GroupClosed`, `StreamTruncated`, `RequestAborted`, `RequestTimeout`,
    `StreamOverflow` or `ProtocolError` (after yielding every output that arrived first)
    if the request ends any other way. Made by `AsyncioEngineGroup.submit`, never
    directly.

    Leaving the `async with` block before the request ended, for any reason (an
    exception, `break`, a cancellation), aborts the request on its rank, exactly once;
    that is a synchronous queue operation, so it always happens.

    `receive`, `receive_batch` and the rest are `RequestStream`'s: only the wait
    (`_wait`, on an asyncio future) and the wake-up (`notify`) are asyncio's own. An
    output that is already buffered is returned without yielding to the loop. If
    cancelled while waiting, no output is lost and the request stays live.
    """

    __slots__ = ("_future",)

    def __init__(
        self,
        request_id: str,
        on_close: Callable[[RequestStream], None],
        max_buffered: int | None = None,
    ) -> None:
        super().__init__(request_id, on_close, max_buffered)
        self._future: asyncio.Future[None] | None = None

    # -- the dispatcher's side --------------------------------------------------------

    def notify(self) -> None:
        """Wake the consumer if it is waiting (the dispatcher runs on the loop's thread,
        inside a guest step: resolving the future schedules the consumer task)."""
        future = self._future
        if future is not None:
            self._future = None
            if not future.done():  # a cancelled waiter has not cleaned up yet
                future.set_result(None)

    # -- the consumer's side ----------------------------------------------------------

    async def __aenter__(self) -> AsyncioRequestStream:
        return self

    def __aiter__(self) -> AsyncioRequestStream:
        return self

    async def __anext__(self) -> Output:
        """`receive()`, ending the iteration at the clean end of the stream."""
        buffer = self._buffer
        if buffer:  # the common case, inlined
            return buffer.popleft()
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def _wait(self) -> None:
        """Wait until an output is buffered or the request ended."""
        self._check_thread()
        if self._future is not None:
            raise self._busy()
        while not self._buffer and not self._done:
            if self._future is not None:  # another reader took our output and waits
                raise self._busy()
            future = self._future = asyncio.get_running_loop().create_future()
            try:
                await future
            finally:
                if self._future is future:  # cancelled: the same task may read again
                    self._future = None


class _Guest:
    """One trio guest run on the host loop, around one `EngineGroup`: its main task, the
    nursery where waiting calls run, and how it ended."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.get_ident()
        self.scope = trio.CancelScope()
        """The main task's scope: cancelled when connecting is given up."""
        self.closing = trio.Event()
        """Set to leave the group's block."""
        self.changed: asyncio.Future[None] = loop.create_future()
        """Done once the group is connected, or the run has ended."""
        self.finished: asyncio.Future[None] = loop.create_future()
        """Done once the run has ended."""
        self.running = False
        self.close_requested = False
        self.group: EngineGroup[Any] | None = None
        self.nursery: trio.Nursery | None = None
        self.result: outcome.Outcome[None] | None = None

    # -- lifecycle --------------------------------------------------------------------

    async def start(
        self, url: str, engines: int, dialect: GroupDialect[R], options: ConnectOptions
    ) -> EngineGroup[R]:
        """Start the guest run and wait until its group is connected; raise what
        connecting raised. Cancellation: the trio side is cancelled, and this returns
        (raising `CancelledError`) once the guest run has ended."""
        if trio.lowlevel.in_trio_run():
            raise RuntimeError(
                "a trio run is already active in this thread (another AsyncioEngineGroup "
                "on this event loop?): one thread holds one trio run at a time"
            )
        trio.lowlevel.start_guest_run(
            self._main,
            url,
            engines,
            dialect,
            options,
            run_sync_soon_threadsafe=self.loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=self.loop.call_soon,
            done_callback=self._done,
            host_uses_signal_set_wakeup_fd=True,
        )
        self.running = True
        try:
            await asyncio.shield(self.changed)
        except asyncio.CancelledError:
            self.scope.cancel("connect() was cancelled")
            await self.wait_finished()
            raise
        if self.group is None or not self.running:
            await self.wait_finished()
            raise self.failure() or self.closed_error()
        return cast(EngineGroup[R], self.group)

    async def _main(
        self, url: str, engines: int, dialect: GroupDialect[Any], options: ConnectOptions
    ) -> None:
        with self.scope:
            async with (
                open_service_nursery() as nursery,
                EngineGroup.open(
                    url, engines, dialect, options, stream_class=AsyncioRequestStream
                ) as group,
            ):
                self.group = group
                self.nursery = nursery
                self.changed.set_result(None)
                try:
                    await self.closing.wait()
                finally:
                    self.nursery = None  # waiting calls from now on: GroupClosed

    def _done(self, result: outcome.Outcome[None]) -> None:
        """The guest run ended (called by trio, in a loop callback)."""
        if isinstance(result, outcome.Error) and isinstance(result.error, BaseExceptionGroup):
            result = outcome.Error(collapse(result.error))
        self.result = result
        self.running = False
        self.nursery = None
        for future in (self.changed, self.finished):
            if not future.done():
                future.set_result(None)
        if isinstance(result, outcome.Error):
            error = result.error
            if not isinstance(error, Exception):
                raise error  # KeyboardInterrupt, SystemExit: stop the loop, as anywhere
            if self.group is not None and not self.close_requested:
                log.error("the engine group's trio side failed; the group is closed: %r", error)

    async def close(self) -> None:
        """Leave the group's block and wait until the guest run has ended.

        Cancellation: the guest run is cancelled too, and `CancelledError` is raised
        once it has ended (closing takes at most the transport's close linger)."""
        self.close_requested = True
        if self.running:
            self.closing.set()
        await self.wait_finished()

    async def wait_finished(self) -> None:
        """Wait until the guest run has ended, even if cancelled meanwhile (then the
        trio side is cancelled too, and `CancelledError` raised after the end)."""
        cancelled = False
        while not self.finished.done():
            try:
                await asyncio.shield(self.finished)
            except asyncio.CancelledError:
                cancelled = True
                self.scope.cancel("the host task was cancelled while zmqdp was closing")
        if cancelled:
            raise asyncio.CancelledError

    def failure(self) -> Exception | None:
        """The error the guest run ended with, if any (a KeyboardInterrupt or SystemExit
        was raised from the loop callback already)."""
        result = self.result
        if isinstance(result, outcome.Error) and isinstance(result.error, Exception):
            return result.error
        return None

    def closed_error(self, request_id: str | None = None) -> GroupClosed:
        closed = self.group.closed if self.group is not None else None
        cause = closed.cause if closed is not None else "the engine group is closed"
        return GroupClosed(cause, request_id)

    # -- waiting calls ----------------------------------------------------------------

    def check_thread(self) -> None:
        if threading.get_ident() != self.thread:
            raise RuntimeError(
                "an AsyncioEngineGroup is used from another thread than its event loop's"
            )

    async def run(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        late: Callable[[T], None] | None = None,
    ) -> T:
        """`await fn(*args)` as a trio task of the guest; its result or exception.
        Raises `GroupClosed` if the group has closed. Cancellation: the task is
        cancelled; if its result came in the same turn of the loop, `late(result)`."""
        nursery = self.nursery
        if nursery is None:
            raise self.closed_error()
        future: asyncio.Future[T] = self.loop.create_future()
        scope = trio.CancelScope()
        name = f"zmqdp-aio-{getattr(fn, '__name__', 'call')}"
        nursery.start_soon(self._task, future, scope, fn, args, late, name=name)
        try:
            return await future
        except asyncio.CancelledError:
            scope.cancel("the asyncio caller was cancelled")
            if future.done() and not future.cancelled() and future.exception() is None:
                # the result came, but this task was cancelled before it could resume
                value = future.result()
                if late is not None:
                    late(value)
            raise

    async def _task(
        self,
        future: asyncio.Future[T],
        scope: trio.CancelScope,
        fn: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        late: Callable[[T], None] | None,
    ) -> None:
        try:
            with scope:
                value = await fn(*args)
                if not future.done():
                    future.set_result(value)
                elif late is not None:  # the caller was cancelled as the result came
                    late(value)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
        finally:
            if not future.done():  # cancelled because the group is closing
                future.set_exception(self.closed_error())


class AsyncioEngineGroup(Generic[R], metaclass=NoPublicConstructor):
    """The client of one engine group, for asyncio code. Get one from `connect`, never
    by calling the class::

        async with AsyncioEngineGroup.connect("ipc:///tmp/zmqdp-g1/g", 2) as group:
            async with group.submit(Request("r1", body)) as stream:
                async for out in stream:
                    ...

    `EngineGroup`'s API with asyncio coroutines and streams (module docstring), on any
    wire (`dialect=zmqdp.vllm.dialect()` for vLLM engine cores)."""

    def __init__(self, group: EngineGroup[R], guest: _Guest) -> None:
        """Private: `connect` builds it. Use `AsyncioEngineGroup.connect(url, engines)`;
        calling the class raises `TypeError`."""
        self._group = group
        self._guest = guest
        self.size = group.size
        """The number of ranks."""
        self.lockstep = group.lockstep
        """Whether the ranks step in lockstep (docs/protocol.md §5)."""

    @classmethod
    @with_connect_options
    @asynccontextmanager
    async def connect(
        cls,
        url: str,
        engines: int,
        *,
        dialect: GroupDialect[Any] = NATIVE,
        options: ConnectOptions | None = None,
        **kwargs: Unpack[ConnectKeywords],
    ) -> AsyncIterator[AsyncioEngineGroup[Any]]:
        """Start trio as a guest of the running loop, bind the group URL, wait for all
        `engines` ranks, and serve them. `dialect`: `zmqdp.NATIVE` (native engines,
        `Request`s) or `zmqdp.vllm.dialect(moe=...)` (vLLM engine cores,
        `VllmRequest`s). The other keyword arguments are `zmqdp.ConnectOptions`'s
        (or pass one as `options`), as for `EngineGroup.connect`.

        Raises `HandshakeTimeout` if the group is not ready in `ready_timeout` s, and
        whatever else `EngineGroup.connect` raises, as one plain exception.
        `RuntimeError` if this thread already runs trio (another group is open on this
        loop). Leaving the block sends ABORT for every live request, closes every socket
        and ends the guest run, then returns; live streams end with `GroupClosed`. An
        exception raised in the block passes out unchanged.

        Cancellation: cancelled while waiting for the engines, it cancels the trio side
        and raises `CancelledError` once the guest run has ended: nothing is left
        running. Cancelled inside the block, it closes as above.
        """
        options = connect_options(options, kwargs)
        guest = _Guest(asyncio.get_running_loop())
        group = await guest.start(url, engines, dialect, options)
        try:
            yield cls._create(group, guest)
        except BaseException as exc:
            await guest.close()
            error = guest.failure()
            if error is not None:
                exc.add_note(f"zmqdp also failed: {type(error).__name__}: {error}")
            raise
        await guest.close()
        error = guest.failure()
        if error is not None:
            raise error

    # -- state ------------------------------------------------------------------------

    @property
    def engines(self) -> tuple[EngineInfo, ...]:
        """Per rank: READY info and state."""
        return self._group.engines

    @property
    def draining(self) -> bool:
        """`drain()` was called: no new requests are taken."""
        return self._group.draining

    @property
    def closed(self) -> GroupClosed | None:
        """Why the group is closed or failed, or None while it serves."""
        return self._group.closed

    def health(self) -> GroupHealth:
        """A snapshot for liveness and readiness probes (`EngineGroup.health`)."""
        return self._group.health()

    def statistics(self) -> GroupStatistics:
        """A frozen snapshot of per-rank state and the group's counters."""
        return self._group.statistics()

    # -- requests ---------------------------------------------------------------------

    def submit(self, request: R) -> AsyncioRequestStream:
        """Send a request; return its stream (use it with `async with` at once).

        Never blocks. Raises a `SubmitRefused` or a `GroupClosed`, each before
        anything is sent or reserved: `Overloaded` (admission control: no room, see
        `wait_submit`), `GroupDraining`, `GroupClosed`, `DuplicateRequestId` (an
        `InvalidRequest`), `InvalidRank`, `NoEngineAvailable` or `InvalidRequest`
        (`EngineGroup.submit`).
        """
        guest = self._guest
        guest.check_thread()
        if not guest.running:  # no trio run left to ask the time
            raise guest.closed_error(str(getattr(request, "id", request)))
        return cast(AsyncioRequestStream, self._group.submit(request))

    async def wait_submit(self, request: R) -> AsyncioRequestStream:
        """`submit`, waiting for room while admission control refuses it: waiters are
        admitted first come, first served (a plain `submit` that finds room takes it).
        Raises what `submit` raises, except `Overloaded`; `GroupDraining` if the group
        starts draining meanwhile, `GroupClosed` if it closes.

        Cancellation: if cancelled while waiting, nothing is left submitted: the trio
        waiter is cancelled, and a request the group admitted in the same turn of the
        loop as the cancellation is aborted on its rank (its stream is never handed
        out). Once this returns the request is live: enter its `async with` at once.
        """
        guest, group = self._guest, self._group
        guest.check_thread()
        if not guest.running or group.would_admit(getattr(request, "rank", None)):
            return self.submit(request)  # nobody queued ahead: no trio task needed
        stream = await self._guest.run(group.wait_submit, request, late=RequestStream.close_nowait)
        return cast(AsyncioRequestStream, stream)

    async def abort(self, request_id: str) -> None:
        """Abort a live request; a no-op for unknown or ended ids (idempotent). A reader
        of its stream gets `RequestAborted`.

        Cancellation: the abort is queued synchronously before the suspension point,
        so it happens even if this call is cancelled.
        """
        self._guest.check_thread()
        if self._guest.running:
            self._group.abort_nowait(request_id)
        await asyncio.sleep(0)

    async def call(self, rank: int, method: str, *args: Any, timeout: float = 10.0) -> Any:  # noqa: ASYNC109
        """Run a utility method on one rank and return its result (`EngineGroup.call`).

        Raises `CallTimeout` if no reply comes within `timeout` s, `CallFailed` with the
        engine's error string, `EngineDead` if the rank dies first or is not up,
        `GroupClosed`, `InvalidRank`, and `InvalidRequest` if the arguments have no CBOR
        form or the CALL is larger than the rank accepts.

        Cancellation: the trio task waiting for the reply is cancelled; the reply, if
        it comes later, is dropped.
        """
        self._guest.check_thread()
        call = functools.partial(self._group.call, timeout=timeout)
        return await self._guest.run(call, rank, method, *args)

    async def drain(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Stop taking requests (`submit` raises `GroupDraining`, waiters too), wait until
        every live request has ended, then close the group (as leaving `connect`'s
        block does). After `timeout` seconds, the requests still live are aborted on
        their ranks and their streams raise `GroupClosed`. Returns at once if the group
        is closed.

        Cancellation: the group stays draining and its live requests go on; leaving
        `connect`'s block closes it.
        """
        self._guest.check_thread()
        try:
            await self._guest.run(self._group.drain, timeout)
        except GroupClosed:
            if self._group.closed is None:
                raise

    async def wait_rank_state(self, rank: int, state: RankState) -> None:
        """Wait until `rank` is in `state` (`EngineGroup.rank_state(rank).wait_value`).
        Raises `InvalidRank` for a rank outside the group, `GroupClosed` if the group
        closes first.

        Cancellation: nothing changes.
        """
        self._guest.check_thread()
        watched = self._group.rank_state(rank)
        if watched.value != state:
            await self._guest.run(watched.wait_value, state)

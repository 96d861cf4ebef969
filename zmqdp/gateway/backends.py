"""What the gateway needs from its async library, for trio and for asyncio.

Why a shim
----------
The gateway runs on two stacks: hypercorn's trio worker with `EngineGroup`, and uvicorn
(asyncio) with `zmqdp.aio.AsyncioEngineGroup`, which runs trio in guest mode inside the
asyncio loop. The ASGI code above this module is written once; the few things it needs
from the loop it runs on are here, chosen at lifespan startup by
`sniffio.current_async_library()`:

* `event()`: a one-shot event (`trio.Event` / `asyncio.Event`);
* `race(a, b, ...)`: run coroutine functions concurrently; the first to finish wins and
  the others are cancelled *and waited for* before `race` returns. The lifespan uses it
  to wait for "shutdown" or "drain";
* `watched(fn, watch, stopper)`: the request path's one structure: the response `fn`
  runs in the request's own task, inside a `stopper` block, and `watch` (the
  `http.disconnect` watcher) in one task beside it, which stops the block when it
  returns; `GatewayApp.stop_now()` stops the same block. One task per request, not
  three;
* `within(seconds, fn)`: `fn()` under a timeout (waiting for admission room);
* `stopper()`: a block that a plain function can stop from the loop's thread (the
  lifespan's startup, when a drain is asked for before the group is up);
* `sleep`, `sleep_forever`, `connect` (the group flavour) and `run_mock` (the embedded
  mock group).

anyio would give the same (and more), but it would be a new dependency for about sixty
lines, and its cancel scopes on asyncio add a layer under every await of the hot path;
`race` and `watched` are the only structured-concurrency primitives the gateway uses.

Cancellation in `race` and `watched`: an error raised by a contestant (an `Exception`)
ends it and is re-raised as itself, not in an `ExceptionGroup`: the request path maps it
to an HTTP status. Cancellation of the calling task cancels every contestant.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio

from .._core.messages import Output
from ._renamed import renamed

if TYPE_CHECKING:
    from ..mock import MockConfig
    from ..values import GroupHealth, GroupStatistics

__all__ = [
    "AsyncioBackend",
    "Backend",
    "EventLike",
    "GroupLike",
    "StreamLike",
    "TrioBackend",
    "backend_for",
]

log = logging.getLogger("zmqdp.gateway")

__getattr__ = renamed(__name__)  # mock_command, which moved to zmqdp.mock, deprecated here


HEAVY_LANE = max(1, len(os.sched_getaffinity(0)) - 1) if hasattr(os, "sched_getaffinity") else 1
"""Worker threads of the heavy lane (`Backend.in_thread`): the cores this process may
run on, but one (1 on a 2-core machine). Tokenizing a 2 MiB prompt takes a core for
seconds; two hostile clients sending them took both cores of a 2-core gateway from its
event loop."""

T = TypeVar("T")


class StreamLike(Protocol):
    """What the gateway uses of a request stream (`RequestStream`, or the asyncio
    flavour's): `async with` (leaving early aborts the request on its rank) and
    `receive_batch()` (every buffered output, waiting for the first)."""

    @property
    def rank(self) -> int: ...

    @property
    def request_id(self) -> str: ...

    async def __aenter__(self) -> object: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def receive_batch(self) -> list[Output]:
        """Every output buffered so far (at least one), as `RequestStream.receive_batch`."""
        ...


class GroupLike(Protocol):
    """What the gateway uses of an engine group: `EngineGroup` and
    `zmqdp.aio.AsyncioEngineGroup` share it."""

    @property
    def size(self) -> int: ...

    def submit(self, request: Any) -> StreamLike:
        """`request`: what the group's wire takes (the gateway's `Frontend` builds it)."""
        ...

    async def wait_submit(self, request: Any) -> StreamLike:
        """`submit`, waiting for room first (`EngineGroup.wait_submit`)."""
        ...

    async def drain(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """No new requests; let the live ones finish, then close (`EngineGroup.drain`)."""
        ...

    def health(self) -> GroupHealth:
        """`EngineGroup.health()`: what `/health` and `/ready` answer."""
        ...

    def statistics(self) -> GroupStatistics:
        """`EngineGroup.statistics()`: what `/metrics` exports."""
        ...


class EventLike(Protocol):
    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> Any: ...


class Stopper(Protocol):
    """`async with` a block that `stop()` cancels; leaving it after a stop is quiet and
    sets `stopped`. The block must be entered and left by one task."""

    stopped: bool

    def stop(self) -> None: ...

    async def __aenter__(self) -> Stopper: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...


class Backend(Protocol):
    """The async library the gateway runs on (module docstring)."""

    name: str

    def event(self) -> EventLike: ...

    def stopper(self) -> Stopper: ...

    async def race(self, *fns: Callable[[], Awaitable[T]]) -> tuple[int, T]:
        """(index, value) of the first of `fns` to finish; the others are cancelled and
        waited for. The first to raise an `Exception` makes `race` raise it instead."""
        ...

    async def watched(
        self,
        fn: Callable[[], Awaitable[None]],
        watch: Callable[[], Awaitable[None]],
        stopper: Stopper,
    ) -> bool:
        """`fn()` in this task inside `stopper`'s block, with `watch()` in one task
        beside it (cancelled and waited for once `fn` ends); `watch` stops the block
        itself if it should (so may anyone else, through `stopper.stop()`). True if
        `fn` was stopped."""
        ...

    async def within(self, seconds: float, fn: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """(True, fn()) if it finished within `seconds`, else (False, None), cancelled."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    async def in_thread(self, fn: Callable[[], T], *, heavy: bool = False) -> T:
        """`fn()` in a worker thread (CPU work that releases the GIL, such as a
        tokenizer). Cancellation: waits for `fn` to finish (it cannot be interrupted).
        `heavy`: in the heavy lane, at most `HEAVY_LANE` calls at a time (the work of a
        large body, which may take a core for seconds: however many such requests
        arrive, they leave a core to the event loop's thread)."""
        ...

    async def sleep_forever(self) -> None:
        """Wait until cancelled."""
        ...

    def connect(
        self, url: str, engines: int, options: dict[str, Any]
    ) -> AbstractAsyncContextManager[GroupLike]: ...

    def run_mock(self, url: str, config: MockConfig) -> AbstractAsyncContextManager[None]: ...


class _Finish:
    """The first contestant of a race to finish: its index and value, or its error."""

    __slots__ = ("error", "index", "value")

    def __init__(self) -> None:
        self.index = -1
        self.value: Any = None
        self.error: Exception | None = None

    def take(self, index: int, value: Any, error: Exception | None) -> bool:
        if self.index >= 0:
            return False
        self.index, self.value, self.error = index, value, error
        return True

    def result(self) -> tuple[int, Any]:
        if self.error is not None:
            raise self.error
        return self.index, self.value


class _TrioStopper:
    __slots__ = ("_scope", "stopped")

    def __init__(self) -> None:
        self.stopped = False
        self._scope = trio.CancelScope()

    def stop(self) -> None:
        self._scope.cancel("stopped")

    async def __aenter__(self) -> _TrioStopper:
        self._scope.__enter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        swallowed = self._scope.__exit__(exc_type, exc, tb)
        self.stopped = self._scope.cancelled_caught
        return bool(swallowed)


class _AsyncioStopper:
    __slots__ = ("_asked", "_open", "_timeout", "stopped")

    def __init__(self) -> None:
        self.stopped = False
        self._asked = False
        self._open = False
        self._timeout = asyncio.timeout(None)

    def stop(self) -> None:
        """Before the block: it starts stopped; after it: nothing."""
        self._asked = True
        if self._open and self._timeout.when() is None:
            self._timeout.reschedule(asyncio.get_running_loop().time())

    async def __aenter__(self) -> _AsyncioStopper:
        await self._timeout.__aenter__()
        self._open = True
        if self._asked:
            self._timeout.reschedule(asyncio.get_running_loop().time())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._open = False
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if not self._timeout.expired():
                raise
            self.stopped = True
            return True
        return False


class TrioBackend:
    """trio (hypercorn's trio worker): `EngineGroup`, nurseries, cancel scopes."""

    name = "trio"

    def event(self) -> EventLike:
        return trio.Event()

    def stopper(self) -> Stopper:
        return _TrioStopper()

    async def race(self, *fns: Callable[[], Awaitable[T]]) -> tuple[int, T]:
        finish = _Finish()

        async with trio.open_nursery() as nursery:

            async def run(index: int, fn: Callable[[], Awaitable[T]]) -> None:
                try:
                    value = await fn()
                except Exception as exc:
                    finish.take(index, None, exc)
                else:
                    finish.take(index, value, None)
                nursery.cancel_scope.cancel()

            for index, fn in enumerate(fns):
                nursery.start_soon(run, index, fn)
        return finish.result()

    async def watched(
        self,
        fn: Callable[[], Awaitable[None]],
        watch: Callable[[], Awaitable[None]],
        stopper: Stopper,
    ) -> bool:
        errors: list[Exception] = []

        async def watcher() -> None:
            try:
                await watch()
            except Exception as exc:  # as itself, after `fn` stopped: no ExceptionGroup
                errors.append(exc)
                stopper.stop()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watcher)
            try:
                async with stopper:
                    await fn()
            except Exception as exc:
                errors.insert(0, exc)
            nursery.cancel_scope.cancel()
        if errors:
            raise errors[0]
        return stopper.stopped

    async def within(self, seconds: float, fn: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        with trio.move_on_after(seconds):
            return True, await fn()
        return False, None

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)

    _heavy: trio.CapacityLimiter | None = None

    async def in_thread(self, fn: Callable[[], T], *, heavy: bool = False) -> T:
        if not heavy:
            return await trio.to_thread.run_sync(fn)
        if self._heavy is None:
            self._heavy = trio.CapacityLimiter(HEAVY_LANE)
        return await trio.to_thread.run_sync(fn, limiter=self._heavy)

    async def sleep_forever(self) -> None:
        await trio.sleep_forever()

    def connect(
        self, url: str, engines: int, options: dict[str, Any]
    ) -> AbstractAsyncContextManager[GroupLike]:
        from .._sockets import NATIVE
        from ..client import EngineGroup

        options = dict(options)
        dialect = options.pop("dialect", NATIVE)  # the wire: zmqdp.vllm.dialect(...)
        return EngineGroup.open(url, engines, dialect, **options)

    @asynccontextmanager
    async def run_mock(self, url: str, config: MockConfig) -> AsyncIterator[None]:
        from ..mock import run_mock_group

        async with trio.open_nursery() as nursery:
            # start_soon, not start: the ranks are up only once the group has bound the
            # URL and answered their HELLOs, which `connect` does next.
            nursery.start_soon(run_mock_group, url, config)
            yield
            nursery.cancel_scope.cancel()


class AsyncioBackend:
    """asyncio (uvicorn): `zmqdp.aio.AsyncioEngineGroup`, tasks, `asyncio.timeout`."""

    name = "asyncio"

    def event(self) -> EventLike:
        return asyncio.Event()

    def stopper(self) -> Stopper:
        return _AsyncioStopper()

    async def race(self, *fns: Callable[[], Awaitable[T]]) -> tuple[int, T]:
        finish = _Finish()

        async def run(index: int, fn: Callable[[], Awaitable[T]]) -> None:
            try:
                value = await fn()
            except Exception as exc:
                finish.take(index, None, exc)
            else:
                finish.take(index, value, None)

        tasks = [asyncio.create_task(run(i, fn)) for i, fn in enumerate(fns)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            # Wait for the losers to unwind (a stream's `async with` aborts its request).
            await asyncio.gather(*tasks, return_exceptions=True)
        return finish.result()

    async def watched(
        self,
        fn: Callable[[], Awaitable[None]],
        watch: Callable[[], Awaitable[None]],
        stopper: Stopper,
    ) -> bool:
        errors: list[Exception] = []

        async def watcher() -> None:
            try:
                await watch()
            except Exception as exc:
                errors.append(exc)
                stopper.stop()

        task = asyncio.create_task(watcher())
        try:
            async with stopper:
                await fn()
        except Exception as exc:
            errors.insert(0, exc)
        finally:
            if not task.done():
                task.cancel()
                # Waited for (it is `receive()`), never raising its cancellation here;
                # this task's own cancellation still raises.
                await asyncio.wait((task,))
        if errors:
            raise errors[0]
        return stopper.stopped

    async def within(self, seconds: float, fn: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        try:
            async with asyncio.timeout(seconds) as scope:
                return True, await fn()
        except TimeoutError:
            if scope.expired():
                return False, None
            raise

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    _heavy: asyncio.Semaphore | None = None

    async def in_thread(self, fn: Callable[[], T], *, heavy: bool = False) -> T:
        # shielded: a cancelled wait would leave the thread running unawaited
        if not heavy:
            return await asyncio.shield(asyncio.to_thread(fn))
        if self._heavy is None:
            self._heavy = asyncio.Semaphore(HEAVY_LANE)
        lane = self._heavy
        await lane.acquire()
        # the lane is the thread's until it ends, even if this wait is cancelled
        future = asyncio.ensure_future(asyncio.to_thread(fn))

        def done(f: asyncio.Future[T]) -> None:
            lane.release()
            if not f.cancelled():
                f.exception()  # retrieved: no "never retrieved" log if nobody awaits it

        future.add_done_callback(done)
        return await asyncio.shield(future)

    async def sleep_forever(self) -> None:
        await asyncio.get_running_loop().create_future()

    def connect(
        self, url: str, engines: int, options: dict[str, Any]
    ) -> AbstractAsyncContextManager[GroupLike]:
        from ..aio import AsyncioEngineGroup

        group: AbstractAsyncContextManager[GroupLike] = AsyncioEngineGroup.connect(
            url, engines, **options
        )
        return group

    @asynccontextmanager
    async def run_mock(self, url: str, config: MockConfig) -> AsyncIterator[None]:
        """The mock group in a subprocess (`python -m zmqdp mock`): the asyncio flavour
        owns the trio run it hosts, so the mock ranks run next to it, not inside it.
        SIGTERM on the way out, SIGKILL after 5 s."""
        from ..mock import mock_command

        proc = await asyncio.create_subprocess_exec(
            *mock_command(url, config),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=None,
        )
        try:
            yield
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    async with asyncio.timeout(5.0):
                        await proc.wait()
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


def backend_for(library: str) -> Backend:
    """The backend of `sniffio.current_async_library()`'s answer."""
    if library == "trio":
        return TrioBackend()
    if library == "asyncio":
        return AsyncioBackend()
    raise RuntimeError(f"zmqdp.gateway runs on trio or asyncio, not {library!r}")

"""`backends.watched`, the request path's one structure (the response in the request's
own task, inside a stop block, with one watcher task beside it), and the stop blocks
themselves, on both backends: who stopped the response, errors as themselves (never in
an `ExceptionGroup`), the watcher cancelled and waited for, and a stop before or after
the block. No server here: the gateway suites run the same paths over HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from zmqdp.gateway.backends import AsyncioBackend, Backend, TrioBackend

LIMIT = 10.0


def run(library: str, main: Callable[[Backend], Awaitable[Any]]) -> Any:
    """`main(backend)` on `library`, under a time limit."""
    if library == "trio":

        async def on_trio() -> Any:
            with trio.fail_after(LIMIT):
                return await main(TrioBackend())

        return trio.run(on_trio)

    async def on_asyncio() -> Any:
        async with asyncio.timeout(LIMIT):
            return await main(AsyncioBackend())

    return asyncio.run(on_asyncio())


LIBRARIES = pytest.mark.parametrize("library", ["trio", "asyncio"])


@LIBRARIES
def test_a_response_that_ends_cancels_the_watcher(library: str) -> None:
    seen: list[str] = []

    async def main(backend: Backend) -> bool:
        async def watch() -> None:
            try:
                await backend.sleep_forever()
            finally:
                seen.append("watcher ended")

        async def fn() -> None:
            await backend.sleep(0)  # (the watcher starts)
            seen.append("response")

        stopped = await backend.watched(fn, watch, backend.stopper())
        seen.append("returned")
        return stopped

    assert run(library, main) is False
    assert seen == ["response", "watcher ended", "returned"]  # waited for


@LIBRARIES
def test_the_watcher_stops_the_response(library: str) -> None:
    seen: list[str] = []

    async def main(backend: Backend) -> bool:
        stopper = backend.stopper()
        go = backend.event()

        async def watch() -> None:
            await go.wait()  # (the client went away)
            stopper.stop()

        async def fn() -> None:
            go.set()
            try:
                await backend.sleep_forever()
            finally:
                seen.append("response cancelled")

        return await backend.watched(fn, watch, stopper)

    assert run(library, main) is True
    assert seen == ["response cancelled"]


@LIBRARIES
def test_a_stop_from_outside_stops_the_response(library: str) -> None:
    """`GatewayApp.stop_now()`'s way: `stopper.stop()` called from another task, no
    task waiting for it per request."""

    async def main(backend: Backend) -> bool:
        stopper = backend.stopper()

        async def fn() -> None:
            stopper.stop()  # (as stop_now would, from anywhere on the loop)
            await backend.sleep_forever()

        return await backend.watched(fn, backend.sleep_forever, stopper)

    assert run(library, main) is True


@LIBRARIES
def test_a_stop_before_the_block_and_after_it(library: str) -> None:
    """A stop asked for before the block is entered stops it at its first wait; one
    after it has been left does nothing (asyncio's timeout would raise RuntimeError)."""

    async def main(backend: Backend) -> tuple[bool, bool]:
        early = backend.stopper()
        early.stop()
        first = await backend.watched(backend.sleep_forever, backend.sleep_forever, early)

        async def quick() -> None:
            pass

        late = backend.stopper()
        second = await backend.watched(quick, backend.sleep_forever, late)
        late.stop()
        return first, second

    assert run(library, main) == (True, False)


@LIBRARIES
@pytest.mark.parametrize("who", ["response", "watcher"])
def test_errors_come_out_as_themselves(library: str, who: str) -> None:
    """An error of the response, or of the watcher (which then stops the response), is
    raised as itself: the request path maps it, an `ExceptionGroup` would leak."""

    class Boom(Exception):
        pass

    async def main(backend: Backend) -> None:
        async def fail() -> None:
            await backend.sleep(0)
            raise Boom(who)

        fn, watch = (
            (fail, backend.sleep_forever) if who == "response" else (backend.sleep_forever, fail)
        )
        await backend.watched(fn, watch, backend.stopper())

    with pytest.raises(Boom, match=who):
        run(library, main)


def test_asyncio_a_servers_cancellation_goes_through() -> None:
    """uvicorn cancelling the request's task: `watched` neither swallows the
    `CancelledError` nor leaves its watcher task behind."""
    watcher_done: list[bool] = []

    async def main() -> None:
        backend = AsyncioBackend()
        started = asyncio.Event()

        async def watch() -> None:
            try:
                await backend.sleep_forever()
            finally:
                watcher_done.append(True)

        async def fn() -> None:
            started.set()
            await backend.sleep_forever()

        task = asyncio.create_task(backend.watched(fn, watch, backend.stopper()))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def limited() -> None:
        async with asyncio.timeout(LIMIT):
            await main()

    asyncio.run(limited())
    assert watcher_done == [True]

"""Engines in a thread of their own, for tests whose event loop is asyncio or uvloop
(tests/test_aio.py), or any loop that must see the engines the same way whatever it is
(the gateway suites, written once for hypercorn's trio and uvicorn's asyncio).

The engines are trio code: they run in a trio run of their own, in another thread
(`EngineThread`), so the loop under test never runs them and a blocked loop does not
block them. The test side sees an engine only through snapshots the engine thread
publishes after each message it handles (`View`), and drives it with `trio.from_thread`
from a worker thread, never from the loop's thread.

`loop_runner` is the body of a `run` fixture (one per test module, parametrized over
`RUNNERS`): ``run(main)`` runs ``main()`` on a new loop of each kind, under an
`asyncio.timeout` of `TIME_LIMIT`. Nothing here waits on the clock to synchronize:
waits are on engine snapshots or, for state the trio side of the loop under test
changes in its own steps, a check at every turn of the loop (`wait_until`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import sniffio
import trio
import uvloop

from zmqdp.engine import Abort, Add, Output
from zmqdp.mock import MockConfig, run_mock_group

from .engines import ScriptedEngine

T = TypeVar("T")

TIME_LIMIT = 20.0
"""Seconds: the `asyncio.timeout` around every test body, and the engines' time limit."""

RUNNERS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,
}

Run = Callable[[Callable[[], Awaitable[None]]], None]


def loop_runner(request: pytest.FixtureRequest) -> Run:
    """The `run` fixture: ``run = pytest.fixture(params=sorted(RUNNERS), name="run")(
    loop_runner)`` in a test module. `run(main)` runs `main()` on a new loop of the
    parametrized kind, under an `asyncio.timeout` of `TIME_LIMIT`."""
    return functools.partial(run_limited, RUNNERS[request.param])


def run_limited(
    runner: Callable[[Coroutine[Any, Any, None]], None], main: Callable[[], Awaitable[None]]
) -> None:
    """`runner(main())` (`asyncio.run`, `uvloop.run`) under an `asyncio.timeout` of
    `TIME_LIMIT`."""

    async def limited() -> None:
        async with asyncio.timeout(TIME_LIMIT):
            await main()

    runner(limited())


def url_in(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/g"


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Check `predicate()` at every turn of the loop (asyncio's, or a trio run's) until it
    holds (no clock): for state the trio side changes in its own steps without telling
    asyncio."""
    while not predicate():
        await anyio.lowlevel.checkpoint()


# -- engines in a thread of their own ---------------------------------------------------


@dataclass(frozen=True)
class View:
    """A snapshot of what one engine has received, taken after each message it handled."""

    inbox: tuple[Any, ...] = ()
    times: tuple[float, ...] = ()
    """`time.monotonic()` when the engine began to handle each message of `inbox`."""
    held: frozenset[str] = frozenset()
    """Wire ids of the requests it holds."""

    def adds(self) -> list[str]:
        """Application ids of the ADDs it got, in order."""
        return [m.id.rpartition("#")[0] for m in self.inbox if isinstance(m, Add)]

    def aborted(self) -> list[str]:
        """Wire ids of the ABORTs it got, in order."""
        return [i for m in self.inbox if isinstance(m, Abort) for i in m.ids]

    def wire(self, request_id: str) -> str:
        """The wire id of the latest ADD for `request_id`."""
        for m in reversed(self.inbox):
            if isinstance(m, Add) and m.id.rpartition("#")[0] == request_id:
                return str(m.id)
        raise AssertionError(f"no ADD for {request_id!r}")

    def holds(self, request_id: str) -> bool:
        return any(w.rpartition("#")[0] == request_id for w in self.held)


@functools.cache
def _watched(base: type[ScriptedEngine]) -> type[ScriptedEngine]:
    """`base` (a `ScriptedEngine` class), publishing a `View` after each message it
    handles."""

    class Watched(base):  # type: ignore[valid-type,misc]
        def __init__(self, owner: EngineThread, url: str, rank: int, size: int) -> None:
            super().__init__(url, rank, size)
            self.owner = owner
            self.times: list[float] = []

        async def handle(self, msg: Any) -> None:
            self.times.append(time.monotonic())
            await super().handle(msg)
            self.owner._publish(self)

    Watched.__name__ = Watched.__qualname__ = f"Watched{base.__name__}"
    return Watched


class EngineThread:
    """`n` scripted engines (instances of `engine`, a `ScriptedEngine` class), or a
    `run_mock_group`, in a trio run in another thread.

    Use as `with`: the engines start on entry and are cancelled on exit, and an error of
    their run is raised then. In the test's loop, `attach()` first, then `wait_for` and
    `run`."""

    def __init__(
        self,
        url: str,
        n: int = 0,
        *,
        mock: MockConfig | None = None,
        engine: type[ScriptedEngine] = ScriptedEngine,
    ) -> None:
        self.url = url
        watched = _watched(engine)
        self.engines: list[Any] = [watched(self, url, r, n) for r in range(n)]
        self.views = [View() for _ in range(n)]
        self._mock = mock
        self._scopes = [trio.CancelScope() for _ in range(n)]
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engines", daemon=True)
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._error: BaseException | None = None
        self._notify: Callable[[], None] | None = None
        self._changed: asyncio.Event | trio.Event | None = None

    def __enter__(self) -> EngineThread:
        self._thread.start()
        assert self._started.wait(TIME_LIMIT), "the engine thread did not start"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._nursery is not None and self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._nursery.cancel_scope.cancel, trio_token=self._token)
        self._thread.join(TIME_LIMIT)
        assert not self._thread.is_alive(), "the engines did not stop"
        if self._error is not None and exc is None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self._error = exc
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.fail_after(TIME_LIMIT):
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for engine, scope in zip(self.engines, self._scopes, strict=True):
                    nursery.start_soon(self._serve, engine, scope)
                if self._mock is not None:
                    nursery.start_soon(run_mock_group, self.url, self._mock)
                self._started.set()

    @staticmethod
    async def _serve(engine: ScriptedEngine, scope: trio.CancelScope) -> None:
        with scope:
            await engine.run()

    # -- the engine thread's side -------------------------------------------------------

    def _publish(self, engine: Any) -> None:
        self.views[engine.rank] = View(
            tuple(engine.inbox), tuple(engine.times), frozenset(engine.held)
        )
        notify = self._notify
        if notify is not None:
            with contextlib.suppress(RuntimeError):  # that loop is closed: the test is over
                notify()

    # -- the test loop's side -----------------------------------------------------------

    def attach(self) -> None:
        """Let this loop's tasks wait for the engines (call in the test's loop: asyncio,
        uvloop or another trio run)."""
        if sniffio.current_async_library() == "trio":
            self._changed = trio.Event()
            token = trio.lowlevel.current_trio_token()
            self._notify = functools.partial(token.run_sync_soon, self._wake)
        else:
            self._changed = asyncio.Event()
            self._notify = functools.partial(
                asyncio.get_running_loop().call_soon_threadsafe, self._wake
            )

    def _wake(self) -> None:
        changed = self._changed
        assert changed is not None
        self._changed = trio.Event() if isinstance(changed, trio.Event) else asyncio.Event()
        changed.set()

    async def wait_for(self, rank: int, predicate: Callable[[View], bool]) -> View:
        """The first snapshot of `rank` for which `predicate` holds."""
        while True:
            changed = self._changed
            assert changed is not None, "attach() first"
            view = self.views[rank]
            if predicate(view):
                return view
            await changed.wait()

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`await fn(*args)` in the engines' trio run (from a worker thread)."""
        call = functools.partial(trio.from_thread.run, fn, *args, trio_token=self._token)
        return await anyio.to_thread.run_sync(call)

    async def emit(self, rank: int, *outputs: Output) -> None:
        await self.run(self.engines[rank].emit, outputs)

    async def finish(self, rank: int, request_id: str) -> None:
        await self.run(self.engines[rank].finish, request_id)

    async def kill(self, rank: int) -> None:
        """Stop engine `rank` (its sockets close; it sends nothing more)."""
        call = functools.partial(
            trio.from_thread.run_sync, self._scopes[rank].cancel, trio_token=self._token
        )
        await anyio.to_thread.run_sync(call)

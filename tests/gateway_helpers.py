"""What the gateway tests share, on trio (hypercorn) and on asyncio and uvloop (uvicorn):
an engine and a frontend a test can drive, the servers themselves, the SSE reader, the
metrics parser, and the client side of the `serve` command's SIGTERM drain.

A behaviour is written once and run on every server (`SERVERS`, the `server` fixture
of a module: ``server = pytest.fixture(params=SERVERS, name="server")(server_param)``):
`on_server(server, tmp_path, body)` runs ``body(served)`` in the server's own loop
(a trio run for hypercorn, `asyncio.run` or `uvloop.run` for uvicorn) against a
gateway over `TokenEngine`s in a thread of their own (`EngineThread`), which the body
sees through snapshots. httpx and anyio run on both libraries, so the bodies do too.
Every body runs under a time limit of `TIME_LIMIT` s; nothing waits on the clock to
synchronize.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import uvicorn
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.fakes.engines import ScriptedEngine
from tests.fakes.threaded import RUNNERS, TIME_LIMIT, EngineThread, run_limited, url_in
from zmqdp import GroupStatistics
from zmqdp._core.messages import Output
from zmqdp.engine import Abort, Add
from zmqdp.gateway import CompletionRequest, GatewayApp, Piece, Prepared, create_app
from zmqdp.gateway.connections import (
    MAX_HEAD,
    ConnectionCap,
    install_hypercorn_fast_paths,
    uvicorn_protocol,
)

from .helpers import READY_TIMEOUT

# -- engines and a frontend a test can drive -------------------------------------------


class TokenEngine(ScriptedEngine):
    """A `ScriptedEngine` with three more ADD bodies: ``{"tokens": k, "hold": True}``
    emits k outputs (one batch each) and holds the request; ``{"burst": k}`` emits k
    outputs in one batch, the last terminal; ``{"die": True}`` announces the rank dead."""

    async def handle(self, msg: Any) -> None:
        body = msg.body if isinstance(msg, Add) else None
        if isinstance(body, dict) and body.get("hold") and body.get("tokens"):
            for i in range(body["tokens"]):
                await self.emit((Output(msg.id, i),))
            self.held[msg.id] = body
        elif isinstance(body, dict) and "burst" in body:
            k = body["burst"]
            await self.emit(
                tuple(Output(msg.id, i, "length" if i == k - 1 else None) for i in range(k))
            )
        elif isinstance(body, dict) and body.get("die"):
            await self.emit(dead="injected: the engine died")
        else:
            await super().handle(msg)


class ScriptFrontend:
    """The engine body is the request's own ``"script"`` field (a field the gateway does
    not know: frontends read `raw`), else ``{"tokens": max_tokens}``; output i is " t{i}".
    Every prompt counts as 3 tokens."""

    fields = frozenset({"script"})

    def prepare(self, request: CompletionRequest) -> Prepared:
        body = request.raw.get("script", {"tokens": request.max_tokens})
        return Prepared(body, 3, self.decode)

    @staticmethod
    def decode(output: Output) -> Piece:
        return Piece(f" t{output.body}", 1, output.finish)


def aborted(engine: ScriptedEngine) -> list[str]:
    return [i for m in engine.inbox if isinstance(m, Abort) for i in m.ids]


def hold(tokens: int = 0, **fields: Any) -> dict[str, Any]:
    """A request body the `TokenEngine` holds (after `tokens` outputs)."""
    script: dict[str, Any] = {"hold": True}
    if tokens:
        script["tokens"] = tokens
    return {"prompt": "x", "max_tokens": 100, "script": script, **fields}


# -- the servers ------------------------------------------------------------------------

UVICORN_PARSERS = {"asyncio": "h11", "uvloop": "httptools"}
"""The HTTP/1.1 parser uvicorn runs with on each asyncio loop: each loop and each parser
is covered without a run for every pair (`serve --server uvicorn` takes httptools when
installed, and uvloop when installed)."""

SERVERS = ["hypercorn", *(f"uvicorn-{loop}-{UVICORN_PARSERS[loop]}" for loop in sorted(RUNNERS))]
"""hypercorn's trio worker, and uvicorn on each asyncio loop (asyncio, uvloop), through
the protocol class `zmqdp serve` uses (`zmqdp.gateway.connections.uvicorn_protocol`)."""


def server_param(request: pytest.FixtureRequest) -> str:
    """The body of a module's `server` fixture (module docstring)."""
    return need_parser(str(request.param))


def need_parser(server: str) -> str:
    """`server`, or a skip naming the extra if its HTTP parser is not installed."""
    if server.endswith("-httptools") and importlib.util.find_spec("httptools") is None:
        pytest.skip(f"{server} needs the gateway extra (httptools is not installed)")
    return server


def run_on(server: str, main: Callable[[], Awaitable[None]]) -> None:
    """`main()` in `server`'s loop, under a time limit of `TIME_LIMIT` s."""
    if server == "hypercorn":

        async def limited() -> None:
            with trio.fail_after(TIME_LIMIT):
                await main()

        trio.run(limited)
    else:
        run_limited(RUNNERS[server.split("-")[1]], main)


class UvicornServer(uvicorn.Server):
    """uvicorn's `Server`, telling when it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.listening.set()


def uvicorn_server(app: GatewayApp, http: str = "auto") -> UvicornServer:
    """`app` on uvicorn with `serve`'s protocol class for `http` (`UVICORN_HTTP`), with no
    connection bound and a head deadline no test reaches."""
    config = uvicorn.Config(
        app,
        http=uvicorn_protocol(ConnectionCap(0), TIME_LIMIT, http),
        h11_max_incomplete_event_size=MAX_HEAD,
        host="127.0.0.1",
        port=0,
        lifespan="on",
        log_level="warning",
        loop="none",  # the test's loop: serve() runs in it
        timeout_graceful_shutdown=2,
    )
    return UvicornServer(config)


@asynccontextmanager
async def serving(
    server: str, app: GatewayApp, **config_options: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """`app` on `server` in this loop on 127.0.0.1 (an OS-assigned port), and a client
    of it. The server stops (lifespan shutdown: drain and close) when the block ends.
    `config_options`: attributes of hypercorn's `Config` (`keep_alive_timeout`...)."""
    if server == "hypercorn":
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.graceful_timeout = 2.0
        install_hypercorn_fast_paths(config)  # as `zmqdp serve` runs it
        for name, value in config_options.items():
            setattr(config, name, value)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve, app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
            async with httpx.AsyncClient(base_url=binds[0], timeout=15) as client:
                yield client
            stop.set()
        return
    assert not config_options, "uvicorn's configuration is fixed here"
    userver = uvicorn_server(app, server.split("-")[2])

    async def serve_it() -> None:
        try:
            await userver.serve()
        except SystemExit as exc:  # a failed lifespan startup
            raise AssertionError(f"uvicorn exited with {exc.code} at startup") from None

    running = asyncio.create_task(serve_it())
    listening = asyncio.create_task(userver.listening.wait())
    await asyncio.wait([running, listening], return_when=asyncio.FIRST_COMPLETED)
    if not listening.done():
        listening.cancel()
        await running
        raise AssertionError("uvicorn stopped before it listened")
    host, port = userver.servers[0].sockets[0].getsockname()[:2]
    try:
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=15) as client:
            yield client
    finally:
        userver.should_exit = True
        await running


@dataclass
class Served:
    """What a body sees: the client, the app, and the engines behind it."""

    client: httpx.AsyncClient
    app: GatewayApp
    engines: EngineThread
    server: str

    def stats(self) -> GroupStatistics:
        assert self.app.group is not None
        return self.app.group.statistics()

    async def finish_held(self, rank: int = 0) -> None:
        """Finish the one request rank `rank` holds (" tdone", finish "stop")."""
        [wire] = (await self.engines.wait_for(rank, lambda v: len(v.held) == 1)).held
        await self.engines.finish(rank, wire.rpartition("#")[0])


Body = Callable[[Served], Awaitable[None]]


def on_server(
    server: str,
    tmp_path: Path,
    body: Body,
    n: int = 1,
    *,
    config: dict[str, Any] | None = None,
    **kw: Any,
) -> None:
    """`body(served)` in `server`'s loop, against a gateway on `server` over `n`
    `TokenEngine`s (`ScriptFrontend`); `kw` go to `create_app`, `config` to `serving`.
    Afterwards the lifespan shutdown has closed the group."""
    need_parser(server)
    with EngineThread(url_in(tmp_path), n, engine=TokenEngine) as engines:

        async def main() -> None:
            engines.attach()
            app = create_app(
                engines.url, n, frontend=ScriptFrontend(), ready_timeout=READY_TIMEOUT, **kw
            )
            async with serving(server, app, **(config or {})) as client:
                await body(Served(client, app, engines, server))
            assert app.group is not None and app.group.closed is not None

        run_on(server, main)


# -- reading responses --------------------------------------------------------------------


async def events(response: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of an SSE response, in order."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            assert event.startswith("data: "), event
            yield event[len("data: ") :]


async def all_events(response: httpx.Response) -> list[str]:
    return [e async for e in events(response)]


class Metrics:
    """A `/metrics` page, parsed with prometheus_client's own parser."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(self, name: str, suffix: str = "") -> list[Sample]:
        return [s for s in self.families[name].samples if s.name == name + suffix]

    def by_rank(self, name: str, suffix: str = "") -> dict[str, float]:
        """{rank label ("" if none): value} of the samples of `name` + `suffix`."""
        return {s.labels.get("rank", ""): s.value for s in self.samples(name, suffix)}

    def http(self) -> dict[tuple[str, str], float]:
        """{(route, status): count} of the gateway's HTTP responses."""
        return {
            (s.labels["route"], s.labels["status"]): s.value
            for s in self.samples("zmqdp_gateway_http_responses", "_total")
        }


# -- the serve command --------------------------------------------------------------------


def serve_command(*options: str) -> list[str]:
    """`python -m zmqdp serve --mock` on any free port, quiet, with `options`."""
    cmd = [sys.executable, "-m", "zmqdp", "serve", "--mock", "--port", "0"]
    return [*cmd, "--step-time", "0.01", "--log-level", "WARNING", *options]


BANNER_END = b"try: curl"
"""`serve` has printed its URL once its output holds this."""


async def read_banner(proc: trio.Process) -> bytes:
    """What `serve` (started with `stdout=PIPE`) printed, up to its banner."""
    assert proc.stdout is not None
    out = b""
    while BANNER_END not in out:
        data = await proc.stdout.receive_some()
        assert data, out
        out += data
    return out


def served_url(banner: bytes) -> str:
    """The URL in the banner `serve` prints once it listens."""
    url = banner.split(b" at ", 1)[1].split(b" ", 1)[0].decode()
    assert url.startswith("http://127.0.0.1:"), banner
    return url


async def check_sigterm_drain(url: str, sigterm: Callable[[], None]) -> None:
    """Against a `serve --mock` at `url`: a completion; then, mid-stream, `sigterm()`
    turns /ready to 503 while the stream goes on to [DONE]. The caller then checks that
    the process exits 0."""
    async with httpx.AsyncClient(base_url=url, timeout=15) as client:
        plain = await client.post("/v1/completions", content=b'{"prompt":"hi","max_tokens":5}')
        assert plain.json()["choices"][0]["text"] == " t1001 t1002 t1003 t1004 t1005"
        body = {"prompt": "hi", "max_tokens": 300, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            stream = events(response)
            await anext(stream)
            sigterm()
            # the server takes requests while it drains: poll readiness over HTTP
            while (ready := await client.get("/ready")).status_code == 200:
                pass
            assert ready.status_code == 503 and ready.json()["gateway_draining"] is True
            rest = [d async for d in stream]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"

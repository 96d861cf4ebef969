"""`GatewayApp`: the ASGI application, its routes, and the life of the engine group.

Theory of operation
-------------------
Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (completions.py; chat
if the frontend renders one), ``GET /v1/models`` and ``GET /v1/models/{id}``, ``GET
/health`` (liveness: 200 while the group serves), ``GET /ready`` (readiness: 200 while
it takes requests and no drain was asked for), ``GET /metrics`` (metrics.py). With an
`api_key`, the ``/v1/`` routes need its bearer token. Routes match the path below the
ASGI ``root_path`` (a Starlette `Mount`, uvicorn's ``--root-path``), whether the server
left that prefix in ``path`` or not.

The lifespan owns the group. At ``lifespan.startup`` the app picks its backend from
`sniffio.current_async_library()` (trio: `EngineGroup`; asyncio:
`zmqdp.aio.AsyncioEngineGroup`), starts the embedded mock group if it has one, and
connects (waiting for every rank, up to `ready_timeout`); a failure there is
``lifespan.startup.failed`` with the reason, and the server does not start. The lifespan
task then holds the group open until shutdown. An app given an already connected group
(`create_app(group=...)`) neither connects nor closes it. A host that runs no lifespan
for the app (FastAPI and Starlette never run a mounted app's) runs the same lifespan
task through `GatewayApp.lifespan()`, an ``async with`` block that plays the server's
part of the protocol; until it runs, completions answer 503 ``not_started``.

Drain, in this order:

1. `begin_drain()`: `/ready` answers 503 from now on (a load balancer stops sending);
   requests are still served;
2. after `drain_grace` seconds (default 0: at once; a server shutdown ends the grace
   early), the group drains: new requests get
   503 (`GroupDraining`), live ones run to their end, for at most `drain_timeout`
   seconds, after which they are aborted on their ranks (their clients get a 503 or an
   SSE error event); the group is then closed, and `/health` answers 503;
3. `wait_drained()` returns: the caller stops the server. The `serve` entry point
   (serve.py) does exactly this on SIGTERM or SIGINT, with hypercorn's
   `shutdown_trigger` or a uvicorn `Server` subclass; an embedder does the same from its
   own shutdown hook: ``app.begin_drain(); await app.wait_drained()``, then stop its
   server.

`stop_now()` (the second SIGTERM of `serve`) hurries a drain: every live completion is
aborted on its rank and answered 503 `shutting_down` (an SSE error event if its stream
had begun), new ones get the same, the grace is cut short, and the drain, with nothing
left to wait for, ends at once. The server then stops as after any drain: answered, not
cut off (completions.py).

Step 2 runs in the lifespan task (it is woken by `begin_drain`), so `begin_drain` is a
plain function: call it from the event loop's thread (a signal handler should hand it
over, e.g. with `loop.call_soon_threadsafe`). A server shutdown without a drain (the
server stopped for another reason) drains at ``lifespan.shutdown``: by then the server
has closed its connections, so that drain is immediate.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import shutil
import tempfile
import warnings
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any, Unpack

import sniffio
import trio
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
)

from ..mock import MockConfig
from ..values import ConnectKeywords, with_connect_options
from .backends import Backend, EventLike, GroupLike, backend_for
from .completions import CompletionSettings, LiveResponses, handle_completion
from .errors import HTTPError
from .frontend import Frontend, MockFrontend
from .http import Exchange, Receive, Scope, Send, header
from .metrics import GatewayCollector, HTTPCounters
from .openai import MAX_MODEL_LENGTH

__all__ = ["GatewayApp", "create_app"]

log = logging.getLogger("zmqdp.gateway")

DEFAULT_MAX_BODY_SIZE = 4 * 1024 * 1024
"""Bytes: a prompt of 128k token ids in JSON is about 1 MiB. A body of more than 64 KiB
is parsed in a worker thread (openai.py), but its JSON decode is one call that holds the
GIL (40 to 60 ms for 4 MiB): a larger limit lets one client stall the others longer."""

DEFAULT_MAX_COLLECTED_TOKENS = 1 << 17
"""Tokens: the longest non-streaming answer the gateway collects (131072, a long
context). A non-streaming answer is held whole until its last output, so without a
limit a client asking for `max_tokens` 2**31-1 grows the gateway's memory for as long
as the engine generates. Past it: 400 up front (`max_tokens`), 502 at run time."""

DEFAULT_MAX_COLLECTED_CHARS = 1 << 22
"""Characters of text a non-streaming answer collects at most (4 Mi, 32 per token of
`DEFAULT_MAX_COLLECTED_TOKENS`): bounds a frontend whose outputs carry much text."""

DEFAULT_MAX_BUFFERED = 4096
"""Outputs a request's stream holds for a client that does not read (`max_buffered` of
`EngineGroup.connect`): past it the request is aborted on its rank (an SSE error event).
A gateway must not let a stalled client grow its memory without bound."""


def create_app(
    url: str | None = None,
    engines: int | None = None,
    *,
    group: GroupLike | None = None,
    mock: MockConfig | None = None,
    frontend: Frontend | None = None,
    wire: Any = None,
    model: str | Sequence[str] = "zmqdp",
    api_key: str | None = None,
    vllm_metric_names: bool = False,
    queue_timeout: float = 0.0,
    retry_after: int = 1,
    drain_timeout: float | None = 30.0,
    drain_grace: float = 0.0,
    max_body_size: int = DEFAULT_MAX_BODY_SIZE,
    max_collected_tokens: int | None = DEFAULT_MAX_COLLECTED_TOKENS,
    max_collected_chars: int | None = DEFAULT_MAX_COLLECTED_CHARS,
    dialect: Frontend | None = None,
    **options: Unpack[ConnectKeywords],
) -> GatewayApp:
    """An OpenAI-compatible ASGI app (completions, chat completions, models, probes and
    metrics: app.py) over an engine group.

    The app connects to `url` and `engines` ranks at lifespan startup (a server's, or
    `GatewayApp.lifespan` for a host that runs none, such as FastAPI for a mounted
    app) with `options`, those of `EngineGroup.connect` (`zmqdp.ConnectOptions`:
    `ready_timeout`, `max_inflight`, `request_timeout`, `curve`...; `max_buffered`
    defaults here to `DEFAULT_MAX_BUFFERED`, and `recover` to True: a failed lockstep
    group waits for its ranks, `/ready` answers 503 meanwhile and `/health` 200), and
    drains and closes the group at shutdown. Mounted under a prefix (ASGI
    `root_path`), it routes on the path below it. `mock` also runs a mock group (engines
    from the config unless `engines` says otherwise) on `url`, or on a private ipc path
    if `url` is None. `group`: serve an already connected group instead (the caller
    owns it: give no `url`, `engines`, `mock` or connect options).

    `frontend` translates requests and outputs (default `MockFrontend`, the mock engine's
    bodies; `VllmFrontend(MODEL_DIR)` for vLLM engine cores, with `wire=` a
    `zmqdp.vllm.dialect(moe=...)`: the engine protocol of the group the app connects,
    native by default); `model`: the name the model is served under, or several (vLLM's
    `--served-model-name`): the first names it in every response, as vLLM's; a
    request naming another gets 404 ``model_not_found``, as OpenAI answers it (the
    first name is answered whichever was asked). `api_key`: the `/v1/` routes need
    ``Authorization: Bearer <api_key>`` (401 ``invalid_api_key`` otherwise; the probes
    and `/metrics` stay open, as vLLM's). `vllm_metric_names`: `/metrics` also has the
    ``vllm:`` series vLLM's Grafana dashboards read (labels ``model_name``, ``engine``).
    `queue_timeout`: seconds a request waits for admission room before a 429 (0: 429 at
    once); `retry_after`: the `Retry-After` of 429 and 503 answers. `drain_timeout`:
    seconds a drain waits for live requests (None: no limit); `drain_grace`: seconds
    between `/ready` turning 503 and the group refusing new requests (app.py).
    `max_body_size`: bytes of a request body (413 past it).

    A non-streaming answer is held whole until its last output (a stream is bounded by
    `max_buffered` instead). `max_collected_tokens` (default
    `DEFAULT_MAX_COLLECTED_TOKENS`, 131072; None: no limit): a non-streaming request
    with a larger `max_tokens` is refused up front with a 400 naming `max_tokens`, and
    an answer that collects more tokens than this anyway (an engine that overshoots) is
    aborted on its rank and answered 502 `response_too_large`, naming the request and
    the limit. `max_collected_chars` (default `DEFAULT_MAX_COLLECTED_CHARS`, 4 Mi; None:
    no limit): the same 502 for an answer whose text grows past this many characters.

    `dialect`: the old name of `frontend`, deprecated (the wire's dialect is `wire`).
    """
    connect_options: dict[str, Any] = dict(options)
    if dialect is not None:
        if frontend is not None:
            raise TypeError("create_app: give frontend=, not also its deprecated name dialect=")
        warnings.warn(
            "create_app(dialect=...) is deprecated: use frontend=", DeprecationWarning, stacklevel=2
        )
        frontend = dialect
    if group is not None:
        if url is not None or engines is not None or mock is not None or connect_options:
            raise ValueError("create_app(group=...) serves that group: no url, engines or mock")
    elif mock is not None:
        if engines is not None and engines != mock.engines:
            mock = dataclasses.replace(mock, engines=engines)
    elif url is None or engines is None:
        raise ValueError("create_app needs url and engines, a mock config, or a group")
    if wire is not None:
        if group is not None or mock is not None:
            raise ValueError("wire= is for the group create_app connects (url and engines)")
        connect_options["dialect"] = wire
    if group is None:
        connect_options.setdefault("max_buffered", DEFAULT_MAX_BUFFERED)
        connect_options.setdefault("recover", True)  # a failed group comes back: 503 meanwhile
    served = (model,) if isinstance(model, str) else tuple(model)
    if not served or not all(isinstance(m, str) and 0 < len(m) <= 256 for m in served):
        raise ValueError(
            f"model must be one name or several, each of 1 to 256 characters: {model!r}"
        )
    if api_key is not None and (
        not isinstance(api_key, str) or not api_key or not all("!" <= c <= "~" for c in api_key)
    ):
        # (a header carries visible ASCII; a key with a stray newline would lock out all)
        raise ValueError("api_key must be a non-empty string of visible ASCII, or None")
    if queue_timeout < 0 or retry_after < 0 or drain_grace < 0:
        raise ValueError("queue_timeout, retry_after and drain_grace must be >= 0")
    if drain_timeout is not None and drain_timeout < 0:
        raise ValueError("drain_timeout must be >= 0 or None")
    for name, limit in (
        ("max_collected_tokens", max_collected_tokens),
        ("max_collected_chars", max_collected_chars),
    ):
        if limit is not None and limit < 1:
            raise ValueError(f"{name} must be >= 1 or None")
    settings = CompletionSettings(
        frontend=MockFrontend() if frontend is None else frontend,
        model=served[0],
        served=served,
        queue_timeout=queue_timeout,
        retry_after=retry_after,
        max_body_size=max_body_size,
        max_collected_tokens=max_collected_tokens,
        max_collected_chars=max_collected_chars,
    )
    return GatewayApp._create(
        url=url,
        api_key=api_key,
        vllm_metric_names=vllm_metric_names,
        engines=mock.engines if mock is not None else engines,
        group=group,
        mock=mock,
        settings=settings,
        drain_timeout=drain_timeout,
        drain_grace=drain_grace,
        connect_options=connect_options,
    )


class GatewayApp:
    """The ASGI app (`create_app` makes one). Call it as ``app(scope, receive, send)``."""

    def __init__(self, *, _token: object = None, **kw: Any) -> None:
        if _token is not _TOKEN:
            raise TypeError("use zmqdp.gateway.create_app(...) to make a GatewayApp")
        self._url: str | None = kw["url"]
        self._engines: int | None = kw["engines"]
        self._group: GroupLike | None = kw["group"]
        self._owns_group = self._group is None
        self._mock: MockConfig | None = kw["mock"]
        self._settings: CompletionSettings = kw["settings"]
        self._drain_timeout: float | None = kw["drain_timeout"]
        self._drain_grace: float = kw["drain_grace"]
        self._connect_options: dict[str, Any] = kw["connect_options"]
        key: str | None = kw["api_key"]
        self._bearer = None if key is None else key.encode()
        """The API key's bytes: ``Authorization: Bearer <key>``, the scheme in any case
        (RFC 7235, and vLLM's check)."""
        self._backend: Backend | None = None
        self._drain_asked = False
        self._stop_asked = False
        self._stopping: EventLike | None = None
        self._drain_requested: EventLike | None = None
        self._drained: EventLike | None = None
        self._lifespan_claimed = False
        """`lifespan()` was entered: set before its first await, so that a second
        entry, even a concurrent one, is refused (`_drained` is set only later)."""
        self._stop_startup: Callable[[], None] | None = None
        self._live = LiveResponses()
        self.counters = HTTPCounters()
        self.collector = GatewayCollector(self._statistics, self._health, self.counters)
        """The Prometheus collector behind `/metrics` (metrics.py), to add to another
        registry if the embedder serves its own metrics."""
        if kw["vllm_metric_names"]:
            self.collector.vllm_names = self._settings.model
            dialect = self._connect_options.get("dialect")
            self.collector.watch(self._settings.frontend, dialect or self._group)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory, fds
        self._routes: dict[str, tuple[str, str, Callable[..., Any]]] = {
            "/v1/completions": ("completions", "POST", self._completions),
            "/v1/chat/completions": ("chat", "POST", partial(self._completions, chat=True)),
            "/v1/models": ("models", "GET", self._models),
            "/health": ("health", "GET", self._liveness),
            "/ready": ("ready", "GET", self._readiness),
            "/metrics": ("metrics", "GET", self._metrics),
        }

    @classmethod
    def _create(cls, **kw: Any) -> GatewayApp:
        return cls(_token=_TOKEN, **kw)

    # -- public state -----------------------------------------------------------------

    @property
    def group(self) -> GroupLike | None:
        """The engine group, once connected (or as given)."""
        return self._group

    @property
    def draining(self) -> bool:
        """`begin_drain()` was called: `/ready` answers 503."""
        return self._drain_asked

    def begin_drain(self) -> None:
        """Start the drain (module docstring): `/ready` turns 503 now; the lifespan task
        drains the group. Called while the lifespan startup is still connecting, it
        stops the startup instead (``lifespan.startup.failed``: the server does not
        start). Idempotent; call it from the event loop's thread."""
        if self._drain_asked:
            return
        self._drain_asked = True
        log.info("drain asked: /ready answers 503")
        if self._stop_startup is not None:  # still connecting: give up
            self._stop_startup()
        if self._drain_requested is not None:
            self._drain_requested.set()

    def stop_now(self) -> None:
        """Stop serving now (the second SIGTERM of `serve`): `begin_drain()` if it was
        not called, then every live completion is aborted on its rank and answered 503
        `shutting_down` (a last SSE error event if its stream had begun), and so is any
        completion asked for from now on; the drain then ends at once (its grace cut
        short) and `wait_drained()` returns. Idempotent; call it from the event loop's
        thread."""
        self.begin_drain()
        if self._stop_asked:
            return
        self._stop_asked = True
        log.info("stop asked: live requests are aborted and answered 503")
        if self._stopping is not None:
            self._stopping.set()
        self._live.stop_all()

    async def wait_drained(self) -> None:
        """Return once a drain has finished (the group is drained and closed). Needs the
        lifespan to be running (it does the draining)."""
        if self._drained is None:
            raise RuntimeError("the gateway's lifespan has not started")
        await self._drained.wait()

    def lifespan(self, app: object = None) -> AbstractAsyncContextManager[None]:
        """The app's lifespan as an ``async with`` block, for a host that does not run
        it: FastAPI and Starlette never run a mounted app's lifespan. The block starts
        as ``lifespan.startup`` does (the embedded mock, then `connect`, waiting for
        every rank; a failure raises `RuntimeError` with the reason), serves while
        it runs, and drains and closes the group on the way out, as a server's
        ``lifespan.shutdown`` would. `begin_drain`, `stop_now` and `wait_drained` work
        as under a server.

        `app` is ignored: it lets FastAPI take the method itself,
        ``FastAPI(lifespan=gateway.lifespan)``. In a host lifespan of its own::

            @asynccontextmanager
            async def lifespan(app):
                async with gateway.lifespan():
                    yield

        On trio or asyncio (`zmqdp.aio.AsyncioEngineGroup` then), as the server's
        lifespan."""
        return self._run_lifespan()

    @asynccontextmanager
    async def _run_lifespan(self) -> AsyncIterator[None]:
        if self._drained is not None or self._lifespan_claimed:
            raise RuntimeError("the gateway's lifespan has already run (or is running)")
        self._lifespan_claimed = True
        library = sniffio.current_async_library()
        replies: list[Mapping[str, Any]] = []
        answered = backend_for(library).event()
        shutdown = backend_for(library).event()
        asked: list[str] = []

        async def receive() -> Mapping[str, Any]:
            if not asked:
                asked.append("startup")
                return {"type": "lifespan.startup"}
            await shutdown.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: dict[str, Any]) -> None:
            replies.append(message)
            answered.set()

        async def reply() -> Mapping[str, Any]:
            nonlocal answered
            await answered.wait()
            answered = backend_for(library).event()
            return replies[-1]

        async def ended(message: Mapping[str, Any], step: str) -> None:
            if message["type"] == f"lifespan.{step}.failed":
                raise RuntimeError(f"the gateway's {step} failed: {message.get('message')}")

        if library == "trio":
            # Errors are raised after the nursery, as themselves (no ExceptionGroup).
            started: Mapping[str, Any] = {}
            stopped: Mapping[str, Any] = {}
            error: BaseException | None = None
            # The lifespan task is shielded once started: a cancel of the host's block
            # (a `move_on_after` around it) must not kill it mid-way, or the shielded
            # shutdown below would wait for its reply forever. Startup stays cancellable.
            scope = trio.CancelScope()

            async def run() -> None:
                with scope:
                    await self._lifespan(receive, send)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                started = await reply()
                if started["type"] == "lifespan.startup.complete":
                    scope.shield = True
                    try:
                        yield
                    except BaseException as exc:  # re-raised below, once drained
                        error = exc
                    with trio.CancelScope(shield=True):  # drained and closed, whatever
                        shutdown.set()
                        stopped = await reply()
            await ended(started, "startup")
            if error is not None:
                raise error
            await ended(stopped, "shutdown")
            return
        task = asyncio.create_task(self._lifespan(receive, send))
        try:
            await ended(await reply(), "startup")
            try:
                yield
            finally:
                shutdown.set()
                await ended(await reply(), "shutdown")
        finally:
            if not task.done():
                task.cancel()
            await asyncio.wait((task,))

    # -- ASGI -------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            try:
                await self._lifespan(receive, send)
            except asyncio.CancelledError:
                # uvicorn's force_exit (a third signal to `serve`) skips the lifespan
                # shutdown, and `asyncio.run` then cancels this task: the group closed on
                # the way out. Re-raised, uvicorn would log it as a traceback.
                log.info("the lifespan was cancelled (the server stopped without a shutdown)")
            return
        if kind != "http":
            return
        if self._backend is None:  # no lifespan (an embedded group): pick it now
            self._use(backend_for(sniffio.current_async_library()))
        path = _route_path(scope)
        route = self._routes.get(path)
        if route is None and path.startswith("/v1/models/"):
            route = ("models", "GET", self._model)
        if route is not None and self._bearer is not None and path.startswith("/v1/"):
            given = header(scope, b"authorization") or b""
            scheme, _, token = given.strip().partition(b" ")
            if not (
                hmac.compare_digest(token.strip(), self._bearer) and scheme.lower() == b"bearer"
            ):
                await self._error(
                    send,
                    route[0],
                    HTTPError(
                        401,
                        "invalid_request_error",
                        "invalid_api_key",
                        "a missing or wrong API key: send 'Authorization: Bearer <key>' with "
                        "the key this server was started with",
                    ),
                )
                return
        if route is None:
            await self._error(
                send,
                "other",
                HTTPError(404, "invalid_request_error", "not_found", _no_route(scope, path)),
            )
            return
        name, method, handler = route
        if scope["method"] != method and not (method == "GET" and scope["method"] == "HEAD"):
            exchange = Exchange(send, name, self.counters)
            exchange.headers.append((b"allow", method.encode()))
            await exchange.fail(
                HTTPError(
                    405,
                    "invalid_request_error",
                    "method_not_allowed",
                    f"{scope['path']} takes {method}, not {scope['method'][:20]}",
                )
            )
            return
        await handler(scope, receive, send)

    async def _error(self, send: Send, route: str, error: HTTPError) -> None:
        await Exchange(send, route, self.counters).fail(error)

    def _use(self, backend: Backend) -> Backend:
        """Run on `backend` from now on (at lifespan startup, or at the first request of
        an app served without a lifespan)."""
        self._backend = backend
        self._stopping = backend.event()
        if self._stop_asked:
            self._stopping.set()
        return backend

    async def _completions(
        self, scope: Scope, receive: Receive, send: Send, *, chat: bool = False
    ) -> None:
        assert self._backend is not None and self._stopping is not None
        if self._group is None and self._owns_group and self._drained is None:
            # mounted in a framework that does not run a sub-app's lifespan (Starlette)
            await self._error(
                send,
                "chat" if chat else "completions",
                HTTPError(
                    503,
                    "service_unavailable",
                    "not_started",
                    "the gateway's lifespan never ran, so its engine group is not "
                    "connected: an app mounted in FastAPI or Starlette needs "
                    "FastAPI(lifespan=gateway.lifespan) (or `async with "
                    "gateway.lifespan():` in the host's own lifespan)",
                    retry_after=self._settings.retry_after,
                ),
            )
            return
        await handle_completion(
            scope,
            receive,
            send,
            group=self._group,
            backend=self._backend,
            settings=self._settings,
            counters=self.counters,
            stopping=self._stopping,
            chat=chat,
            live=self._live,
        )

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = {"object": "list", "data": [_model_object(m) for m in self._settings.served]}
        await Exchange(send, "models", self.counters).respond(200, json.dumps(body).encode())

    async def _model(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`GET /v1/models/{id}`: the model object, or 404 as OpenAI answers it."""
        name = _route_path(scope)[len("/v1/models/") :]
        exchange = Exchange(send, "models", self.counters)
        if name in self._settings.served:
            await exchange.respond(200, json.dumps(_model_object(name)).encode())
            return
        await exchange.fail(
            HTTPError(
                404,
                "invalid_request_error",
                "model_not_found",
                f"the model {name[:MAX_MODEL_LENGTH]!r} does not exist",
                param="model",
            )
        )

    def _health(self) -> Any:
        return None if self._group is None else self._group.health()

    def _statistics(self) -> Any:
        return None if self._group is None else self._group.statistics()

    def _probe_body(self) -> dict[str, Any]:
        health = self._health()
        body: dict[str, Any] = {"gateway_draining": self._drain_asked}
        if health is None:
            body["live"] = body["ready"] = False
        else:
            body.update(dataclasses.asdict(health))
        return body

    async def _liveness(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self._probe_body()
        status = 200 if body["live"] else 503
        await Exchange(send, "health", self.counters).respond(status, json.dumps(body).encode())

    async def _readiness(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self._probe_body()
        body["ready"] = ready = bool(body["ready"]) and not self._drain_asked
        status = 200 if ready else 503
        await Exchange(send, "ready", self.counters).respond(status, json.dumps(body).encode())

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        data = generate_latest(self.registry)
        await Exchange(send, "metrics", self.counters).respond(
            200, data, CONTENT_TYPE_LATEST.encode()
        )

    # -- lifespan ---------------------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "lifespan.startup":
            return
        backend = self._use(backend_for(sniffio.current_async_library()))
        stopping = self._stopping
        assert stopping is not None
        self._drain_requested = requested = backend.event()
        self._drained = backend.event()
        if self._drain_asked:
            requested.set()
        failure: str | None = None
        stopper = backend.stopper()
        self._stop_startup = stopper.stop
        try:
            async with stopper, contextlib.AsyncExitStack() as stack:
                try:
                    await self._start(stack, backend)
                except Exception as exc:
                    failure = f"{type(exc).__name__}: {exc}"
                else:
                    self._stop_startup = None
                    await send({"type": "lifespan.startup.complete"})
                    winner, _ = await backend.race(lambda: _next_message(receive), requested.wait)
                    if winner == 1:  # begin_drain()
                        shutdown = False
                        if self._drain_grace > 0 and not stopping.is_set():
                            # a server shutdown, or stop_now(), cuts the grace short
                            first, _ = await backend.race(
                                lambda: _next_message(receive),
                                lambda: backend.sleep(self._drain_grace),
                                stopping.wait,
                            )
                            shutdown = first == 0
                        await self._drain(asked=True)
                        if not shutdown:
                            await _next_message(receive)  # lifespan.shutdown
                    else:  # a shutdown without a drain: the server has closed its connections
                        self._drain_asked = True
                        await self._drain(asked=False)
            if stopper.stopped:
                failure = "stopped (begin_drain) before the engine group was ready"
                log.info("gateway startup %s", failure)
        except Exception as exc:
            if failure is None:
                log.exception("gateway shutdown failed")
                await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
                return
            log.exception("gateway startup cleanup failed")
        if failure is not None:
            self._drained.set()  # nothing to drain: a `wait_drained()` returns
            if not stopper.stopped:
                log.error("gateway startup failed: %s", failure)
            await send({"type": "lifespan.startup.failed", "message": failure})
            return
        await send({"type": "lifespan.shutdown.complete"})

    async def _start(self, stack: contextlib.AsyncExitStack, backend: Backend) -> None:
        if not self._owns_group:
            return
        url, engines = self._url, self._engines
        assert engines is not None
        if self._mock is not None:
            if url is None:
                directory = tempfile.mkdtemp(prefix="zmqdp-gateway-")
                stack.callback(shutil.rmtree, directory, ignore_errors=True)
                url = f"ipc://{directory}/group"
            await stack.enter_async_context(backend.run_mock(url, self._mock))
            log.info("mock group of %d rank(s) at %s", engines, url)
        assert url is not None
        log.info("waiting for %d rank(s) at %s", engines, url)
        self._group = await stack.enter_async_context(
            backend.connect(url, engines, self._connect_options)
        )
        log.info("engine group of %d rank(s) connected at %s (%s)", engines, url, backend.name)

    async def _drain(self, *, asked: bool) -> None:
        """Step 2 of the drain (module docstring), in the lifespan task. A group the app
        does not own is drained on `begin_drain()` only, never at a plain shutdown."""
        assert self._drained is not None
        group = self._group
        if group is not None and (self._owns_group or asked):
            health = group.health()
            log.info("draining the engine group: %d live request(s)", health.inflight)
            await group.drain(self._drain_timeout)
            log.info("the engine group is drained")
        self._drained.set()


with_connect_options(
    create_app, defaults={"max_buffered": DEFAULT_MAX_BUFFERED, "recover": True}
)  # help(create_app) lists connect's options, with the defaults it gives them


def _no_route(scope: Scope, path: str) -> str:
    """A 404's message: the path routed on, and the prefix taken off it (a proxy in front
    strips it, so a request that still has it is below it twice)."""
    root: str = scope.get("root_path") or ""
    below = f" below the root path {root[:100]!r}" if root else ""
    return f"no route {path[:100]!r}{below}"


def _route_path(scope: Scope) -> str:
    """The path the routes match: ``scope["path"]`` less ``scope["root_path"]`` where
    the server or framework left it there (Starlette's `Mount` and uvicorn's
    ``--root-path`` keep the full path, as ASGI now says; older ones strip it)."""
    path: str = scope["path"]
    root: str = scope.get("root_path") or ""
    if root and path.startswith(root):
        rest = path[len(root.rstrip("/")) :]
        if not rest or rest.startswith("/"):
            return rest or "/"
    return path


def _model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "zmqdp"}


async def _next_message(receive: Receive) -> Mapping[str, Any]:
    return await receive()


_TOKEN = object()

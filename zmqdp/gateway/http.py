"""Plain-ASGI plumbing: the callables' types, one response as an `Exchange`, the body
reader and the disconnect watcher.

No web framework: the gateway has seven routes and one request path is hot (completions
and chat completions). A framework's
request object, middleware stack and response classes would sit on every token write,
and starlette (like hypercorn) drops sends after a disconnect without telling the app,
which is exactly what the gateway has to notice (see `wait_for_disconnect`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from .errors import HTTPError
from .metrics import HTTPCounters
from .openai import error_body, sse

__all__ = [
    "Exchange",
    "Receive",
    "Scope",
    "Send",
    "header",
    "read_body",
    "wait_for_disconnect",
]

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON = b"application/json"


def header(scope: Scope, name: bytes) -> bytes | None:
    """The value of request header `name` (lower case), or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


class Exchange:
    """One HTTP response: sent once, counted by route and status. `headers` go on
    every response of this exchange (the request id, the rank)."""

    __slots__ = ("_counters", "_send", "ended", "headers", "route", "started")

    def __init__(self, send: Send, route: str, counters: HTTPCounters) -> None:
        self._send = send
        self._counters = counters
        self.route = route
        self.started = False
        """The status line is out: an error can only be an SSE event now."""
        self.ended = False
        """The last body write is out: a disconnect now changes nothing."""
        self.headers: Headers = []

    async def start(
        self, status: int, content_type: bytes, extra: Iterable[tuple[bytes, bytes]] = ()
    ) -> None:
        self.started = True
        self._counters.responses[(self.route, status)] += 1
        headers = [(b"content-type", content_type), *self.headers, *extra]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, *, more: bool = False) -> None:
        if not more:
            self.ended = True
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def respond(
        self,
        status: int,
        data: bytes,
        content_type: bytes = JSON,
        extra: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        """A whole response in one write."""
        await self.start(status, content_type, [*extra, (b"content-length", b"%d" % len(data))])
        await self.body(data)

    async def fail(self, error: HTTPError) -> None:
        """The error as its status and OpenAI error body; once the response has started,
        as a last SSE event (errors.py). Nothing if the response has ended."""
        if self.ended:
            return
        if self.started:
            await self.body(sse(error_body(error)))
            return
        extra = [] if error.retry_after is None else [(b"retry-after", b"%d" % error.retry_after)]
        if error.should_retry is not None:
            extra.append((b"x-should-retry", b"true" if error.should_retry else b"false"))
        await self.respond(error.status, error_body(error), extra=extra)


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None if the client went away first. `HTTPError` 413 past
    `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.disconnect":
            return None
        if kind != "http.request":
            continue
        data = message.get("body", b"")
        size += len(data)
        if size > limit:
            raise HTTPError(
                413,
                "invalid_request_error",
                "body_too_large",
                f"the request body is larger than {limit} bytes",
            )
        chunks.append(data)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def wait_for_disconnect(
    receive: Receive, exchange: Exchange, forever: Callable[[], Awaitable[None]]
) -> None:
    """Return when the client goes away (`http.disconnect`) before `exchange` has ended.
    Call it only once the body has been read: from then on `receive` has nothing else to
    say.

    Both servers report a closed connection this way (hypercorn when its reader sees
    EOF or a reset, uvicorn from `connection_lost`), and both then drop the app's sends
    silently, so this watcher is the only way the gateway learns that a response is no
    longer read.

    Once the last body write has begun (`exchange.ended`), a disconnect changes nothing
    and the watcher waits, with `forever()`, to be cancelled when the response task is
    done. Both servers say `http.disconnect` as part of *completing* a response:
    hypercorn from inside that last `send()` (it closes its stream, then closes the
    connection on `Connection: close` or restarts the keep-alive timer), uvicorn right
    after it. A watcher returning then would have the response task cancelled inside the
    server's own `send()`, and hypercorn's close step would never run: the connection
    would stay open forever, `Connection: close` and `keep_alive_timeout` ignored."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if exchange.ended:
                await forever()
            return

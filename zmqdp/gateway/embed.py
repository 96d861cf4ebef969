"""Tools for an embedder's own endpoints: the disconnect watch the gateway's completions
use, for a hand-written FastAPI, Starlette or raw ASGI endpoint.

Why
---
Neither uvicorn nor hypercorn tells an app that its client left, other than by an
``http.disconnect`` message on `receive`: both drop the app's later sends silently. A
non-streaming endpoint that waits for a whole answer therefore runs it to its end for
nobody, and its request holds a slot on its rank all along. (Starlette's
`StreamingResponse` already watches `receive` and cancels its iterator: a streaming
endpoint whose generator holds the request's stream in ``async with`` aborts it.)

`until_disconnected(receive, fn)` runs ``fn()`` with a watcher on `receive` beside it
(`Backend.watched`, the gateway's own structure, on trio or asyncio): if the client
goes away first, ``fn`` is cancelled, so a stream's ``async with`` block aborts its
request on its rank, and `ClientDisconnected` is raised.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import sniffio

from .backends import backend_for
from .http import Receive

__all__ = ["ClientDisconnected", "until_disconnected"]

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the answer was ready: the work was cancelled (a
    request's stream, left early, aborted it on its rank). Nothing is left to answer."""


async def until_disconnected(receive: Receive, fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()``, cancelled if the client goes away first (`ClientDisconnected`).

    `receive`: the request's ASGI receive (``request.receive`` in FastAPI or
    Starlette). Call this only once the body has been read (FastAPI has read it for a
    body parameter; otherwise ``await request.body()``): the watcher consumes what
    `receive` says, and after the body that is only ``http.disconnect``. An error of
    ``fn`` passes out as itself. Runs on trio and asyncio::

        @app.post("/generate")
        async def generate(request: fastapi.Request, body: Body) -> dict[str, Any]:
            async def answer() -> dict[str, Any]:
                async with group.submit(Request(new_id(), {...})) as stream:
                    return {"tokens": [o.body["token"] async for o in stream]}

            try:
                return await until_disconnected(request.receive, answer)
            except ClientDisconnected:
                return fastapi.Response(status_code=499)  # nobody reads it
    """
    backend = backend_for(sniffio.current_async_library())
    stopper = backend.stopper()
    result: list[T] = []

    async def run() -> None:
        result.append(await fn())

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        stopper.stop()

    await backend.watched(run, watch, stopper)
    if not result:
        raise ClientDisconnected("the client went away before the answer was ready")
    return result[0]

"""What the gateway tests share, on trio (tests/test_gateway.py, hypercorn) and on
asyncio (tests/test_gateway_asyncio.py, uvicorn): an engine and a frontend a test can
drive, the SSE reader, the metrics parser, and the client side of the `serve` command's
SIGTERM drain. httpx runs on both libraries, so the client code here does too.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.fakes.engines import ScriptedEngine
from zmqdp._core.messages import Output
from zmqdp.engine import Abort, Add
from zmqdp.gateway import CompletionRequest, Piece, Prepared

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

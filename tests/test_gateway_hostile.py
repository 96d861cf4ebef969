"""The HTTP gateway against hostile or careless clients (issue 24), over real HTTP. What
involves the server runs on every server (the `server` fixture: hypercorn's trio
worker, uvicorn on asyncio and on uvloop; tests/gateway_helpers.py `on_server`); what
the app alone decides runs on hypercorn; what only uvicorn does runs on uvicorn
only (`UVICORN`). Each test names the finding it guards:

* 5: a non-streaming answer is held whole, so it is bounded (`max_collected_tokens`,
  `max_collected_chars`): a larger `max_tokens` is refused up front, an answer that
  grows past the limits anyway is aborted on its rank;
* 6: `model` is echoed in every chunk, so its length is bounded;
* 7: the server closes a `Connection: close` connection after a completion, and
  hypercorn times out an idle keep-alive one (the disconnect watcher no longer cancels
  the response inside hypercorn's last `send()`);
* 8: a rank header or a JSON number too long for `int()` is a 400, never a bare 500;
* 9: a second SIGTERM answers live requests with a JSON 503 (an SSE error event for a
  begun stream), with no traceback in the log, on both servers; so do `stop_now()` and,
  on uvicorn, the cancellation of a request's task past `timeout_graceful_shutdown`;
* 10 (issue 34, uvicorn on httptools, whose parser has no bound of its own): a request
  head that grows past 16 KiB (one endless header, endless headers, an endless request
  target) is answered 431 and its connection closed, on every server and parser, while
  a 12 KiB head in small pieces is served; requests pipelined behind one in progress are
  answered in order up to `MAX_PIPELINED`, one more closes the connection on httptools
  (h11 holds their raw bytes instead), and a client that pipelined and left has its
  request aborted; a chunked body past the body limit is a 413 on every parser.

Every test has its own time limit (`trio.fail_after`, `anyio.fail_after`); nothing
waits on the clock to synchronize.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import trio
import uvicorn
from anyio.abc import ByteStream, TaskStatus

from tests.fakes.threaded import EngineThread, url_in, wait_until
from zmqdp.engine import Add
from zmqdp.gateway import create_app
from zmqdp.gateway.app import DEFAULT_MAX_COLLECTED_TOKENS
from zmqdp.gateway.connections import MAX_HEAD, MAX_PIPELINED

from .gateway_helpers import (
    SERVERS,
    ScriptFrontend,
    Served,
    TokenEngine,
    UvicornServer,
    all_events,
    events,
    hold,
    on_server,
    read_banner,
    run_on,
    serve_command,
    served_url,
    server_param,
)
from .helpers import READY_TIMEOUT
from .test_gateway import FAST_MOCK, serving, stats

server = pytest.fixture(params=SERVERS, name="server")(server_param)

STEP = 5.0
"""Seconds: the time limit of each test's I/O (its body, on the servers' suite)."""

# -- raw HTTP/1.1 -------------------------------------------------------------------------


def _address(client: httpx.AsyncClient) -> tuple[str, int]:
    url = client.base_url
    assert url.host and url.port
    return url.host, url.port


def _post(body: dict[str, Any], *headers: bytes) -> bytes:
    data = json.dumps(body).encode()
    head = [b"POST /v1/completions HTTP/1.1", b"host: test", *headers]
    head += [b"content-type: application/json", b"content-length: %d" % len(data)]
    return b"\r\n".join(head) + b"\r\n\r\n" + data


async def _receive(sock: ByteStream) -> bytes:
    """What comes next on `sock`; b"" at its end (on any loop: anyio)."""
    try:
        return await sock.receive()
    except anyio.EndOfStream:
        return b""


async def _read_until_eof(sock: ByteStream) -> bytes:
    data = b""
    while chunk := await _receive(sock):
        data += chunk
    return data


async def _read_response(sock: ByteStream, buffer: bytes = b"") -> tuple[bytes, bytes]:
    """One response with a content-length: (head, body), and nothing read past it."""
    while b"\r\n\r\n" not in buffer:
        chunk = await _receive(sock)
        assert chunk, buffer
        buffer += chunk
    head, _, body = buffer.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = await _receive(sock)
        assert chunk, body
        body += chunk
    assert len(body) == length
    return head, body


# -- 5: a non-streaming answer is bounded --------------------------------------------------


async def test_a_plain_request_past_the_collect_limit_is_a_400_naming_max_tokens() -> None:
    app = create_app(mock=FAST_MOCK)
    with trio.fail_after(5):
        async with serving(app) as client:
            response = await client.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 2**31 - 1}
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "max_tokens" and error["code"] == "invalid_request"
            assert f"at most {DEFAULT_MAX_COLLECTED_TOKENS}" in error["message"]
            assert '"stream": true' in error["message"]
            assert stats(app).submitted == 0
            # a stream is not collected (`max_buffered` bounds it): it is not limited
            body = {"prompt": "hi", "max_tokens": 2**31 - 1, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as streamed:
                assert streamed.status_code == 200
                assert json.loads(await anext(events(streamed)))["choices"][0]["text"]
            assert stats(app).submitted == 1


@pytest.mark.parametrize(
    ("limit", "reached"),
    [({"max_collected_tokens": 5}, "5 tokens"), ({"max_collected_chars": 10}, "10 characters")],
    ids=["tokens", "chars"],
)
def test_a_plain_answer_past_the_collect_limit_is_aborted_with_a_502(
    tmp_path: Path, server: str, limit: dict[str, int], reached: str
) -> None:
    """The engine sends 8 outputs (" t0" ... " t7") whatever `max_tokens` says: more
    than asked for, or more text than the gateway holds. It is aborted on its rank.
    (`max_tokens` 5 is at the token limit: taken.)"""

    async def body(s: Served) -> None:
        with anyio.fail_after(STEP):
            if "max_collected_tokens" in limit:  # past the limit: refused up front
                past = await s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 6})
                assert past.status_code == 400 and past.json()["error"]["param"] == "max_tokens"
                assert "at most 5" in past.json()["error"]["message"]
            request = {**hold(tokens=8), "max_tokens": 5}
            response = await s.client.post("/v1/completions", json=request)
            assert response.status_code == 502, response.text
            error = response.json()["error"]
            request_id = response.headers["x-request-id"]
            assert (error["type"], error["code"]) == ("engine_error", "response_too_large")
            assert f"rank 0, request {request_id!r}" in error["message"]
            assert f"past the {reached}" in error["message"]
            view = await s.engines.wait_for(0, lambda v: bool(v.aborted()))
            assert view.aborted() == [view.wire(request_id)]
            await wait_until(lambda: s.stats().aborted == 1)
            assert s.stats().ranks[0].inflight == 0 and s.stats().submitted == 1

    on_server(server, tmp_path, body, **limit)


def test_create_app_refuses_a_collect_limit_below_1() -> None:
    with pytest.raises(ValueError, match="max_collected_tokens must be >= 1 or None"):
        create_app(mock=FAST_MOCK, max_collected_tokens=0)


# -- 6: the model name is bounded -----------------------------------------------------------


async def test_a_model_name_past_256_characters_is_a_400_naming_model() -> None:
    app = create_app(mock=FAST_MOCK, model=["m" * 256, "zmqdp"])  # (the first is answered)
    with trio.fail_after(5):
        async with serving(app) as client:
            long = await client.post(
                "/v1/completions", json={"prompt": "hi", "model": "m" * 257, "stream": True}
            )
            assert long.status_code == 400, long.text[:200]
            error = long.json()["error"]
            assert error["param"] == "model" and "257 characters" in error["message"]
            assert len(long.content) < 500  # the name is not echoed in the error either
            assert stats(app).submitted == 0
            name = "m" * 256
            request = {"prompt": "hi", "model": name, "max_tokens": 2, "stream": True}
            async with client.stream("POST", "/v1/completions", json=request) as response:
                assert response.status_code == 200
                data = await all_events(response)
            assert data[-1] == "[DONE]"
            assert {json.loads(d)["model"] for d in data[:-1]} == {name}


# -- 7: hypercorn releases connections ---------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_connection_close_closes_the_connection_after_a_completion(
    tmp_path: Path, server: str, stream: bool
) -> None:
    async def body(s: Served) -> None:
        with anyio.fail_after(STEP):
            async with await anyio.connect_tcp(*_address(s.client)) as sock:
                request = {"prompt": "hi", "max_tokens": 2, "stream": stream}
                await sock.send(_post(request, b"connection: close"))
                data = await _read_until_eof(sock)  # hangs if the server keeps it open
        head, _, rest = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        if stream:
            assert b" t0" in rest and b" t1" in rest and b"[DONE]" in rest
        else:
            assert json.loads(rest)["choices"][0]["text"] == " t0 t1"

    on_server(server, tmp_path, body)


async def test_an_idle_keep_alive_connection_times_out_after_completions() -> None:
    """Two completions on one connection (keep-alive works), then the connection is idle
    and hypercorn closes it after its `keep_alive_timeout`."""
    with trio.fail_after(5):
        async with serving(create_app(mock=FAST_MOCK), keep_alive_timeout=0.2) as client:
            sock = await anyio.connect_tcp(*_address(client))
            async with sock:
                for _ in range(2):
                    await sock.send(_post({"prompt": "hi", "max_tokens": 2}))
                    head, body = await _read_response(sock)
                    assert head.startswith(b"HTTP/1.1 200 ")
                    assert json.loads(body)["usage"]["completion_tokens"] == 2
                assert await _read_until_eof(sock) == b""  # hangs if never timed out


# -- 8: numbers too long for int() ------------------------------------------------------------


@pytest.mark.parametrize("value", ["1" * 4400, "1" * 10], ids=["4400-digits", "10-digits"])
def test_a_huge_rank_header_is_a_400_naming_the_header(
    tmp_path: Path, server: str, value: str
) -> None:
    async def body(s: Served) -> None:
        with anyio.fail_after(STEP):
            response = await s.client.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 1},
                headers={"X-Data-Parallel-Rank": value},
            )
            assert response.status_code == 400, response.text[:200]
            error = response.json()["error"]
            assert error["code"] == "invalid_rank"
            assert (
                "X-Data-Parallel-Rank" in error["message"]
                and "at most 9 digits" in error["message"]
            )
            assert len(error["message"]) < 300
            assert s.stats().submitted == 0 and s.engines.views[0].adds() == []

    on_server(server, tmp_path, body, 2)


@pytest.mark.parametrize("field", ["max_tokens", "seed"])
async def test_a_json_integer_too_long_to_parse_is_a_400(field: str) -> None:
    """json.loads refuses an int of more than 4300 digits (Python's limit): a 400 that
    says so, without the server-side advice of Python's message."""
    body = b'{"prompt": "a", "%s": %s}' % (field.encode(), b"9" * 5000)
    with trio.fail_after(5):
        async with serving(create_app(mock=FAST_MOCK)) as client:
            response = await client.post("/v1/completions", content=body)
    assert response.status_code == 400, response.text[:200]
    message = response.json()["error"]["message"]
    assert "integer too long" in message and "set_int_max_str_digits" not in message


async def test_an_error_quotes_a_bad_value_briefly() -> None:
    bodies = [
        {"prompt": "a", "max_tokens": [[[[1]]]] * 100_000},
        {"prompt": "a", "stream": "s" * 100_000},
        {"prompt": "a", "n": {"k": "v" * 100_000}},
    ]
    with trio.fail_after(5):
        async with serving(create_app(mock=FAST_MOCK)) as client:
            for body in bodies:
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 400
                assert len(response.content) < 400, response.text[:400]


# -- stop_now (9, in process) --------------------------------------------------------------------


def test_stop_now_answers_live_requests_503_and_aborts_them(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        client, app = s.client, s.app
        with anyio.fail_after(STEP):
            answers: list[httpx.Response] = []
            last_events: list[str] = []

            async def plain() -> None:
                answers.append(
                    await client.post(
                        "/v1/completions", json=hold(), headers={"X-Data-Parallel-Rank": "0"}
                    )
                )

            async def streamed(
                *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
            ) -> None:
                request = {**hold(tokens=1), "stream": True}
                headers = {"X-Data-Parallel-Rank": "1"}
                async with client.stream(
                    "POST", "/v1/completions", json=request, headers=headers
                ) as response:
                    stream = events(response)
                    assert json.loads(await anext(stream))["choices"][0]["text"] == " t0"
                    task_status.started()
                    last_events.extend([d async for d in stream])

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(plain)
                await tasks.start(streamed)
                await s.engines.wait_for(0, lambda v: bool(v.held))
                app.stop_now()
            [answer] = answers
            assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
            error = answer.json()["error"]
            assert error["code"] == "shutting_down" and "on rank 0" in error["message"]
            assert answer.headers["x-request-id"] in error["message"]
            [last] = last_events  # no [DONE]
            assert json.loads(last)["error"]["code"] == "shutting_down"
            for rank in (0, 1):
                view = await s.engines.wait_for(rank, lambda v: bool(v.aborted()))
                assert view.aborted() == [m.id for m in view.inbox if isinstance(m, Add)]
            late = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert late.status_code == 503
            await app.wait_drained()
            assert s.stats().aborted == 2
            assert len(app._live) == 0  # the stop registry holds no ended response

    on_server(server, tmp_path, body, 2)


# -- 9, on uvicorn only: the cancellation of a request's task -----------------------------

UVICORN = [s for s in SERVERS if s.startswith("uvicorn")]
"""hypercorn does not cancel a live request's task at shutdown: uvicorn only."""


@pytest.mark.parametrize("server", UVICORN)
def test_a_request_cancelled_by_uvicorn_is_answered_503_without_a_traceback(
    tmp_path: Path, server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn cancels the tasks of requests still live `timeout_graceful_shutdown`
    after its shutdown began (and `asyncio.run` cancels any left at its end). The app
    answers a JSON 503 and ends the task quietly: a `CancelledError` reaching uvicorn
    is logged as "Exception in ASGI application" with a traceback, and answered with a
    bare text 500."""
    with EngineThread(url_in(tmp_path), 1, engine=TokenEngine) as engines:

        async def main() -> None:
            engines.attach()
            app = create_app(engines.url, 1, frontend=ScriptFrontend(), ready_timeout=READY_TIMEOUT)
            config = uvicorn.Config(
                app,
                host="127.0.0.1",
                port=0,
                lifespan="on",
                loop="none",
                log_config=None,  # uvicorn's records reach caplog
                timeout_graceful_shutdown=0,
            )
            server = UvicornServer(config)
            serving = asyncio.create_task(server.serve())
            async with asyncio.timeout(STEP):
                await server.listening.wait()
                host, port = server.servers[0].sockets[0].getsockname()[:2]
                async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                    post = asyncio.create_task(client.post("/v1/completions", json=hold()))
                    [wire] = (await engines.wait_for(0, lambda v: bool(v.held))).held
                    server.should_exit = True  # the held request outlives the grace
                    response = await post
                await serving
                await engines.wait_for(0, lambda v: bool(v.aborted()))
            assert response.status_code == 503, response.text
            assert response.headers["content-type"] == "application/json"
            assert response.json()["error"]["code"] == "shutting_down"
            assert engines.views[0].aborted() == [wire]
            assert app.group is not None and app.group.statistics().aborted == 1

        with caplog.at_level(logging.INFO):
            run_on(server, main)
    assert "Cancel 1 running task(s)" in caplog.text  # uvicorn did cancel it
    assert "Exception in ASGI application" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text


# -- 9: the second SIGTERM of `serve` --------------------------------------------------------


async def check_second_sigterm(server: str, tmp_path: Path) -> None:
    """`serve --mock --server <server>` with 2 plain and 2 streaming requests live:
    SIGTERM (a drain: they go on), SIGTERM again: each is answered with a JSON 503
    (`shutting_down`), or a last SSE error event; the process exits 0 and logs no
    traceback."""
    errors = tmp_path / "stderr"
    with errors.open("wb") as stderr:
        proc = await trio.lowlevel.open_process(
            serve_command("--server", server, "--log-level", "INFO"),
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,  # a process group: a failed test kills its mock too
        )
    try:
        out = await read_banner(proc)
        plain: list[httpx.Response] = []
        streamed: list[str] = []
        body = {"prompt": "hi", "max_tokens": 100_000}
        async with (
            httpx.AsyncClient(base_url=served_url(out), timeout=15) as client,
            trio.open_nursery() as nursery,
        ):

            async def post() -> None:
                plain.append(await client.post("/v1/completions", json=body))

            async def stream(task_status: trio.TaskStatus[None]) -> None:
                request = {**body, "stream": True}
                async with client.stream("POST", "/v1/completions", json=request) as response:
                    assert response.status_code == 200
                    data = events(response)
                    await anext(data)
                    task_status.started()
                    streamed.append([d async for d in data][-1])

            for _ in range(2):
                nursery.start_soon(post)
                await nursery.start(stream)
            while (await client.get("/health")).json()["inflight"] < 4:
                pass
            proc.send_signal(signal.SIGTERM)
            while (await client.get("/ready")).status_code == 200:
                pass  # the first signal was handled: a drain, requests go on
            proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    log = errors.read_text(errors="replace")
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert len(plain) == 2 and len(streamed) == 2
    for response in plain:
        assert response.status_code == 503, response.text
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == "shutting_down"
    for last in streamed:
        assert json.loads(last)["error"]["code"] == "shutting_down"


@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
async def test_a_second_sigterm_answers_live_requests_503_without_tracebacks(
    server: str, tmp_path: Path
) -> None:
    with trio.fail_after(15):
        await check_second_sigterm(server, tmp_path)


# -- 10: a request head is bounded, and so is pipelining -------------------------------------


async def _send_until_closed(sock: ByteStream, first: bytes, piece: bytes, total: int) -> None:
    """`first`, then `piece` until `total` bytes are sent or the server has closed."""
    sent = 0
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        await sock.send(first)
        while sent < total:
            await sock.send(piece)
            sent += len(piece)


async def _read_all(sock: ByteStream) -> bytes:
    """Everything until the server closes (a reset, for bytes it left unread, too)."""
    data = b""
    with contextlib.suppress(anyio.BrokenResourceError, OSError):
        while chunk := await _receive(sock):
            data += chunk
    return data


ENDLESS_HEADS = {
    "header-value": (b"POST /v1/completions HTTP/1.1\r\nhost: test\r\nx-long: ", b"v" * 1024),
    "header-count": (b"POST /v1/completions HTTP/1.1\r\nhost: test\r\n", b"x-h: 1\r\n" * 128),
    "request-target": (b"GET /", b"a" * 1024),
}


@pytest.mark.parametrize("kind", ENDLESS_HEADS)
def test_a_request_head_growing_past_16_KiB_is_a_431_and_closes(
    tmp_path: Path, server: str, kind: str
) -> None:
    """The head never completes; 4 MiB of it are offered. Before issue 34, uvicorn on
    httptools read it all, kept it, and never answered."""
    first, piece = ENDLESS_HEADS[kind]

    async def body(s: Served) -> None:
        with anyio.fail_after(STEP):
            async with (
                await anyio.connect_tcp(*_address(s.client)) as sock,
                anyio.create_task_group() as tasks,
            ):
                # read meanwhile: a client that only reads once its send fails may
                # find the connection reset, the answer with it
                tasks.start_soon(_send_until_closed, sock, first, piece, 4 << 20)
                answer = await _read_all(sock)  # hangs if the server keeps reading
                tasks.cancel_scope.cancel()
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:300]
        if server != "hypercorn":  # hypercorn's own 431 has no body
            error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "request_header_fields_too_large"
            assert f"more than {MAX_HEAD} bytes" in error["message"]
        assert s.stats().submitted == 0

    on_server(server, tmp_path, body)


def test_a_12_KiB_request_head_in_small_pieces_is_served(tmp_path: Path, server: str) -> None:
    """No false 431: 120 headers of 100 bytes sent 500 bytes at a time, the last piece
    with the body (one read holds the head's end and the body)."""

    async def body(s: Served) -> None:
        data = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        pad = b"".join(b"x-pad-%03d: %s\r\n" % (i, b"p" * 87) for i in range(120))
        assert len(pad) == 12_000
        head = _post({"prompt": "hi", "max_tokens": 2}).partition(b"\r\n\r\n")[0]
        whole = head + b"\r\n" + pad + b"\r\n" + data
        with anyio.fail_after(STEP):
            async with await anyio.connect_tcp(*_address(s.client)) as sock:
                cut = len(whole) - len(data) - 100  # the last piece: the head's end, the body
                for i in range(0, cut, 500):
                    await sock.send(whole[i : min(i + 500, cut)])
                await sock.send(whole[cut:])
                head, answer = await _read_response(sock)
        assert head.startswith(b"HTTP/1.1 200 "), head
        assert json.loads(answer)["choices"][0]["text"] == " t0 t1"

    on_server(server, tmp_path, body)


async def _read_responses(sock: ByteStream, n: int) -> list[tuple[bytes, bytes]]:
    """`n` responses with a content-length, in order: [(head, body)]."""
    out: list[tuple[bytes, bytes]] = []
    buffer = b""
    while len(out) < n:
        while b"\r\n\r\n" not in buffer:
            chunk = await _receive(sock)
            assert chunk, (out, buffer)
            buffer += chunk
        head, _, rest = buffer.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        while len(rest) < length:
            chunk = await _receive(sock)
            assert chunk, (out, rest)
            rest += chunk
        out.append((head, rest[:length]))
        buffer = rest[length:]
    return out


@pytest.mark.parametrize("queued", [MAX_PIPELINED, MAX_PIPELINED + 1])
def test_requests_pipelined_behind_one_in_progress(
    tmp_path: Path, server: str, queued: int
) -> None:
    """A held completion and `queued` health checks behind it, in one write. Up to
    `MAX_PIPELINED`, or on h11 (which keeps their raw bytes), each is answered in order
    once the completion ends; past it on httptools (which parses a whole read into
    requests) the connection is closed, and the completion is not left on its rank."""
    overflow = queued > MAX_PIPELINED and server.endswith("httptools")

    async def body(s: Served) -> None:
        health = b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n"
        with anyio.fail_after(STEP):
            async with await anyio.connect_tcp(*_address(s.client)) as sock:
                await sock.send(_post(hold()) + health * queued)
                if overflow:
                    assert await _read_all(sock) == b""
                    await wait_until(lambda: s.stats().ranks[0].inflight == 0)
                    assert s.stats().submitted == s.stats().aborted
                    return
                await s.finish_held()
                answers = await _read_responses(sock, 1 + queued)
        assert all(head.startswith(b"HTTP/1.1 200 ") for head, _ in answers)
        assert json.loads(answers[0][1])["choices"][0]["text"] == " tdone"
        assert all(json.loads(answer)["live"] for _, answer in answers[1:])

    on_server(server, tmp_path, body)


@pytest.mark.parametrize("server", UVICORN)
def test_a_client_that_pipelined_and_left_has_its_request_aborted(
    tmp_path: Path, server: str
) -> None:
    """A held completion with a health check pipelined behind it, then the client goes.
    uvicorn on httptools told only the request parsed last (the health check, never
    started) that the connection was lost: the completion stayed on its rank for good.
    (hypercorn 0.18 stops reading while a request waits behind the one in progress, so
    it sees no disconnect either: not fixed here.)"""

    async def body(s: Served) -> None:
        health = b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n"
        with anyio.fail_after(STEP):
            async with await anyio.connect_tcp(*_address(s.client)) as sock:
                await sock.send(_post(hold()) + health)
                [wire] = (await s.engines.wait_for(0, lambda v: len(v.held) == 1)).held
            view = await s.engines.wait_for(0, lambda v: bool(v.aborted()))
            assert view.aborted() == [wire]
            await wait_until(lambda: s.stats().ranks[0].inflight == 0)

    on_server(server, tmp_path, body)


def test_a_chunked_body_past_the_limit_is_a_413(tmp_path: Path, server: str) -> None:
    """The body bound holds for a chunked body too, on every parser (the body is read
    by the app, not the parser: a body that never ends is answered once past it)."""

    async def body(s: Served) -> None:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: test\r\n"
        head += b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        chunk = b"20\r\n" + b" " * 32 + b"\r\n"  # JSON whitespace, never a whole body
        with anyio.fail_after(STEP):
            async with await anyio.connect_tcp(*_address(s.client)) as sock:
                await sock.send(head + chunk * 3)
                status, answer = await _read_response(sock)
        assert status.startswith(b"HTTP/1.1 413 "), status
        assert json.loads(answer)["error"]["code"] == "body_too_large"
        assert s.stats().submitted == 0

    on_server(server, tmp_path, body, max_body_size=64)

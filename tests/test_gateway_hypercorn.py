"""What only hypercorn's trio worker does under zmqdp: its fast paths
(`zmqdp.gateway.connections.install_hypercorn_fast_paths`), each against hypercorn's own.

* A response write goes out as one non-blocking socket write when no other write waits
  for the socket, with no task step (hypercorn's: two per write); what the socket cannot
  take at once goes hypercorn's way (its lock, a shielded `send_all`), and the bytes
  arrive whole and in order. A peer that resets the connection is an `http.disconnect`
  to the app, its later writes dropped, as on hypercorn's path. A write cancelled after
  part of it went out still goes out whole. A TLS connection keeps hypercorn's writes.
* A body part that is not the last goes past hypercorn's stream and h11, framed as the
  chunk h11 would frame; every shape of response (chunked, content-length, HEAD, 204,
  HTTP/1.0) is the same bytes as hypercorn sends.
* An answer that ends before the request body is read keeps the connection, as on
  hypercorn's path.
* The keep-alive timer is one task per connection: the same deadline (from the
  connection's start and from each response, never during a request), the same close
  of an idle connection when the server stops; and a connection its client closes
  while idle ends at once (hypercorn's waited for its timer to fire).
"""

from __future__ import annotations

import contextlib
import shutil
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hypercorn", reason="needs the gateway extra: pip install 'zmqdp[gateway]'")

import hypercorn.trio.run as hypercorn_run
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio import serve

from zmqdp.gateway.connections import (
    ConnectionCap,
    install_hypercorn_cap,
    install_hypercorn_fast_paths,
)

App = Callable[
    [Mapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]
LIMIT = 10.0
REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


class TaskSteps(trio.abc.Instrument):
    """Counts the steps of one task."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


@dataclass
class Served:
    address: tuple[str, int]
    stop: trio.Event
    """Set: the server stops (hypercorn's `shutdown_trigger`)."""
    cap: ConnectionCap
    """Counts the open connections (no bound)."""


@asynccontextmanager
async def hypercorn_on(app: App, fast: bool, keep_alive: float = 30.0) -> AsyncIterator[Served]:
    """`app` on hypercorn's trio worker on 127.0.0.1, with zmqdp's fast paths or without,
    connections counted, a keep-alive timeout of `keep_alive` s."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 1.0
    config.accesslog = None
    config.keep_alive_timeout = keep_alive
    cap = ConnectionCap(0)
    install_hypercorn_cap(config, cap)
    if fast:
        install_hypercorn_fast_paths(config)

    async def with_lifespan(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        else:
            await app(scope, receive, send)

    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve, with_lifespan, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
        )
        host, port = binds[0].removeprefix("http://").rsplit(":", 1)
        yield Served((host, int(port)), stop, cap)
        stop.set()


def sse_app(chunks: list[bytes], report: dict[str, Any]) -> App:
    """Streams `chunks` as one chunked response, then an empty last write (hypercorn
    readies the connection for its next request in it: steps of its own), counting its
    own task's steps over the start and the chunks' writes (`report["steps"]`)."""

    async def app(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        await receive()
        steps = TaskSteps(trio.lowlevel.current_task())
        trio.lowlevel.add_instrument(steps)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            trio.lowlevel.remove_instrument(steps)
        report["steps"] = steps.steps
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def read_response(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    """The head and the de-chunked body of one chunked response."""
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        buffer += await stream.receive_some()
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    body = bytearray()
    while True:
        while b"\r\n" not in buffer:
            buffer += await stream.receive_some()
        size_line, _, buffer = buffer.partition(b"\r\n")
        size = int(size_line, 16)
        while len(buffer) < size + 2:
            buffer += await stream.receive_some()
        body += buffer[:size]
        buffer = buffer[size + 2 :]
        if size == 0:
            return head, bytes(body)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hypercorn"])
async def test_a_write_takes_no_task_step_on_the_direct_path(fast: bool) -> None:
    """100 writes that the socket takes at once: no step of the writing task on the
    direct path (each used to cost two: hypercorn's send lock and the socket send both
    checkpoint); the response arrives whole either way."""
    chunks = [b"data: %d\n\n" % i for i in range(100)]
    report: dict[str, Any] = {}
    with trio.fail_after(LIMIT):
        async with hypercorn_on(sse_app(chunks, report), fast) as served:
            stream = await trio.open_tcp_stream(*served.address)
            async with stream:
                await stream.send_all(REQUEST)
                head, body = await read_response(stream)
    assert head.startswith(b"HTTP/1.1 200 ")
    assert body == b"".join(chunks)
    if fast:
        assert report["steps"] == 0
    else:
        assert report["steps"] >= 2 * len(chunks)


async def connect_slow_reader(address: tuple[str, int]) -> trio.SocketStream:
    """A connection whose receive buffer stays small (no autotuning): the server's
    socket fills after a few MB."""
    sock = trio.socket.socket()
    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 65536)
    await sock.connect(address)
    return trio.SocketStream(sock)


async def test_writes_past_what_the_socket_takes_arrive_whole_and_in_order() -> None:
    """The peer reads nothing until the app is blocked on a full socket (8 MB, past the
    kernel's 4 MB send buffer): a write's rest goes hypercorn's way, the writes behind
    it queue on its lock, and the bytes arrive whole and in order once the peer reads."""
    chunks = [bytes([65 + i % 26]) * (50_000 + i) for i in range(170)]
    report: dict[str, Any] = {}
    with trio.fail_after(LIMIT):
        async with (
            hypercorn_on(sse_app(chunks, report), True) as served,
            await connect_slow_reader(served.address) as stream,
        ):
            await stream.send_all(REQUEST)
            await trio.testing.wait_all_tasks_blocked()  # the server's socket is full
            head, body = await read_response(stream)
    assert head.startswith(b"HTTP/1.1 200 ")
    assert len(body) == sum(map(len, chunks))
    assert body == b"".join(chunks)
    assert report["steps"] > 0  # it did wait for the socket


async def test_a_reset_peer_is_an_http_disconnect_on_the_direct_path() -> None:
    """The peer resets the connection while the app writes: the app hears
    `http.disconnect` and its later writes are dropped without an error, as on
    hypercorn's path."""
    started, disconnected, done = trio.Event(), trio.Event(), trio.Event()
    writes_after = 0

    async def app(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        nonlocal writes_after
        await receive()

        async def watch() -> None:
            if (await receive())["type"] == "http.disconnect":
                disconnected.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            started.set()
            while not disconnected.is_set():
                await send({"type": "http.response.body", "body": b"x" * 4096, "more_body": True})
                await trio.lowlevel.checkpoint()
            for _ in range(3):
                await send({"type": "http.response.body", "body": b"late", "more_body": True})
                writes_after += 1
        done.set()

    with trio.fail_after(LIMIT):
        async with hypercorn_on(app, True) as served:
            stream = await trio.open_tcp_stream(*served.address)
            await stream.send_all(REQUEST)
            await started.wait()
            linger = struct.pack("ii", 1, 0)  # close with a reset
            stream.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, linger)
            await stream.aclose()
            await done.wait()
    assert writes_after == 3


def answer_app() -> App:
    """Answers every request with a short whole response."""

    async def app(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        await receive()
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


async def one_answer(stream: trio.SocketStream) -> None:
    await stream.send_all(REQUEST)
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        data += await stream.receive_some()
    assert data.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hypercorn"])
async def test_a_connection_its_client_closes_is_released_at_once(fast: bool) -> None:
    """A keep-alive connection closed by its client after a response: with the fast
    paths its task ends at once (the connection bound counts it out); hypercorn's kept
    it until its keep-alive timer fired (30 s here)."""
    with trio.fail_after(LIMIT):
        async with hypercorn_on(answer_app(), fast) as served:
            async with await trio.open_tcp_stream(*served.address) as stream:
                await one_answer(stream)
                await trio.testing.wait_all_tasks_blocked()  # idle: its timer runs
                assert served.cap.open == 1
            await trio.testing.wait_all_tasks_blocked()
            assert served.cap.open == (0 if fast else 1)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hypercorn"])
async def test_an_idle_connection_is_closed_at_its_keep_alive_deadline_not_during_a_request(
    fast: bool,
) -> None:
    """The deadline runs from the connection's start and from each response, not while
    a request is in progress: a connection that sends no head is closed after it; one
    whose response takes 3 deadlines gets it whole, then is closed after one more."""
    release = trio.Event()

    async def slow(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await release.wait()
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    with trio.fail_after(LIMIT):
        async with hypercorn_on(slow, fast, keep_alive=0.2) as served:
            start = trio.current_time()  # (before the server can start its timer)
            async with await trio.open_tcp_stream(*served.address) as silent:
                assert await silent.receive_some() == b""
                assert trio.current_time() - start >= 0.2
            async with await trio.open_tcp_stream(*served.address) as stream:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(one_answer, stream)
                    await trio.sleep(0.6)  # the request outlasts 3 deadlines
                    released = trio.current_time()  # (before the response is written)
                    release.set()
                assert await stream.receive_some() == b""
                assert trio.current_time() - released >= 0.2


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hypercorn"])
async def test_a_stopping_server_closes_an_idle_connection_at_once(fast: bool) -> None:
    """hypercorn's shutdown closes an idle keep-alive connection at once, not at its
    keep-alive deadline (30 s here)."""
    with trio.fail_after(LIMIT):
        async with (
            hypercorn_on(answer_app(), fast) as served,
            await trio.open_tcp_stream(*served.address) as stream,
        ):
            await one_answer(stream)
            await trio.testing.wait_all_tasks_blocked()  # idle: its timer runs
            served.stop.set()
            with trio.fail_after(2):
                assert await stream.receive_some() == b""


def shapes_app() -> App:
    """Responses of several shapes, each body in several parts (empty ones, a
    bytearray, a memoryview among them)."""
    parts: list[Any] = [b"a", b"", bytearray(b"bc"), memoryview(b"def"), b"g"]

    async def app(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        await receive()
        path = scope["path"]
        status, headers = 200, [(b"x-shape", path.encode())]
        if path == "/length":
            headers.append((b"content-length", b"7"))
        elif path == "/nothing":
            status = 204
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < 4})

    return app


async def raw_answer(address: tuple[str, int], request: bytes) -> bytes:
    """All the server sends for `request` until it closes, its date header cut out."""
    async with await trio.open_tcp_stream(*address) as stream:
        await stream.send_all(request)
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"date:")]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@pytest.mark.parametrize(
    "request_",
    [
        b"GET /chunked HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        b"HEAD /chunked HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        b"GET /length HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        b"GET /nothing HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        b"GET /chunked HTTP/1.0\r\n\r\n",
    ],
    ids=["chunked", "head", "content-length", "204", "http-1.0"],
)
async def test_the_fast_paths_send_the_bytes_hypercorn_sends(request_: bytes) -> None:
    """Every shape of response, byte for byte the same with the fast paths as without
    (the chunk short cut frames only what h11 would frame as a chunk)."""
    answers = []
    with trio.fail_after(LIMIT):
        for fast in (True, False):
            async with hypercorn_on(shapes_app(), fast) as served:
                answers.append(await raw_answer(served.address, request_))
    assert answers[0] == answers[1]
    if request_.startswith(b"GET /chunked HTTP/1.1"):
        assert answers[0].endswith(b"\r\n\r\n1\r\na\r\n2\r\nbc\r\n3\r\ndef\r\n1\r\ng\r\n0\r\n\r\n")


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hypercorn"])
async def test_a_chunk_goes_past_hypercorns_stream_and_h11(
    fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the fast paths, a non-empty body part that is not the last reaches the
    socket without `HTTPStream.app_send` (nor h11): only the start, the empty part and
    the last part pass it."""
    from hypercorn.protocol.http_stream import HTTPStream

    seen: list[str] = []
    app_send = HTTPStream.app_send

    async def counted(self: HTTPStream, message: Any) -> None:
        if message is not None:
            seen.append(message["type"])
        await app_send(self, message)

    monkeypatch.setattr(HTTPStream, "app_send", counted)
    request = b"GET /chunked HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    with trio.fail_after(LIMIT):
        async with hypercorn_on(shapes_app(), fast) as served:
            answer = await raw_answer(served.address, request)
    assert answer.endswith(b"\r\n\r\n1\r\na\r\n2\r\nbc\r\n3\r\ndef\r\n1\r\ng\r\n0\r\n\r\n")
    assert len(seen) == (3 if fast else 6)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "hypercorn"])
async def test_an_answer_before_the_body_is_read_keeps_the_connection(fast: bool) -> None:
    """An app that answers without reading the request body (as the gateway's 401
    does), the body sent right after the head (as httpx does): the connection stays
    open for the next request, 30 times over. hypercorn keeps it only if its reader has
    taken in the whole request when the response ends, which its own path's task
    switches nearly always allowed; fast writes alone did not (this failed at once
    without `request_read`)."""

    async def unread(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": b"no"})

    head, body = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 14\r\n\r\n", b'{"prompt":"x"}'
    with trio.fail_after(LIMIT):
        async with (
            hypercorn_on(unread, fast) as served,
            await trio.open_tcp_stream(*served.address) as stream,
        ):
            for _ in range(30):
                await stream.send_all(head)  # as httpx sends them: two writes
                await stream.send_all(body)
                data = b""
                while not data.endswith(b"\r\n\r\nno"):
                    chunk = await stream.receive_some()
                    assert chunk, "the server closed the connection"
                    data += chunk
                assert data.startswith(b"HTTP/1.1 401 ")
                assert b"connection: close" not in data.lower()


async def test_a_write_cancelled_after_part_of_it_went_out_is_finished_whole() -> None:
    """A write that the socket takes only in part, from a task already cancelled (the
    gateway's stop or disconnect landing while the response task was being woken): its
    rest still goes out, so the app's next write (the gateway's last SSE event) starts
    on a chunk boundary. Its rest used to wait for hypercorn's send lock outside any
    shield: the lock's cancellation check raised, the rest was dropped, and the client
    read half a chunk followed by the next one (a corrupt chunked body)."""
    big = b"x" * 8_000_000  # past the kernel's send buffer: os.write takes a part
    raised: list[bool] = []

    async def app(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        with trio.CancelScope() as cancelled:
            cancelled.cancel()
            await send({"type": "http.response.body", "body": big, "more_body": True})
        raised.append(cancelled.cancelled_caught)
        await send({"type": "http.response.body", "body": b"last", "more_body": False})

    with trio.fail_after(LIMIT):
        async with (
            hypercorn_on(app, True) as served,
            await connect_slow_reader(served.address) as stream,
        ):
            await stream.send_all(REQUEST)
            await trio.testing.wait_all_tasks_blocked()  # the server's socket is full
            head, body = await read_response(stream)
    assert head.startswith(b"HTTP/1.1 200 ")
    assert body == b"first" + big + b"last"
    assert raised == [False]  # the write finished: nothing of it was lost


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl for a certificate")
async def test_a_tls_connection_keeps_hypercorns_write_path(tmp_path: Path) -> None:
    """With a TLS config the fast paths leave the writes to hypercorn (the bytes must go
    through the TLS stream, never to the socket): every write is hypercorn's, and the
    response arrives whole."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    command = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    command += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
    await trio.run_process(command, capture_stdout=True, capture_stderr=True)
    chunks = [b"data: %d\n\n" % i for i in range(50)]
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.certfile, config.keyfile = str(cert), str(key)
    install_hypercorn_cap(config, ConnectionCap(0))
    install_hypercorn_fast_paths(config)
    direct: list[int] = []
    server_class: Any = hypercorn_run.TCPServer
    send = server_class.protocol_send

    async def spied(self: Any, event: Any) -> None:
        direct.append(self._fd)
        await send(self, event)

    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    data = b""
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            app = sse_app(chunks, {})

            async def with_lifespan(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
                if scope["type"] == "lifespan":
                    while (await receive())["type"] != "lifespan.shutdown":
                        await send({"type": "lifespan.startup.complete"})
                    await send({"type": "lifespan.shutdown.complete"})
                else:
                    await app(scope, receive, send)

            server_class.protocol_send = spied
            try:
                binds = await nursery.start(partial(serve, with_lifespan, config))  # type: ignore[arg-type]
                host, port = binds[0].removeprefix("https://").rsplit(":", 1)
                stream = await trio.open_ssl_over_tcp_stream(host, int(port), ssl_context=client)
                closing = REQUEST.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
                await stream.send_all(closing)
                with contextlib.suppress(trio.BrokenResourceError):
                    while chunk := await stream.receive_some():
                        data += chunk
            finally:
                server_class.protocol_send = send
            nursery.cancel_scope.cancel()
    assert data.startswith(b"HTTP/1.1 200 ")
    assert data.endswith(b"\r\n0\r\n\r\n")
    assert all(b"\r\n" + chunk + b"\r\n" in data for chunk in chunks)
    assert direct and set(direct) == {-1}  # never the socket's own descriptor


async def test_a_body_sent_after_its_response_ended_never_reaches_the_next_one() -> None:
    """An app that sends more body after its response's last message (an embedder's
    bug; hypercorn drops it) while the connection already streams the next pipelined
    response: the stray part must not be framed into that response (the chunk short cut
    looks at the connection's current response, so it must know its own ended). Fast
    paths only: hypercorn's own path reads no next request before the app returns."""
    second_started = trio.Event()
    stray_sent = trio.Event()

    async def app(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        await receive()
        start = {"type": "http.response.start", "status": 200, "headers": []}
        if scope["path"] == "/first":
            await send(start)
            await send({"type": "http.response.body", "body": b"one", "more_body": False})
            await second_started.wait()
            try:  # (hypercorn refuses a message after the response's end)
                await send({"type": "http.response.body", "body": b"STRAY", "more_body": True})
            finally:
                stray_sent.set()
        else:
            await send(start)
            await send({"type": "http.response.body", "body": b"two", "more_body": True})
            second_started.set()
            await stray_sent.wait()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    requests = (
        b"GET /first HTTP/1.1\r\nhost: x\r\n\r\n"
        b"GET /second HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    with trio.fail_after(LIMIT):
        async with hypercorn_on(app, fast=True) as served:
            data = await raw_answer(served.address, requests)
    assert b"STRAY" not in data
    assert data.count(b"HTTP/1.1 200 ") == 2

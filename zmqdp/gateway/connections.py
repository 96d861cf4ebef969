"""The gateway's bounds on HTTP connections, on hypercorn and on uvicorn: how many are
open, how long a request head may take, and how large it may be; and hypercorn's
direct write path.

Why: every HTTP connection takes a descriptor of the process's table, the same table
libzmq needs when a rank (re)connects to an ipc group URL, and libzmq 4.3.5 aborts the
process when that accept finds the table full (`zmqdp.fdlimit`). Neither server bounds
its connections (uvicorn's `limit_concurrency` answers 503 only once a request head is
complete, so idle or slowloris connections are never counted), and a connection that
never completes a request never reaches the API key check. So:

* `ConnectionCap` admits at most `limit` connections; past it a new connection is
  answered ``503 too_many_connections`` at once and closed. By default the limit is
  what the soft open-files limit leaves once the descriptors in use when the server
  starts (the engine group's sockets among them) and `headroom` are set aside: room for
  every rank to reconnect while its old connections close, and for the refused
  connections' own brief descriptors.
* a connection must complete a request head within `head_timeout` of its start or of
  its last response, else it is closed (hypercorn: its `keep_alive_timeout`, which
  already runs until a request head is complete; uvicorn has no such deadline at all:
  `uvicorn_protocol` adds one).
* a request head is at most `MAX_HEAD` (16 KiB) while it is incomplete: h11 (hypercorn's
  parser, and uvicorn's pure-Python one) refuses more with a 431 (uvicorn's bare 400 for
  it becomes the same JSON 431 here). uvicorn's fast parser, httptools (llhttp, the
  default once installed), has no bound at all: it would hold an endless header, so
  `uvicorn_protocol` counts each head's bytes itself, answers 431 past `MAX_HEAD`, and
  closes a connection that pipelines more than `MAX_PIPELINED` requests behind the one
  being answered (httptools turns a whole read into request objects where h11 keeps the
  raw bytes). It also tells every request of a lost connection that it is lost, where
  uvicorn's httptools protocol tells only the one parsed last.

On hypercorn the same replaced connection class also has cheaper paths
(`install_hypercorn_fast_paths`, which `zmqdp serve` uses), with hypercorn's behaviour:
a response's bytes go out with one non-blocking `os.write` while the socket takes them
(hypercorn's own path, a `trio.Lock` and a shielded `send_all` per write, costs two task
steps each time); a body part that is not the last is framed as its chunk directly
(`_ChunkedBodies`) instead of passing hypercorn's stream, protocol and h11; and the
keep-alive timer (the head deadline above) is one task per connection whose deadline
moves, not a task started after every response. Together they take an SSE write from
~130 to ~60 µs of CPU (benchmarks/bench_http_writes.py); the rest is the syscall, the
task's wake, and hypercorn's per-request work.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..fdlimit import current_limit, open_fds

__all__ = [
    "MAX_HEAD",
    "UVICORN_HTTP",
    "ConnectionCap",
    "headroom",
    "install_hypercorn_cap",
    "install_hypercorn_fast_paths",
    "uvicorn_http_class",
    "uvicorn_http_name",
    "uvicorn_protocol",
]

log = logging.getLogger("zmqdp.gateway")

REPORT_EVERY = 10.0
"""Seconds between two warnings about refused connections."""


def headroom(engines: int) -> int:
    """Descriptors kept free besides those in use at start: a rank holds 3 to 4
    connections to the client (about 14 descriptors for an embedded mock rank, both
    ends and its own context), and a restarted rank opens its new ones before the old
    ones are seen closed; 64 more for the refused connections, logs and the like."""
    return 64 + 16 * engines


class ConnectionCap:
    """At most `limit` HTTP connections open at once (None: settle it from the
    open-files limit when the server starts: `settle`; 0: no bound)."""

    def __init__(self, limit: int | None, engines: int = 1) -> None:
        self.limit = limit
        self.engines = engines
        """Ranks to keep room for (`headroom`); the server sets it once the group is up."""
        self.open = 0
        self.refused = 0
        self._settled = False
        self._last_report = -REPORT_EVERY

    def settle(self, engines: int | None = None) -> int:
        """Fix the limit, if it was not given, and log it: called once the server
        listens (the engine group of `engines` ranks is connected by then, so its
        descriptors are counted), or at the first connection if that comes first."""
        if self._settled:
            return self.limit or 0
        self._settled = True
        if engines is not None:
            self.engines = engines
        soft, in_use = current_limit().soft, open_fds()
        if soft is None or in_use is None:  # nothing to fit under, or no way to count
            safe = None
            if self.limit is None:
                self.limit = 0
        else:
            safe = max(1, soft - in_use - headroom(self.engines))
            if self.limit is None:
                self.limit = safe
        if not self.limit:
            log.info("HTTP connections: no bound")
            return 0
        log.info(
            "HTTP connections: at most %d (open-files limit %s, %s in use, %d kept for the "
            "engine group's reconnects; --max-connections sets it)",
            self.limit,
            soft,
            in_use,
            headroom(self.engines),
        )
        if safe is not None and self.limit > safe:
            log.warning(
                "--max-connections %d is more than the open-files limit leaves (%d): HTTP "
                "clients can fill the descriptor table, and libzmq then aborts the process",
                self.limit,
                safe,
            )
        elif self.limit < 64:
            log.warning(
                "the open-files limit (%s) leaves room for only %d HTTP connections; raise "
                "it (ulimit -n, systemd LimitNOFILE=)",
                soft,
                self.limit,
            )
        return self.limit

    def admit(self) -> bool:
        """Count a new connection in, or refuse it (False: answer `refusal()`, close)."""
        limit = self.limit if self._settled else self.settle()
        if limit and self.open >= limit:
            self.refused += 1
            now = time.monotonic()
            if now - self._last_report >= REPORT_EVERY:
                log.warning(
                    "refusing HTTP connections: %d open, the limit (%d refused so far)",
                    self.open,
                    self.refused,
                )
                self._last_report = now
            return False
        self.open += 1
        return True

    def release(self) -> None:
        """A connection taken with `admit` closed: its place is free again."""
        self.open -= 1

    def refusal(self) -> bytes:
        """The whole answer to a refused connection: a 503 in the OpenAI error shape."""
        return _answer(
            "503 Service Unavailable",
            "too_many_connections",
            "service_unavailable",
            f"the gateway has {self.open} HTTP connections open, its limit: close idle "
            "connections or retry later",
            "retry-after: 1\r\n",
        )


# -- hypercorn (trio) ---------------------------------------------------------------------


_CAP_ATTRIBUTE = "zmqdp_connection_cap"
_FAST_ATTRIBUTE = "zmqdp_fast_paths"


def install_hypercorn_cap(config: Any, cap: ConnectionCap) -> None:
    """Bound the connections of hypercorn's trio worker run with `config`.

    hypercorn has no such option and builds its listeners itself, so its trio worker's
    connection class is replaced, once per process, by a subclass that looks for a cap
    on the connection's config: a server started with another config is unchanged."""
    setattr(config, _CAP_ATTRIBUTE, cap)
    _install_tcp_server()


def install_hypercorn_fast_paths(config: Any) -> None:
    """Give the connections of hypercorn's trio worker run with `config` cheaper paths,
    the same behaviour: a response write is one non-blocking socket write when the
    socket takes it (`ZmqdpTCPServer.protocol_send`), a body part that is not the last
    goes there framed as its chunk (`_ChunkedBodies`), and the keep-alive timer is one
    task per connection whose deadline moves (`_KeepAliveTimer`).

    Why: hypercorn writes every chunk under a `trio.Lock` and a shielded `send_all`,
    each a checkpoint that reschedules the writing task: two task steps per write
    beyond the wake that produced it, about 45 of the 120-150 µs an SSE write cost at
    c=256. And it starts a task (and takes a lock) for its keep-alive timer after every
    response, and cancels it (the lock again) at every request head. Same
    once-per-process subclass as `install_hypercorn_cap`; a server started with another
    config keeps hypercorn's paths."""
    setattr(config, _FAST_ATTRIBUTE, True)
    _install_tcp_server()


class _KeepAliveTimer:
    """hypercorn's keep-alive timer (`TCPServer.idle_task` running `_idle_timeout`)
    as one task for the connection's life. hypercorn's closes the connection once it
    has been idle (no request in progress) for `keep_alive_timeout` s, from its start
    or from its last response, or at once when the server stops while it is idle;
    `restart` (idle from now) and `stop` (a request head came) move this one's
    deadline instead of starting and cancelling a task. `end`: the connection is over
    (its reader has returned), the task returns; hypercorn's kept the connection's
    task alive until the timer fired, holding its descriptor that long."""

    def __init__(self, server: Any) -> None:
        self._server = server
        self._deadline = math.inf
        """While idle: when the connection is closed."""
        self._idle = trio.Event()
        """Set while the connection is idle (`restart`), a new one at `stop`."""
        self._scope: trio.CancelScope | None = None
        self._started = False
        self._ended = False

    async def restart(self, task_group: Any, action: Any) -> None:
        self._deadline = trio.current_time() + self._server.config.keep_alive_timeout
        if self._scope is not None:
            self._scope.deadline = self._deadline
        self._idle.set()
        if not self._started:
            self._started = True
            task_group.spawn(self._run)

    async def stop(self) -> None:
        self._deadline = math.inf
        if self._scope is not None:
            self._scope.deadline = math.inf
        if self._idle.is_set():
            self._idle = trio.Event()

    def end(self) -> None:
        self._ended = True
        if self._scope is not None:
            self._scope.cancel()
        self._idle.set()

    async def _run(self) -> None:
        terminated = self._server.context.terminated
        while True:
            await self._idle.wait()
            if self._ended:
                return
            with trio.CancelScope(deadline=self._deadline) as self._scope:
                await terminated.wait()
            self._scope = None
            if self._ended:
                return
            if self._idle.is_set():  # still idle: its time is up, or the server stops
                break
            # else a request came in the meantime: wait until the connection is idle again
        with trio.CancelScope(shield=True):
            await self._server._initiate_server_close()


def _install_tcp_server() -> None:
    import hypercorn.trio.run as hypercorn_run
    from hypercorn.events import Closed, Event, RawData
    from hypercorn.trio.tcp_server import TCPServer

    current = getattr(hypercorn_run, "TCPServer", None)
    if getattr(current, "zmqdp_capped", False):
        return
    if current is not TCPServer:  # pragma: no cover - a hypercorn we do not know
        raise RuntimeError("hypercorn.trio.run.TCPServer is not hypercorn's: cannot replace it")

    framer = _chunk_framer(RawData)

    class ZmqdpTCPServer(TCPServer):
        zmqdp_capped = True
        _fd = -1
        """The socket written directly (`protocol_send`), or -1: hypercorn's path."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if getattr(self.config, _FAST_ATTRIBUTE, False):
                self.idle_task = _KeepAliveTimer(self)  # type: ignore[assignment] # same calls

        async def _read_data(self) -> None:
            try:
                await super()._read_data()
            finally:
                if isinstance(self.idle_task, _KeepAliveTimer):
                    self.idle_task.end()

        async def run(self) -> None:
            if (
                getattr(self.config, _FAST_ATTRIBUTE, False)
                and os.name == "posix"
                and isinstance(self.stream, trio.SocketStream)  # not TLS
                and isinstance(getattr(self, "send_lock", None), trio.Lock)  # as hypercorn 0.18
            ):
                self._fd = self.stream.socket.fileno()
                if framer is not None:
                    self.app = _ChunkedBodies(self.app, self, framer)
            cap: ConnectionCap | None = getattr(self.config, _CAP_ATTRIBUTE, None)
            if cap is None:
                await super().run()
                return
            if not cap.admit():
                await _refuse_trio(self.stream, cap.refusal())
                return
            try:
                await super().run()
            finally:
                cap.release()

        async def protocol_send(self, event: Event) -> None:
            """hypercorn's, but the bytes go out at once, with no checkpoint, while no
            other write waits for the socket (`send_lock` free): what the socket takes
            now is written by a plain `os.write`, and only a rest it cannot take yet
            goes hypercorn's way, under the lock, shielded (and its wait for the lock
            too: a cancelled task's rest is not dropped). Order holds (a later write
            finds the lock taken and queues behind that rest), and a write never stops
            halfway. A closed or shut-down socket goes hypercorn's
            way too, which reports it."""
            fd = self._fd
            if fd >= 0 and type(event) is RawData and not self.send_lock.locked():
                sock = self.stream.socket
                if sock.fileno() == fd and not sock.did_shutdown_SHUT_WR:
                    data = event.data
                    try:
                        sent = os.write(fd, data)
                    except BlockingIOError:
                        sent = 0
                    except OSError:  # reset, broken pipe: what hypercorn's send_all reports
                        await self.protocol.handle(Closed())
                        return
                    if sent == len(data):
                        return
                    if sent:
                        # part of it is out: the rest must follow, cancelled or not (the
                        # lock's cancellation check would drop it: half a chunk, then
                        # the next write's bytes)
                        event = RawData(data=bytes(memoryview(data)[sent:]))
                        with trio.CancelScope(shield=True):
                            await super().protocol_send(event)
                        return
            await super().protocol_send(event)

    setattr(hypercorn_run, "TCPServer", ZmqdpTCPServer)  # noqa: B010 - not exported


class _Framer:
    """What `_ChunkedBodies` reads of hypercorn's HTTP/1.1 state (`_chunk_framer`)."""

    def __init__(
        self,
        chunk_of: Callable[[Any, bytes], Any],
        request_read: Callable[[Any], Awaitable[None]],
    ) -> None:
        self.chunk_of = chunk_of
        self.request_read = request_read


def _chunk_framer(raw_data: Any) -> _Framer | None:
    """`chunk_of(server, body)`: the `RawData` that carries `body` as one chunk of the
    response in progress on `server`'s HTTP/1.1 connection when hypercorn would frame it
    exactly so (an h11 connection sending a chunked body, its ASGI stream in its
    response), else None. `request_read(server)`: see `_ChunkedBodies`. None if this
    hypercorn or h11 is not one it knows (0.18, 0.16)."""
    try:
        import h11
        from h11._writers import ChunkedWriter
        from hypercorn.protocol.h11 import H11Protocol
        from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
    except ImportError:  # pragma: no cover - another hypercorn or h11
        return None
    sending_body, responding = h11.SEND_BODY, ASGIHTTPState.RESPONSE

    def chunk_of(server: Any, body: bytes) -> Any:
        protocol = server.protocol.protocol
        if type(protocol) is not H11Protocol:  # HTTP/2
            return None
        stream, connection = protocol.stream, protocol.connection
        if (
            type(stream) is HTTPStream
            and stream.state is responding
            and type(connection) is h11.Connection
            and connection.our_state is sending_body
            and type(connection._writer) is ChunkedWriter
        ):
            return raw_data(data=b"%x\r\n%b\r\n" % (len(body), body))
        return None

    async def request_read(server: Any) -> None:
        protocol = server.protocol.protocol
        if type(protocol) is H11Protocol:
            for _ in range(8):
                if protocol.connection.their_state is not sending_body:
                    return
                await trio.lowlevel.cancel_shielded_checkpoint()

    return _Framer(chunk_of, request_read)


class _ChunkedBodies:
    """hypercorn's app wrapper for one connection, with a short cut for a response body
    part that is not the last (`more_body`): where hypercorn would pass it through its
    stream (`HTTPStream.app_send`), its protocol (`H11Protocol.stream_send`), h11
    (`Connection.send`, which only checks the state and frames the chunk) and two
    events to `protocol_send`, it goes to `protocol_send` framed, when `chunk_of` says
    hypercorn would frame it exactly so: h11's state is the same after it (a chunk
    changes nothing in it). About 10 µs less per SSE write.

    And before a response's last message, `request_read`: hypercorn keeps a connection
    open for the next request only if it has read the whole of this one when the
    response ends (else it closes it, with no ``connection: close`` said). An app that
    answers before reading the body (the gateway's 401) used to finish its response
    only after about eight task switches, in which hypercorn's reader took in the body
    that followed the head (httpx sends them in two writes); with writes that do not
    switch it finished first, and a keep-alive client's next request met a closed
    connection. So while the request is not read to its end, the last message waits
    for up to eight switches (none once it is read, as for every completion). A body
    that comes later than that closes the connection, as on hypercorn's own path."""

    def __init__(self, app: Any, server: Any, framer: _Framer) -> None:
        self.app = app
        self.server = server
        self.framer = framer

    async def __call__(
        self, scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send, sync_spawn, call_soon)
            return
        server, chunk_of, request_read = self.server, self.framer.chunk_of, self.framer.request_read
        ended = False  # this request's last body message was sent

        async def send_chunk(message: Any) -> None:
            nonlocal ended
            if message["type"] == "http.response.body" and not ended:
                if message.get("more_body"):
                    body = message.get("body")
                    # (never after this response's end: the connection's current
                    # response may then be the next pipelined request's)
                    if body and (event := chunk_of(server, body)) is not None:
                        await server.protocol_send(event)
                        return
                else:
                    ended = True
                    await request_read(server)
            await send(message)

        await self.app(scope, receive, send_chunk, sync_spawn, call_soon)


async def _refuse_trio(stream: Any, answer: bytes) -> None:
    """Answer and close a refused connection (an answer this small fits the socket's
    buffer: the send does not wait for the peer)."""
    with (
        trio.move_on_after(1.0),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
    ):
        await stream.send_all(answer)
    await trio.aclose_forcefully(stream)


# -- uvicorn (asyncio) --------------------------------------------------------------------

UVICORN_HTTP = ("auto", "httptools", "h11")
"""`uvicorn_protocol`'s choices of uvicorn's HTTP/1.1 implementation: auto is httptools
(llhttp, in C) when it is installed (the `gateway` extra installs it), else h11 (pure
Python, several times the CPU per write)."""

MAX_HEAD = 16 * 1024
"""Bytes of a request head (request line and headers) at most, past which it is answered
431 and the connection closed: h11's bound on an incomplete event (uvicorn's h11 and
hypercorn's default). llhttp has none: httptools would buffer an endless header."""

LINGER = 1.0
"""Seconds a connection answered 431 stays open, its input dropped (`_close_overflowing`)."""

MAX_PIPELINED = 16
"""Requests parsed ahead of the one being answered on a connection, at most; past it the
connection is closed. httptools parses a whole read (up to 256 KiB) at once and makes
each request a cycle of about 2 KB (a read of minimal pipelined requests: 15 MB), where
h11 keeps the raw bytes until the answer is done."""


def uvicorn_http_class(http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol class for `http` (`UVICORN_HTTP`); ImportError if httptools is
    asked for and not installed."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    if http not in UVICORN_HTTP:
        raise ValueError(f"http must be one of {', '.join(UVICORN_HTTP)}, not {http!r}")
    if http == "auto":
        http = "h11" if importlib.util.find_spec("httptools") is None else "httptools"
    cls: type[asyncio.Protocol] = import_from_string(HTTP_PROTOCOLS[http])
    return cls


def uvicorn_http_name(cls: type[asyncio.Protocol]) -> str:
    """The implementation ("httptools" or "h11") of a class `uvicorn_protocol` made."""
    return "httptools" if any(c.__name__ == "HttpToolsProtocol" for c in cls.__mro__) else "h11"


def _answer(status: str, code: str, kind: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 answer that closes the connection: an error in the OpenAI shape."""
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


HEAD_TOO_LARGE = _answer(
    "431 Request Header Fields Too Large",
    "request_header_fields_too_large",
    "invalid_request_error",
    f"the request line and headers are more than {MAX_HEAD} bytes",
)


class _Overflow(Exception):
    """Raised in an httptools callback to stop the parser (it answers "callback error")."""


def uvicorn_protocol(
    cap: ConnectionCap, head_timeout: float, http: str = "auto"
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (`uvicorn_http_class(http)`), admitting connections
    through `cap`, closing one that has no request in progress and completes no request
    head within `head_timeout` s of its start or of its last response, and bounding a
    request head to `MAX_HEAD` bytes (431) on httptools as h11 does (h11's own 400 for
    it becomes the same 431)."""
    base: Any = uvicorn_http_class(http)

    class CappedProtocol(base):  # type: ignore[misc]
        _refused = False
        _lingering = False
        _admitted = False
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            if not cap.admit():
                self._refused = True
                transport.write(cap.refusal())
                transport.close()
                return
            self._admitted = True
            super().connection_made(transport)
            self._arm_head_deadline()

        def data_received(self, data: bytes) -> None:
            if not (self._refused or self._lingering):
                super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._admitted:
                self._admitted = False
                cap.release()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            if not self._refused:
                super().pause_writing()

        def resume_writing(self) -> None:
            if not self._refused:
                super().resume_writing()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_deadline()

        def _arm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle  # a new request head makes a new cycle
            self._head_timer = self.loop.call_later(head_timeout, self._head_expired)

        def _head_expired(self) -> None:
            self._head_timer = None
            cycle = self.cycle
            idle = cycle is None or cycle.response_complete
            if cycle is self._head_cycle and idle and not self.transport.is_closing():
                self.transport.close()

        def _close_overflowing(self) -> None:
            """Answer 431 and close, or only close if a response is being written (an
            answer now would land inside it). The answer is followed by a FIN, and what
            the client still sends is read and dropped for `LINGER` s: a close with
            unread bytes would reset the connection, and the client might never see
            the 431."""
            if self.transport.is_closing() or self._lingering:
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                self.transport.close()
                return
            self._lingering = True
            self.transport.write(HEAD_TOO_LARGE)
            self.transport.write_eof()
            self.flow.resume_reading()
            self.loop.call_later(LINGER, self.transport.close)

    if uvicorn_http_name(base) == "h11":

        class H11Protocol(CappedProtocol):
            def send_400_response(self, msg: str) -> None:
                # h11 refuses a head past its incomplete-event bound with a 400 that
                # does not say why: the head it holds tells
                if len(self.conn.trailing_data[0]) > MAX_HEAD:
                    self._close_overflowing()
                else:
                    super().send_400_response(msg)

        return H11Protocol

    class HttpToolsProtocol(CappedProtocol):
        """Counts the bytes of each request head, from the callbacks (the request
        target and every complete header, exactly) and from the reads that fall wholly
        inside it (a header still incomplete, which httptools holds unseen), and stops
        the parser past `MAX_HEAD`; bounds pipelining to `MAX_PIPELINED`; and tells
        every request of the connection when it is lost (uvicorn's tells only the last
        one parsed: a request answered while others were pipelined behind it would
        never see `http.disconnect`, and a held one would stay on its rank for good)."""

        _cycles: tuple[Any, ...] = ()
        """The connection's requests not yet answered, in order."""
        _head_open = False
        _heads = 0
        _head_reads = 0
        _head_seen = 0
        _overflow = False

        def data_received(self, data: bytes) -> None:
            was_open, heads = self._head_open, self._heads
            super().data_received(data)
            if self._head_open and was_open and heads == self._heads:
                self._head_reads += len(data)  # all of it is the open head's
                if self._head_reads > MAX_HEAD:
                    self._close_overflowing()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_open = True
            self._heads += 1
            self._head_reads = self._head_seen = 0

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._count(len(url))

        def on_header(self, name: bytes, value: bytes) -> None:
            super().on_header(name, value)
            self._count(len(name) + len(value) + 4)

        def _count(self, size: int) -> None:
            self._head_seen += size
            if self._head_seen > MAX_HEAD:
                self._overflow = True
                raise _Overflow

        def on_headers_complete(self) -> None:
            self._head_open = False
            cycle = self.cycle
            busy = cycle is not None and not cycle.response_complete
            if busy and len(self.pipeline) >= MAX_PIPELINED:
                self._overflow = True
                raise _Overflow
            super().on_headers_complete()
            live = tuple(c for c in self._cycles if not c.response_complete)
            if self.cycle is not None and self.cycle not in live:  # None: an upgrade
                live += (self.cycle,)
            self._cycles = live

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            for cycle in self._cycles:
                if not cycle.response_complete and not cycle.disconnected:
                    cycle.disconnected = True
                    cycle.message_event.set()
            self._cycles = ()

        def send_400_response(self, msg: str) -> None:
            if self._overflow:  # a callback stopped the parser
                self._close_overflowing()
            else:
                super().send_400_response(msg)

    return HttpToolsProtocol

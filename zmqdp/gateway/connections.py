"""The gateway's bounds on HTTP connections, on hypercorn and on uvicorn: how many are
open, how long a request head may take, and how large it may be.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import time
from typing import Any

import trio

from ..fdlimit import current_limit, open_fds

__all__ = [
    "MAX_HEAD",
    "UVICORN_HTTP",
    "ConnectionCap",
    "headroom",
    "install_hypercorn_cap",
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


def install_hypercorn_cap(config: Any, cap: ConnectionCap) -> None:
    """Bound the connections of hypercorn's trio worker run with `config`.

    hypercorn has no such option and builds its listeners itself, so its trio worker's
    connection class is replaced, once per process, by a subclass that looks for a cap
    on the connection's config: a server started with another config is unchanged."""
    import hypercorn.trio.run as hypercorn_run
    from hypercorn.trio.tcp_server import TCPServer

    setattr(config, _CAP_ATTRIBUTE, cap)
    current = getattr(hypercorn_run, "TCPServer", None)
    if getattr(current, "zmqdp_capped", False):
        return
    if current is not TCPServer:  # pragma: no cover - a hypercorn we do not know
        raise RuntimeError("hypercorn.trio.run.TCPServer is not hypercorn's: cannot bound it")

    class CappedTCPServer(TCPServer):
        zmqdp_capped = True

        async def run(self) -> None:
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

    setattr(hypercorn_run, "TCPServer", CappedTCPServer)  # noqa: B010 - not exported


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

"""`POST /v1/completions` and `POST /v1/chat/completions`: one HTTP request, one engine
request.

Theory of operation
-------------------
The request path, in order:

1. **Read the body** (up to `max_body_size`, else 413). A client that goes away
   meanwhile ends the exchange here; nothing was submitted.
2. **Validate**: the JSON (`openai.parse_completion`, or `openai.parse_chat`; a body of
   more than `openai.LARGE_BODY` bytes in a worker thread, so that the event loop keeps
   serving the other requests while it is parsed), the optional `X-Data-Parallel-Rank`
   header (an int >= 0 of at most `MAX_RANK_DIGITS` digits,
   else 400), a non-streaming request's `max_tokens` against `max_collected_tokens`
   (400 naming `max_tokens` past it: stream it instead), then the frontend's `prepare`
   (a chat's prompt rendered first by its `chat_prompt`; for a `threaded` frontend, in
   a worker thread if the body is over `INLINE_PREPARE` bytes, else inline: a short
   prompt tokenizes faster than a thread's round trip; its `ValueError` is a 400).
   Still nothing submitted.
3. **Run the response in the request's own task, watched** (`backend.watched`): inside
   a stop block (a cancel scope; on asyncio a `Stopper`) registered with the app
   (`LiveResponses`), with one watcher task beside it. From here on the `receive`
   callable says nothing but `http.disconnect`; the watcher waits for it and stops the
   block; `GatewayApp.stop_now()` stops every registered block. One task per request
   besides its own, and nothing waiting for the stop per request.
4. Inside the response:

   a. **Submit**: `group.submit` (never blocks), or with a queue time `wait_submit`
      under that timeout. `Overloaded` or no room in time is a 429 with `Retry-After`;
      draining, closed or no rank up a 503; a bad pinned rank a 400 (503 if it exists
      but is down). A cancellation while waiting for room submits nothing.
   b. **Enter the stream's `async with` at once**, with no await in between, so the
      request is never live without the block that aborts it.
   c. **Read batches** with `receive_batch()`: everything buffered at once, so a burst
      of outputs is one HTTP write, with one decode (`BatchDecode.batch`), one SSE
      encode and one count: the work is per write, not per token. Non-streaming: collect
      until the terminal output, then one JSON response; an answer that grows past
      `max_collected_tokens` tokens or `max_collected_chars` characters is aborted on
      its rank and answered 502 (`response_too_large`): the engine sent more than was
      asked for, or more text than the gateway holds for one client. Streaming: the
      status line and SSE headers go out with the first batch (an error before the first
      output still gets its own status: 504, 502...), then one write per batch, the last
      with `finish_reason`, the usage chunk if asked for, and `[DONE]`.
   d. A zmqdp error read from the stream becomes an HTTP error (errors.py): its status
      before the first write, an SSE error event after it (then the response ends,
      without `[DONE]`).

Disconnect handling: if the client goes away during 4, the watcher stops the block and
the response is **cancelled inside the stream's `async with`**: leaving it early
aborts the request on its own rank (a synchronous queue operation in the group, so it
cannot be lost to the cancellation), whether the response was streaming or still
collecting a non-streaming answer, or still waiting for room (then nothing was
submitted). Without the watcher the gateway would never know: hypercorn and uvicorn
accept and drop writes to a closed connection, and a non-streaming request writes
nothing until the end, so the engine would generate the whole answer for nobody.

If the response ends first, the watcher is cancelled and waited for; a disconnect after
the last write is not counted. Once the last write has begun (`Exchange.ended`) neither
the watcher nor the stop ever stops it: the servers complete a response inside that `send()`
(hypercorn closes a `Connection: close` connection or restarts its keep-alive timer
there), and cancelling it there would leave the connection open forever
(`http.wait_for_disconnect`).

Stopping (`GatewayApp.stop_now()`, the second SIGTERM of `serve`): it stops the block of
every live response (`LiveResponses.stop_all`): each is cancelled inside its stream's
`async with` (the request is aborted on its rank) and the client gets a 503
`shutting_down`, or an SSE error event if its stream had begun. A request that arrives
after the stop gets that 503 at once. On asyncio, a server that cancels the request's
task (uvicorn past its `timeout_graceful_shutdown`, or the end of `asyncio.run`) gets
the same answer, sent if the connection can take it, and the task then ends quietly: a
`CancelledError` escaping the app would be logged by uvicorn as a traceback and answered
with a bare 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import itertools
import logging
import os
import secrets
import time
from typing import Any

from .._core.errors import ZmqdpError
from ..values import Request
from .backends import Backend, EventLike, GroupLike, Stopper, StreamLike
from .errors import HTTPError, http_error
from .frontend import CompletionRequest, Frontend, Prepared, batch_decoder
from .http import Exchange, Receive, Scope, Send, header, read_body, wait_for_disconnect
from .metrics import HTTPCounters
from .openai import (
    DONE,
    LARGE_BODY,
    MAX_MODEL_LENGTH,
    ChatChunkEncoder,
    ChunkEncoder,
    chat_completion,
    chunk,
    completion,
    parse_chat,
    parse_completion,
)

__all__ = [
    "INLINE_PREPARE",
    "MAX_RANK_DIGITS",
    "RANK_HEADER",
    "CompletionSettings",
    "LiveResponses",
    "handle_completion",
]

log = logging.getLogger("zmqdp.gateway")

RANK_HEADER = b"x-data-parallel-rank"
"""Pins the request to one rank (vLLM's and SGLang's header)."""

MAX_RANK_DIGITS = 9
"""The longest `X-Data-Parallel-Rank` taken: no group has a billion ranks, and `int()`
of a longer one costs more (past 4300 digits it raises `ValueError`)."""

MESSAGE_QUOTE = 500
"""Characters of a frontend's error message that an error body quotes at most."""

SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]

INLINE_PREPARE = 512
"""A `threaded` frontend prepares a request of a body up to this many bytes on the event
loop: a worker thread's round trip (its hand-off, wake-ups and the loop's wake after
it) costs more CPU than tokenizing a prompt that short, and holding the loop for it
costs other streams little (the test model's tokenizer: about 10 us for a 20-byte
prompt, at most about 0.5 ms at this size on a loaded 2-core machine). A longer one
goes to a thread (past `openai.LARGE_BODY`, to the heavy lane)."""


class _Ids:
    """Request ids: a random prefix per process and a counter. Unique as `uuid4` is for
    what they are used for (an engine's request key, a log line, `x-request-id`), at a
    fraction of its cost: the prefix (64 random bits) tells this process's ids from
    another gateway's on the same engines, the counter one request from the next. A
    forked child draws its own prefix."""

    def __init__(self) -> None:
        self.reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = secrets.token_hex(8)
        self.count = itertools.count(1)

    def new(self, kind: str) -> str:
        return f"{kind}-{self.prefix}{next(self.count):08x}"


_ids = _Ids()


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionSettings:
    frontend: Frontend
    model: str
    """The `model` of responses to requests that name none (the first served name)."""
    served: tuple[str, ...]
    """Every name the model is served under: a request naming another gets 404."""
    queue_timeout: float
    """Seconds to wait for admission room before a 429 (0: answer 429 at once)."""
    retry_after: int
    """The `Retry-After` of 429 and 503 answers, in seconds."""
    max_body_size: int
    max_collected_tokens: int | None = None
    """The most tokens a non-streaming answer may collect (None: no limit)."""
    max_collected_chars: int | None = None
    """The most characters of text a non-streaming answer may collect (None: no limit)."""
    engines_seen: list[object] = dataclasses.field(default_factory=lambda: [None])
    """[the group whose ranks' info the frontend was told last] (`_learn_engines`)."""


def _rank(scope: Scope) -> int | None:
    value = header(scope, RANK_HEADER)
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    if not text.isdigit() or not text.isascii() or len(text) > MAX_RANK_DIGITS:
        got = repr(text[:40]) + ("" if len(text) <= 40 else f"... ({len(text)} characters)")
        raise HTTPError(
            400,
            "invalid_request_error",
            "invalid_rank",
            "X-Data-Parallel-Rank must be a rank number (an int >= 0 of at most "
            f"{MAX_RANK_DIGITS} digits), got {got}",
        )
    return int(text)


def _check_collected(request: CompletionRequest, settings: CompletionSettings) -> None:
    """400 for a non-streaming request that asks for more tokens than the gateway
    collects for one answer: refused before any engine works on it."""
    limit = settings.max_collected_tokens
    if not request.stream and limit is not None and request.max_tokens > limit:
        raise HTTPError(
            400,
            "invalid_request_error",
            "invalid_request",
            f"'max_tokens' is {request.max_tokens}: a non-streaming request takes at most "
            f"{limit} on this gateway (its answer is held whole until it ends); ask for "
            'fewer, or stream it ("stream": true)',
            param="max_tokens",
        )


def _shutting_down(request_id: str, rank: int | None, retry_after: int) -> HTTPError:
    where = "" if rank is None else f" on rank {rank}"
    return HTTPError(
        503,
        "service_unavailable",
        "shutting_down",
        f"request {request_id!r}: the gateway is shutting down; the request was aborted{where}",
        retry_after=retry_after,
    )


_DISCONNECT = "disconnect"
_STOP = "stop"


class _Live:
    """One response being served: what stops it early (the client going away, or
    `GatewayApp.stop_now()`), and which of them did."""

    __slots__ = ("exchange", "stopper", "why")

    def __init__(self, exchange: Exchange, stopper: Stopper) -> None:
        self.exchange = exchange
        self.stopper = stopper
        self.why: str | None = None

    def stop(self, why: str) -> None:
        """Cancel the response (inside its stream's `async with`), unless it was
        stopped already or its last write has begun (module docstring)."""
        if self.why is None and not self.exchange.ended:
            self.why = why
            self.stopper.stop()


class LiveResponses:
    """The responses being served, for `GatewayApp.stop_now()` to stop at once: a set,
    not a task per request waiting for the stop."""

    __slots__ = ("_live",)

    def __init__(self) -> None:
        self._live: set[_Live] = set()

    def __len__(self) -> int:
        return len(self._live)

    def add(self, live: _Live) -> None:
        self._live.add(live)

    def discard(self, live: _Live) -> None:
        self._live.discard(live)

    def stop_all(self) -> None:
        """Stop every live response (each is then answered 503 `shutting_down`, or a
        last SSE error event)."""
        for live in list(self._live):
            live.stop(_STOP)


def _parse(
    body: bytes, frontend: Any, chat: bool
) -> tuple[CompletionRequest, tuple[dict[str, str], ...] | None]:
    """The request, and a chat's messages (its prompt is rendered later, `_prepare`).
    A frontend's `max_prompt_tokens` bounds a prompt's token ids and a chat's messages
    before they are looked at one by one (openai.py)."""
    fields: frozenset[str] = getattr(frontend, "fields", frozenset())
    limit: int | None = getattr(frontend, "max_prompt_tokens", None)
    if not chat:
        return parse_completion(body, fields, max_prompt_tokens=limit), None
    if getattr(frontend, "chat_prompt", None) is None:
        raise HTTPError(
            404,
            "invalid_request_error",
            "not_found",
            "this server's frontend renders no chat: use /v1/completions",
        )
    return parse_chat(body, fields, max_prompt_tokens=limit)


def _learn_engines(settings: CompletionSettings, group: GroupLike) -> None:
    """Tell a frontend that wants it (`learn_engines`: vLLM's, for the engines'
    ``max_model_len``) the handshake info of the ranks up now, at every request: a rank
    that restarts with another ``--max-model-len`` changes the limit (learnt once per
    group, a shorter one went unseen: its prompts met only the wire's own check)."""
    learn = getattr(settings.frontend, "learn_engines", None)
    engines = getattr(group, "engines", None)
    if learn is not None and engines is not None:
        learn([engine.info for engine in engines if engine.info])
    settings.engines_seen[0] = group


def _prepare(
    frontend: Frontend,
    request: CompletionRequest,
    messages: tuple[dict[str, str], ...] | None,
    request_id: str,
) -> tuple[CompletionRequest, Prepared]:
    """Render a chat's prompt and prepare the engine request: the frontend's work, in a
    worker thread for a frontend that says it is slow (`threaded`: a tokenizer)."""
    if messages is not None:
        try:
            prompt = frontend.chat_prompt(messages)  # type: ignore[attr-defined]
        except ValueError as exc:
            raise HTTPError(
                400,
                "invalid_request_error",
                "invalid_request",
                str(exc)[:MESSAGE_QUOTE],
                param="messages",
            ) from None
        request = dataclasses.replace(request, prompt=prompt)
    try:
        return request, frontend.prepare(request)
    except ValueError as exc:
        param = getattr(exc, "param", None)
        if param is not None:  # a `VllmValidationError`: vLLM's own answer
            raise HTTPError(
                400, "BadRequestError", "invalid_request", str(exc)[:MESSAGE_QUOTE], param=param
            ) from None
        raise HTTPError(
            400, "invalid_request_error", "invalid_request", str(exc)[:MESSAGE_QUOTE]
        ) from None
    except Exception as exc:  # a frontend bug: a JSON 500, logged, never a bare one
        log.error("request %r: the frontend failed: %r", request_id, exc, exc_info=exc)
        raise HTTPError(
            500,
            "internal_error",
            "dialect_failed",
            f"request {request_id!r}: the frontend failed ({type(exc).__name__}); "
            "the gateway's log has the details",
        ) from None


async def handle_completion(
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    group: GroupLike | None,
    backend: Backend,
    settings: CompletionSettings,
    counters: HTTPCounters,
    stopping: EventLike,
    chat: bool = False,
    live: LiveResponses | None = None,
) -> None:
    """Serve one `POST /v1/completions` (module docstring), or with `chat` one `POST
    /v1/chat/completions` (the frontend renders the messages into the prompt:
    `Frontend.chat_prompt`). `stopping`: set by `GatewayApp.stop_now()`, which stops
    the responses registered in `live` (None: a stop reaches only requests arriving
    after it)."""
    exchange = Exchange(send, "chat" if chat else "completions", counters)
    request_id = _ids.new("chatcmpl" if chat else "cmpl")
    exchange.headers.append((b"x-request-id", request_id.encode()))
    counters.active += 1
    arrived = time.perf_counter()
    response: _Response | None = None
    try:
        try:
            body = await read_body(receive, settings.max_body_size)
            if body is None:
                counters.disconnects[exchange.route] += 1
                return
            parse = functools.partial(_parse, body, settings.frontend, chat)
            heavy = len(body) > LARGE_BODY
            if heavy:  # off the event loop (openai.py), in the heavy lane
                request, messages = await backend.in_thread(parse, heavy=True)
            else:
                request, messages = parse()
            if request.model is not None and request.model not in settings.served:
                raise HTTPError(
                    404,
                    "invalid_request_error",
                    "model_not_found",
                    f"the model {request.model[:MAX_MODEL_LENGTH]!r} does not exist: this "
                    f"server serves {', '.join(map(repr, settings.served))}",
                    param="model",
                )
            rank = _rank(scope)
            _check_collected(request, settings)
            if group is not None:
                _learn_engines(settings, group)
            work = functools.partial(_prepare, settings.frontend, request, messages, request_id)
            if getattr(settings.frontend, "threaded", False) and len(body) > INLINE_PREPARE:
                request, prepared = await backend.in_thread(work, heavy=heavy)
            else:
                request, prepared = work()
            if group is None:
                raise HTTPError(
                    503,
                    "service_unavailable",
                    "starting",
                    "the engine group is not connected (yet)",
                    retry_after=settings.retry_after,
                )
            if stopping.is_set():
                raise _shutting_down(request_id, None, settings.retry_after)
        except HTTPError as error:
            await exchange.fail(error)
            return
        response = _Response(
            group, backend, settings, counters, exchange, request_id, request, prepared, rank
        )
        watch = _Live(exchange, backend.stopper())

        async def disconnected() -> None:
            await wait_for_disconnect(receive, exchange, backend.sleep_forever)
            watch.stop(_DISCONNECT)

        if live is not None:
            live.add(watch)
        try:
            stopped = await backend.watched(response.run, disconnected, watch.stopper)
        finally:
            if live is not None:
                live.discard(watch)
        if stopped and watch.why == _STOP:
            log.info("request %r (rank %s): aborted: the gateway stops", request_id, response.rank)
            await exchange.fail(_shutting_down(request_id, response.rank, settings.retry_after))
        elif stopped and not exchange.ended:
            counters.disconnects[exchange.route] += 1
            log.info(
                "request %r (rank %s): the client went away; the request was aborted on its rank",
                request_id,
                response.rank,
            )
    except asyncio.CancelledError:
        # The server cancelled this request's task (module docstring): answer if the
        # connection takes it at once, and end quietly. Never raised on trio.
        rank = None if response is None else response.rank
        log.info("request %r (rank %s): cancelled by the server", request_id, rank)
        try:
            async with asyncio.timeout(1.0):
                await exchange.fail(_shutting_down(request_id, rank, settings.retry_after))
        except (Exception, asyncio.CancelledError):
            pass
    finally:
        counters.active -= 1
        counters.observe_duration(exchange.route, time.perf_counter() - arrived)


class _Response:
    """Steps 4a-4d of the module docstring, for one request."""

    def __init__(
        self,
        group: GroupLike,
        backend: Backend,
        settings: CompletionSettings,
        counters: HTTPCounters,
        exchange: Exchange,
        request_id: str,
        request: CompletionRequest,
        prepared: Prepared,
        rank: int | None,
    ) -> None:
        self.group = group
        self.backend = backend
        self.settings = settings
        self.counters = counters
        self.exchange = exchange
        self.request_id = request_id
        self.request = request
        self.prepared = prepared
        self.pinned = rank
        self.rank: int | None = None
        self.model = settings.model  # the first served name, whichever was asked (vLLM)
        self.tokens = 0
        """Tokens of the answer so far."""
        self.first = 0.0
        """When its first token came (`time.perf_counter`), 0.0 before."""
        self.finish: str | None = None
        self.max_tokens = request.max_tokens
        """The request's `max_tokens` as its engine got it (a frontend may lower it)."""
        self.created = int(time.time())
        self.arrived = time.perf_counter()
        """When the request was parsed and ready to submit (vLLM's `arrival_time`)."""

    def _error(self, exc: BaseException) -> HTTPError:
        error = http_error(exc, retry_after=self.settings.retry_after, size=self.group.size)
        if error.status >= 500:
            if isinstance(exc, ZmqdpError | HTTPError):
                log.warning("request %r: %d: %s", self.request_id, error.status, exc)
            else:
                log.error("request %r: %s", self.request_id, exc, exc_info=exc)
        return error

    async def _submit(self) -> StreamLike:
        make = self.prepared.request
        request: Any = (
            Request(self.request_id, self.prepared.body, self.pinned, tokens=self.prepared.tokens)
            if make is None
            else make(self.request_id, self.pinned)
        )
        # vLLM's `request_params_max_tokens` is the engine's, after the frontend's clamp
        sent = getattr(getattr(request, "sampling", None), "max_tokens", None)
        if type(sent) is int:
            self.max_tokens = sent
        wait = self.settings.queue_timeout
        if wait <= 0:
            return self.group.submit(request)
        done, stream = await self.backend.within(wait, lambda: self.group.wait_submit(request))
        if not done or stream is None:
            raise HTTPError(
                429,
                "rate_limit_error",
                "queue_timeout",
                f"request {self.request_id!r}: no room on "
                + ("any rank" if self.pinned is None else f"rank {self.pinned}")
                + f" within the queue time ({wait:g} s)",
                retry_after=self.settings.retry_after,
            )
        return stream

    async def run(self) -> None:
        exchange = self.exchange
        try:
            stream = await self._submit()
        except (ZmqdpError, HTTPError) as exc:
            await exchange.fail(self._error(exc))
            return
        self.rank = stream.rank
        exchange.headers.append((b"x-data-parallel-rank", b"%d" % stream.rank))
        try:
            async with stream:
                if self.request.stream:
                    await self._stream(stream)
                else:
                    await self._complete(stream)
        except Exception as exc:
            await exchange.fail(self._error(exc))
        finally:
            # every submitted request is counted once, by how its answer ended ("abort":
            # the client went away, the gateway stopped, or the request failed)
            now = time.perf_counter()
            self.counters.observe_answer(
                self.finish if exchange.ended and self.finish is not None else "abort",
                self.prepared.prompt_tokens,
                self.tokens,
                self.first or now,
                now,
                rank=self.rank or 0,
                arrived=self.arrived,
                max_tokens=self.max_tokens,
            )

    async def _complete(self, stream: StreamLike) -> None:
        decode = batch_decoder(self.prepared.decode)
        text = io.StringIO()  # one growing buffer, not an object per output
        chars = tokens = 0
        max_tokens = self.settings.max_collected_tokens
        max_chars = self.settings.max_collected_chars
        finish: str | None = None
        stop_reason: int | str | None = None
        while finish is None:
            # (a frontend's finish before the engine's, a stop string, ends it too:
            # leaving the stream's block aborts the request on its rank)
            piece = decode(await stream.receive_batch())
            chars += text.write(piece.text)
            tokens += piece.tokens
            finish, stop_reason = piece.finish_reason, piece.stop_reason
            if not self.first and tokens:
                self.first = time.perf_counter()
            if max_tokens is not None and tokens > max_tokens:
                raise self._too_large(f"{tokens} tokens", f"{max_tokens} tokens")
            if max_chars is not None and chars > max_chars:
                raise self._too_large(f"{chars} characters", f"{max_chars} characters")
        self.counters.completion_tokens += tokens
        self.counters.prompt_tokens += self.prepared.prompt_tokens
        self.tokens, self.finish = tokens, finish
        await self.exchange.respond(
            200,
            (chat_completion if self.request.chat else completion)(
                self.request_id,
                self.created,
                self.model,
                text.getvalue(),
                finish,
                self.prepared.prompt_tokens,
                tokens,
                stop_reason,
            ),
        )

    def _too_large(self, size: str, limit: str) -> HTTPError:
        """A non-streaming answer past a collect limit (raised inside the stream's
        `async with`: the request is aborted on its rank)."""
        return HTTPError(
            502,
            "engine_error",
            "response_too_large",
            f"rank {self.rank}, request {self.request_id!r}: the answer reached {size}, past "
            f"the {limit} this gateway holds for a non-streaming request "
            f"(max_tokens was {self.request.max_tokens}); the request was aborted. "
            'Stream it ("stream": true) for a longer answer',
        )

    async def _stream(self, stream: StreamLike) -> None:
        """One decode, one encode and one write per batch (`receive_batch()`: every
        output buffered when this task woke): nothing here is per token."""
        decode = batch_decoder(self.prepared.decode)
        exchange = self.exchange
        counters = self.counters
        prompt_tokens = self.prepared.prompt_tokens
        encode = (ChatChunkEncoder if self.request.chat else ChunkEncoder)(
            self.request_id, self.created, self.model
        ).text
        receive = stream.receive_batch
        counters.prompt_tokens += prompt_tokens
        tokens = 0
        finish: str | None = None
        while finish is None:
            piece = decode(await receive())
            counters.completion_tokens += piece.tokens
            tokens += piece.tokens
            if not self.first and tokens:
                self.first = time.perf_counter()
            self.tokens, self.finish = tokens, (finish := piece.finish_reason)
            data = encode(piece.text, finish, piece.stop_reason)
            if finish is not None:
                if self.request.include_usage:
                    data += chunk(
                        self.request_id,
                        self.created,
                        self.model,
                        None,
                        None,
                        (prompt_tokens, tokens),
                        kind="chat.completion.chunk" if self.request.chat else "text_completion",
                    )
                data += DONE
            if not exchange.started:
                # the headers go out with the first batch's chunk (an error before it
                # still gets its own status)
                await exchange.start(200, b"text/event-stream", SSE_HEADERS)
            await exchange.body(data, more=finish is None)

"""Which HTTP status each failure gets, and why.

=====================================  ======  ==========================================
failure                                status  meaning for the client
=====================================  ======  ==========================================
invalid JSON, a wrong field, a field   400     fix the request; do not retry as is
the engine cannot honour (named in
`param`, ``unsupported_parameter``),
an unknown field
(``unrecognized_argument``),
`InvalidRequest` (`DuplicateRequestId`
too), a pinned rank that does not
exist (`X-Data-Parallel-Rank`),
a non-streaming `max_tokens` past
`max_collected_tokens`
`Overloaded` (every rank, or the       429     retry after `Retry-After` seconds
pinned one, at its in-flight cap), or
no room within the queue time
`GroupDraining`, `GroupClosed`,        503     retry elsewhere / later (`Retry-After`)
`NoEngineAvailable`, a pinned rank
that is down, the group not yet up,
the gateway stopping (`stop_now()`:
``shutting_down``)
`RequestTimeout` (the request's        504     the engine did not finish in time; the
deadline passed)                               request was aborted on its rank
                                               (``x-should-retry: false``)
a streaming client reading too slowly  400     ``client_too_slow`` (sent as the last SSE
(`StreamOverflow`: `max_buffered`              event: the status is out already)
outputs waited unread)
a `model` that is not served           404     ``model_not_found``, as OpenAI answers
a missing or wrong API key (`api_key`) 401     ``invalid_api_key``
`EngineDead`, `ProtocolError`,         502     the engine failed the request
`StreamTruncated`, a non-streaming
answer past `max_collected_tokens` or
`max_collected_chars`
(``response_too_large``)
anything else                          500     a bug; logged with its traceback
=====================================  ======  ==========================================

Once a streaming response has started, the status is sent already: the same error goes
out as a last SSE event ``data: {"error": {...}}`` and the response ends without
``[DONE]`` (the OpenAI client raises `APIError` on it).

The message is zmqdp's own: it names the rank and the request id (the response's `id`,
also in the `X-Request-Id` header), so one log line or one client error is enough to
find the engine and the request.
"""

from __future__ import annotations

from .._core.errors import (
    EngineDead,
    GroupClosed,
    GroupDraining,
    InvalidRank,
    InvalidRequest,
    NoEngineAvailable,
    Overloaded,
    ProtocolError,
    RequestTimeout,
    StreamOverflow,
    StreamTruncated,
)

__all__ = ["HTTPError", "http_error"]


class HTTPError(Exception):
    """A failure with its HTTP status and OpenAI error fields (`type`, `code`)."""

    def __init__(
        self,
        status: int,
        type: str,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after: int | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after
        """Seconds for a `Retry-After` header (429, 503), or None for none."""
        self.should_retry = should_retry
        """An `x-should-retry` header (the OpenAI clients obey it over their own rule,
        which retries every 5xx twice), or None for none."""


def http_error(exc: BaseException, *, retry_after: int, size: int) -> HTTPError:
    """The HTTP answer to `exc`, raised by `submit` or read from a stream of a group of
    `size` ranks."""
    if isinstance(exc, HTTPError):
        return exc
    message = str(exc)
    if isinstance(exc, Overloaded):
        where = "every engine rank is" if exc.rank is None else f"engine rank {exc.rank} is"
        cap = "" if exc.cap is None else f" of {exc.cap}"
        return HTTPError(
            429,
            "rate_limit_error",
            "overloaded",
            f"request {exc.request_id!r}: {where} at its limit{cap} requests in flight; "
            f"retry after {retry_after} s",
            retry_after=retry_after,
        )
    if isinstance(exc, GroupDraining):
        return HTTPError(503, "service_unavailable", "draining", message, retry_after=retry_after)
    if isinstance(exc, GroupClosed):
        return HTTPError(
            503, "service_unavailable", "group_closed", message, retry_after=retry_after
        )
    if isinstance(exc, NoEngineAvailable):
        return HTTPError(
            503, "service_unavailable", "no_engine_available", message, retry_after=retry_after
        )
    if isinstance(exc, InvalidRank):
        if type(exc.rank) is int and 0 <= exc.rank < size:  # it exists, it is down
            return HTTPError(
                503, "service_unavailable", "rank_unavailable", message, retry_after=retry_after
            )
        return HTTPError(400, "invalid_request_error", "invalid_rank", message)
    if isinstance(exc, InvalidRequest):  # DuplicateRequestId too: it is one
        return HTTPError(400, "invalid_request_error", "invalid_request", message)
    if isinstance(exc, RequestTimeout):
        # Not retried by the client: the same request would run to the same deadline
        # (the OpenAI clients otherwise send it twice more).
        return HTTPError(504, "timeout_error", "request_timeout", message, should_retry=False)
    if isinstance(exc, EngineDead):
        return HTTPError(502, "engine_error", "engine_dead", message)
    if isinstance(exc, ProtocolError):
        return HTTPError(502, "engine_error", "protocol_error", message)
    if isinstance(exc, StreamTruncated):
        return HTTPError(502, "engine_error", "truncated", message)
    if isinstance(exc, StreamOverflow):
        # The gateway's writer is this stream's consumer: it fell behind because the
        # client read the response too slowly (TCP backpressure), not a server fault.
        return HTTPError(
            400,
            "invalid_request_error",
            "client_too_slow",
            f"the client read the response too slowly: {message}",
            should_retry=False,
        )
    # Not one of ours: its text may hold anything (a path, a prompt), so the client gets
    # its type only; the caller logs the whole of it.
    return HTTPError(
        500,
        "internal_error",
        "internal_error",
        f"internal error ({type(exc).__name__}); the gateway's log has the details",
    )

"""zmqdp's exception tree: one base class, one subclass per situation a caller can act on.

Every message names the rank, the request id and the cause where they are known, so a
log line alone tells an operator which engine to look at.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "QUOTE_LIMIT",
    "CallFailed",
    "CallTimeout",
    "DuplicateRequestId",
    "EngineDead",
    "GroupClosed",
    "GroupDraining",
    "GroupRecovering",
    "HandshakeRejected",
    "HandshakeTimeout",
    "InvalidRank",
    "InvalidRequest",
    "NoEngineAvailable",
    "Overloaded",
    "ProtocolError",
    "RequestAborted",
    "RequestTimeout",
    "StreamOverflow",
    "StreamTruncated",
    "ZmqdpError",
    "quote",
]

QUOTE_LIMIT = 200
"""At most this many characters of a peer's value appear in an error (§7)."""

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = _repr.maxlong = QUOTE_LIMIT
_repr.maxlist = _repr.maxdict = _repr.maxtuple = _repr.maxset = 16
_repr.maxlevel = 4


def quote(value: Any) -> str:
    """`repr(value)`, cut to `QUOTE_LIMIT` characters. Safe on hostile values: strings
    are sliced and containers abbreviated *before* they are rendered, so a 16 MiB
    string costs a slice, not a 16 MiB message."""
    if type(value) is str or type(value) is bytes:
        if len(value) > QUOTE_LIMIT:
            return f"{value[:QUOTE_LIMIT]!r}... ({len(value)} long)"
        return repr(value)
    text = _repr.repr(value)
    return text if len(text) <= QUOTE_LIMIT else f"{text[:QUOTE_LIMIT]}..."


def _where(rank: int | None, request_id: str | None) -> str:
    parts = []
    if rank is not None:
        parts.append(f"rank {rank}")
    if request_id is not None:
        parts.append(f"request {quote(request_id)}")
    return ", ".join(parts)


class ZmqdpError(Exception):
    """Base class of every error zmqdp raises on purpose."""


class ProtocolError(ZmqdpError):
    """A peer sent bytes or a message that docs/protocol.md does not allow.

    Raised by the codec for any undecodable or invalid body; never anything else.
    `rank` and `request_id` are filled in by the layer that knows them; `message` is
    the type of message the body claimed to be (`"hello"`, `"ready"` ...) when known.
    A request whose engine sent a malformed entry for it ends with this error.
    """

    def __init__(
        self,
        cause: str,
        *,
        rank: int | None = None,
        request_id: str | None = None,
        message: str | None = None,
    ):
        self.cause = cause
        self.rank = rank
        self.request_id = request_id
        self.message = message
        where = _where(rank, request_id)
        super().__init__(f"{where}: {cause}" if where else cause)

    def at(
        self, rank: int | None = None, request_id: str | None = None, message: str | None = None
    ) -> ProtocolError:
        """The same error, placed at a rank, request and/or message type."""
        return ProtocolError(
            self.cause,
            rank=self.rank if rank is None else rank,
            request_id=self.request_id if request_id is None else request_id,
            message=self.message if message is None else message,
        )


class InvalidRequest(ZmqdpError, ValueError):
    """A request cannot be sent as it is (for example its body has no CBOR form §8 allows)."""

    def __init__(self, request_id: str, cause: str):
        self.request_id = request_id
        self.cause = cause
        super().__init__(f"request {quote(request_id)} cannot be sent: {cause}")


class DuplicateRequestId(ZmqdpError, ValueError):
    """A request with this id is still live; ids must be unique among live requests."""

    def __init__(self, request_id: str, rank: int | None = None):
        self.request_id = request_id
        self.rank = rank
        on = f" on rank {rank}" if rank is not None else ""
        super().__init__(
            f"request {quote(request_id)} is already live{on}; wait for it to end or abort it first"
        )


class InvalidRank(ZmqdpError, ValueError):
    """A pinned request names a rank that does not exist or is not up."""

    def __init__(self, rank: int, size: int, request_id: str | None, cause: str):
        self.rank = rank
        self.size = size
        self.request_id = request_id
        self.cause = cause
        req = f" (request {quote(request_id)})" if request_id is not None else ""
        super().__init__(f"rank {rank}{req}: {cause}")


class NoEngineAvailable(ZmqdpError):
    """An unpinned request found no rank up to take it (every rank is down or rejoining)."""

    def __init__(self, request_id: str, size: int):
        self.request_id = request_id
        self.size = size
        super().__init__(
            f"request {quote(request_id)}: none of the {size} ranks is up; "
            "wait for a rank to rejoin and submit again"
        )


class Overloaded(ZmqdpError):
    """Admission control refused the request: the pinned `rank`, or every up rank, is at
    its in-flight cap (`max_inflight`). Nothing was sent or reserved; submit again
    later, or use `wait_submit` to wait for room. A gateway answers 429."""

    def __init__(self, request_id: str, rank: int | None = None, cap: int | None = None):
        self.request_id = request_id
        self.rank = rank
        self.cap = cap
        """The pinned rank's cap (None for an unpinned request)."""
        where = "every up rank is" if rank is None else f"rank {rank} is"
        limit = "" if cap is None else f" ({cap})"
        super().__init__(
            f"request {quote(request_id)}: {where} at its in-flight cap{limit}; "
            "submit again when a request ends, or use wait_submit"
        )


class RequestTimeout(ZmqdpError, TimeoutError):
    """The request passed its deadline (`Request.timeout`, or the group's
    `request_timeout`) before its terminal output: it was aborted on its rank. The
    outputs that came before are still read first. A gateway answers 504."""

    def __init__(self, rank: int, request_id: str, timeout: float):
        self.rank = rank
        self.request_id = request_id
        self.timeout = timeout
        super().__init__(
            f"{_where(rank, request_id)}: no terminal output within its {timeout:g} s "
            "deadline; the request was aborted on its rank"
        )


class HandshakeTimeout(ZmqdpError, TimeoutError):
    """The group was not ready in time; names every missing rank and every rejected
    handshake message."""

    def __init__(self, missing: dict[int, str], rejected: list[str], timeout: float):
        self.missing = dict(missing)
        self.rejected = list(rejected)
        self.timeout = timeout
        lines = [f"engine group not ready after {timeout:g} s"]
        lines += [f"  rank {r}: {why}" for r, why in sorted(self.missing.items())]
        lines += [f"  rejected handshake: {why}" for why in self.rejected]
        super().__init__("\n".join(lines))


class HandshakeRejected(ZmqdpError):
    """Engine side: the client answered our HELLO with REJECT."""

    def __init__(self, rank: int, reason: str):
        self.rank = rank
        self.reason = reason
        super().__init__(f"rank {rank}: the client rejected this engine: {reason}")


class EngineDead(ZmqdpError):
    """A rank was declared dead (docs/protocol.md §6); the requests it held fail with this."""

    def __init__(self, rank: int, cause: str, request_id: str | None = None):
        self.rank = rank
        self.cause = cause
        self.request_id = request_id
        super().__init__(f"{_where(rank, request_id)}: engine is dead: {cause}")


class GroupClosed(ZmqdpError):
    """The EngineGroup is closed or has failed; no request can be submitted or served."""

    def __init__(self, cause: str = "the engine group is closed", request_id: str | None = None):
        self.cause = cause
        self.request_id = request_id
        super().__init__(f"request {quote(request_id)}: {cause}" if request_id else cause)


class GroupDraining(GroupClosed):
    """`drain()` was called: the group finishes the requests it holds and takes no new
    ones (a gateway answers 503)."""

    def __init__(self, request_id: str | None = None):
        super().__init__("the engine group is draining: it takes no new requests", request_id)


class GroupRecovering(GroupClosed):
    """The group failed as a whole (a rank of a lockstep group died) and, as
    `ConnectOptions.recover` asked, waits with its sockets bound until every rank has
    completed a new handshake; then it serves again. Retry later (a gateway answers
    503). `EngineGroup.closed` is this error while it waits."""


class CallTimeout(ZmqdpError, TimeoutError):
    """`EngineGroup.call` got no reply in time (the reply, if it comes later, is dropped)."""

    def __init__(self, rank: int, method: str, timeout: float):
        self.rank = rank
        self.method = method
        self.timeout = timeout
        super().__init__(f"rank {rank}: CALL {quote(method)} got no reply in {timeout:g} s")


class CallFailed(ZmqdpError):
    """The engine answered a `call()` with an error, or with a reply entry that was not
    valid (§7); `error` is the engine's text or what was wrong."""

    def __init__(self, rank: int, method: str, error: str):
        self.rank = rank
        self.method = method
        self.error = error
        super().__init__(f"rank {rank}: CALL {quote(method)} failed on the engine: {quote(error)}")


class RequestAborted(ZmqdpError):
    """The request was aborted with `EngineGroup.abort` while its stream was being read."""

    def __init__(self, rank: int, request_id: str):
        self.rank = rank
        self.request_id = request_id
        super().__init__(f"rank {rank}, request {quote(request_id)}: aborted by the client")


class StreamTruncated(ZmqdpError):
    """The engine dropped a request (listed it in `finished`) without a terminal output."""

    def __init__(self, rank: int, request_id: str):
        self.rank = rank
        self.request_id = request_id
        super().__init__(
            f"{_where(rank, request_id)}: the engine dropped the request without a "
            "terminal output (listed it in `finished`); the stream is incomplete"
        )


class StreamOverflow(ZmqdpError):
    """The stream's consumer fell `max_buffered` outputs behind: the request was aborted
    on its rank (its outputs would otherwise pile up in memory without bound). The
    outputs buffered before that are still read first."""

    def __init__(self, rank: int, request_id: str, limit: int, aborted: bool = True):
        self.rank = rank
        self.request_id = request_id
        self.limit = limit
        self.aborted = aborted
        """False if the request had just ended on its rank (in the same batch)."""
        what = (
            "the request was aborted on its rank"
            if aborted
            else "the request had just ended on its rank; its later outputs were dropped"
        )
        super().__init__(
            f"{_where(rank, request_id)}: the consumer did not keep up: {limit} outputs "
            f"were waiting to be read (max_buffered); {what}"
        )

"""zmqdp's exception tree: one base class, one subclass per situation a caller can act on.

Every message names the rank, the request id and the cause where they are known, so a
log line alone tells an operator which engine to look at. Every class is exported from
`zmqdp` and reports that module (tracebacks say `zmqdp.EngineDead`); every instance
survives `pickle` and `copy` with its message and attributes.

The tree (indentation is subclassing; the standard base, if any, in parentheses):

- `ZmqdpError`: the base of every error zmqdp raises on purpose.
    - `SubmitRefused`: `submit()` / `wait_submit()` refused the request synchronously;
      nothing was sent or reserved. With `GroupClosed`, all they raise (besides
      `RuntimeError` for a call from another thread than the group's).
        - `InvalidRequest` (`ValueError`): the request cannot be sent as it is (a bad
          id, timeout or rank type, a body with no wire form, an ADD larger than the
          engine accepts; `call()`: arguments with no wire form). Fix it; do not retry.
            - `DuplicateRequestId`: a request with this id is still live.
        - `InvalidRank` (`ValueError`): a pinned rank outside the group (fix it) or
          down (retry later); also `call()` and `rank_state()` with a rank outside it.
        - `Overloaded`: admission control (`max_inflight`): no room on the pinned
          rank or any up rank. Retry later, or use `wait_submit()`.
        - `NoEngineAvailable`: no rank is up to take an unpinned request. Retry later.
    - `GroupClosed`: the group is closed or failed: `submit()` and `call()` refuse,
      live streams end with it.
        - `GroupDraining`: `drain()` was called: no new requests.
        - `GroupRecovering`: a failed lockstep group waits for its ranks
          (`recover=True`); it serves again afterwards.
    - `HandshakeTimeout` (`TimeoutError`): `connect()`: not every rank finished the
      handshake within `ready_timeout` (names the URL, each missing rank, what to do).
    - `HandshakeRejected`: engine side: the client answered this engine's HELLO with
      REJECT.
    - `ProtocolError`: a peer sent what docs/protocol.md does not allow; a stream ends
      with it when a malformed entry names its request.
    - `EngineDead`: a rank was declared dead: the streams of its requests end with it;
      `call()` raises it for a rank that dies first or is not up.
    - `RequestTimeout` (`TimeoutError`): a stream: the request's deadline passed; it was
      aborted on its rank.
    - `RequestAborted`: a stream: `abort()` was called while it was being read.
    - `StreamTruncated`: a stream: the engine dropped the request without a terminal
      output.
    - `StreamOverflow`: a stream: its reader fell `max_buffered` outputs behind; the
      request was aborted on its rank.
    - `CallTimeout` (`TimeoutError`): `call()` got no reply within its `timeout`.
    - `CallFailed`: `call()`: the engine answered with an error, or an invalid reply.

Around `submit()`, `except (SubmitRefused, GroupClosed)` catches every refusal; a
stream's errors are the ones marked "a stream" above, plus `EngineDead`,
`ProtocolError` and `GroupClosed`.
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
    "SubmitRefused",
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
    """Base class of every error zmqdp raises on purpose (the tree below)."""

    def __reduce__(self) -> tuple[Any, ...]:
        # The default calls `type(self)(*self.args)`, which our `__init__`s (taking
        # the parts, not the message) refuse: rebuild without calling `__init__`.
        return (_rebuild, (type(self), self.args), self.__dict__)


def _rebuild(cls: type[ZmqdpError], args: tuple[Any, ...]) -> ZmqdpError:
    """Unpickle (or copy) a `ZmqdpError`: its message (`args`), then its attributes."""
    error = cls.__new__(cls)
    error.args = args
    return error


class SubmitRefused(ZmqdpError):
    """`submit()` or `wait_submit()` refused the request, synchronously, before
    anything was sent or reserved: catch this (and `GroupClosed`, the group's own
    refusal) around a submit. A subclass says why: `InvalidRequest` (fix the request),
    `InvalidRank`, `Overloaded` or `NoEngineAvailable` (retry later)."""


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


class InvalidRequest(SubmitRefused, ValueError):
    """A request cannot be sent as it is (for example its body has no CBOR form §8 allows,
    or its id is already live: `DuplicateRequestId`). `call()` raises it too, for
    arguments with no wire form. Fix the request; sending it again as is fails again."""

    def __init__(self, request_id: str, cause: str):
        self.request_id = request_id
        self.cause = cause
        super().__init__(f"request {quote(request_id)} cannot be sent: {cause}")


class DuplicateRequestId(InvalidRequest):
    """A request with this id is still live; ids must be unique among live requests.
    An `InvalidRequest`, so `except InvalidRequest` catches it."""

    def __init__(self, request_id: str, rank: int | None = None):
        self.request_id = request_id
        self.rank = rank
        on = f" on rank {rank}" if rank is not None else ""
        why = f"already live{on}; wait for it to end or abort it first"
        self.cause = f"the id is {why}"
        ZmqdpError.__init__(self, f"request {quote(request_id)} is {why}")


class InvalidRank(SubmitRefused, ValueError):
    """A pinned request names a rank that does not exist (fix it) or is not up (retry
    later, or submit it unpinned). `call()` and `rank_state()` raise it too, for a rank
    outside the group."""

    def __init__(self, rank: int, size: int, request_id: str | None, cause: str):
        self.rank = rank
        self.size = size
        self.request_id = request_id
        self.cause = cause
        req = f" (request {quote(request_id)})" if request_id is not None else ""
        who = rank if type(rank) is int else quote(rank)  # rank="0" must read as a str
        super().__init__(f"rank {who}{req}: {cause}")


class NoEngineAvailable(SubmitRefused):
    """An unpinned request found no rank up to take it (every rank is down or rejoining)."""

    def __init__(self, request_id: str, size: int):
        self.request_id = request_id
        self.size = size
        super().__init__(
            f"request {quote(request_id)}: none of the {size} ranks is up; "
            "wait for a rank to rejoin and submit again"
        )


class Overloaded(SubmitRefused):
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
    """The group was not ready in time. The message names the URL, which ranks came up
    and which did not (each with what it lacks), every rejected handshake message, how
    long it waited, and what to do next.

    `missing`: rank -> why it is not up; `rejected`: the recent rejection reasons;
    `timeout`: the seconds waited; `url`, `size` (the group's ranks), `up` (the ranks
    that came up) and `next_step` when the raiser knows them (the client does; the
    engine side's own handshake timeout names its rank only)."""

    def __init__(
        self,
        missing: dict[int, str],
        rejected: list[str],
        timeout: float,
        *,
        url: str | None = None,
        size: int | None = None,
        next_step: str | None = None,
    ):
        self.missing = dict(missing)
        self.rejected = list(rejected)
        self.timeout = timeout
        self.url = url
        self.size = size
        self.up: tuple[int, ...] = (
            () if size is None else tuple(r for r in range(size) if r not in self.missing)
        )
        """The ranks that completed the handshake (empty when `size` is unknown)."""
        self.next_step = next_step
        if url is None:
            lines = [f"engine group not ready after {timeout:g} s"]
        else:
            lines = [f"engine group at {url} not ready after waiting {timeout:g} s"]
        if size is not None:
            lines[0] += f": {len(self.up)} of {size} ranks up"
            if self.up:
                lines[0] += f" ({_ranks(self.up)})"
        lines += [f"  rank {r}: {why}" for r, why in sorted(self.missing.items())]
        lines += [f"  rejected handshake: {why}" for why in self.rejected]
        if next_step:
            lines.append(f"next step: {next_step}")
        super().__init__("\n".join(lines))


def _ranks(ranks: tuple[int, ...]) -> str:
    """`rank 0` / `ranks 0, 2`: at most 16 named, then how many more."""
    shown = ", ".join(map(str, ranks[:16]))
    more = f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


class HandshakeRejected(ZmqdpError):
    """Engine side: the client answered our HELLO with REJECT."""

    def __init__(self, rank: int, reason: str):
        self.rank = rank
        self.reason = reason
        prefix = f"rank {rank}: "  # the client's reason often names the rank already
        said = reason[len(prefix) :] if reason.startswith(prefix) else reason
        super().__init__(f"rank {rank}: the client rejected this engine: {said}")


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


def _document_tree() -> None:
    """`help(zmqdp.ZmqdpError)` shows the tree of the module docstring (one copy)."""
    if __doc__ is None or ZmqdpError.__doc__ is None:  # python -OO: no docstrings
        return
    ZmqdpError.__doc__ += "\n\n" + __doc__[__doc__.index("The tree") :].rstrip()


_document_tree()

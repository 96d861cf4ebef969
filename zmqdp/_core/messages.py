"""Typed messages of docs/protocol.md, one frozen class per message.

These are plain values: the codec (`codec.py`) turns them into bytes and back, and the
state machines consume them. Field names follow the wire keys, except where a Python
name is clearer (`Output.request_id` for the wire key `id`). The protocol's limits and
the validators of what an application hands in (`check_request_id`, `check_timeout`,
`check_rank`) live here too: the core, the options and the transports share them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import msgspec

from .errors import InvalidRequest, quote

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "MAX_ID_LENGTH",
    "PROTOCOL_VERSION",
    "Abort",
    "Add",
    "BadEntry",
    "Call",
    "HandshakeMessage",
    "Hello",
    "Init",
    "Load",
    "Output",
    "OutputBatch",
    "Ready",
    "Register",
    "Reject",
    "Reply",
    "RequestMessage",
    "Resync",
    "Wake",
    "check_rank",
    "check_request_id",
    "check_timeout",
]

PROTOCOL_VERSION = 1

DEFAULT_MAX_MESSAGE_SIZE = 64 * 1024 * 1024
"""docs/protocol.md §1: what a peer accepts unless it says otherwise."""

MAX_ID_LENGTH = 512
"""Longest application id accepted, in characters: ids appear in every log line."""


# -- handshake (§2) -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """engine -> client: "I am rank `rank` of a group of `size`"."""

    rank: int
    size: int
    lockstep: bool
    wave: int | None = None
    version: int = PROTOCOL_VERSION
    max_message_size: int | None = None
    """The largest message this engine accepts (§1); None: the default, 64 MiB."""


@dataclass(frozen=True, slots=True)
class Init:
    """client -> engine: the exact input and output addresses to connect to, and the
    epoch that names this incarnation (§2.3)."""

    input: str
    output: str
    size: int
    version: int = PROTOCOL_VERSION
    epoch: int | None = None
    max_message_size: int | None = None
    """The largest message the client accepts: engines split batches to fit (§1)."""


@dataclass(frozen=True, slots=True)
class Reject:
    """client -> engine: this HELLO was refused, and why."""

    reason: str


@dataclass(frozen=True, slots=True)
class Ready:
    """engine -> client: free-form engine metadata, exposed to users as is."""

    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Register:
    """engine -> client on the input socket: proves the input route exists. Echoes the
    INIT's `epoch` so a REGISTER of a dead incarnation cannot bring up the next (§2.3)."""

    epoch: int | None = None


@dataclass(frozen=True, slots=True)
class Resync:
    """client -> engine: drop every request and redo the handshake."""


HandshakeMessage = Hello | Init | Reject | Ready | Register | Resync


# -- requests (§3) --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Add:
    """Queue request `id` with the application's payload `body`."""

    id: str
    body: Any


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop these requests; idempotent on the engine."""

    ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Wake:
    """Lockstep only: start (or join) wave `wave` unless it is stale (§5)."""

    wave: int


@dataclass(frozen=True, slots=True)
class Call:
    """Run a utility method; the answer comes back in `OutputBatch.replies`."""

    call: int
    method: str
    args: tuple[Any, ...] = ()


RequestMessage = Add | Abort | Wake | Call


# -- outputs (§4) ---------------------------------------------------------------------


class Output(msgspec.Struct, gc=False):
    """One output of one request. A string `finish` makes it the request's last.

    A msgspec Struct that the garbage collector does not track (``gc=False``): one is
    made per output on the dispatcher's hot path and lives in its stream's buffer until
    the consumer takes it, and tracked outputs (named tuples, until now) made the
    cyclic collector walk every buffered one again and again: 39 % of the client's CPU
    at 256 x 256 on vLLM's wire (issue 21). It also builds in a fifth of a named tuple's
    time. Unpacks like the tuple it was (``rid, body, finish = out``); unlike it, it is
    mutable and unhashable. The collector never sees it, so it must not be part of a
    reference cycle: do not store an output inside its own body (it would never be
    freed). Decoded bodies never refer back to their output.

    The wire decoders make it with the request's wire id, and the core rewrites
    `request_id` in place to the application's id before delivering it (no copy).
    """

    request_id: str
    """Your `Request.id` (the wire id, as decoded, until the core renames it)."""
    body: Any = None
    """The engine's output (the mock: `{"tokens": [...]}`; vLLM: a `VllmOutput`)."""
    finish: str | None = None
    """None while the request runs; the finish reason ("stop", "length", "abort",
    "error"...) on its last output."""

    @property
    def terminal(self) -> bool:
        """Whether this is the request's last output (`finish` is set)."""
        return self.finish is not None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.request_id, self.body, self.finish))


@dataclass(frozen=True, slots=True)
class Load:
    """A rank's scheduler snapshot. `kv` is the KV-cache usage fraction (NaN if unknown)."""

    waiting: int = 0
    """Requests queued on the engine, not yet scheduled."""
    running: int = 0
    """Requests the engine is running."""
    kv: float = 0.0
    """The fraction of the KV cache in use, 0 to 1 (NaN: unknown)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to `Call(call=...)`: a `result`, or an `error` string."""

    call: int
    result: Any = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class OutputBatch:
    """One engine -> client message. Every field but `rank` is optional on the wire."""

    rank: int
    seq: int | None = None
    epoch: int | None = None
    outputs: tuple[Output, ...] = ()
    finished: tuple[str, ...] = ()
    load: Load | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    replies: tuple[Reply, ...] = ()
    dead: str | None = None
    bad_entries: tuple[BadEntry, ...] = ()
    """Malformed entries of `outputs`, `finished` or `replies` (§7 entry errors):
    filled in by the decoder, never encoded."""


class BadEntry(NamedTuple):
    """One malformed entry of a batch. `id` is the wire id (or, for `replies`, the call
    id) it names when that much is usable, else None; `cause` says what is wrong."""

    key: Literal["outputs", "finished", "replies"]
    id: str | int | None
    cause: str


# -- what an application hands in ------------------------------------------------------


def check_request_id(request_id: Any) -> str:
    """Return `request_id` if it is a usable application id, else raise
    `InvalidRequest` saying why."""
    if type(request_id) is not str:
        raise InvalidRequest(
            quote(request_id), f"the id must be a str, got {type(request_id).__name__}"
        )
    if not request_id:
        raise InvalidRequest(request_id, "the id must not be empty")
    if len(request_id) > MAX_ID_LENGTH:
        raise InvalidRequest(
            request_id, f"the id is {len(request_id)} characters long; at most {MAX_ID_LENGTH}"
        )
    try:
        request_id.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            request_id, f"the id has no UTF-8 form (lone surrogate at {exc.start})"
        ) from None
    return request_id


def check_timeout(request_id: str, timeout: Any) -> float | None:
    """A request timeout is a positive finite number of seconds, or None."""
    if timeout is None:
        return None
    if type(timeout) in (int, float) and 0 < timeout < math.inf:
        return float(timeout)
    raise InvalidRequest(
        request_id, f"timeout must be a positive number of seconds or None, got {quote(timeout)}"
    )


def check_rank(request_id: str, rank: Any) -> int | None:
    """A pinned rank must be an int (not a bool, float or string) or None."""
    if rank is None or type(rank) is int:
        return rank
    raise InvalidRequest(
        request_id, f"rank must be an int or None, got {type(rank).__name__} {quote(rank)}"
    )

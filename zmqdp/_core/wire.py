"""The wire as an object: what a dialect changes, and zmqdp's own (`NativeWire`).

A `Wire` is the codec and the few capability flags of one engine protocol. `GroupCore`
and the trio client take one as an argument and never ask which it is: the native CBOR
protocol (docs/protocol.md) and vLLM's engine-core wire (`zmqdp.vllm.wire`) are two
values of this one interface, the way wsproto takes its extensions as arguments instead
of being subclassed. Everything else (routing, the request book, the wave clock,
per-rank health) is the core's own and the same on every wire.

Sans-IO like the rest of `_core`: no trio, no zmq; time comes in as a value.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Container, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from .codec import BatchDecoder, EntryCursor, decode_batch_sliced, encode_request
from .errors import InvalidRequest, ProtocolError, quote
from .handshake import identity_rank
from .messages import Abort, Add, Call, OutputBatch, Wake

__all__ = ["Incoming", "NativeWire", "Prepared", "Wire", "check_tokens"]

R_contra = TypeVar("R_contra", contravariant=True)


def check_tokens(request_id: Any, tokens: Any) -> Sequence[int]:
    """`Request.tokens` as the prefix index takes them: a list or tuple of ints as it
    is (bools refused), any other sequence of integer-likes (numpy's) as a list of
    ints; anything else raises `InvalidRequest` naming the request."""
    if (type(tokens) is list or type(tokens) is tuple) and all(type(t) is int for t in tokens):
        return tokens
    if isinstance(tokens, (str, bytes, bytearray, Mapping)) or not isinstance(tokens, Sequence):
        raise InvalidRequest(
            str(request_id), f"tokens must be a sequence of ints or None, not {quote(tokens)}"
        )
    try:
        if any(type(t) is bool for t in tokens):
            raise TypeError("a bool")
        return [operator.index(t) for t in tokens]
    except TypeError:
        bad = next((t for t in tokens if type(t) is bool or not hasattr(t, "__index__")), None)
        raise InvalidRequest(
            str(request_id), f"tokens must be a sequence of ints, and holds {quote(bad)}"
        ) from None


class Prepared(NamedTuple):
    """A request as the core takes it: the application id, the ADD's body (what
    `Wire.encode_add` encodes), the pinned rank (None: least-loaded), the timeout
    (None: the group's), and for prefix affinity the prompt's token ids and the root
    key of its chain (`_core/prefix.py`; None: routed by load). Each is validated by
    the core, but `prefix`, which the wire checks."""

    id: Any
    body: Any
    rank: Any
    timeout: Any
    prefix: tuple[Sequence[int], int] | None = None


class Incoming(NamedTuple):
    """One output-socket message as the wire reads it, before the core judges it."""

    rank: int | None
    """The rank it came from (None: it names none; counted and logged)."""
    body: bytes | None = None
    """A batch body for the core to decode (`Wire.decode_batch`, in slices if long)."""
    batch: OutputBatch | None = None
    """A batch the wire decoded already (never sliced)."""
    error: ProtocolError | None = None
    """The message is invalid: a connection error of `rank` (§7), or if `rank` is
    None only counted and logged."""
    group_dead: str | None = None
    """A death sentinel that names no rank: the whole group fails."""
    junk: ProtocolError | None = None
    """An invalid message that came from `rank`'s own socket but is not a connection
    error: counted against `rank` and logged, and the rank lives on (vLLM: anyone who
    can connect to a rank's output socket can send one, and a real engine never
    does; a vLLM rank declared dead does not come back by itself)."""


class Wire(Protocol[R_contra]):
    """One engine protocol, as the core and the trio client use it. `R_contra` is the
    request type `EngineGroup.submit` takes on this wire."""

    name: str
    """For messages: "native", "vLLM"."""
    abort_malformed: bool
    resumes: bool
    """A rank declared dead may come back as the same process, without a new handshake
    (vLLM: a stalled engine whose sockets reconnect; `zmqdp.vllm.sockets`): the
    requests that ended with its death are ABORTed when it is up again, since the
    engine may still be running them."""
    """Send ABORT for a request a malformed entry ended (§7): an engine that has no
    idea its entry was rejected would run it on, holding a slot the client freed."""
    wake_published: bool
    """WAKEs go out as one publication to every rank (vLLM's coordinator XPUB), not as
    one message per up rank on the input socket."""
    default_ready_timeout: float
    """`connect`'s `ready_timeout` when none is given."""

    def prepare(
        self, request: R_contra, infos: Sequence[Mapping[str, Any]], wall_time: float
    ) -> Prepared:
        """The request as the core takes it. `infos`: each rank's handshake info (a
        wire may check a request against what the engines announced); `wall_time`:
        `time.time()` (vLLM stamps arrival times). Raises `InvalidRequest`."""
        ...

    def encode_add(self, wire_id: str, body: Any, wave: int) -> tuple[bytes, bytes]:
        """An ADD's frames; `wave` is the clock `c` (0 when not lockstep). Raises
        `ProtocolError` if `body` has no wire form."""
        ...

    def encode_abort(self, wire_ids: tuple[str, ...]) -> tuple[bytes, bytes]:
        """ABORT of `wire_ids` (docs/protocol.md §3), as sent to their rank."""
        ...

    def encode_wake(self, wave: int) -> list[bytes]:
        """WAKE(wave) (docs/protocol.md §5), as sent to each rank or published."""
        ...

    def encode_call(self, call_id: int, method: str, args: tuple[Any, ...]) -> Sequence[bytes]:
        """A utility call's frames; raises `ProtocolError` if they have no wire form."""
        ...

    def new_call_id(self, taken: Container[int]) -> int:
        """A call id not in `taken`."""
        ...

    def read(self, frames: list[bytes], size: int) -> Incoming:
        """Which rank one output-socket message is from, and what it holds."""
        ...

    def decode_batch(
        self, body: bytes, slice_entries: int
    ) -> tuple[OutputBatch, EntryCursor | None]:
        """A batch body from `Incoming.body`; its entries past the first
        `slice_entries` come in a cursor. Raises `ProtocolError` only for a connection
        error (§7); malformed entries are in `OutputBatch.bad_entries`."""
        ...

    def batch_decoder(self, body: bytes, judge: Any) -> BatchDecoder:
        """An incremental decoder for a body of at least `incremental_bytes`."""
        ...


class NativeWire:
    """docs/protocol.md: CBOR over three ROUTERs; the rank is the routing identity."""

    name = "native"
    abort_malformed = False
    resumes = False
    wake_published = False
    default_ready_timeout = 60.0

    def __init__(self) -> None:
        self._call_ids = itertools.count()

    def prepare(
        self, request: Any, infos: Sequence[Mapping[str, Any]], wall_time: float
    ) -> Prepared:
        """`zmqdp.Request` as it is (`Request.body` any CBOR-able value); its `tokens`
        (never sent) under root 0."""
        try:  # (duck-typed: the core does not import zmqdp.values)
            id_, body, rank, timeout = request.id, request.body, request.rank, request.timeout
        except AttributeError:
            raise InvalidRequest(
                str(getattr(request, "id", "?")),
                f"submit takes a zmqdp.Request, not a {type(request).__name__}: {quote(request)}",
            ) from None
        tokens = getattr(request, "tokens", None)
        if tokens is None:
            return Prepared(id_, body, rank, timeout)
        return Prepared(id_, body, rank, timeout, (check_tokens(id_, tokens), 0))

    def encode_add(self, wire_id: str, body: Any, wave: int) -> tuple[bytes, bytes]:
        """`Wire.encode_add`: `Add(wire_id, body)` in CBOR (§3); `wave` is not sent."""
        return encode_request(Add(wire_id, body))

    def encode_abort(self, wire_ids: tuple[str, ...]) -> tuple[bytes, bytes]:
        """`Wire.encode_abort`: one ABORT naming every id (§3)."""
        return encode_request(Abort(wire_ids))

    def encode_wake(self, wave: int) -> list[bytes]:
        """`Wire.encode_wake`: WAKE(wave) (§5), sent to each rank."""
        return list(encode_request(Wake(wave)))

    def encode_call(self, call_id: int, method: str, args: tuple[Any, ...]) -> Sequence[bytes]:
        """`Wire.encode_call`: CALL (§3); `ProtocolError` for arguments with no CBOR form."""
        return encode_request(Call(call_id, method, args))

    def new_call_id(self, taken: Container[int]) -> int:
        """`Wire.new_call_id`: the next free count (call ids are only unique per client)."""
        while (call_id := next(self._call_ids)) in taken:
            pass
        return call_id

    def read(self, frames: list[bytes], size: int) -> Incoming:
        """`[identity, body]` from the output ROUTER."""
        rank = identity_rank(frames[0]) if frames else None
        if rank is None or rank >= size:
            who = frames[0].hex() if frames else "?"
            error = ProtocolError(f"output: a message from identity {who}, which is no rank")
            return Incoming(None, error=error)
        if len(frames) != 2:
            error = ProtocolError(f"a message of {len(frames) - 1} frames, not 1")
            return Incoming(rank, error=error)
        return Incoming(rank, body=frames[1])

    def decode_batch(
        self, body: bytes, slice_entries: int
    ) -> tuple[OutputBatch, EntryCursor | None]:
        """`Wire.decode_batch`: the batch, its entries past `slice_entries` left to the cursor."""
        return decode_batch_sliced(body, slice_entries)

    def batch_decoder(self, body: bytes, judge: Any) -> BatchDecoder:
        """`Wire.batch_decoder`: decodes a long batch in slices (`Incoming.body`)."""
        return BatchDecoder(body, judge)

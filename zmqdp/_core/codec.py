"""Encode and decode every message of docs/protocol.md.

Decoding is total: for any byte string, a `decode_*` function returns a typed message or
raises `ProtocolError` (never anything else), in time linear in the input. It enforces
§8 through `cbor.loads`, checks the type of every known key, and vets every opaque value
it hands on (bodies, READY info, CALL arguments, reply results) with `cbor.check_value`.
Unknown keys are ignored, unread, so a later protocol version can add fields. Booleans
are not integers here (CBOR keeps them apart even though Python does not), and
counters, ranks and waves must be >= 0.

Encoding our own fixed-shape messages goes straight to cbor2 (made total by
`cbor.encode`). Values that come from the application (an ADD body, CALL arguments) are
checked against §8 before encoding, so a body that a conforming engine would have to
reject is refused before it is sent; any failure to encode raises `ProtocolError`.

Error scope (docs/protocol.md §7): `decode_batch` raises only for a *connection* error (the
batch as a whole is not valid); a malformed entry is returned in `bad_entries` so that
the caller can end just the request it names.

Long batches (`decode_batch_sliced`). A legal 64 MiB batch can hold millions of entries,
and checking them all in one go froze the event loop for seconds. So the client takes
the entries in slices: the first slice comes with the batch, an `EntryCursor` parses the
next ones on demand, and the caller checkpoints in between. The whole body is still
decoded by cbor2 at once (one C call), with the garbage collector paused for large
bodies (`cbor.loads`), which is what makes that call several times faster.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from . import cbor
from .cbor import INT_MAX, INT_MIN
from .errors import ProtocolError, quote
from .messages import (
    Abort,
    Add,
    BadEntry,
    Call,
    HandshakeMessage,
    Hello,
    Init,
    Load,
    Output,
    OutputBatch,
    Ready,
    Register,
    Reject,
    Reply,
    RequestMessage,
    Resync,
    Wake,
)

__all__ = [
    "ABORT",
    "ADD",
    "CALL",
    "WAKE",
    "BatchDecoder",
    "EntryCursor",
    "decode_batch",
    "decode_batch_sliced",
    "decode_handshake",
    "decode_request",
    "encode_batch",
    "encode_handshake",
    "encode_request",
]

# Request type frames (§3): one raw byte each.
ADD = b"\x00"
ABORT = b"\x01"
WAKE = b"\x02"
CALL = b"\x03"

_MISSING: Any = object()


# -- field checks ---------------------------------------------------------------------


def _map(value: Any, what: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise ProtocolError(f"{what} must be a CBOR map, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {
        int: "an integer",
        float: "a float",
        str: "a text string",
        bytes: "a byte string",
        list: "an array",
        dict: "a map",
    }.get(type(value), type(value).__name__)


def _count(m: Mapping[str, Any], key: str, what: str, *, required: bool = False) -> int | None:
    """A non-negative integer field (rank, size, seq, wave, epoch, call id, counts...),
    at most 2^63 - 1 (§1). Null = absent."""
    value = m.get(key)
    if value is None:
        if required:
            raise ProtocolError(f"{what} lacks required key {key!r}")
        return None
    if type(value) is not int or not 0 <= value <= INT_MAX:
        raise ProtocolError(
            f"{what} key {key!r} must be an integer in [0, 2^63 - 1], got {quote(value)}"
        )
    return value


def _text(m: Mapping[str, Any], key: str, what: str, *, required: bool = False) -> str | None:
    """A text field. Null counts as absent, as for every optional key."""
    value = m.get(key)
    if value is None:
        if required:
            raise ProtocolError(f"{what} lacks required key {key!r}")
        return None
    if type(value) is not str:
        raise ProtocolError(f"{what} key {key!r} must be a text string, got {_kind(value)}")
    return value


def _texts(value: Any, what: str) -> tuple[str, ...]:
    if type(value) is not list:
        raise ProtocolError(f"{what} must be an array of text strings, got {_kind(value)}")
    for item in value:
        if type(item) is not str:
            raise ProtocolError(f"{what} must hold text strings only, got {_kind(item)}")
    return tuple(value)


# -- handshake ------------------------------------------------------------------------


def encode_handshake(msg: HandshakeMessage) -> bytes:
    """The CBOR body of a handshake-socket message (or REGISTER on the input socket)."""
    if isinstance(msg, Hello):
        body: dict[str, Any] = {
            "type": "hello",
            "version": msg.version,
            "rank": msg.rank,
            "size": msg.size,
            "lockstep": msg.lockstep,
        }
        if msg.wave is not None:
            body["wave"] = msg.wave
        if msg.max_message_size is not None:
            body["max_message_size"] = msg.max_message_size
    elif isinstance(msg, Init):
        body = {
            "type": "init",
            "version": msg.version,
            "input": msg.input,
            "output": msg.output,
            "size": msg.size,
        }
        if msg.epoch is not None:
            body["epoch"] = msg.epoch
        if msg.max_message_size is not None:
            body["max_message_size"] = msg.max_message_size
    elif isinstance(msg, Reject):
        body = {"type": "reject", "reason": msg.reason}
    elif isinstance(msg, Ready):
        return cbor.dumps({"type": "ready", "info": dict(msg.info)})
    elif isinstance(msg, Register):
        body = (
            {"type": "register"} if msg.epoch is None else {"type": "register", "epoch": msg.epoch}
        )
    elif isinstance(msg, Resync):
        body = {"type": "resync"}
    else:  # pragma: no cover - exhaustiveness guard
        raise TypeError(f"not a handshake message: {msg!r}")
    return cbor.encode(body)


def decode_handshake(data: bytes | memoryview) -> HandshakeMessage:
    """Decode a handshake-socket body (either direction) or a REGISTER. The
    `ProtocolError` it raises names in `message` the type the body claimed, if any."""
    m = _map(cbor.loads(data), "handshake message")
    kind = _text(m, "type", "handshake message", required=True)
    try:
        return _handshake(m, kind)
    except ProtocolError as exc:
        raise exc.at(message=kind) from None


def _handshake(m: dict[str, Any], kind: str | None) -> HandshakeMessage:
    what = f"{quote(kind)} message"
    if kind == "hello":
        version = _count(m, "version", what, required=True)
        rank = _count(m, "rank", what, required=True)
        size = _count(m, "size", what, required=True)
        lockstep = m.get("lockstep")
        if type(lockstep) is not bool:
            raise ProtocolError(f"{what} key 'lockstep' must be a boolean, got {_kind(lockstep)}")
        wave = _count(m, "wave", what)
        limit = _count(m, "max_message_size", what)
        assert version is not None and rank is not None and size is not None
        return Hello(
            rank=rank,
            size=size,
            lockstep=lockstep,
            wave=wave,
            version=version,
            max_message_size=limit,
        )
    if kind == "init":
        version = _count(m, "version", what, required=True)
        size = _count(m, "size", what, required=True)
        inp = _text(m, "input", what, required=True)
        out = _text(m, "output", what, required=True)
        epoch = _count(m, "epoch", what)
        limit = _count(m, "max_message_size", what)
        assert version is not None and size is not None and inp is not None and out is not None
        return Init(
            input=inp,
            output=out,
            size=size,
            version=version,
            epoch=epoch,
            max_message_size=limit,
        )
    if kind == "reject":
        reason = _text(m, "reason", what, required=True)
        assert reason is not None
        return Reject(reason=reason)
    if kind == "ready":
        info = m.get("info")
        if info is None:
            return Ready()
        cbor.check_value(_map(info, "'ready' message key 'info'"))
        return Ready(info=info)
    if kind == "register":
        return Register(epoch=_count(m, "epoch", what))
    if kind == "resync":
        return Resync()
    raise ProtocolError(f"unknown handshake message type {quote(kind)}")


# -- requests -------------------------------------------------------------------------


def encode_request(msg: RequestMessage) -> tuple[bytes, bytes]:
    """The `(type, body)` frames of a request. Raises `ProtocolError` for a body or
    argument that has no §8 form (the caller names the request)."""
    if isinstance(msg, Add):
        return ADD, cbor.dumps({"id": msg.id, "body": msg.body})
    if isinstance(msg, Abort):
        return ABORT, cbor.encode(list(msg.ids))
    if isinstance(msg, Wake):
        return WAKE, cbor.encode({"wave": msg.wave})
    if isinstance(msg, Call):
        return CALL, cbor.dumps({"call": msg.call, "method": msg.method, "args": list(msg.args)})
    raise TypeError(f"not a request message: {msg!r}")  # pragma: no cover


def decode_request(kind: bytes, data: bytes | memoryview) -> RequestMessage | None:
    """Decode a request as an engine receives it. Returns None for a type byte this
    version does not know: §3 says an engine must ignore it."""
    if kind == ADD:
        m = _map(cbor.loads(data), "ADD body")
        rid = _text(m, "id", "ADD", required=True)
        if "body" not in m:
            raise ProtocolError("ADD lacks required key 'body'", request_id=rid)
        assert rid is not None
        body = m["body"]
        try:
            cbor.check_value(body)
        except ProtocolError as exc:
            raise exc.at(request_id=rid) from None
        return Add(id=rid, body=body)
    if kind == ABORT:
        return Abort(ids=_texts(cbor.loads(data), "ABORT body"))
    if kind == WAKE:
        wave = _count(_map(cbor.loads(data), "WAKE body"), "wave", "WAKE", required=True)
        assert wave is not None
        return Wake(wave=wave)
    if kind == CALL:
        m = _map(cbor.loads(data), "CALL body")
        call = _count(m, "call", "CALL", required=True)
        method = _text(m, "method", "CALL", required=True)
        args = m.get("args")
        if args is None:
            args = []
        if type(args) is not list:
            raise ProtocolError(f"CALL key 'args' must be an array, got {_kind(args)}")
        cbor.check_value(args)
        assert call is not None and method is not None
        return Call(call=call, method=method, args=tuple(args))
    if len(kind) != 1:
        raise ProtocolError(f"request type frame must be one byte, got {len(kind)}")
    return None


# -- output batches -------------------------------------------------------------------


def encode_batch(batch: OutputBatch) -> bytes:
    """The CBOR body of an output batch (engine side). Raises `ProtocolError` if an
    output body or reply result has no §8 form."""
    body: dict[str, Any] = {"rank": batch.rank}
    if batch.seq is not None:
        body["seq"] = batch.seq
    if batch.epoch is not None:
        body["epoch"] = batch.epoch
    if batch.outputs:
        body["outputs"] = [
            {"id": o.request_id, "body": o.body, "finish": o.finish} for o in batch.outputs
        ]
    if batch.finished:
        body["finished"] = list(batch.finished)
    if batch.load is not None:
        ld = batch.load
        body["load"] = {"waiting": ld.waiting, "running": ld.running, "kv": ld.kv}
    if batch.wave_complete is not None:
        body["wave_complete"] = batch.wave_complete
    if batch.start_wave is not None:
        body["start_wave"] = batch.start_wave
    if batch.replies:
        body["replies"] = [
            {"call": r.call, "error": r.error}
            if r.error is not None
            else {"call": r.call, "result": r.result}
            for r in batch.replies
        ]
    if batch.dead is not None:
        body["dead"] = batch.dead
    return cbor.dumps(body)


def _output(item: Any) -> Output:
    if type(item) is not dict:
        raise ProtocolError(f"each entry of 'outputs' must be a map, got {_kind(item)}")
    rid = item.get("id", _MISSING)
    if type(rid) is not str:
        raise ProtocolError(
            "an output lacks its 'id'"
            if rid is _MISSING
            else f"output key 'id' must be a text string, got {_kind(rid)}"
        )
    finish = item.get("finish")
    if finish is not None and type(finish) is not str:
        raise ProtocolError(
            f"output key 'finish' must be a text string or null, got {_kind(finish)}",
            request_id=rid,
        )
    body = item.get("body")
    kind = type(body)
    if kind is not str and kind is not float and body is not None and kind is not bool:
        # containers, integers (range) and anything else get the full check
        try:
            cbor.check_value(body)
        except ProtocolError as exc:
            raise exc.at(request_id=rid) from None
    return Output(rid, body, finish)


def _load(value: Any) -> Load:
    m = _map(value, "batch key 'load'")
    waiting = _count(m, "waiting", "load") or 0
    running = _count(m, "running", "load") or 0
    kv = m.get("kv")
    if kv is None:  # null is absent, as for every optional key
        kv = 0.0
    elif type(kv) is int:
        if not INT_MIN <= kv <= INT_MAX:
            raise ProtocolError(f"load key 'kv' must be a number, got {quote(kv)}")
        kv = float(kv)
    elif type(kv) is not float:
        raise ProtocolError(f"load key 'kv' must be a number, got {_kind(kv)}")
    if not math.isnan(kv):
        kv = min(1.0, max(0.0, kv))
    return Load(waiting, running, kv)


def _reply(item: Any) -> Reply:
    m = _map(item, "each entry of 'replies'")
    call = _count(m, "call", "reply", required=True)
    assert call is not None
    error = _text(m, "error", "reply")
    if error is not None:
        return Reply(call=call, error=error)
    result = m.get("result")
    cbor.check_value(result)
    return Reply(call=call, result=result)


def _array(m: Mapping[str, Any], key: str) -> list[Any] | None:
    raw = m.get(key)
    if raw is None or type(raw) is list:
        return raw
    raise ProtocolError(f"batch key {key!r} must be an array, got {_kind(raw)}")


def _usable_id(item: Any, key: str) -> str | int | None:
    """The wire id (or call id) a malformed entry still names, if it names one."""
    if type(item) is not dict:
        return None
    if key == "replies":
        call = item.get("call")
        return call if type(call) is int and 0 <= call <= INT_MAX else None
    rid = item.get("id")
    return rid if type(rid) is str else None


def _entries(
    raw: list[Any],
    key: Literal["outputs", "finished", "replies"],
    parse: Any,
    bad: list[BadEntry],
) -> tuple[Any, ...]:
    """Parse every entry of one array; a malformed one goes to `bad` (§7 entry
    error) instead of failing the batch. The common all-valid case is one `map`."""
    if key == "finished" and all(type(item) is str for item in raw):
        return tuple(raw)
    try:
        return tuple(map(parse, raw))
    except ProtocolError:
        pass
    good = []
    for item in raw:
        try:
            good.append(parse(item))
        except ProtocolError as exc:
            bad.append(BadEntry(key, _usable_id(item, key), exc.cause))
    return tuple(good)


def _finished_id(item: Any) -> str:
    if type(item) is not str:
        raise ProtocolError(f"each entry of 'finished' must be a text string, got {_kind(item)}")
    return item


_PARSERS: tuple[tuple[Literal["outputs", "finished", "replies"], Any], ...] = (
    ("outputs", _output),
    ("finished", _finished_id),
    ("replies", _reply),
)


class EntryCursor:
    """The entries of a long batch not handed out yet, in batch order: `outputs`, then
    `finished`, then `replies`. Each `next_slice` takes up to `n` of them, parsing them
    with the same entry rules as `decode_batch` (unless `parsed`: `BatchDecoder` parses
    each entry as it decodes it, so that the work of a step is bounded by its bytes)."""

    __slots__ = ("_arrays", "_key", "_parsed", "_pos")

    def __init__(self, arrays: list[list[Any]], *, parsed: bool = False) -> None:
        self._arrays = arrays  # the outputs, finished and replies arrays
        self._parsed = parsed  # their items are parsed entries and BadEntry already
        self._key = 0
        self._pos = 0

    def remaining(self) -> int:
        left = sum(len(a) for a in self._arrays[self._key :])
        return left - self._pos

    def next_slice(
        self, n: int
    ) -> tuple[tuple[Output, ...], tuple[str, ...], tuple[Reply, ...], tuple[BadEntry, ...]]:
        """Parse up to `n` more entries: (outputs, finished, replies, bad entries)."""
        parsed: list[tuple[Any, ...]] = [(), (), ()]
        bad: list[BadEntry] = []
        while n > 0 and self._key < 3:
            raw = self._arrays[self._key]
            end = min(len(raw), self._pos + n)
            if end > self._pos:
                key, parse = _PARSERS[self._key]
                chunk = raw if self._pos == 0 and end == len(raw) else raw[self._pos : end]
                if self._parsed:
                    parsed[self._key] = tuple(x for x in chunk if type(x) is not BadEntry)
                    bad += [x for x in chunk if type(x) is BadEntry]
                else:
                    parsed[self._key] = _entries(chunk, key, parse, bad)
                n -= end - self._pos
            if end < len(raw):
                self._pos = end
                break
            self._key += 1
            self._pos = 0
        return parsed[0], parsed[1], parsed[2], tuple(bad)


def decode_batch(data: bytes | memoryview) -> OutputBatch:
    """Decode one output batch as the client receives it.

    Raises `ProtocolError` for what §7 calls a connection error: not §8 CBOR, not a
    map, `rank` missing, or a known top-level key of the wrong type. A malformed entry
    of `outputs`, `finished` or `replies` does not fail the batch: it is returned in
    `bad_entries`, with the id it names if it names one, and the other entries stand.
    """
    return decode_batch_sliced(data)[0]


def decode_batch_sliced(
    data: bytes | memoryview, max_entries: int | None = None
) -> tuple[OutputBatch, EntryCursor | None]:
    """`decode_batch`, with at most `max_entries` entries parsed: the batch holds the
    first ones, and the cursor (None if nothing is left) the rest. The scalar fields
    are all checked here, so a connection error is always raised by this call."""
    return _batch_from_map(cbor.loads(data), max_entries)


def _batch_from_map(
    m: Any, max_entries: int | None, parsed: bool = False
) -> tuple[OutputBatch, EntryCursor | None]:
    if type(m) is not dict:
        raise ProtocolError(f"output batch must be a CBOR map, got {_kind(m)}")
    for key in m:
        if type(key) is not str:  # §8: maps with text keys (MapReader refuses them too)
            raise ProtocolError(f"a top-level map key must be a text string, got {quote(key)}")
    rank = _count(m, "rank", "output batch", required=True)
    assert rank is not None
    try:
        seq = _count(m, "seq", "output batch")
        epoch = _count(m, "epoch", "output batch")
        arrays = [_array(m, key) or [] for key in _ARRAY_KEYS]
        raw = m.get("load")
        load = None if raw is None else _load(raw)
        wave_complete = _count(m, "wave_complete", "output batch")
        start_wave = _count(m, "start_wave", "output batch")
        dead = _text(m, "dead", "output batch")
    except ProtocolError as exc:
        raise exc.at(rank=rank) from None
    cursor = EntryCursor(arrays, parsed=parsed)
    total = len(arrays[0]) + len(arrays[1]) + len(arrays[2])
    outputs, finished, replies, bad = cursor.next_slice(
        total if max_entries is None else max_entries
    )
    batch = OutputBatch(
        rank=rank,
        seq=seq,
        epoch=epoch,
        outputs=outputs,
        finished=finished,
        load=load,
        wave_complete=wave_complete,
        start_wave=start_wave,
        replies=replies,
        dead=dead,
        bad_entries=bad,
    )
    return batch, cursor if cursor.remaining() else None


_ARRAY_KEYS = ("outputs", "finished", "replies")


class BatchDecoder:
    """Decodes one large output batch in steps, for a caller that checkpoints between
    them (`cbor.MapReader`): `step()` decodes and checks at most `max_bytes` of the body
    (or `max_items` items), plus the item it is on, and returns True once the whole body
    is decoded; `result()` is then what `decode_batch_sliced` returns for the same body.
    Both raise `ProtocolError` only.

    Top-level arrays are taken element by element, and each entry of `outputs`,
    `finished` and `replies` is parsed as it is decoded (the elements of unknown keys
    are decoded and dropped); any other value, and each single element, is one cbor2
    call: its cost is bounded by `max_message_size` only."""

    __slots__ = (
        "_array",
        "_array_left",
        "_judge",
        "_left",
        "_map",
        "_parse",
        "_reader",
        "junk",
        "known",
    )

    def __init__(
        self, data: bytes | memoryview, judge: Callable[[Any], bool | None] | None = None
    ) -> None:
        self._reader = cbor.MapReader(data)
        self._judge = judge
        self.junk = 0
        """Entries decoded so far that `judge` called junk (True), so that the caller's
        stray rule can stop a batch of junk long before it is all decoded."""
        self.known = 0
        """Entries decoded so far that `judge` called known (False; None is neither)."""
        self._map: dict[str, Any] = {}
        self._left = self._reader.pairs
        self._array: list[Any] | None = None
        self._array_left = 0
        self._parse: Any = None

    def step(self, max_items: int = 4096, max_bytes: int = 256 * 1024) -> bool:
        with cbor.gc_paused():  # see cbor.gc_paused: 25 % faster, and no collection inside
            return self._step(max_items, max_bytes)

    def _step(self, max_items: int, max_bytes: int) -> bool:
        reader = self._reader
        stop = reader.position() + max_bytes
        while max_items > 0 and reader.position() < stop:
            if self._array_left:
                element, parse, array = reader.element, self._parse, self._array
                position, judge = reader.position, self._judge
                while self._array_left and max_items > 0 and position() < stop:
                    value = element()
                    if array is not None:
                        entry = parse(value)
                        array.append(entry)
                        if judge is not None:
                            verdict = judge(entry)
                            if verdict:
                                self.junk += 1
                            elif verdict is not None:
                                self.known += 1
                    self._array_left -= 1
                    max_items -= 1
                continue
            if not self._left:
                reader.finish()
                return True
            self._left -= 1
            max_items -= 1
            key = reader.key()
            length = reader.array()
            if length is None:
                self._map[key] = reader.value()
            elif key in _ARRAY_KEYS:
                self._array = self._map[key] = []
                self._parse = _parsed_or_bad(*_PARSERS[_ARRAY_KEYS.index(key)])
                self._array_left = length
            else:  # its elements are checked and dropped; a known key still sees an array
                self._array = None
                self._map[key] = []
                self._array_left = length
        if not self._array_left and not self._left:
            reader.finish()
            return True
        return False

    def result(self, max_entries: int | None = None) -> tuple[OutputBatch, EntryCursor | None]:
        return _batch_from_map(self._map, max_entries, parsed=True)

    def seen(self, key: str) -> Any:
        """The raw value of a top-level key decoded so far (None if not yet, or absent):
        the caller can tell a stale batch (`epoch`) before the body is all decoded."""
        return self._map.get(key)


def _parsed_or_bad(key: Literal["outputs", "finished", "replies"], parse: Any) -> Any:
    """`parse` for one entry of `key`, returning a `BadEntry` instead of raising."""

    def one(item: Any) -> Any:
        try:
            return parse(item)
        except ProtocolError as exc:
            return BadEntry(key, _usable_id(item, key), exc.cause)

    return one

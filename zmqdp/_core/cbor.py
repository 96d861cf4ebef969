"""CBOR restricted to docs/protocol.md §8, on top of cbor2.

What cbor2 enforces for us, given the right options:

* indefinite lengths (`allow_indefinite=False`), duplicate map keys
  (`allow_duplicate_keys=False`), nesting depth (`max_depth=64`), invalid UTF-8;
* tags: cbor2 decodes many semantic tags natively (bignums, sets, datetimes, regexes,
  shared values, string references, the self-describe tag ...) and only calls
  `tag_hook` for the others. `semantic_decoders` overrides the native ones, so we pass
  a mapping that answers "reject" for *every* tag number.

What it does not, and we do here:

* trailing bytes: `cbor2.loads` ignores everything after the first item, so we decode
  from a stream and compare the position with the length;
* simple values other than false/true/null, and map keys that are not text strings:
  `check_value` walks opaque values (an ADD body, an output body, READY info ...);
  known fields are type-checked by the codec itself.

The same `check_value` vets values before encoding, so nothing we send can be refused
by a conforming engine: a value of the allowed Python types encodes to allowed CBOR.
Decoding is O(len(data)) and raises only `ProtocolError`.
"""

from __future__ import annotations

import gc
import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import cbor2

from .errors import QUOTE_LIMIT, ProtocolError, quote

__all__ = ["INT_MAX", "INT_MIN", "MAX_DEPTH", "MapReader", "check_value", "dumps", "loads"]

MAX_DEPTH = 64
"""Deepest container nesting accepted (a top-level map or array is at depth 1)."""

INT_MIN = -(2**63)
INT_MAX = 2**63 - 1
"""§1: every integer on the wire is within signed 64 bits (CBOR itself allows 2^64 - 1
and -2^64, which many decoders, msgpack's among them, cannot hold)."""
_INT_MIN = INT_MIN
_INT_MAX = INT_MAX


def _reject_tag(*_: Any) -> NoReturn:
    raise ValueError("CBOR tags are not allowed")


class _EveryTag(dict[int, Any]):
    """A `semantic_decoders` mapping that claims every tag number, so that cbor2's
    native tag decoders never run (cbor2 looks tags up with `in` / `get`)."""

    def __contains__(self, key: object) -> bool:
        return True

    def __missing__(self, key: int) -> Any:
        return _reject_tag

    def get(self, key: int, default: Any = None) -> Any:
        return _reject_tag


_DECODER_OPTIONS: dict[str, Any] = {
    "tag_hook": _reject_tag,
    "semantic_decoders": _EveryTag(),
    "max_depth": MAX_DEPTH,
    "allow_indefinite": False,
    "allow_duplicate_keys": False,
}


GC_PAUSE_BYTES = 1 << 20
"""Bodies at least this large are decoded with the garbage collector paused."""

_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a large body is decoded.

    Decoding builds millions of containers, which triggers full collections over and over
    while the result grows (3x the decode time of a 100 MiB batch, measured); the result
    holds no cycles, so there is nothing for them to find. Counted, so that concurrent
    decodes in several threads restore the collector's state only when the last ends."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def gc_pausers() -> int:
    """How many `gc_paused` blocks are open now, in every thread."""
    return _gc_pausers


def loads(data: bytes | memoryview) -> Any:
    """Decode exactly one CBOR item with §8's rules (but see `check_value` for opaque
    values). Raises `ProtocolError` and nothing else."""
    if len(data) >= GC_PAUSE_BYTES:
        with gc_paused():
            return _loads(data)
    return _loads(data)


_FAST_OPTIONS = {**_DECODER_OPTIONS, "max_depth": MAX_DEPTH - 1}


def _loads(data: bytes | memoryview) -> Any:
    fp = io.BytesIO(data)
    try:
        value = cbor2.CBORDecoder(fp, **_FAST_OPTIONS).decode()  # see `_Item`
    except Exception as exc:  # cbor2 wraps its own errors; be total regardless
        if "nesting depth" not in f"{exc} {exc.__cause__}":
            raise _invalid(exc) from None
        fp.seek(0)
        value = _Item(fp, MAX_DEPTH).decode_at_limit()
    _check_end(fp.tell(), len(data))
    return value


class _Item:
    """Decodes one item from `fp` with at most `depth` levels of nesting, exactly.

    cbor2's `max_depth` is checked when a container's *items* are decoded, so an empty
    container one level too deep gets through it. Decoding with one level less first
    settles almost every body (whatever passes that is within `depth`); only a body that
    reaches the limit is decoded again with the full depth and walked once."""

    __slots__ = ("_depth", "_fast", "_fp")

    def __init__(self, fp: io.BytesIO, depth: int) -> None:
        self._fp = fp
        self._depth = depth
        self._fast = cbor2.CBORDecoder(fp, **{**_DECODER_OPTIONS, "max_depth": depth - 1})

    def decode(self) -> Any:
        start = self._fp.tell()
        try:
            return self._fast.decode()
        except Exception as exc:  # cbor2 wraps its own errors; be total regardless
            # A cbor2 decoder that raised is left in a broken state (its next decode
            # returns leftovers of the failed item): the next item gets a fresh one.
            self._fast = cbor2.CBORDecoder(
                self._fp, **{**_DECODER_OPTIONS, "max_depth": self._depth - 1}
            )
            if "nesting depth" not in f"{exc} {exc.__cause__}":
                raise _invalid(exc) from None
        self._fp.seek(start)
        return self.decode_at_limit()

    def decode_at_limit(self) -> Any:
        """Decode with the full depth (rare: the body reaches the limit) and check it."""
        full = cbor2.CBORDecoder(self._fp, **{**_DECODER_OPTIONS, "max_depth": self._depth})
        try:
            value = full.decode()
        except Exception as exc:
            raise _invalid(exc) from None
        _check_depth(value, self._depth)
        return value


def _check_depth(value: Any, depth: int) -> None:
    """Raise unless every container in `value` is at most `depth` levels deep."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if type(item) is list or type(item) is dict:
            if level > depth:
                raise ProtocolError(f"invalid CBOR body: nested deeper than {MAX_DEPTH}")
            children = item.values() if type(item) is dict else item
            stack.extend((child, level + 1) for child in children)


def _invalid(exc: Exception) -> ProtocolError:
    cause = exc.__cause__ or exc.__context__
    detail = f"{exc}: {cause}" if cause is not None and str(cause) not in str(exc) else str(exc)
    if len(detail) > QUOTE_LIMIT:  # cbor2 quotes the offending value (a key, a string)
        detail = f"{detail[:QUOTE_LIMIT]}..."
    return ProtocolError(f"invalid CBOR body: {detail}")


def _check_end(end: int, length: int) -> None:
    if end != length:
        raise ProtocolError(f"{length - end} trailing bytes after the CBOR body")


class MapReader:
    """Decode a body whose top level is a map one piece at a time, so that a very large
    body can be decoded in slices with checkpoints in between (cbor2 decodes a whole
    item in one uninterruptible call: seconds for a 64 MiB batch).

    It enforces what `loads` enforces, item by item: cbor2 decodes every key, value and
    array element with the same options and the depth left at that level; the map and
    array heads, which this class reads itself, must have definite lengths and no tag;
    duplicate keys are refused; nothing may follow the map. It is stricter in one point
    only: a top-level key must be a text string (§8 "maps with text keys"); `loads`
    leaves that to the caller, and the codec refuses such keys in both paths.

    Use: `pairs` is the number of entries; for each, `key()`, then either `array()`
    (a definite array's length, its elements to be read with `element()`) or `value()`.
    `finish()` checks that the body ends there. Every method raises `ProtocolError`.
    """

    __slots__ = ("_data", "_element", "_fp", "_keys", "_value", "pairs")

    def __init__(self, data: bytes | memoryview) -> None:
        self._data = memoryview(data)
        self._fp = io.BytesIO(data)
        self._value = _Item(self._fp, MAX_DEPTH - 1)  # under the top-level map
        self._element = _Item(self._fp, MAX_DEPTH - 2)  # in an array under it
        self._keys: set[str] = set()
        head = self._head(5)
        if head is None:
            raise ProtocolError("output batch must be a CBOR map")
        self.pairs = head

    def _head(self, major: int) -> int | None:
        """If the next item has `major` type with a definite length, consume its head and
        return that length; else leave it and return None."""
        pos = self._fp.tell()
        data = self._data
        if pos >= len(data):
            raise ProtocolError("invalid CBOR body: premature end of data")
        initial = data[pos]
        if initial >> 5 != major:
            return None
        info = initial & 0x1F
        if info < 24:
            length, size = info, 0
        elif info <= 27:
            size = 1 << (info - 24)
            if pos + 1 + size > len(data):
                raise ProtocolError("invalid CBOR body: premature end of data")
            length = int.from_bytes(data[pos + 1 : pos + 1 + size], "big")
        elif info == 31:
            raise ProtocolError("invalid CBOR body: indefinite-length items are not allowed")
        else:
            raise ProtocolError(f"invalid CBOR body: reserved additional information {info}")
        self._fp.seek(pos + 1 + size)
        return length

    def key(self) -> str:
        key = self._value.decode()
        if type(key) is not str:
            raise ProtocolError(f"a top-level map key must be a text string, got {quote(key)}")
        if key in self._keys:
            raise ProtocolError(f"invalid CBOR body: duplicate map key {quote(key)}")
        self._keys.add(key)
        return key

    def array(self) -> int | None:
        """The length of the definite array that comes next (its head consumed), or None
        if the next value is not an array (read it with `value()`)."""
        return self._head(4)

    def value(self) -> Any:
        return self._value.decode()

    def element(self) -> Any:
        return self._element.decode()

    def position(self) -> int:
        """How many bytes have been read."""
        return self._fp.tell()

    def finish(self) -> None:
        _check_end(self._fp.tell(), len(self._data))


def _kind_error(value: Any) -> ProtocolError:
    if value is cbor2.undefined or isinstance(value, cbor2.CBORSimpleValue):
        return ProtocolError(f"CBOR simple value {quote(value)} is not allowed")
    if type(value) is int:
        return ProtocolError(f"integer {quote(value)} is outside the signed 64-bit range (§1)")
    return ProtocolError(f"a value of type {type(value).__name__} has no CBOR form in §8")


def check_value(value: Any, depth: int = MAX_DEPTH) -> None:
    """Raise `ProtocolError` unless `value` is made only of None, bool, int (64-bit),
    float, str, bytes, list and dict with str keys, nested at most `depth` deep."""
    t = type(value)
    if t is str or t is float or t is bool or value is None or t is bytes:
        return
    if t is int:
        if not _INT_MIN <= value <= _INT_MAX:
            raise _kind_error(value)
        return
    if t is not list and t is not dict:
        raise _kind_error(value)
    stack: list[tuple[Any, int]] = [(value, depth)]
    while stack:
        container, budget = stack.pop()
        if budget <= 0:
            raise ProtocolError(f"value nested deeper than {MAX_DEPTH}")
        if type(container) is dict:
            for key in container:
                if type(key) is not str:
                    raise ProtocolError(f"map key {quote(key)} is not a text string")
            items = container.values()
        else:
            items = container
        for item in items:
            t = type(item)
            if t is str or t is float or t is bool or item is None or t is bytes:
                continue
            if t is int:
                if not _INT_MIN <= item <= _INT_MAX:
                    raise _kind_error(item)
            elif t is list or t is dict:
                stack.append((item, budget - 1))
            else:
                raise _kind_error(item)


def dumps(obj: Any, *, depth: int = MAX_DEPTH) -> bytes:
    """Encode a value after `check_value`; raise `ProtocolError` if it has no §8 form.

    Total like `loads`: whatever cbor2 raises (a string with a lone surrogate has no
    UTF-8 form and raises `UnicodeEncodeError`) becomes `ProtocolError`, so a caller that
    rolls back on `ProtocolError` rolls back on every failure to encode."""
    check_value(obj, depth)
    return encode(obj)


def encode(obj: Any) -> bytes:
    """`cbor2.dumps` for a value known to be in the subset, made total: any failure
    (for example a lone surrogate in a string) raises `ProtocolError`."""
    try:
        return cbor2.dumps(obj)
    except Exception as exc:
        raise ProtocolError(f"cannot encode as CBOR: {type(exc).__name__}: {exc}") from None

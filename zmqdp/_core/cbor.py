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

import io
from typing import Any, NoReturn

import cbor2

from .errors import QUOTE_LIMIT, ProtocolError, quote

__all__ = ["INT_MAX", "INT_MIN", "MAX_DEPTH", "check_value", "dumps", "loads"]

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


def loads(data: bytes | memoryview) -> Any:
    """Decode exactly one CBOR item with §8's rules (but see `check_value` for opaque
    values). Raises `ProtocolError` and nothing else."""
    fp = io.BytesIO(data)
    try:
        value = cbor2.CBORDecoder(fp, **_DECODER_OPTIONS).decode()
    except Exception as exc:  # cbor2 wraps its own errors; be total regardless
        cause = exc.__cause__ or exc.__context__
        detail = f"{exc}: {cause}" if cause is not None and str(cause) not in str(exc) else str(exc)
        if len(detail) > QUOTE_LIMIT:  # cbor2 quotes the offending value (a key, a string)
            detail = f"{detail[:QUOTE_LIMIT]}..."
        raise ProtocolError(f"invalid CBOR body: {detail}") from None
    end = fp.tell()
    if end != len(data):
        raise ProtocolError(f"{len(data) - end} trailing bytes after the CBOR body")
    return value


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

"""Codec fuzz of vLLM's wire (hostile peers): every decoder of `zmqdp.vllm.codec` is total.

vLLM's engine-core wire has no authentication: whoever reaches the handshake or input
port can send anything. For ANY bytes, `decode_hello`, `decode_ready_response` and
`decode_outputs` return a well-typed value or raise `ProtocolError`, never anything
else (a `RecursionError` for about 1,000 nested arrays, a 1 KB message, used to escape
the socket's task and end the group), and an error message stays small. Whatever a
decoder accepts encodes again (msgspec, as vLLM encodes) to a message that decodes to
the same value.

The inputs, as in tests/core/test_codec_fuzz.py (whose `Case`, `same` and generic byte
mutations this module reuses), start from *valid* messages so that they get past the
first checks: HELLO / READY maps, ready responses, `EngineCoreOutputs` arrays with
entries, scheduler stats, utility outputs and error details (vLLM 0.32 and 0.33
shapes, shorter and longer arrays). Then:

* `vllm_arbitrary_cases`: random bytes to every decoder;
* `vllm_mutated_cases`: byte-level damage, msgpack-aware: item heads rewritten (other
  type, reserved byte 0xC1, ext types and bad timestamps, huge declared lengths), an
  item buried under 60 to 100,000 levels of arrays or maps (`_nest_deep`), invalid
  UTF-8, splices of two messages;
* `vllm_structure_cases`: a nested value, key or container replaced by a hostile one
  (wrong types, integers at the 64-bit edges, NaN, ext values, non-text keys, long
  strings, raw msgpack 1,000 levels deep), re-encoded with msgspec.

scripts/fuzz_codec.py runs `PROPERTIES` for long runs, with the native wire's.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from zmqdp._core.errors import ProtocolError
from zmqdp._core.messages import BadEntry, Load, Output, OutputBatch, Reply
from zmqdp.vllm.codec import (
    FINISH_REASONS,
    VllmError,
    VllmOutput,
    decode_hello,
    decode_outputs,
    decode_ready_response,
)

from .test_codec_fuzz import (
    ALL,
    MAX_ERROR_CHARS,
    Case,
    Outcome,
    _delete,
    _duplicate,
    _flip_bit,
    _insert,
    _paths,
    _pos,
    _replace_at,
    _truncate,
    same,
)

__all__ = ["DECODERS", "FAMILIES", "PROPERTIES", "exercise"]

FAMILIES = ("hello", "ready", "outputs")
"""vLLM message families: handshake HELLO/READY, ready responses, EngineCoreOutputs."""
DECODERS = ("vllm.decode_hello", "vllm.decode_ready_response", "vllm.decode_outputs")
U64 = 2**64 - 1
I64_MIN = -(2**63)

_encode = msgspec.msgpack.Encoder().encode

# -- valid values and messages ----------------------------------------------------------

INT_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, U64]
counts = st.integers(0, 40) | st.sampled_from(INT_EDGES[:-1]) | st.integers(0, 2**63 - 1)
ints = (
    st.integers(-40, 40)
    | st.sampled_from([*INT_EDGES, -1, -32, -33, -128, -129, -(2**31), I64_MIN])
    | st.integers(I64_MIN, U64)
)
texts = st.text(max_size=10) | st.sampled_from(["", "a#0", "HELLO", "x" * 31, "y" * 32, "é" * 130])
scalars = st.none() | st.booleans() | ints | st.floats() | texts | st.binary(max_size=24)
plain_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
"""msgpack values as vLLM's msgspec decoder returns them (untyped: lists and maps)."""


@st.composite
def _map(draw: st.DrawFn, required: dict[str, Any], optional: dict[str, Any]) -> dict[str, Any]:
    """A map with the known keys, maybe a few unknown ones, in a random order."""
    m = draw(st.fixed_dictionaries(required, optional=optional))
    extra = draw(st.dictionaries(texts, plain_values, max_size=2))
    m.update((k, v) for k, v in extra.items() if k not in required and k not in optional)
    return dict(draw(st.permutations(list(m.items()))))


_hellos = _map(
    {"status": st.sampled_from(["HELLO", "READY"]) | texts},
    {
        "local": st.booleans(),
        "headless": st.booleans(),
        "parallel_config_hash": texts,
        "num_gpu_blocks": counts,
    },
)
_ready_responses = _map(
    {},
    {
        "max_num_seqs": counts,
        "max_model_len": counts,
        "vllm_version": st.sampled_from(["0.32.0", "0.33.1", "1.0", "x"]) | texts,
        "dtype": texts,
        "parallel_config_hash": texts,
    },
)
_request_errors = _map({"code": texts, "message": texts}, {"retryable": st.booleans()}).map(
    lambda m: {k: m[k] for k in ("code", "message", "retryable") if k in m}
)


@st.composite
def _entries(draw: st.DrawFn) -> list[Any]:
    """An `EngineCoreOutput`: the 7 fields zmqdp reads, then up to 13 more (0.32 has 18
    in all, 0.33 19: `error`, a map, for an ERROR finish)."""
    finish = draw(st.none() | st.integers(0, len(FINISH_REASONS) - 1))
    entry: list[Any] = [
        draw(texts),
        draw(st.lists(ints, max_size=6)),
        None,
        None,
        None,
        finish,
        draw(st.none() | ints | texts),
    ]
    if finish == 3 and draw(st.booleans()):
        entry += [None] * 11 + [draw(_request_errors)]
    else:
        entry += draw(st.lists(st.none() | scalars, max_size=13))
    return entry


_scheduler_stats = _map(
    {},
    {
        "num_running_reqs": counts,
        "num_waiting_reqs": counts,
        "kv_cache_usage": st.floats() | ints,
        "step_counter": counts,
    },
)
_utility_outputs = st.tuples(
    st.integers(0, U64),
    st.none() | texts,
    st.none() | st.tuples(st.none() | texts, plain_values).map(list),
).map(list)


@st.composite
def _outputs(draw: st.DrawFn) -> list[Any]:
    """`EngineCoreOutputs` (an array): all 8 fields zmqdp reads, fewer (trailing
    defaults), or more (a later vLLM's)."""
    msg: list[Any] = [
        draw(counts),
        draw(st.lists(_entries(), max_size=4)),
        draw(st.none() | _scheduler_stats),
        draw(st.floats(allow_nan=False, allow_infinity=False)),
        draw(st.none() | _utility_outputs),
        draw(st.none() | st.lists(texts, max_size=3)),
        draw(st.none() | counts),
        draw(st.none() | counts),
    ]
    if draw(st.integers(0, 3)) == 0:
        return msg[: draw(st.integers(1, 7))]
    return msg + draw(st.lists(plain_values, max_size=2))


_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "hello": _hellos,
    "ready": _ready_responses,
    "outputs": _outputs(),
}


def valid_values(family: str | None = None) -> st.SearchStrategy[tuple[str, Any]]:
    """`(family, value)` of a valid message of `family` (None: any family)."""
    if family is None:
        return st.sampled_from(FAMILIES).flatmap(valid_values)
    return _VALUES[family].map(lambda v: (family, v))


@st.composite
def valid_cases(draw: st.DrawFn, family: str | None = None) -> Case:
    target, value = draw(valid_values(family))
    return Case(target, b"", _encode(value))


# -- arbitrary bytes ----------------------------------------------------------------------

vllm_arbitrary_cases = st.builds(
    Case,
    st.just(ALL),
    st.just(b""),
    st.binary(max_size=64) | st.binary(min_size=64, max_size=4096),
    st.just(False),
)

# -- byte-level mutations, msgpack-aware -------------------------------------------------


def _head(data: bytes | bytearray, pos: int) -> tuple[int, int, int]:
    """The item head at `pos`: (bytes after the head byte to skip, items it contains,
    whether it has a payload length to skip as well) as ``(skip, items, payload)``."""
    b = data[pos]
    if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC1, 0xC2, 0xC3):
        return 0, 0, 0
    if 0x80 <= b <= 0x8F:
        return 0, 2 * (b & 0x0F), 0
    if 0x90 <= b <= 0x9F:
        return 0, b & 0x0F, 0
    if 0xA0 <= b <= 0xBF:
        return 0, 0, b & 0x1F
    width = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4, 0xD9: 1, 0xDA: 2}
    width |= {0xDB: 4, 0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
    if b in width:
        w = width[b]
        n = int.from_bytes(data[pos + 1 : pos + 1 + w], "big")
        ext = 1 if b in (0xC7, 0xC8, 0xC9) else 0
        if b in (0xDC, 0xDD):
            return w, n, 0
        if b in (0xDE, 0xDF):
            return w, 2 * n, 0
        return w + ext, 0, n
    fixed = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
    fixed |= {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
    fixed |= {0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}  # fixext: type + data
    return fixed[b], 0, 0


def msgpack_heads(data: bytes | bytearray) -> list[int]:
    """The offsets of the item heads of a msgpack encoding, in order; the walk stops at
    the first head it cannot follow (truncated input)."""
    heads: list[int] = []
    pending = [1]
    pos = 0
    while pending and pos < len(data):
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        heads.append(pos)
        skip, items, payload = _head(data, pos)
        pos += 1 + skip + payload
        if items:
            pending.append(items)
    return heads


def _head_pos(draw: st.DrawFn, data: bytearray) -> int:
    heads = msgpack_heads(data)
    return draw(st.sampled_from(heads)) if heads else _pos(draw, data)


DEEP_LEVELS = [60, 500, 997, 998, 999, 1000, 1001, 1100, 5000, 100_000]
"""How deep `_nest_deep` buries an item: msgspec recurses once per level and raises
`RecursionError` near Python's limit (1,000, fewer from deeper in the stack)."""
NEST_PREFIXES = [b"\x91", b"\x81\xa1a", b"\xdc\x00\x01", b"\x81\x91\x00"]
"""One level each: array, map (value side), array16, map (key side: an array key)."""
HUGE_HEADS = [
    b"\xdd\xff\xff\xff\xff",  # array32 of 2^32 - 1
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdb\xff\xff\xff\xff",  # str32
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xc9\xff\xff\xff\xff\x05",  # ext32
    b"\xdc\xff\xff",
    b"\xde\xff\xff",
]
SNIPPETS = [
    *HUGE_HEADS,
    b"\xc1",  # never used
    b"\xc0",
    b"\xa2\xff\xfe",  # invalid UTF-8
    b"\xa3\xed\xa0\x80",  # an encoded surrogate
    b"\xd4\x05\x00",  # fixext 1
    b"\xd6\xff\x00\x00\x00\x00",  # timestamp 32
    b"\xd7\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # timestamp 64, nanoseconds > 10^9
    b"\xc7\x0c\xff" + b"\xff" * 12,  # timestamp 96, out of range
    b"\xc7\x03\xff\x00\x00\x00",  # timestamp of a bad length
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # NaN
    b"\xcf" + b"\xff" * 8,  # 2^64 - 1
    b"\xd3\x80" + b"\x00" * 7,  # -2^63
    b"\x81\x80\x00",  # a map as a map key
    b"\x81\x91\x80\x00",  # an array holding a map as a key
    b"\x91" * 1000 + b"\xc0",  # the 1 KB message that ended a group
]
INTERESTING_BYTES = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, *range(0xC0, 0x100)]


def _replace_byte(draw: st.DrawFn, data: bytearray) -> bytearray:
    if data:
        new = draw(st.sampled_from(INTERESTING_BYTES) | st.integers(0, 255))
        data[_head_pos(draw, data) if draw(st.booleans()) else _pos(draw, data)] = new
    return data


def _insert_snippet(draw: st.DrawFn, data: bytearray) -> bytearray:
    at = _head_pos(draw, data) if data and draw(st.booleans()) else _pos(draw, data, end=True)
    data[at:at] = draw(st.sampled_from(SNIPPETS) | st.binary(min_size=1, max_size=8))
    return data


def _splice(draw: st.DrawFn, data: bytearray) -> bytearray:
    other = draw(valid_cases()).data
    cut = _head_pos(draw, data) if data and draw(st.booleans()) else _pos(draw, data, end=True)
    return data[:cut] + other[draw(st.integers(0, len(other))) :]


def _huge_length(draw: st.DrawFn, data: bytearray) -> bytearray:
    at = _head_pos(draw, data) if data else 0
    head = draw(st.sampled_from(HUGE_HEADS))
    if draw(st.booleans()) and data:
        data[at : at + 1] = head  # replace the head byte (its argument bytes stay)
    else:
        data[at:at] = head
    return data


def _nest_deep(draw: st.DrawFn, data: bytearray) -> bytearray:
    """Bury one item (or the whole message) under 60 to 100,000 levels of one-element
    arrays or maps: still well-formed msgpack, only deep."""
    at = _head_pos(draw, data) if data else 0
    prefix = draw(st.sampled_from(NEST_PREFIXES))
    data[at:at] = prefix * draw(st.sampled_from(DEEP_LEVELS))
    return data


def _wrap(draw: st.DrawFn, data: bytearray) -> bytearray:
    before, after = draw(
        st.sampled_from(
            [(b"\x91", b""), (b"\x92", b"\xc0"), (b"\x81\xa6status", b""), (b"", b"\xc0")]
        )
    )
    return bytearray(before) + data + after


Mutation = Callable[[st.DrawFn, bytearray], bytearray]
MUTATIONS: list[Mutation] = [
    _flip_bit,
    _replace_byte,
    _insert,
    _insert_snippet,
    _delete,
    _truncate,
    _duplicate,
    _splice,
    _huge_length,
    _nest_deep,
    _wrap,
]


@st.composite
def vllm_mutated_cases(draw: st.DrawFn, family: str | None = None) -> Case:
    """A valid message of `family`, then one to four byte-level mutations."""
    case = draw(valid_cases(family))
    data = bytearray(case.data)
    for _ in range(draw(st.integers(1, 4))):
        data = draw(st.sampled_from(MUTATIONS))(draw, data)
    return Case(case.target, b"", bytes(data))


# -- structure-level mutations --------------------------------------------------------------


def _deep(levels: int, prefix: bytes = b"\x91", leaf: bytes = b"\xc0") -> msgspec.Raw:
    """`levels` nested containers as raw msgpack (msgspec's encoder would recurse)."""
    return msgspec.Raw(prefix * levels + leaf)


UTC = datetime.UTC
SPECIAL_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1.0,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "HELLO",
    "READY",
    b"",
    [],
    {},
    2**63 - 1,
    2**63,
    U64,
    I64_MIN,
    {1: 2},
    {b"k": 1},
    {None: 0},
    {True: 1},
    {1.5: 1},
    {(1, 2): 3},
    {"status": 0},
    {"status": "HELLO"},
    [[[]]],
    datetime.datetime(2026, 1, 1, tzinfo=UTC),
    msgspec.msgpack.Ext(5, b"x"),
    msgspec.msgpack.Ext(-1, b"\xff" * 12),
    msgspec.Raw(b"\xc1"),
    msgspec.Raw(b"\xa2\xff\xfe"),
    msgspec.Raw(b"\x81\x80\x00"),
    *[msgspec.Raw(h) for h in HUGE_HEADS[:2]],
]
hostile_values: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from(SPECIAL_VALUES),
    st.integers(I64_MIN, U64),
    st.floats(),
    st.binary(max_size=16),
    st.text(max_size=16),
    st.builds(lambda n, c: c * n, st.integers(190, 100_000), st.sampled_from(["x", "é", "😀"])),
    st.builds(
        _deep,
        st.sampled_from(DEEP_LEVELS) | st.integers(0, 1200),
        st.sampled_from(NEST_PREFIXES),
        st.sampled_from([b"\xc0", b"\x00", b"\x90", b"\x80", b"\xa1a"]),
    ),
    st.dictionaries(st.integers() | st.binary(max_size=4) | st.none(), scalars, max_size=3),
)
"""Values a hostile peer might put anywhere (msgspec.Raw: bytes written as they are)."""
hostile_keys: st.SearchStrategy[Any] = st.one_of(
    texts,
    st.integers(I64_MIN, U64),
    st.floats(),
    st.binary(max_size=8),
    st.none(),
    st.booleans(),
    st.tuples(scalars, scalars),
    st.builds(lambda n: "k" * n, st.integers(190, 100_000)),
)


@st.composite
def _structure_change(draw: st.DrawFn, node: Any) -> Any:
    ops = ["replace", "wrap", "nest"]
    if type(node) is dict:
        ops += ["delete key", "add key"]
    elif type(node) is list:
        ops += ["delete item", "append"]
    op = draw(st.sampled_from(ops))
    if op == "replace":
        return draw(hostile_values)
    if op == "wrap":
        return [[node], {"a": node}][draw(st.integers(0, 1))]
    if op == "nest":  # node under `levels` arrays: raw bytes, then the node's encoding
        levels = draw(st.sampled_from(DEEP_LEVELS))
        try:
            return msgspec.Raw(b"\x91" * levels + _encode(node))
        except Exception:
            return node
    if op == "delete key":
        if not node:
            return node
        gone = draw(st.sampled_from(list(node)))
        return {k: v for k, v in node.items() if k != gone}
    if op == "add key":
        return {**node, draw(hostile_keys): draw(hostile_values)}
    if op == "delete item":
        if not node:
            return node
        at = draw(st.integers(0, len(node) - 1))
        return node[:at] + node[at + 1 :]
    return [*node, draw(hostile_values)]


@st.composite
def vllm_structure_cases(draw: st.DrawFn, family: str | None = None) -> Case:
    """A valid message of `family` with one to three nested values made hostile,
    re-encoded with msgspec (an input msgspec cannot encode is skipped)."""
    target, value = draw(valid_values(family))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(value)
        path = paths[draw(st.integers(0, len(paths) - 1))]
        if path and path[-1][0] == "k":
            value = _replace_at(value, path, lambda _: draw(hostile_keys))
        else:
            value = _replace_at(value, path, lambda node: draw(_structure_change(node)))
    try:
        data = _encode(value)
    except Exception:
        data = None
    assume(data is not None)
    assert data is not None
    return Case(target, b"", data)


# -- the checks -------------------------------------------------------------------------------


def _is_opt_int(value: Any) -> bool:
    return value is None or type(value) is int


def _check_map(msg: Any, status: bool) -> None:
    assert type(msg) is dict, msg
    if status:
        assert type(msg["status"]) is str


def _check_outputs(batch: Any) -> None:
    assert type(batch) is OutputBatch, batch
    assert type(batch.rank) is int and batch.rank >= 0
    for out in batch.outputs:
        assert type(out) is Output and type(out.request_id) is str
        assert out.finish is None or out.finish in FINISH_REASONS
        body = out.body
        assert type(body) is VllmOutput and type(body.token_ids) is list
        assert all(type(t) is int for t in body.token_ids)
        assert body.stop_reason is None or type(body.stop_reason) in (int, str)
        if body.error is not None:
            error = body.error
            assert type(error) is VllmError and out.finish == "error"
            assert type(error.code) is str and type(error.message) is str
            assert type(error.retryable) is bool
    if batch.load is not None:
        ld = batch.load
        assert type(ld) is Load and type(ld.waiting) is int and type(ld.running) is int
        assert ld.waiting >= 0 and ld.running >= 0 and type(ld.kv) is float
    assert _is_opt_int(batch.wave_complete) and _is_opt_int(batch.start_wave)
    assert len(batch.replies) <= 1
    for reply in batch.replies:
        assert type(reply) is Reply and type(reply.call) is int
        assert reply.error is None or (type(reply.error) is str and reply.result is None)
    for bad in batch.bad_entries:
        assert type(bad) is BadEntry and bad.key in ("outputs", "replies")
        assert bad.id is None or type(bad.id) is (int if bad.key == "replies" else str)
        assert type(bad.cause) is str and len(bad.cause) <= MAX_ERROR_CHARS


def encode_outputs(batch: OutputBatch) -> bytes:
    """`batch` as an `EngineCoreOutputs` again (what it keeps of one: no timestamp, no
    finished list), for the round trip."""
    entries = []
    for out in batch.outputs:
        body = out.body
        finish = None if out.finish is None else FINISH_REASONS.index(out.finish)
        entry = [out.request_id, body.token_ids, None, None, None, finish, body.stop_reason]
        if body.error is not None:
            e = body.error
            entry += [None] * 11 + [
                {"code": e.code, "message": e.message, "retryable": e.retryable}
            ]
        entries.append(entry)
    stats: dict[str, Any] | None = None
    if batch.load is not None:
        ld = batch.load
        stats = {"num_waiting_reqs": ld.waiting, "num_running_reqs": ld.running}
        stats["kv_cache_usage"] = ld.kv
    utility = None
    for r in batch.replies:
        utility = [r.call, r.error, None if r.error is not None else [None, r.result]]
    return _encode(
        [batch.rank, entries, stats, 0.0, utility, None, batch.wave_complete, batch.start_wave]
    )


def _round_trip(family: str, msg: Any) -> None:
    """Whatever was accepted encodes again (as vLLM would) and decodes to the same."""
    if family == "outputs":
        batch = decode_outputs([encode_outputs(msg)])
        assert same(batch, dataclasses.replace(msg, bad_entries=())), (msg, batch)
        return
    try:
        data = _encode(msg)
    except RecursionError:  # a value that only just fits msgspec's decoder
        return
    decode = decode_hello if family == "hello" else decode_ready_response
    again = decode(data)
    assert same(again, msg), (msg, again)


_DECODE: dict[str, Callable[[bytes], Any]] = {
    "hello": decode_hello,
    "ready": decode_ready_response,
    "outputs": lambda data: decode_outputs([data]),
}
_CHECK: dict[str, Callable[[Any], None]] = {
    "hello": lambda msg: _check_map(msg, status=True),
    "ready": lambda msg: _check_map(msg, status=False),
    "outputs": _check_outputs,
}
_NAMES = dict(zip(FAMILIES, DECODERS, strict=True))


def _run(family: str, case: Case, round_trip: bool) -> Outcome:
    start = time.perf_counter()
    try:
        msg = _DECODE[family](case.data)
    except ProtocolError as exc:
        seconds = time.perf_counter() - start
        text = str(exc)
        assert len(text) <= MAX_ERROR_CHARS, f"{len(text)}-character error: {text[:300]}..."
        assert type(exc.cause) is str
        return Outcome(_NAMES[family], "rejected", seconds)
    seconds = time.perf_counter() - start
    _CHECK[family](msg)
    if round_trip:
        _round_trip(family, msg)
    return Outcome(_NAMES[family], "decoded", seconds)


def exercise(case: Case, *, round_trip: bool = True) -> list[Outcome]:
    """Decode `case` with the decoder of its family (every decoder for `ALL`), checking
    totality, types, error size and (if `round_trip`) the round trip of whatever was
    accepted. Any other exception or a failed check propagates."""
    families = list(FAMILIES) if case.target == ALL else [case.target]
    return [_run(family, case, round_trip) for family in families]


PROPERTIES: dict[str, st.SearchStrategy[Case]] = {
    "vllm arbitrary": vllm_arbitrary_cases,
    "vllm mutated bytes": vllm_mutated_cases(),
    "vllm mutated struct": vllm_structure_cases(),
}
"""The long-run properties of scripts/fuzz_codec.py for vLLM's wire (families mixed)."""


# -- the tests ----------------------------------------------------------------------------


def test_msgpack_heads_finds_every_item_head() -> None:
    data = _encode({"a": [1, 2.5, b"xy", None, "é" * 40], "b": {"c": -200}})
    heads = msgpack_heads(data)
    assert [data[i] for i in heads] == [
        0x82,  # {2 pairs}
        0xA1,  # "a"
        0x95,  # [5 items]
        0x01,
        0xCB,  # 2.5
        0xC4,  # b"xy"
        0xC0,  # nil
        0xD9,  # str8 (80 bytes)
        0xA1,  # "b"
        0x81,  # {1 pair}
        0xA1,  # "c"
        0xD1,  # int16
    ]


@given(valid_cases())
def test_the_valid_vllm_messages_the_fuzz_starts_from_are_valid(case: Case) -> None:
    """The starting points must decode cleanly, else mutating them proves little."""
    assert [o.result for o in exercise(case)] == ["decoded"]
    if case.target == "outputs":
        assert decode_outputs([case.data]).bad_entries == ()


@given(vllm_arbitrary_cases)
def test_every_vllm_decoder_is_total_on_arbitrary_bytes(case: Case) -> None:
    assert [o.decoder for o in exercise(case)] == list(DECODERS)


@given(vllm_mutated_cases())
def test_byte_mutations_of_valid_vllm_messages_are_decoded_or_rejected(case: Case) -> None:
    exercise(case)


@given(vllm_structure_cases())
def test_hostile_values_inside_valid_vllm_messages_are_decoded_or_rejected(case: Case) -> None:
    exercise(case)


# -- what the fuzz found ------------------------------------------------------------------

ONE_KB = b"\x91" * 1000 + b"\xc0"
"""1,001 bytes: 1,000 nested one-element arrays around a nil. msgspec raises
`RecursionError` for it, which every decoder let out (except `decode_outputs`)."""


@pytest.mark.parametrize(
    "body",
    [ONE_KB, b"\x81\xa1a" * 1000 + b"\xc0", b"\x91" * 100_000 + b"\xc0"],
    ids=["arrays", "maps", "100k arrays"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_deep_nesting_is_a_protocol_error_in_every_vllm_decoder(family: str, body: bytes) -> None:
    # EngineCoreOutputs' typed fields refuse an array before it gets deep
    cause = None if family == "outputs" else "nested too deeply"
    with pytest.raises(ProtocolError, match=cause):
        _DECODE[family](body)


@pytest.mark.parametrize("family", FAMILIES)
def test_deep_nesting_under_a_valid_key_is_a_protocol_error(family: str) -> None:
    """Deep inside an otherwise valid message: a HELLO's extra key, a ready response's
    value, an output entry's logprobs."""
    deep = _deep(1000)
    value: Any = {
        "hello": {"status": "HELLO", "local": False, "headless": True, "x": deep},
        "ready": {"max_num_seqs": 8, "x": deep},
        "outputs": [0, [["r", [1], deep, None, None, None, None]], None, 0.0],
    }[family]
    with pytest.raises(ProtocolError, match="nested too deeply"):
        _DECODE[family](_encode(value))


def test_deep_nesting_is_a_protocol_error_from_deep_in_the_stack() -> None:
    """msgspec's limit is Python's recursion limit, counted from the caller's depth: a
    decoder called from a deep stack (a trio task under a nursery or two) fails at
    fewer levels, and must still fail only with `ProtocolError`."""

    def at_depth(n: int, family: str, body: bytes) -> None:
        if n:
            return at_depth(n - 1, family, body)
        with pytest.raises(ProtocolError):
            _DECODE[family](body)
        return None

    for family in FAMILIES:
        at_depth(800, family, b"\x91" * 300 + b"\xc0")


def test_a_struct_field_nested_too_deeply_is_an_entry_or_message_error_with_a_short_cause() -> None:
    """A typed field (token ids) holding deep arrays: msgspec's error names the path,
    1,000 levels of it; the cause is cut to a quote's length."""
    body = _encode([0, [["r", _deep(990, leaf=b"\x01"), None, None, None, None, None]]])
    try:
        batch = decode_outputs([body])
    except ProtocolError as exc:
        assert len(str(exc)) <= MAX_ERROR_CHARS
    else:
        assert batch.outputs == () and len(batch.bad_entries) == 1
        assert len(batch.bad_entries[0].cause) <= MAX_ERROR_CHARS

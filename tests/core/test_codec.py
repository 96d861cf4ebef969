"""The codec: round trips for every message, and docs/protocol.md §8 enforced on decode."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zmqdp._core import cbor
from zmqdp._core.codec import (
    ABORT,
    ADD,
    CALL,
    WAKE,
    decode_batch,
    decode_handshake,
    decode_request,
    encode_batch,
    encode_handshake,
    encode_request,
)
from zmqdp._core.errors import ProtocolError
from zmqdp._core.messages import (
    Abort,
    Add,
    Call,
    Hello,
    Init,
    Load,
    Output,
    OutputBatch,
    Ready,
    Register,
    Reject,
    Reply,
    Resync,
    Wake,
)

# -- values inside the §8 subset ------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
counts = st.integers(min_value=0, max_value=2**40)
texts = st.text(max_size=12)


@pytest.mark.parametrize(
    "msg",
    [
        Hello(rank=3, size=4, lockstep=True, wave=7),
        Hello(rank=0, size=1, lockstep=False),
        Hello(rank=0, size=1, lockstep=False, max_message_size=1 << 20),
        Init(input="ipc:///tmp/g.in", output="ipc:///tmp/g.out", size=2),
        Init(input="a", output="b", size=2, epoch=2**63 - 1, max_message_size=4096),
        Register(epoch=17),
        Reject(reason="rank 9 is out of range"),
        Ready(info={"model": "m", "max_num_seqs": 256, "nested": {"a": [1, 2.5]}}),
        Ready(),
        Register(),
        Resync(),
    ],
)
def test_handshake_round_trip(msg: Any) -> None:
    assert decode_handshake(encode_handshake(msg)) == msg


@pytest.mark.parametrize(
    ("msg", "kind"),
    [
        (Add(id="r1", body={"prompt": [1, 2, 3], "max_tokens": 4}), ADD),
        (Abort(ids=("r1", "r2")), ABORT),
        (Wake(wave=12), WAKE),
        (Call(call=5, method="ping", args=(1, "x")), CALL),
    ],
)
def test_request_round_trip(msg: Any, kind: bytes) -> None:
    frame, body = encode_request(msg)
    assert frame == kind
    assert decode_request(frame, body) == msg


def test_unknown_request_type_is_ignored_not_an_error() -> None:
    assert decode_request(b"\x7f", b"\xa0") is None


@given(
    rank=counts,
    seq=st.none() | counts,
    epoch=st.none() | st.integers(0, 2**63 - 1),
    outputs=st.lists(
        st.builds(Output, texts, values, st.none() | st.sampled_from(["stop", "length", "x"])),
        max_size=4,
    ),
    finished=st.lists(texts, max_size=3).map(tuple),
    load=st.none() | st.builds(Load, counts, counts, st.floats(min_value=0, max_value=1)),
    wave_complete=st.none() | counts,
    start_wave=st.none() | counts,
    replies=st.lists(
        st.builds(Reply, counts, values) | st.builds(Reply, counts, st.none(), texts),
        max_size=2,
    ),
    dead=st.none() | texts,
)
def test_batch_round_trip(**fields: Any) -> None:
    batch = OutputBatch(
        **{**fields, "outputs": tuple(fields["outputs"]), "replies": tuple(fields["replies"])}
    )
    assert decode_batch(encode_batch(batch)) == batch


def test_batch_minimal_and_null_keys_mean_absent() -> None:
    assert decode_batch(cbor2.dumps({"rank": 2})) == OutputBatch(rank=2)
    body = {"rank": 1, "seq": None, "outputs": None, "wave_complete": None, "dead": None}
    assert decode_batch(cbor2.dumps(body)) == OutputBatch(rank=1)


def test_load_kv_nan_kept_and_out_of_range_clamped() -> None:
    nan = decode_batch(cbor2.dumps({"rank": 0, "load": {"waiting": 1, "kv": math.nan}}))
    assert nan.load is not None and math.isnan(nan.load.kv)
    high = decode_batch(cbor2.dumps({"rank": 0, "load": {"kv": 1.5, "running": 2}}))
    assert high.load == Load(waiting=0, running=2, kv=1.0)
    assert decode_batch(cbor2.dumps({"rank": 0, "load": {"kv": 0}})).load == Load(kv=0.0)


def test_unknown_keys_are_ignored() -> None:
    body = {"rank": 0, "future": [1, {"x": 2}], "outputs": [{"id": "a", "new": 1}]}
    assert decode_batch(cbor2.dumps(body)).outputs == (Output("a"),)
    hello = {"type": "hello", "version": 1, "rank": 0, "size": 1, "lockstep": False, "z": 1}
    assert decode_handshake(cbor2.dumps(hello)) == Hello(0, 1, False)


# -- §8 rejections --------------------------------------------------------------------

BAD_BODIES = {
    "tag": cbor2.dumps(cbor2.CBORTag(35, "a+")),
    "bignum": cbor2.dumps(2**70),
    "nested tag": cbor2.dumps({"rank": 0, "x": cbor2.CBORTag(1, 5)}),
    "indefinite array": b"\x9f\x01\xff",
    "indefinite map": b"\xbf\x61a\x01\xff",
    "indefinite text": b"\x7f\x61a\xff",
    "duplicate key": b"\xa2\x64rank\x00\x64rank\x01",
    "trailing bytes": cbor2.dumps({"rank": 0}) + b"\x00",
    "too deep": b"\x81" * 65 + b"\x00",
    "undefined": b"\xa2\x64rank\x00\x68finished\xf7",
    "simple value": b"\xa2\x64rank\x00\x64dead\xf0",
    "integer map key": b"\xa1\x01\x02",
    "array map key": b"\xa1\x81\x01\x02",
    "shared value": bytes.fromhex("d81c81d81d00"),
    "string reference": cbor2.dumps(["abcdef", "abcdef"], string_referencing=True),
    "self-describe": bytes.fromhex("d9d9f7a0"),
    "truncated": cbor2.dumps({"rank": 0, "outputs": [{"id": "abc"}]})[:-2],
    "empty": b"",
    "reserved head": b"\x1c",
    "huge declared length": b"\x5b\xff\xff\xff\xff\xff\xff\xff\xff",
    "huge declared array": b"\x9b\xff\xff\xff\xff\xff\xff\xff\xff",
    "invalid utf-8": b"\x62\xff\xfe",
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_decoder_rejects_what_section_7_forbids(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_batch(body)


BAD_ENTRY_BODIES = {
    "undefined in finished": b"\xa2\x64rank\x00\x68finished\x81\xf7",
    "simple value in a body": b"\xa2\x64rank\x00\x67outputs\x81\xa2\x62id\x61a\x64body\xf0",
    "one-byte simple": b"\xa2\x64rank\x00\x67outputs\x81\xa2\x62id\x61a\x64body\xf8\x20",
}


@pytest.mark.parametrize("body", BAD_ENTRY_BODIES.values(), ids=BAD_ENTRY_BODIES.keys())
def test_section_7_violations_inside_an_entry_are_entry_errors(body: bytes) -> None:
    batch = decode_batch(body)
    assert batch.outputs == batch.finished == ()
    [bad] = batch.bad_entries
    assert "simple value" in bad.cause or "text string" in bad.cause


def test_depth_64_is_accepted() -> None:
    assert cbor.loads(b"\x81" * 64 + b"\x00") is not None


def test_opaque_values_are_vetted_and_unknown_keys_unread() -> None:
    batch = decode_batch(cbor2.dumps({"rank": 0, "outputs": [{"id": "a", "body": {1: 2}}]}))
    assert [(b.id, b.cause) for b in batch.bad_entries] == [("a", "map key 1 is not a text string")]
    assert decode_batch(b"\xa2\x64rank\x00\x63out\xf7") == OutputBatch(rank=0)


@pytest.mark.parametrize(
    "tag",
    [
        0,
        1,
        2,
        3,
        4,
        5,
        24,
        25,
        28,
        29,
        30,
        35,
        36,
        37,
        52,
        54,
        100,
        256,
        258,
        260,
        1004,
        43000,
        55799,
        2**32 - 1,
        2**64 - 1,
    ],
)
def test_every_tag_is_rejected_even_those_cbor2_knows(tag: int) -> None:
    for inner in (0, "2013-03-21T20:04:00Z", b"\x01" * 16, [0, 1], {"a": 0}):
        with pytest.raises(ProtocolError):
            decode_batch(
                cbor2.dumps(
                    {"rank": 0, "outputs": [{"id": "a", "body": cbor2.CBORTag(tag, inner)}]}
                )
            )


WRONG_TYPES = [
    ({"rank": True}, "rank"),
    ({"rank": -1}, "rank"),
    ({"rank": "0"}, "rank"),
    ({}, "rank"),
    ({"rank": 0, "seq": 1.0}, "seq"),
    ({"rank": 0, "outputs": {"id": "a"}}, "outputs"),
    ({"rank": 0, "outputs": {"id": "a"}}, "outputs"),
    ({"rank": 0, "finished": "a"}, "finished"),
    ({"rank": 0, "epoch": "1"}, "epoch"),
    ({"rank": 0, "seq": 2**63}, "seq"),
    ({"rank": 0, "epoch": 2**63}, "epoch"),
    ({"rank": 0, "start_wave": 2**64 - 1}, "start_wave"),
    ({"rank": 0, "wave_complete": 2**63}, "wave_complete"),
    ({"rank": 0, "load": {"waiting": -2}}, "waiting"),
    ({"rank": 0, "load": {"kv": "full"}}, "kv"),
    ({"rank": 0, "load": [1, 2]}, "load"),
    ({"rank": 0, "wave_complete": False}, "wave_complete"),
    ({"rank": 0, "start_wave": -1}, "start_wave"),
    ({"rank": 0, "replies": {"call": 1}}, "replies"),
    ({"rank": 0, "dead": 1}, "dead"),
    ([0], "map"),
]


@pytest.mark.parametrize(("body", "key"), WRONG_TYPES)
def test_wrong_types_for_known_keys_are_rejected_with_the_key_named(body: Any, key: str) -> None:
    with pytest.raises(ProtocolError, match=key):
        decode_batch(cbor2.dumps(body))


def test_batch_errors_name_the_rank() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_batch(cbor2.dumps({"rank": 3, "outputs": 1}))
    assert info.value.rank == 3 and "rank 3" in str(info.value)


MALFORMED_ENTRIES: list[tuple[Any, str, str | int | None, str]] = [
    ({"id": 5}, "outputs", None, "id"),
    ({"body": 1}, "outputs", None, "lacks its 'id'"),
    ({"id": "b#1", "finish": 1}, "outputs", "b#1", "finish"),
    ({"id": "b#1", "body": {1: 2}}, "outputs", "b#1", "map key"),
    ({"id": "b#1", "body": 2**63}, "outputs", "b#1", "64-bit"),
    (["b#1"], "outputs", None, "map"),
]


@pytest.mark.parametrize(("entry", "key", "named", "cause"), MALFORMED_ENTRIES)
def test_a_malformed_output_entry_spares_the_rest_of_the_batch(
    entry: Any, key: str, named: str | int | None, cause: str
) -> None:
    """§7: an entry error is not a connection error."""
    good = {"id": "a#0", "body": 1, "finish": "stop"}
    batch = decode_batch(
        cbor2.dumps({"rank": 0, "outputs": [good, entry], "finished": ["c#2"], "seq": 4})
    )
    assert batch.outputs == (Output("a#0", 1, "stop"),)
    assert batch.finished == ("c#2",) and batch.seq == 4
    [bad] = batch.bad_entries
    assert (bad.key, bad.id) == (key, named) and cause in bad.cause


def test_malformed_finished_and_reply_entries_are_reported_with_what_they_name() -> None:
    body = {
        "rank": 0,
        "finished": ["a#0", 7],
        "replies": [{"call": 3, "error": 3}, {"result": 1}, {"call": 4, "result": "ok"}],
    }
    batch = decode_batch(cbor2.dumps(body))
    assert batch.finished == ("a#0",)
    assert batch.replies == (Reply(call=4, result="ok"),)
    assert [(b.key, b.id) for b in batch.bad_entries] == [
        ("finished", None),
        ("replies", 3),
        ("replies", None),
    ]


def test_integers_are_signed_64_bit_on_the_wire() -> None:  # §1
    assert cbor.loads(cbor.dumps(2**63 - 1)) == 2**63 - 1
    assert cbor.loads(cbor.dumps(-(2**63))) == -(2**63)
    for bad in (2**63, -(2**63) - 1, 2**64 - 1):
        with pytest.raises(ProtocolError, match="signed 64-bit"):
            cbor.dumps({"x": [bad]})
    batch = decode_batch(cbor2.dumps({"rank": 0, "seq": 2**63 - 1, "start_wave": 2**63 - 1}))
    assert batch.seq == batch.start_wave == 2**63 - 1
    with pytest.raises(ProtocolError, match="call"):
        decode_request(CALL, cbor2.dumps({"call": 2**63, "method": "m"}))


def test_a_lone_surrogate_cannot_be_encoded_and_says_so() -> None:  # observation 4
    for body in ("\ud800", {"k": ["x\udfff"]}):
        with pytest.raises(ProtocolError, match="UnicodeEncodeError"):
            encode_request(Add(id="r#0", body=body))
    with pytest.raises(ProtocolError):
        encode_request(Abort(("\ud800",)))


def test_handshake_errors_name_the_message_they_claimed_to_be() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_handshake(cbor2.dumps({"type": "ready", "info": [1]}))
    assert info.value.message == "ready"
    with pytest.raises(ProtocolError) as info:
        decode_handshake(cbor2.dumps({"type": "hello", "rank": 0}))
    assert info.value.message == "hello"


def test_errors_quote_at_most_200_characters_of_a_hostile_value() -> None:  # §7
    huge = "x" * (16 << 20)
    with pytest.raises(ProtocolError) as info:
        decode_batch(cbor2.dumps({"rank": 0, "seq": huge}))
    assert len(str(info.value)) < 400
    with pytest.raises(ProtocolError) as info:
        decode_handshake(cbor2.dumps({"type": huge}))
    assert len(str(info.value)) < 400
    key = "k" * 100_000  # cbor2's own error text quotes a duplicate key whole
    body = b"\xa2" + cbor2.dumps(key) + b"\x00" + cbor2.dumps(key) + b"\x01"
    with pytest.raises(ProtocolError) as info:
        decode_batch(body)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize(
    "body",
    [
        {"type": "hello", "rank": 0, "size": 1, "lockstep": False},
        {"type": "hello", "version": 1, "rank": 0, "size": 1, "lockstep": 1},
        {"type": "hello", "version": 1, "rank": 0, "size": 1, "lockstep": True, "wave": -1},
        {"type": "init", "version": 1, "input": "a", "size": 1},
        {"type": "reject"},
        {"type": "ready", "info": [1]},
        {"type": "bogus"},
        {"rank": 0},
    ],
)
def test_bad_handshake_messages_are_rejected(body: Any) -> None:
    with pytest.raises(ProtocolError):
        decode_handshake(cbor2.dumps(body))


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (ADD, {"body": 1}),
        (ADD, {"id": "a"}),
        (ABORT, ["a", 2]),
        (WAKE, {"wave": -1}),
        (CALL, {"call": 1, "method": "m", "args": {}}),
        (b"\x00\x00", {}),
    ],
)
def test_bad_requests_are_rejected(kind: bytes, body: Any) -> None:
    with pytest.raises(ProtocolError):
        decode_request(kind, cbor2.dumps(body))


@pytest.mark.parametrize(
    "body",
    [{1: "int key"}, {"when": __import__("datetime").date(2026, 1, 1)}, {1, 2}, 2**70, 2**63],
)
def test_encoder_refuses_bodies_outside_the_subset(body: Any) -> None:
    with pytest.raises(ProtocolError):
        encode_request(Add(id="r", body=body))


# -- totality -------------------------------------------------------------------------


@given(st.binary(max_size=200))
def test_decoders_are_total_on_arbitrary_bytes(data: bytes) -> None:
    for decode in (decode_batch, decode_handshake, lambda d: decode_request(ADD, d)):
        with contextlib.suppress(ProtocolError):
            decode(data)


@st.composite
def cbor_items(draw: st.DrawFn) -> bytes:
    """Well-formed-looking CBOR heads with random majors, widths and lengths: reaches
    much deeper into the decoder than random bytes do."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 30))):
        major = draw(st.integers(0, 7))
        info = draw(st.sampled_from([0, 1, 5, 23, 24, 25, 26, 27, 28, 31]))
        out.append(major << 5 | info)
        out += draw(st.binary(max_size=3))
    return bytes(out)


@given(cbor_items() | st.builds(lambda v: cbor2.dumps({"rank": 0, "outputs": v}), values))
def test_decoders_are_total_on_structured_garbage(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_batch(data)


@given(values)
def test_subset_values_round_trip_through_the_strict_decoder(value: Any) -> None:
    assert cbor.loads(cbor.dumps(value)) == value

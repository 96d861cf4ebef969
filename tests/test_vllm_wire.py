"""The vLLM dialect's wire against the golden frames made by vLLM 0.33's own code
(/work/shared/vllm/golden_v0330.json, copied to tests/data/vllm_golden_v0330.json):
what zmqdp sends (requests, handshake answers, coordinator messages) must equal them
byte for byte; what it receives (outputs, HELLO/READY, ready responses) must decode to
exactly what vLLM's decoder saw."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zmqdp._core.errors import ProtocolError
from zmqdp._core.messages import Load, Output, Reply
from zmqdp.vllm.codec import (
    COORDINATOR_READY,
    ENGINE_CORE_DEAD,
    FINISH_REASONS,
    XSUB_SUBSCRIBE,
    SamplingParams,
    VllmOutput,
    decode_hello,
    decode_outputs,
    decode_ready_response,
    encode_abort,
    encode_add,
    encode_init,
    encode_start_dp_wave,
    encode_utility,
    rank_identity,
    sampling_map,
)

GOLDEN_PATH = Path(__file__).parent / "data" / "vllm_golden_v0330.json"
GOLDEN: dict[str, Any] = json.loads(GOLDEN_PATH.read_text())
MESSAGES: dict[str, Any] = GOLDEN["messages"]
ARRIVAL = GOLDEN["meta"]["conventions"]["deterministic_inputs"]["arrival_time"]


def frames(name: str) -> list[bytes]:
    return [bytes.fromhex(f) for f in MESSAGES[name]["frames_hex"]]


CHECKED: set[str] = set()


def golden(name: str) -> list[bytes]:
    CHECKED.add(name)
    return frames(name)


# -- what zmqdp sends: byte for byte ---------------------------------------------------


def test_add_minimal() -> None:
    f = golden("add_minimal")
    sp = sampling_map(SamplingParams(temperature=0), None)
    assert f[0] == rank_identity(0)
    assert list(encode_add("req-min", [1, 2, 3, 4], sp, ARRIVAL)) == f[1:]


def test_add_rank_none_as_a_frontend_sends_it() -> None:
    f = golden("add_rank_none")
    m = MESSAGES["add_rank_none"]["payload_decoded"]
    sp = sampling_map(SamplingParams(temperature=0.0), eos_token_id=151645)
    frames_ = encode_add(
        m["request_id"],
        m["prompt_token_ids"],
        sp,
        ARRIVAL,
        external_req_id=m["external_req_id"],
    )
    assert list(frames_) == f[1:]


def test_add_pinned_rank_and_wave_fields_land_in_place() -> None:
    """`data_parallel_rank` (field 9) and `current_wave` (field 13) of the golden request
    as DPLBAsyncMPClient sends it pinned to rank 1 at wave 3."""
    sp = sampling_map(SamplingParams(temperature=0.0), eos_token_id=151645)
    _, body = encode_add("r", [1], sp, ARRIVAL, data_parallel_rank=1, current_wave=3, priority=2)
    arr = msgspec.msgpack.decode(body)
    assert len(arr) == 22
    assert arr[8] == 1 and arr[12] == 3 and arr[13] == 2 and arr[11] == 0


def test_abort() -> None:
    f = golden("abort")
    ids = MESSAGES["abort"]["payload_decoded"]
    assert list(encode_abort(ids)) == f[1:]


def test_utility_call_id_is_uint64() -> None:
    f = golden("utility_is_sleeping")
    client, call_id, method, args = MESSAGES["utility_is_sleeping"]["payload_decoded"]
    assert call_id >= 2**63
    assert list(encode_utility(call_id, method, args, client)) == f[1:]
    with pytest.raises(ProtocolError):
        encode_utility(2**64, "x", [])


def test_start_dp_wave() -> None:
    f = golden("start_dp_wave_exclude_none")
    assert encode_start_dp_wave(4, None) == f


@pytest.mark.parametrize("name", ["handshake_dense_init_rank0", "handshake_moe_init_rank0"])
def test_init(name: str) -> None:
    f = golden(name)
    a = MESSAGES[name]["payload_decoded"]["addresses"]
    pc = msgspec.msgpack.decode(f[1])["parallel_config"]  # the frontend's own values
    body = encode_init(
        a["inputs"],
        a["outputs"],
        a["coordinator_input"],
        a["coordinator_output"],
        a["frontend_stats_publish_address"],
        pc,
    )
    assert body == f[1]


def test_control_frames() -> None:
    golden("control_frames")
    e = MESSAGES["control_frames"]["entries"]
    assert bytes.fromhex(e["engine_core_dead"]["bytes_hex"]) == ENGINE_CORE_DEAD
    assert bytes.fromhex(e["coordinator_ready"]["bytes_hex"]) == COORDINATOR_READY
    assert bytes.fromhex(e["xsub_subscribe"]["bytes_hex"]) == XSUB_SUBSCRIBE


# -- what zmqdp receives: exactly what vLLM decoded ------------------------------------


@pytest.mark.parametrize("name", ["handshake_dense_hello_rank0", "handshake_dense_ready_rank0"])
def test_hello_and_ready(name: str) -> None:
    f = golden(name)
    assert f[0] == rank_identity(0)
    assert decode_hello(f[1]) == MESSAGES[name]["payload_decoded"]


def test_ready_response() -> None:
    f = golden("engine_ready_response_rank1")
    expected = dict(MESSAGES["engine_ready_response_rank1"]["payload_decoded"])
    del expected["__dataclass__"]
    assert f[0] == rank_identity(1)
    assert decode_ready_response(f[1]) == expected
    assert decode_ready_response(b"") == {}


def expected_outputs(name: str) -> tuple[int, list[Output]]:
    p = MESSAGES[name]["payload_decoded"]
    outs = []
    for o in p["outputs"]:
        fr = o["finish_reason"]
        finish = None if fr is None else FINISH_REASONS[fr["value"]]
        assert finish is None or fr["enum"] == f"FinishReason.{finish.upper()}"
        outs.append(
            Output(o["request_id"], VllmOutput(o["new_token_ids"], o["stop_reason"]), finish)
        )
    return p["engine_index"], outs


@pytest.mark.parametrize(
    "name",
    [
        "outputs_tokens_running",
        "outputs_tokens_finished_length",
        "outputs_finished_stop_reason",
        "outputs_finished_requests_only",
    ],
)
def test_outputs(name: str) -> None:
    f = golden(name)
    rank, outs = expected_outputs(name)
    batch = decode_outputs(f)
    assert batch.rank == rank
    assert list(batch.outputs) == outs
    assert batch.bad_entries == () and batch.replies == () and batch.load is None
    assert batch.wave_complete is None and batch.start_wave is None


def test_utility_result() -> None:
    f = golden("outputs_utility_result")
    u = MESSAGES["outputs_utility_result"]["payload_decoded"]["utility_output"]
    batch = decode_outputs(f)
    assert batch.rank == 0 and batch.outputs == ()
    assert batch.replies == (Reply(u["call_id"], u["result"]["UtilityResult"], None),)


def test_utility_failure() -> None:
    f = golden("outputs_utility_failure")
    u = MESSAGES["outputs_utility_failure"]["payload_decoded"]["utility_output"]
    batch = decode_outputs(f)
    assert batch.rank == 1
    assert batch.replies == (Reply(7, None, u["failure_message"]),)


def test_wave_complete() -> None:
    batch = decode_outputs(golden("outputs_wave_complete"))
    assert batch.rank == 0 and batch.wave_complete == 4 and batch.start_wave is None


def test_every_golden_message_is_checked() -> None:
    """Runs last in this module (pytest keeps file order)."""
    assert set(MESSAGES) == CHECKED, set(MESSAGES) - CHECKED


# -- beyond the golden frames ----------------------------------------------------------


def outputs_body(*fields: Any) -> bytes:
    return msgspec.msgpack.encode(list(fields))


def entry(rid: Any, tokens: Any, finish: Any = None, stop: Any = None, n: int = 19) -> list[Any]:
    e: list[Any] = [rid, tokens, None, None, None, finish, stop]
    return e + [None] * (n - len(e))


def test_scheduler_stats_become_load() -> None:
    stats = {"num_running_reqs": 3, "num_waiting_reqs": 2, "kv_cache_usage": 0.75, "x": 1}
    batch = decode_outputs([outputs_body(2, [], stats, 1.0)])
    assert batch.rank == 2 and batch.load == Load(2, 3, 0.75)
    unusable = decode_outputs([outputs_body(2, [], {"num_running_reqs": "3"}, 1.0)])
    assert unusable.load is None
    nokv = decode_outputs([outputs_body(2, [], {"num_running_reqs": 1, "num_waiting_reqs": 0})])
    assert nokv.load is not None and math.isnan(nokv.load.kv)


def test_longer_and_shorter_arrays_are_accepted() -> None:
    long_entry = [*entry("a", [1, 2], 0, 7), "future", "fields"]
    batch = decode_outputs(
        [outputs_body(1, [long_entry], None, 1.0, None, None, None, None, None, "x", 1)]
    )
    assert batch.outputs == (Output("a", VllmOutput([1, 2], 7), "stop"),)
    short = decode_outputs([outputs_body(0, [["b", [5]]])])
    assert short.outputs == (Output("b", VllmOutput([5], None), None),)


def test_a_malformed_entry_names_its_request_and_spares_the_others() -> None:
    body = outputs_body(0, [entry("ok", [1]), entry("bad", "notalist"), entry("odd", [2], 9)])
    batch = decode_outputs([body])
    assert batch.outputs == (Output("ok", VllmOutput([1], None), None),)
    assert [(b.key, b.id) for b in batch.bad_entries] == [("outputs", "bad"), ("outputs", "odd")]


def test_a_malformed_reply_names_its_call() -> None:
    batch = decode_outputs([outputs_body(0, [], None, 1.0, [2**64 - 1, 5, None])])
    assert [(b.key, b.id) for b in batch.bad_entries] == [("replies", 2**64 - 1)]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"a": 1}),
        msgspec.msgpack.encode(["x"]),
        ENGINE_CORE_DEAD,
    ],
)
def test_a_body_that_is_no_outputs_is_a_connection_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_outputs([body])


@given(st.binary(max_size=64))
def test_decode_outputs_never_crashes(body: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_outputs([body])


def _bad_utf8_id(rid: bytes) -> bytes:
    """An output entry whose request id is a msgpack str that is not UTF-8."""
    good = msgspec.msgpack.encode(entry("X" * len(rid), [1]))
    return good.replace(b"X" * len(rid), rid, 1)


def test_deep_nesting_is_a_protocol_error_not_a_crash() -> None:
    deep = entry("a", [1])
    deep[3] = "NEST"  # a field typed Any (new_logprobs), replaced by 5000 nested arrays
    body = outputs_body(0, [deep]).replace(b"\xa4NEST", b"\x91" * 5000 + b"\x00", 1)
    with pytest.raises(ProtocolError, match="not an EngineCoreOutputs"):
        decode_outputs([body])


def test_an_entry_whose_id_is_not_utf8_spares_the_other_entries() -> None:
    """msgspec refuses the whole message: each entry is read alone, so the finish of
    request "ok" in the same message still counts, and the unreadable one names nothing."""
    good = msgspec.msgpack.encode(entry("ok", [1], 0))
    raw_outputs = b"\x92" + good + _bad_utf8_id(b"\xff\xfe")
    body = outputs_body(0, []).replace(b"\x90", raw_outputs, 1)
    batch = decode_outputs([body])
    assert batch.rank == 0 and [o.request_id for o in batch.outputs] == ["ok"]
    assert [(b.key, b.id) for b in batch.bad_entries] == [("outputs", None)]


def test_a_negative_engine_index_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="negative"):
        decode_outputs([outputs_body(-1, [entry("a", [1])])])


def wire_map(params: SamplingParams, eos: int | None) -> dict[str, Any]:
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(sampling_map(params, eos)))
    assert isinstance(decoded, dict)
    return decoded


def test_sampling_map_rules() -> None:
    sp = sampling_map(
        SamplingParams(temperature=0.5, top_k=5, max_tokens=100, stop_token_ids=[7, 7, 3]), 2
    )
    m = msgspec.msgpack.decode(msgspec.msgpack.encode(sp))
    assert list(m) == [
        "temperature",
        "top_k",
        "stop",
        "stop_token_ids",
        "max_tokens",
        "_eos_token_id",
        "_all_stop_token_ids",
        "bad_words",
        "skip_reading_prefix_cache",
    ]
    assert m["stop_token_ids"] == [7, 3] and sorted(m["_all_stop_token_ids"]) == [2, 3, 7]
    greedy = wire_map(SamplingParams(temperature=0.0, top_k=5, top_p=0.5), None)
    assert "top_k" not in greedy and "top_p" not in greedy
    assert wire_map(SamplingParams(temperature=0.001), None)["temperature"] == 0.01
    ignoring = wire_map(SamplingParams(ignore_eos=True), 9)
    assert "_eos_token_id" not in ignoring and ignoring["_all_stop_token_ids"] == [9]
    for bad in (
        SamplingParams(temperature=3.0),
        SamplingParams(top_p=0.0),
        SamplingParams(max_tokens=0),
        SamplingParams(min_tokens=5, max_tokens=2),
        SamplingParams(stop_token_ids=["x"]),  # type: ignore[list-item]
        SamplingParams(temperature=math.nan),
    ):
        with pytest.raises(ValueError):
            sampling_map(bad, None)

"""The mock's sampling parameters (issue 35): `zmqdp serve --mock` takes what it can
honour or ignore without changing the answer, as a client's defaults need, and still
refuses, naming it, what it would silently get wrong.

* `stop` strings and `stop_token_ids` are honoured as vLLM does: the text ends before
  the stop string (held back while it may still be one), a stop token's own text is
  left out, finish ``"stop"``, usage counts the tokens the engine sent up to it;
* `temperature` and `seed` are taken and change nothing: the mock answers a fixed
  function of the prompt, as greedy decoding does;
* `top_p` below 1, `logprobs`, `echo`, penalties... are a 400 naming the field, and a
  wrong value of a taken field is a 400 naming it too.

The native mock's answer to any prompt is `` t1001 t1002 ...`` (one token per output).
Over real HTTP (hypercorn), in front of an embedded mock group of one rank.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from zmqdp._core.messages import Output
from zmqdp.gateway.frontend import MOCK_FIELDS, MockFrontend, _MockStopDecode, decode_each

from .gateway_helpers import all_events
from .test_gateway_openai import error_of, mock_gateway

ANSWER = "".join(f" t{1000 + i}" for i in range(1, 9))
"""The mock's answer of 8 tokens."""


async def complete(client: httpx.AsyncClient, **fields: Any) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of a completion, streamed and not: both
    must agree."""
    body = {"prompt": "hi", "max_tokens": 8, **fields}
    plain = await client.post("/v1/completions", json=body)
    assert plain.status_code == 200, plain.text
    answer = plain.json()
    [choice] = answer["choices"]
    options = {"stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json={**body, **options}) as response:
        assert response.status_code == 200
        data = await all_events(response)
    *chunks, usage = [json.loads(d) for d in data[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert usage["usage"] == answer["usage"]
    return choice["text"], choice["finish_reason"], answer["usage"]["completion_tokens"]


async def test_temperature_and_seed_are_taken_and_change_nothing() -> None:
    async with mock_gateway() as (client, _):
        plain = await complete(client)
        hot = await complete(client, temperature=1.3, seed=42)
        cold = await complete(client, temperature=0, seed=-7)
    assert plain == hot == cold == (ANSWER, "length", 8)


async def test_a_stop_string_ends_the_text_before_it() -> None:
    async with mock_gateway() as (client, _):
        one = await complete(client, stop=" t1003")
        # spans two tokens' text (" t1002" and " t1003"), and one of two stop strings
        spanning = await complete(client, stop=["nowhere", "2 t10"])
        never = await complete(client, stop=["\n"])
        empty = await complete(client, stop=[""])  # asks for nothing (OpenAI's neutral)
    assert one == (" t1001 t1002", "stop", 3)
    assert spanning == (" t1001 t100", "stop", 3)
    assert never == empty == (ANSWER, "length", 8)


async def test_a_stop_token_id_ends_the_answer_without_its_text() -> None:
    async with mock_gateway() as (client, _):
        stopped = await complete(client, stop_token_ids=[1004, 99])
        both = await complete(client, stop=" t1006", stop_token_ids=[1007])
    assert stopped == (" t1001 t1002 t1003", "stop", 4)
    assert both == (" t1001 t1002 t1003 t1004 t1005", "stop", 6)


async def test_a_chat_with_a_clients_defaults_is_answered() -> None:
    """As the OpenAI clients' and aiperf's requests look: temperature and seed set."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0.7,
        "seed": 1,
        "stop": ["\n\n"],
    }
    async with mock_gateway() as (client, _):
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["message"]["content"] == " t1001 t1002 t1003"
    assert choice["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 0.5),
        ("logprobs", 2),
        ("echo", True),
        ("frequency_penalty", 0.5),
        ("logit_bias", {"1001": 5}),
    ],
)
async def test_a_field_that_would_change_the_answer_is_refused(field: str, value: Any) -> None:
    async with mock_gateway() as (client, _):
        response = await client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value}
        )
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"]) == ("unsupported_parameter", field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("temperature", "hot"),
        ("temperature", True),
        ("seed", 1.5),
        ("seed", 1 << 64),
        ("stop", 7),
        ("stop", ["x"] * 17),
        ("stop", ["x" * 257]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", "1001"),
    ],
)
async def test_a_wrong_value_of_a_taken_field_is_a_400_naming_it(field: str, value: Any) -> None:
    async with mock_gateway() as (client, app):
        response = await client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value}
        )
        assert app.group is not None
        assert app.group.statistics().submitted == 0  # refused before any rank saw it
    assert response.status_code == 400
    assert f"'{field}'" in error_of(response)["message"]


def test_the_stop_decoder_holds_back_what_may_become_a_stop_string() -> None:
    """Output by output, as vLLM: the last characters (the longest stop string's length
    minus one) wait for the next token, which may complete a stop string with them."""
    decode = _MockStopDecode(("t1003 ",), frozenset())
    pieces = [decode(Output("r", {"token": 1000 + i}, None)) for i in range(1, 4)]
    assert [p.text for p in pieces] == [" ", "t1001 ", "t1002 "]  # "t1003" held
    assert [p.finish_reason for p in pieces] == [None, None, None]
    last = decode(Output("r", {"token": 1004}, None))  # completes "t1003 "
    assert (last.text, last.finish_reason, last.tokens) == ("", "stop", 1)
    end = _MockStopDecode(("t1003 ",), frozenset())
    decode_each(end, [Output("r", {"token": 1001}, None)])
    held = end(Output("r", {"token": 1002}, "length"))  # the engine's end releases it
    assert (held.text, held.finish_reason) == ("t1001 t1002", "length")


def test_the_stop_decoders_batch_equals_its_outputs_one_by_one() -> None:
    outputs = [Output("r", {"token": 1000 + i}, None) for i in range(1, 7)]
    outputs[-1] = Output("r", {"token": 1006}, "length")
    for stops, ids in [((" t1004",), frozenset()), ((), frozenset({1005})), (("zz",), frozenset())]:
        whole = _MockStopDecode(stops, ids).batch(outputs)
        assert whole == decode_each(_MockStopDecode(stops, ids), outputs)
    assert MOCK_FIELDS == MockFrontend.fields == {"temperature", "seed", "stop", "stop_token_ids"}


def test_the_stop_string_that_ends_first_wins_and_is_the_stop_reason() -> None:
    """Of two stop strings found, the one that ends first ends the text, as vLLM's
    `check_stop_strings` chooses, and it is the `stop_reason`; a stop token id is its
    own (before, the one that started first won, and `stop_reason` was None)."""
    decode = _MockStopDecode(("t1001 t1002", "1 t"), frozenset())
    first = decode(Output("r", {"token": 1001}, None))
    second = decode(Output("r", {"token": 1002}, None))  # " t1001 t1002": both found
    assert first.text + second.text == " t100"
    assert (second.finish_reason, second.stop_reason) == ("stop", "1 t")
    by_id = _MockStopDecode((), frozenset({1002}))
    piece = decode_each(by_id, [Output("r", {"token": 1000 + i}, None) for i in (1, 2)])
    assert (piece.text, piece.finish_reason, piece.stop_reason) == (" t1001", "stop", 1002)

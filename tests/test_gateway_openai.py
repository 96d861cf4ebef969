"""Honest OpenAI behaviour of the gateway (issue 22, "honest refusals"): a field the
engine cannot honour is a 400 naming it, an unknown field a 400 as OpenAI answers it, a
model that is not served a 404, a missing or wrong API key a 401, a 504 tells the
OpenAI clients not to retry, a 429 speaks to HTTP clients, and a stream that overflows
because its client reads slowly is the client's problem, not an internal error.

Over real HTTP (hypercorn on 127.0.0.1), in front of an embedded mock group or of
`TokenEngine`s driven by hand, under conftest.py's `trio.fail_after`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from zmqdp._core.errors import Overloaded, StreamOverflow
from zmqdp.gateway import GatewayApp, create_app
from zmqdp.gateway.errors import http_error
from zmqdp.mock import MockConfig

from .gateway_helpers import hold
from .helpers import wait_until
from .test_gateway import FAST_MOCK, scripted, serving


@asynccontextmanager
async def mock_gateway(**kw: Any) -> AsyncIterator[tuple[httpx.AsyncClient, GatewayApp]]:
    app = create_app(mock=MockConfig(engines=1, step_time=FAST_MOCK.step_time), **kw)
    async with serving(app) as client:
        yield client, app


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_p", 0.7), ("presence_penalty", 1), ("logprobs", 2), ("echo", True)],
)
async def test_a_field_the_engine_cannot_honour_is_a_400_naming_it(field: str, value: Any) -> None:
    async with mock_gateway() as (client, _):
        body = {"prompt": "hi", "max_tokens": 2, field: value}
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"]) == ("unsupported_parameter", field)
    assert f"'{field}' is not supported" in error["message"]


async def test_neutral_values_and_nulls_ask_for_nothing_and_are_taken() -> None:
    neutral = {
        "echo": False,
        "best_of": 1,
        "top_p": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0,
        "stop": [],
        "logit_bias": {},
        "temperature": None,
        "seed": None,
    }
    async with mock_gateway() as (client, _):
        response = await client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **neutral}
        )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


async def test_an_unknown_field_is_a_400_as_openai_answers_it() -> None:
    async with mock_gateway() as (client, _):
        response = await client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temprature": 0.5}
        )
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"]) == ("unrecognized_argument", "temprature")


async def test_a_model_that_is_not_served_is_a_404() -> None:
    async with mock_gateway(model=["tiny", "tiny-alias"]) as (client, _):
        wrong = await client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
        alias = await client.post("/v1/completions", json={"prompt": "x", "model": "tiny-alias"})
        default = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        listed = await client.get("/v1/models")
        one = await client.get("/v1/models/tiny-alias")
        missing = await client.get("/v1/models/gpt-4")
    assert wrong.status_code == 404
    assert (error_of(wrong)["code"], error_of(wrong)["param"]) == ("model_not_found", "model")
    assert "'gpt-4' does not exist" in error_of(wrong)["message"]
    # vLLM answers with the first served name, whichever the request named (issue 35)
    assert alias.status_code == 200 and alias.json()["model"] == "tiny"
    assert default.status_code == 200 and default.json()["model"] == "tiny"
    assert [m["id"] for m in listed.json()["data"]] == ["tiny", "tiny-alias"]
    assert one.status_code == 200 and one.json()["id"] == "tiny-alias"
    assert missing.status_code == 404 and error_of(missing)["code"] == "model_not_found"


async def test_an_api_key_guards_the_v1_routes_and_not_the_probes() -> None:
    async with mock_gateway(api_key="s3cret") as (client, _):
        body = {"prompt": "x", "max_tokens": 1}
        none = await client.post("/v1/completions", json=body)
        wrong = await client.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
        )
        models = await client.get("/v1/models")
        right = await client.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}
        )
        health = await client.get("/health")
        # the scheme is case-insensitive (RFC 7235; vLLM takes "bearer" too)
        lower = await client.post(
            "/v1/completions", json=body, headers={"Authorization": "bearer s3cret"}
        )
        glued = await client.post("/v1/completions", json=body, headers={"Authorization": "s3cret"})
    assert [none.status_code, wrong.status_code, models.status_code] == [401, 401, 401]
    assert error_of(none)["code"] == "invalid_api_key"
    assert right.status_code == 200 and health.status_code == 200
    assert lower.status_code == 200 and glued.status_code == 401


async def test_a_504_tells_the_openai_clients_not_to_retry(tmp_path: Path) -> None:
    async with scripted(tmp_path, request_timeout=0.2) as (client, _, _):
        response = await client.post("/v1/completions", json=hold())
    assert response.status_code == 504
    assert response.headers["x-should-retry"] == "false"


def test_a_429_speaks_to_http_clients() -> None:
    error = http_error(Overloaded("cmpl-1", None, None), retry_after=3, size=2)
    assert error.status == 429 and error.retry_after == 3
    assert "wait_submit" not in error.message and "submit again" not in error.message
    assert "'cmpl-1'" in error.message and "retry after 3 s" in error.message
    pinned = http_error(Overloaded("cmpl-2", 1, 4), retry_after=1, size=2)
    assert "engine rank 1 is at its limit of 4 requests in flight" in pinned.message


def test_a_stream_overflow_is_the_slow_clients_problem() -> None:
    error = http_error(StreamOverflow(0, "cmpl-3", 64), retry_after=1, size=2)
    assert (error.status, error.code) == (400, "client_too_slow")
    assert error.should_retry is False and "too slowly" in error.message


# -- the official OpenAI client -------------------------------------------------------

openai = pytest.importorskip("openai", reason="the official OpenAI client (test extra)")


async def test_the_official_openai_client_async_and_sync() -> None:
    async with mock_gateway(model="tiny", api_key="k") as (client, _):
        base = f"{str(client.base_url).rstrip('/')}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0) as oa:
            plain = await oa.completions.create(model="tiny", prompt="hi", max_tokens=3)
            chunks = [
                c
                async for c in await oa.completions.create(
                    model="tiny", prompt="hi", max_tokens=3, stream=True
                )
            ]
            with pytest.raises(openai.NotFoundError):
                await oa.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
            with pytest.raises(openai.BadRequestError, match="top_p"):
                await oa.completions.create(model="tiny", prompt="hi", top_p=0.2)
        async with openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.completions.create(model="tiny", prompt="hi", max_tokens=1)

        def sync() -> tuple[str, list[str]]:
            with openai.OpenAI(base_url=base, api_key="k", max_retries=0) as so:
                one = so.completions.create(model="tiny", prompt="hi", max_tokens=2)
                streamed = so.completions.create(
                    model="tiny", prompt="hi", max_tokens=2, stream=True
                )
                return one.choices[0].text, [c.choices[0].text for c in streamed if c.choices]

        text, pieces = await trio.to_thread.run_sync(sync)
    assert plain.choices[0].text == " t1001 t1002 t1003" and plain.usage is not None
    assert plain.usage.completion_tokens == 3
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " t1001 t1002 t1003"
    assert text == " t1001 t1002" and "".join(pieces) == " t1001 t1002"


async def test_the_openai_client_does_not_resend_a_request_that_timed_out(
    tmp_path: Path,
) -> None:
    async with scripted(tmp_path, request_timeout=0.2) as (client, app, _):
        base = f"{str(client.base_url).rstrip('/')}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=2) as oa:
            with pytest.raises(openai.APIStatusError) as caught:
                await oa.completions.create(
                    model="zmqdp", prompt="x", max_tokens=100, extra_body={"script": {"hold": True}}
                )
        assert caught.value.status_code == 504
        assert app.group is not None and app.group.statistics().submitted == 1


async def test_chat_completions_with_the_official_client_on_the_mock() -> None:
    async with mock_gateway(model="tiny") as (client, _):
        base = f"{str(client.base_url).rstrip('/')}/v1"
        messages: Any = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ]
        async with openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0) as oa:
            plain = await oa.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
            chunks = [
                c
                async for c in await oa.chat.completions.create(
                    model="tiny",
                    messages=messages,
                    max_tokens=3,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            ]
            with pytest.raises(openai.BadRequestError, match="role"):
                await oa.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "robot", "content": "x"}],  # type: ignore[list-item,misc]
                )
    assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-")
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == " t1001 t1002 t1003"
    assert plain.choices[0].finish_reason == "length"
    # the mock's transcript: "system: be brief\nuser: hi\nassistant:" (byte tokens)
    assert plain.usage is not None
    assert plain.usage.prompt_tokens == len(b"system: be brief\nuser: hi\nassistant:")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " t1001 t1002 t1003"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


# -- metrics ------------------------------------------------------------------------------


async def test_metrics_follow_prometheus_conventions_and_can_speak_vllms_names() -> None:
    from .gateway_helpers import Metrics

    chat_body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    async with mock_gateway(model="tiny", vllm_metric_names=True) as (client, app):
        for path, body in (
            ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
            ("/v1/chat/completions", chat_body),
        ):
            assert (await client.post(path, json=body)).status_code == 200
        # (a duration is observed once the handler returns, just after the last byte)
        await wait_until(lambda: len(app.counters.durations) == 2)
        metrics = Metrics((await client.get("/metrics")).text)
    families = metrics.families
    # a fraction is a _ratio; the process is described; end-to-end latency by route
    assert "zmqdp_rank_kv_cache_usage_ratio" in families
    assert "process_cpu_seconds" in families and "process_resident_memory_bytes" in families
    durations = {
        s.labels["route"]: s.value
        for s in metrics.samples("zmqdp_gateway_request_duration_seconds", "_count")
    }
    assert durations == {"completions": 1.0, "chat": 1.0}
    # vLLM's dashboard names, by engine (the DP rank) and model
    running = metrics.samples("vllm:num_requests_running")
    assert {s.labels["engine"] for s in running} == {"0"}
    assert {s.labels["model_name"] for s in running} == {"tiny"}
    assert metrics.samples("vllm:generation_tokens", "_total")[0].value == 4.0
    assert families["vllm:e2e_request_latency_seconds"].type == "histogram"
    # per request, as vLLM counts them: how each answer ended, and its sizes
    success = metrics.samples("vllm:request_success", "_total")
    assert {(s.labels["finished_reason"], s.value) for s in success if s.value} == {("length", 2.0)}
    [generated] = metrics.samples("vllm:request_generation_tokens", "_sum")
    assert generated.value == 4.0
    [tpot] = metrics.samples("vllm:request_time_per_output_token_seconds", "_count")
    assert tpot.value == 2.0


async def test_a_client_that_leaves_is_counted_as_an_abort() -> None:
    from .gateway_helpers import Metrics

    app = create_app(mock=MockConfig(engines=1, step_time=0.01), vllm_metric_names=True)
    async with serving(app) as client:
        body = {"prompt": "x", "max_tokens": 1000, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_lines():
                break
        await wait_until(lambda: app.counters.finished["abort"] == 1)
        metrics = Metrics((await client.get("/metrics")).text)
    success = metrics.samples("vllm:request_success", "_total")
    assert {(s.labels["finished_reason"], s.value) for s in success if s.value} == {("abort", 1.0)}

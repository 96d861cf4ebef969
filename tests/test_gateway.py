"""The HTTP gateway (`zmqdp.gateway`) over real HTTP: httpx against a server on
127.0.0.1 (an OS-assigned port), in front of an embedded mock group or of
`ScriptedEngine`s that a test drives by hand.

What a client of an OpenAI-compatible server relies on: the JSON and SSE formats, the
status of every failure (400, 429 + Retry-After, 503, 504, 502), that a client that goes
away stops the generation on its rank exactly once (streaming or not), probes and
metrics, and that a drain turns readiness off first and lets live streams finish.

Each behaviour that involves the server is written once and runs on every server (the
`server` fixture: hypercorn's trio worker with an `EngineGroup`, uvicorn on asyncio and
on uvloop with an `AsyncioEngineGroup`; tests/gateway_helpers.py `on_server`), against
engines in a thread of their own. What the app alone decides (request parsing, the
frontend's errors, the mock's answers) runs on hypercorn only, against the embedded mock
or engines in the test's own trio run; what only uvicorn does is marked so
(tests/test_gateway_hostile.py).

Nothing waits on the clock to synchronize: engines are driven by hand and waited on
(`wait_for`, `wait_until`). Every test runs under a time limit: conftest.py's
`trio.fail_after`, or `on_server`'s.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.utils import LifespanFailureError

from tests.fakes.threaded import EngineThread, url_in, wait_until
from zmqdp import EngineGroup, GroupStatistics
from zmqdp.aio import AsyncioEngineGroup
from zmqdp.engine import Add
from zmqdp.gateway import CompletionRequest, GatewayApp, MockFrontend, Prepared, create_app
from zmqdp.mock import MockConfig

from .gateway_helpers import (
    SERVERS,
    Metrics,
    ScriptFrontend,
    Served,
    TokenEngine,
    all_events,
    check_sigterm_drain,
    events,
    hold,
    on_server,
    read_banner,
    run_on,
    serve_command,
    served_url,
    server_param,
    uvicorn_server,
)
from .gateway_helpers import serving as serving_on
from .helpers import READY_TIMEOUT

FAST_MOCK = MockConfig(engines=2, step_time=0.002)

server = pytest.fixture(params=SERVERS, name="server")(server_param)


# -- serving ----------------------------------------------------------------------------


@asynccontextmanager
async def serving(app: GatewayApp, **config_options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """`app` on hypercorn's trio worker (`gateway_helpers.serving`), and a client of it."""
    async with serving_on("hypercorn", app, **config_options) as client:
        yield client


@asynccontextmanager
async def scripted(
    tmp_path: Path, n: int = 1, *, config: dict[str, Any] | None = None, **kw: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, GatewayApp, list[TokenEngine]]]:
    """A gateway over `n` `TokenEngine`s (`ScriptFrontend`); `kw` go to `create_app`,
    `config` to `serving`."""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        engines = [TokenEngine(url, r, n) for r in range(n)]
        for engine in engines:
            nursery.start_soon(engine.run)
        app = create_app(url, n, frontend=ScriptFrontend(), ready_timeout=READY_TIMEOUT, **kw)
        async with serving(app, **(config or {})) as client:
            yield client, app, engines
        nursery.cancel_scope.cancel()


def stats(app: GatewayApp) -> GroupStatistics:
    assert app.group is not None
    return app.group.statistics()


# -- the happy paths --------------------------------------------------------------------


async def test_a_completion_is_one_openai_text_completion() -> None:
    async with serving(create_app(mock=FAST_MOCK)) as client:
        response = await client.post(
            "/v1/completions",
            json={"model": "zmqdp", "prompt": "hi", "max_tokens": 5, "user": "u", "top_p": 1},
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "zmqdp"
    assert body["id"] == response.headers["x-request-id"] and body["id"].startswith("cmpl-")
    assert response.headers["x-data-parallel-rank"] in {"0", "1"}
    [choice] = body["choices"]
    assert choice == {
        "text": " t1001 t1002 t1003 t1004 t1005",
        "index": 0,
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    # "hi" is two byte-level tokens in the mock frontend
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


@pytest.mark.parametrize(
    "prompt", [[104, 105], ["hi"], [[104, 105]]], ids=["token-ids", "list-of-one", "ids-of-one"]
)
async def test_every_form_of_one_prompt_is_taken(prompt: Any) -> None:
    async with serving(create_app(mock=FAST_MOCK)) as client:
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 2


async def test_curl_style_form_content_type_is_accepted() -> None:
    # `curl -d '{...}'` sends application/x-www-form-urlencoded; the body is JSON anyway
    async with serving(create_app(mock=FAST_MOCK)) as client:
        response = await client.post(
            "/v1/completions",
            content=b'{"prompt":"hi","max_tokens":3}',
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
    assert response.status_code == 200 and response.json()["choices"][0]["text"].count(" t") == 3


async def test_a_stream_is_sse_chunks_then_usage_then_done() -> None:
    async with (
        serving(create_app(mock=FAST_MOCK, model="mock-model")) as client,
        client.stream(
            "POST",
            "/v1/completions",
            json={
                "prompt": "hello",
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        data = await all_events(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    *text_chunks, usage = chunks
    assert len(text_chunks) >= 2  # the mock sends one token per step: several writes
    assert {c["id"] for c in chunks} == {response.headers["x-request-id"]}
    assert all(c["object"] == "text_completion" and c["model"] == "mock-model" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in text_chunks)
    assert text == "".join(f" t{1000 + i}" for i in range(1, 9))
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}


async def test_outputs_buffered_together_go_out_in_one_write(tmp_path: Path) -> None:
    async with (
        scripted(tmp_path) as (client, _, _),
        client.stream(
            "POST", "/v1/completions", json={"prompt": "x", "stream": True, "script": {"burst": 6}}
        ) as response,
    ):
        data = await all_events(response)
    assert data[-1] == "[DONE]"
    [chunk] = [json.loads(d) for d in data[:-1]]  # six outputs in one batch: one event
    assert chunk["choices"][0] == {
        "text": " t0 t1 t2 t3 t4 t5",
        "index": 0,
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }


async def test_the_rank_header_pins_the_request(tmp_path: Path) -> None:
    async with scripted(tmp_path, 2) as (client, _, engines):
        for rank in (1, 0, 1):
            response = await client.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 2},
                headers={"X-Data-Parallel-Rank": str(rank)},
            )
            assert response.status_code == 200, response.text
            assert response.headers["x-data-parallel-rank"] == str(rank)
        assert [len([m for m in e.inbox if isinstance(m, Add)]) for e in engines] == [1, 2]


def test_a_pinned_completion_is_one_openai_text_completion(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        response = await s.client.post(
            "/v1/completions",
            json={"model": "zmqdp", "prompt": "hi", "max_tokens": 4},
            headers={"X-Data-Parallel-Rank": "1"},
        )
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["object"] == "text_completion" and answer["model"] == "zmqdp"
        assert answer["id"] == response.headers["x-request-id"]
        assert answer["id"].startswith("cmpl-")
        assert response.headers["x-data-parallel-rank"] == "1"
        assert answer["choices"] == [
            {
                "text": " t0 t1 t2 t3",
                "index": 0,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ]
        assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        view = await s.engines.wait_for(1, lambda v: bool(v.adds()))  # published after it
        assert view.adds() == [answer["id"]] and s.engines.views[0].adds() == []
        models = await s.client.get("/v1/models")
        assert models.json()["data"][0]["id"] == "zmqdp"

    on_server(server, tmp_path, body, 2)


def test_a_held_stream_is_sse_chunks_then_usage_then_done(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        request = hold(tokens=2, stream=True, stream_options={"include_usage": True})
        async with s.client.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert response.headers["cache-control"] == "no-cache"
            stream = events(response)
            chunks = []
            while "".join(c["choices"][0]["text"] for c in chunks) != " t0 t1":
                chunks.append(json.loads(await anext(stream)))  # one event or two
            await s.finish_held()
            rest = [d async for d in stream]
        assert rest[-1] == "[DONE]"
        *tail, usage = [json.loads(d) for d in rest[:-1]]
        chunks += tail
        assert [c["choices"][0]["text"] for c in chunks][-1] == " tdone"
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert {c["id"] for c in [*chunks, usage]} == {response.headers["x-request-id"]}
        assert all(c["object"] == "text_completion" for c in chunks)
        assert usage["choices"] == []
        assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        assert s.stats().finished == 1

    on_server(server, tmp_path, body)


# -- client errors ------------------------------------------------------------------------


def test_client_errors_are_4xx_and_submit_nothing(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        client = s.client
        invalid = await client.post("/v1/completions", content=b"{not json")
        no_prompt = await client.post("/v1/completions", json={"max_tokens": 3})
        bad_rank = await client.post(
            "/v1/completions", json={"prompt": "x"}, headers={"X-Data-Parallel-Rank": "7"}
        )
        too_big = await client.post("/v1/completions", json={"prompt": "x" * 100})
        missing = await client.get("/v1/chat/nope")
        wrong = await client.get("/v1/completions")
        assert invalid.status_code == 400 and "not valid JSON" in invalid.text
        assert no_prompt.status_code == 400 and no_prompt.json()["error"]["param"] == "prompt"
        assert bad_rank.status_code == 400 and "rank 7" in bad_rank.json()["error"]["message"]
        assert too_big.status_code == 413
        assert too_big.json()["error"]["code"] == "body_too_large"
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert s.stats().submitted == 0 and s.engines.views[0].adds() == []

    on_server(server, tmp_path, body, max_body_size=64)


BAD_BODIES = [
    pytest.param(b"{not json", None, "not valid JSON", id="invalid-json"),
    pytest.param(b"[1, 2]", None, "JSON object", id="not-an-object"),
    pytest.param(b'{"max_tokens": 3}', "prompt", "'prompt' is required", id="no-prompt"),
    pytest.param(b'{"prompt": 7}', "prompt", "must be a string", id="prompt-int"),
    pytest.param(b'{"prompt": []}', "prompt", "must be a string", id="prompt-empty-list"),
    pytest.param(b'{"prompt": [1, -2]}', "prompt", "must be a string", id="negative-token"),
    pytest.param(b'{"prompt": ["a", "b"]}', "prompt", "one prompt per request", id="batch"),
    pytest.param(b'{"prompt": "a", "max_tokens": 0}', "max_tokens", "from 1", id="max-tokens-0"),
    pytest.param(
        b'{"prompt": "a", "max_tokens": "9"}', "max_tokens", "from 1", id="max-tokens-str"
    ),
    pytest.param(
        b'{"prompt": "a", "max_tokens": 18446744073709551616}',
        "max_tokens",
        "from 1 to 2147483647",
        id="max-tokens-2**64",
    ),
    pytest.param(b'{"prompt": [1, 4294967296]}', "prompt", "must be a string", id="token-2**32"),
    pytest.param(b'{"prompt": [null]}', "prompt", "must be a string", id="prompt-null-batch"),
    pytest.param(b'{"prompt": "\\ud800"}', None, "no UTF-8 form", id="lone-surrogate"),
    pytest.param(b'{"prompt": "a", "n": true}', "n", "must be 1", id="n-true"),
    pytest.param(b'{"prompt": "a", "n": 1.0}', "n", "must be 1", id="n-float"),
    pytest.param(b'{"prompt": "a", "max_tokens": NaN}', None, "NaN is not JSON", id="nan"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply", id="deep-nesting"),
    pytest.param(b'{"prompt": "a", "stream": "yes"}', "stream", "boolean", id="stream-str"),
    pytest.param(b'{"prompt": "a", "n": 2}', "n", "must be 1", id="n-2"),
    pytest.param(b'{"prompt": "a", "user": 5}', "user", "string", id="user-int"),
    pytest.param(b'{"prompt": "a", "model": []}', "model", "string", id="model-list"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_BODIES)
async def test_a_bad_request_is_a_400_naming_the_field(
    body: bytes, param: str | None, message: str
) -> None:
    app = create_app(mock=FAST_MOCK)
    async with serving(app) as client:
        response = await client.post("/v1/completions", content=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    assert error["param"] == param and message in error["message"]
    assert stats(app).submitted == 0


async def test_a_frontend_refusal_is_a_400() -> None:
    class Small(MockFrontend):
        max_prompt_tokens = 3

    async with serving(create_app(mock=FAST_MOCK, frontend=Small())) as client:
        response = await client.post("/v1/completions", json={"prompt": "four", "max_tokens": 1})
    assert response.status_code == 400
    assert "the prompt has 4 tokens" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("value", "status", "code"),
    [("abc", 400, "invalid_rank"), ("-1", 400, "invalid_rank"), ("7", 400, "invalid_rank")],
)
async def test_a_bad_rank_header_is_a_400(
    tmp_path: Path, value: str, status: int, code: str
) -> None:
    async with scripted(tmp_path, 2) as (client, app, _):
        response = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"X-Data-Parallel-Rank": value},
        )
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code
        if value == "7":
            assert "rank 7" in response.json()["error"]["message"]
        assert stats(app).submitted == 0


async def test_unknown_routes_and_methods() -> None:
    async with serving(create_app(mock=FAST_MOCK)) as client:
        missing = await client.get("/v1/chat/nope")
        wrong = await client.get("/v1/completions")
        too_big = await client.post("/v1/completions", content=b"x" * 100)
        models = await client.get("/v1/models")
        head = await client.head("/health")  # load balancers probe with HEAD too
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert too_big.status_code == 400  # (not JSON; the size limit is 4 MiB)
    assert models.json()["data"][0]["id"] == "zmqdp"
    assert head.status_code == 200 and head.content == b""


async def test_a_failing_frontend_is_a_json_500_naming_the_request() -> None:
    class Broken(MockFrontend):
        def prepare(self, request: CompletionRequest) -> Prepared:
            raise TypeError("a bug in the frontend reading /secret/model.bin")

    app = create_app(mock=FAST_MOCK, frontend=Broken())
    async with serving(app) as client:
        response = await client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "dialect_failed"
    assert response.headers["x-request-id"] in error["message"]
    assert "TypeError" in error["message"]
    assert "/secret" not in error["message"]  # the details go to the log only (issue 24)
    assert stats(app).submitted == 0


async def test_an_unexpected_error_from_a_stream_shows_its_type_only() -> None:
    """A frontend's `decode` that raises: the client gets a JSON 500 with the error's
    type, never its text (a path, a prompt), which the gateway logs."""

    def broken(_output: Any) -> Any:
        raise RuntimeError("decode failed reading /secret/model.bin prompt=x")

    class Broken(MockFrontend):
        def prepare(self, request: CompletionRequest) -> Prepared:
            return dataclasses.replace(super().prepare(request), decode=broken)

    app = create_app(mock=FAST_MOCK, frontend=Broken())
    async with serving(app) as client:
        response = await client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert "RuntimeError" in message and "/secret" not in message


async def test_a_body_past_the_limit_is_a_413() -> None:
    async with serving(create_app(mock=FAST_MOCK, max_body_size=64)) as client:
        response = await client.post("/v1/completions", json={"prompt": "x" * 100})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"


# -- client disconnects -------------------------------------------------------------------


async def assert_aborted_once(s: Served, rank: int, wire: str) -> None:
    """Rank `rank` got an ABORT for `wire`, and no second one: a request sent after it
    reaches the rank after any second ABORT would (one queue per rank, in order)."""
    await s.engines.wait_for(rank, lambda v: wire in v.aborted())
    await wait_until(lambda: s.stats().aborted == 1)
    await wait_until(lambda: s.app.counters.disconnects["completions"] == 1)
    st = s.stats()
    assert st.ranks[rank].inflight == 0 and st.finished == 0
    adds = len(s.engines.views[rank].adds())
    after = await s.client.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"X-Data-Parallel-Rank": str(rank)},
    )
    assert after.status_code == 200, after.text
    view = await s.engines.wait_for(rank, lambda v: len(v.adds()) == adds + 1)
    assert view.aborted() == [wire]
    assert s.stats().aborted == 1 and s.app.counters.disconnects["completions"] == 1


def test_a_client_leaving_a_stream_aborts_the_request_on_its_rank_once(
    tmp_path: Path, server: str
) -> None:
    async def body(s: Served) -> None:
        async with s.client.stream(
            "POST",
            "/v1/completions",
            json={**hold(tokens=2), "stream": True},
            headers={"X-Data-Parallel-Rank": "1"},
        ) as response:
            request_id = response.headers["x-request-id"]
            seen = ""
            async for data in events(response):
                seen += json.loads(data)["choices"][0]["text"]  # one event or two
                if seen == " t0 t1":
                    break
        # the client closed the connection mid-stream
        wire = (await s.engines.wait_for(1, lambda v: v.holds(request_id))).wire(request_id)
        await assert_aborted_once(s, 1, wire)
        assert s.engines.views[0].inbox == ()
        st = s.stats()
        assert [r.inflight for r in st.ranks] == [0, 0] and st.finished == 1  # the later one

    on_server(server, tmp_path, body, 2)


def test_a_client_leaving_before_a_plain_answer_aborts_the_request(
    tmp_path: Path, server: str
) -> None:
    async def body(s: Served) -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(partial(s.client.post, "/v1/completions", json=hold()))
            [wire] = (await s.engines.wait_for(0, lambda v: bool(v.held))).held
            tasks.cancel_scope.cancel()  # the client gives up: httpx closes the connection
        await assert_aborted_once(s, 0, wire)
        assert s.stats().finished == 1  # the later one

    on_server(server, tmp_path, body)


# -- admission, deadlines, engine failures --------------------------------------------------


def test_no_room_is_a_429_with_retry_after(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        first: list[httpx.Response] = []

        async def held() -> None:
            first.append(await s.client.post("/v1/completions", json=hold()))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(held)
            await s.engines.wait_for(0, lambda v: bool(v.held))
            response = await s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert response.status_code == 429
            assert response.headers["retry-after"] == "3"
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "overloaded")
            assert response.headers["x-request-id"] in error["message"]
            assert "requests in flight" in error["message"]
            await s.finish_held()
        [answer] = first
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " tdone"
        assert s.stats().overloaded == 1 and s.engines.views[0].adds() == [answer.json()["id"]]

    on_server(server, tmp_path, body, max_inflight=1, retry_after=3)


def test_a_queue_time_waits_for_room_then_serves(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        answers: dict[str, httpx.Response] = {}

        async def post(name: str, request: dict[str, Any]) -> None:
            answers[name] = await s.client.post("/v1/completions", json=request)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(post, "first", hold())
            await s.engines.wait_for(0, lambda v: bool(v.held))
            tasks.start_soon(post, "second", {"prompt": "x", "max_tokens": 2})
            await wait_until(lambda: s.stats().waiting == 1)
            assert len(s.engines.views[0].adds()) == 1
            await s.finish_held()
        assert [answers[n].status_code for n in ("first", "second")] == [200, 200]
        assert answers["second"].json()["choices"][0]["text"] == " t0 t1"
        st = s.stats()
        assert (st.overloaded, st.finished, st.waiting) == (0, 2, 0)

    on_server(server, tmp_path, body, max_inflight=1, queue_timeout=15)


def test_no_room_within_the_queue_time_is_a_429(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        first: list[httpx.Response] = []

        async def held() -> None:
            first.append(await s.client.post("/v1/completions", json=hold()))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(held)
            await s.engines.wait_for(0, lambda v: bool(v.held))
            response = await s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert response.status_code == 429 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "queue_timeout"
            await wait_until(lambda: s.stats().waiting == 0)  # the waiter is gone
            assert s.stats().submitted == 1 and len(s.engines.views[0].adds()) == 1
            await s.finish_held()
        assert first[0].status_code == 200

    on_server(server, tmp_path, body, max_inflight=1, queue_timeout=0.05)


def test_a_deadline_before_the_answer_is_a_504(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        response = await s.client.post("/v1/completions", json=hold())
        assert response.status_code == 504
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
        request_id = response.headers["x-request-id"]
        assert f"rank 0, request {request_id!r}" in error["message"]
        view = await s.engines.wait_for(0, lambda v: bool(v.aborted()))
        assert view.aborted() == [view.wire(request_id)]
        assert s.stats().timed_out == 1

    on_server(server, tmp_path, body, request_timeout=0.2)


def test_a_deadline_mid_stream_is_an_sse_error_then_the_end(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        request = {**hold(tokens=2), "stream": True}
        async with s.client.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            data = await all_events(response)
        assert "[DONE]" not in data
        *tokens, last = [json.loads(d) for d in data]
        assert "".join(t["choices"][0]["text"] for t in tokens) == " t0 t1"
        assert last["error"]["code"] == "request_timeout" and "rank 0" in last["error"]["message"]
        assert s.stats().timed_out == 1
        view = await s.engines.wait_for(0, lambda v: bool(v.aborted()))
        assert view.aborted() == [view.wire(response.headers["x-request-id"])]

    on_server(server, tmp_path, body, request_timeout=0.3)


def test_a_dead_engine_is_a_502(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        response = await s.client.post(
            "/v1/completions",
            json={"prompt": "x", "script": {"die": True}},
            headers={"X-Data-Parallel-Rank": "0"},
        )
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "engine_dead" and "rank 0" in error["message"]
        assert s.stats().failed == 1

    on_server(server, tmp_path, body, 2)


# -- probes and metrics ---------------------------------------------------------------------


def test_probes_and_metrics_with_per_rank_series(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        client = s.client
        health = await client.get("/health")
        ready = await client.get("/ready")
        assert health.status_code == 200 and health.json()["live"] is True
        assert ready.status_code == 200
        assert ready.json() | {"room": None} == {
            "gateway_draining": False,
            "live": True,
            "ready": True,
            "draining": False,
            "ranks_up": 2,
            "size": 2,
            "inflight": 0,
            "room": None,
            "recovering": False,
        }
        for rank in (0, 1, 1):
            response = await client.post(
                "/v1/completions",
                json={"prompt": "abc", "max_tokens": 2},
                headers={"X-Data-Parallel-Rank": str(rank)},
            )
            assert response.status_code == 200
        await client.post("/v1/completions", content=b"nope")
        scraped = await client.get("/metrics")
        assert scraped.headers["content-type"].startswith("text/plain")
        metrics = Metrics(scraped.text)
        samples = metrics.by_rank
        assert samples("zmqdp_rank_up") == {"0": 1.0, "1": 1.0}
        assert samples("zmqdp_rank_cap") == {"0": 4.0, "1": 4.0}
        assert samples("zmqdp_rank_inflight") == {"0": 0.0, "1": 0.0}
        for name in ("zmqdp_rank_waiting", "zmqdp_rank_running", "zmqdp_rank_kv_cache_usage_ratio"):
            assert set(samples(name)) == {"0", "1"}
        assert samples("zmqdp_rank_ttft_seconds", "_count") == {"0": 1.0, "1": 2.0}
        assert samples("zmqdp_rank_latency_seconds", "_count") == {"0": 1.0, "1": 2.0}
        assert samples("zmqdp_requests_submitted", "_total") == {"": 3.0}
        assert samples("zmqdp_requests_finished", "_total") == {"": 3.0}
        families = metrics.families
        assert families["zmqdp_rank_ttft_seconds"].type == "histogram"
        # every int counter of GroupStatistics is exported
        st = s.stats()
        for field in ("aborted", "failed", "timed_out", "overloaded", "overflowed"):
            assert f"zmqdp_requests_{field}" in families, field
        for field in ("protocol_errors", "late_outputs", "wakes", "resyncs", "impersonations"):
            assert families[f"zmqdp_{field}"].samples[0].value == getattr(st, field)
        http = metrics.http()
        assert http[("completions", "200")] == 3 and http[("completions", "400")] == 1
        assert http[("health", "200")] == 1 and http[("ready", "200")] == 1
        assert metrics.samples("zmqdp_gateway_completion_tokens", "_total")[0].value == 6
        assert metrics.samples("zmqdp_group_ready")[0].value == 1

    on_server(server, tmp_path, body, 2, max_inflight=4)


# -- lifecycle ------------------------------------------------------------------------------


def test_a_drain_turns_ready_off_first_and_lets_a_live_stream_finish(
    tmp_path: Path, server: str
) -> None:
    async def body(s: Served) -> None:
        client, app = s.client, s.app
        group = app.group
        assert group is not None
        request = {**hold(tokens=1), "stream": True}
        async with client.stream("POST", "/v1/completions", json=request) as response:
            stream = events(response)
            assert json.loads(await anext(stream))["choices"][0]["text"] == " t0"
            app.begin_drain()
            ready = await client.get("/ready")
            assert ready.status_code == 503 and ready.json()["gateway_draining"] is True
            assert (await client.get("/health")).status_code == 200  # still live
            await wait_until(lambda: group.health().draining)
            refused = await client.post("/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "draining"
            assert group.closed is None  # the live stream holds the drain
            await s.finish_held()
            rest = [d async for d in stream]
        assert json.loads(rest[0])["choices"][0] == {
            "text": " tdone",
            "index": 0,
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
        }
        assert rest[-1] == "[DONE]"
        await app.wait_drained()
        assert group.closed is not None  # drained, then closed
        assert s.stats().finished == 1 and s.stats().aborted == 0
        assert s.engines.views[0].aborted() == []
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["live"] is False
        late = await client.post("/v1/completions", json={"prompt": "x"})
        assert late.status_code == 503

    on_server(server, tmp_path, body)


def test_a_drain_grace_keeps_serving_while_ready_is_off(tmp_path: Path, server: str) -> None:
    async def body(s: Served) -> None:
        s.app.begin_drain()
        assert (await s.client.get("/ready")).status_code == 503
        served = await s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert served.status_code == 200  # the load balancer has not noticed yet
        assert s.app.group is not None and not s.app.group.health().draining
        # leaving: the server's shutdown cuts the 30 s grace short (the time limit is 20 s)

    on_server(server, tmp_path, body, drain_grace=30)


def test_an_app_serves_a_group_it_was_given_and_leaves_it_open(tmp_path: Path, server: str) -> None:
    """The group's flavour is the server's: `EngineGroup` on hypercorn's trio worker,
    `AsyncioEngineGroup` on uvicorn."""
    flavour: Any = EngineGroup if server == "hypercorn" else AsyncioEngineGroup
    with EngineThread(url_in(tmp_path), 1, engine=TokenEngine) as engines:

        async def main() -> None:
            engines.attach()
            async with flavour.connect(engines.url, 1, ready_timeout=READY_TIMEOUT) as group:
                app = create_app(group=group, frontend=ScriptFrontend())
                async with serving_on(server, app) as client:
                    response = await client.post(
                        "/v1/completions", json={"prompt": "x", "max_tokens": 2}
                    )
                    assert response.json()["choices"][0]["text"] == " t0 t1"
                assert group.closed is None and group.health().ready  # after the shutdown
                assert group.statistics().finished == 1

        run_on(server, main)


def test_a_group_that_does_not_form_fails_the_startup(tmp_path: Path, server: str) -> None:
    """Each server fails its startup its own way (hypercorn: `LifespanFailureError`;
    uvicorn: exit code 3, STARTUP_FAILURE), having closed the group's sockets and, on
    uvicorn, ended the guest trio run."""
    app = create_app(url_in(tmp_path), 1, ready_timeout=0.2)

    async def on_hypercorn() -> None:
        config = Config()
        config.bind = ["127.0.0.1:0"]
        with pytest.RaisesGroup(
            pytest.RaisesExc(LifespanFailureError, match="HandshakeTimeout.*not ready"),
            flatten_subgroups=True,
        ):
            await serve(app, config)  # type: ignore[arg-type]

    async def on_uvicorn() -> None:
        userver = uvicorn_server(app)
        with pytest.raises(SystemExit) as info:
            await userver.serve()
        assert info.value.code == 3  # uvicorn's STARTUP_FAILURE
        assert not userver.started and not trio.lowlevel.in_trio_run()  # the guest run ended

    run_on(server, on_hypercorn if server == "hypercorn" else on_uvicorn)
    assert not list(tmp_path.iterdir())  # the sockets are closed


def test_create_app_refuses_contradictory_arguments() -> None:
    with pytest.raises(ValueError, match="needs url and engines"):
        create_app("ipc:///tmp/x")
    with pytest.raises(ValueError, match="no url, engines or mock"):
        create_app("ipc:///tmp/x", group=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        create_app(mock=FAST_MOCK, queue_timeout=-1)


# -- the serve command ----------------------------------------------------------------------


@pytest.mark.timeout_s(40)
@pytest.mark.parametrize("server", ["hypercorn", "default"])
async def test_serve_drains_on_sigterm_then_exits_0(server: str) -> None:
    """`python -m zmqdp serve --mock`, with `--server hypercorn` or none (uvicorn, the
    default): the banner names the URL, the server, and for uvicorn its loop (uvloop
    when installed) and its parser (httptools when installed); SIGTERM turns /ready to
    503 while a live stream goes on to [DONE]; then the process exits 0."""
    options = ("--server", server) if server != "default" else ()
    proc = await trio.lowlevel.open_process(
        serve_command(*options), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out = await read_banner(proc)
        parser = b"h11" if importlib.util.find_spec("httptools") is None else b"httptools"
        loop = b"asyncio" if importlib.util.find_spec("uvloop") is None else b"uvloop"
        uvicorn = b"(uvicorn, %s, %s)" % (loop, parser)
        flavour = b"(hypercorn, trio)" if server == "hypercorn" else uvicorn
        assert flavour in out, out
        await check_sigterm_drain(served_url(out), lambda: proc.send_signal(signal.SIGTERM))
        assert await proc.wait() == 0
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def _run_serve(*options: str, signal_after: bytes | None = None) -> tuple[int, str]:
    """Run `python -m zmqdp serve` with `options` (no engines: the group never forms); if
    `signal_after` is given, send SIGTERM once that text is in its output. Its exit
    status and output."""
    cmd = [sys.executable, "-m", "zmqdp", "serve", "--port", "0", *options]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = b""
    try:
        assert proc.stdout is not None
        while data := await proc.stdout.receive_some():
            out += data
            if signal_after is not None and signal_after in out:
                proc.send_signal(signal.SIGTERM)
                signal_after = None
        return await proc.wait(), out.decode()
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


@pytest.mark.timeout_s(20)
@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
async def test_sigterm_while_connecting_stops_at_once(tmp_path: Path, server: str) -> None:
    """No engine ever comes: SIGTERM stops the startup (not `--ready-timeout` later, 60 s)
    and the process exits 0 without announcing anything."""
    url = f"ipc://{tmp_path}/g"
    options = ["--url", url, "--engines", "1", "--server", server, "--log-level", "INFO"]
    rc, out = await _run_serve(*options, signal_after=b"waiting for 1 rank(s)")
    assert rc == 0, out
    assert "SIGTERM: stopping now" in out and "try: curl" not in out


@pytest.mark.timeout_s(20)
@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
async def test_a_startup_failure_is_one_line_naming_the_cause(tmp_path: Path, server: str) -> None:
    url = f"ipc://{tmp_path}/g"
    options = ["--url", url, "--engines", "1", "--ready-timeout", "0.3", "--server", server]
    rc, out = await _run_serve(*options)
    assert rc != 0, out
    assert "try: curl" not in out and "ExceptionGroup" not in out and "sub-exception" not in out
    assert "HandshakeTimeout" in out and "rank 0" in out.split("HandshakeTimeout", 1)[1], out


class _VllmTokenFrontend:
    """A gateway frontend for a vLLM group (test stand-in for issue 22's real one): a
    token-id prompt becomes a `VllmRequest`, each output's token ids become text."""

    def prepare(self, request: Any) -> Any:
        from zmqdp.gateway import Piece, Prepared
        from zmqdp.vllm import SamplingParams, VllmRequest

        ids = list(request.prompt) if not isinstance(request.prompt, str) else [1, 2]
        sampling = SamplingParams(temperature=0.0, max_tokens=request.max_tokens)

        def decode(output: Any) -> Any:
            return Piece("".join(f" v{t}" for t in output.body.token_ids), 1, output.finish)

        def make(request_id: str, rank: int | None) -> VllmRequest:
            return VllmRequest(request_id, ids, sampling, rank=rank)

        return Prepared(None, len(ids), decode, make)


async def test_the_gateway_serves_a_group_on_vllms_wire() -> None:
    """The gateway takes any group: an `EngineGroup[VllmRequest]` (fake vLLM engines)
    behind the same app, its frontend building vLLM's requests."""
    from tests.test_vllm_group import vllm_group

    async with vllm_group(2) as (group, fake):
        app = create_app(group=group, frontend=_VllmTokenFrontend())
        async with serving(app) as client:
            response = await client.post(
                "/v1/completions", json={"prompt": [10, 20], "max_tokens": 3}
            )
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["choices"][0]["text"].count(" v") == 3
            assert body["usage"]["completion_tokens"] == 3
        assert sum(len(e.got("add")) for e in fake.engines) == 1

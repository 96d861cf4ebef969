"""The HTTP gateway against hostile or careless clients (issue 24) on uvicorn: the
findings of tests/test_gateway_hostile.py (hypercorn) that concern the app, checked on
asyncio and uvloop, and the ways uvicorn ends a request: `stop_now()` and the
cancellation of a request's task past `timeout_graceful_shutdown`.

Every test runs its body under the `asyncio.timeout` of `run` (tests/fakes/threaded.py),
and each I/O step under a shorter one; nothing waits on the clock to synchronize.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.fakes.threaded import RUNNERS, EngineThread, Run, loop_runner, url_in
from zmqdp.gateway import GatewayApp, create_app

from .gateway_helpers import ScriptFrontend, TokenEngine, events, hold
from .helpers import READY_TIMEOUT
from .test_gateway_asyncio import _Server, on_uvicorn, stats

run = pytest.fixture(params=sorted(RUNNERS), name="run")(loop_runner)

STEP = 5.0
"""Seconds: the `asyncio.timeout` of each I/O step of a test."""


def test_collect_limits_model_and_rank_are_bounded(tmp_path: Path, run: Run) -> None:
    """Findings 5, 6 and 8 on uvicorn: each is a JSON error naming what is wrong."""

    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        async with asyncio.timeout(STEP):
            past = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 6})
            assert past.status_code == 400 and past.json()["error"]["param"] == "max_tokens"
            assert "at most 5" in past.json()["error"]["message"]

            overshoot = await client.post(
                "/v1/completions", json={**hold(tokens=8), "max_tokens": 5}
            )
            assert overshoot.status_code == 502, overshoot.text
            error = overshoot.json()["error"]
            request_id = overshoot.headers["x-request-id"]
            assert error["code"] == "response_too_large" and request_id in error["message"]
            view = await engines.wait_for(0, lambda v: bool(v.aborted()))
            assert view.aborted() == [view.wire(request_id)]

            model = await client.post("/v1/completions", json={"prompt": "x", "model": "m" * 257})
            assert model.status_code == 400 and model.json()["error"]["param"] == "model"

            rank = await client.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 1},
                headers={"X-Data-Parallel-Rank": "1" * 4400},
            )
            assert rank.status_code == 400, rank.text[:200]
            assert rank.json()["error"]["code"] == "invalid_rank"
            assert "X-Data-Parallel-Rank" in rank.json()["error"]["message"]

            digits = b'{"prompt": "a", "max_tokens": %s}' % (b"9" * 5000)
            number = await client.post("/v1/completions", content=digits)
            assert number.status_code == 400
            assert "integer too long" in number.json()["error"]["message"]
            assert stats(app).submitted == 1  # the overshoot only

    on_uvicorn(run, tmp_path, body, max_collected_tokens=5)


def test_connection_close_closes_the_connection_after_a_completion(
    tmp_path: Path, run: Run
) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        url = client.base_url
        assert url.host and url.port
        async with asyncio.timeout(STEP):
            reader, writer = await asyncio.open_connection(url.host, url.port)
            data = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: test\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(data), data)
            )
            answer = await reader.read()  # to EOF: hangs if the server keeps it open
            writer.close()
        head, _, rest = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert json.loads(rest)["choices"][0]["text"] == " t0 t1"

    on_uvicorn(run, tmp_path, body)


def test_stop_now_answers_live_requests_503_and_aborts_them(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        async with asyncio.timeout(STEP):
            plain = asyncio.create_task(
                client.post("/v1/completions", json=hold(), headers={"X-Data-Parallel-Rank": "0"})
            )
            request = {**hold(tokens=1), "stream": True}
            async with client.stream(
                "POST", "/v1/completions", json=request, headers={"X-Data-Parallel-Rank": "1"}
            ) as response:
                stream = events(response)
                assert json.loads(await anext(stream))["choices"][0]["text"] == " t0"
                await engines.wait_for(0, lambda v: bool(v.held))
                app.stop_now()
                rest = [d async for d in stream]
            answer = await plain
            assert answer.status_code == 503
            assert answer.json()["error"]["code"] == "shutting_down"
            [last] = rest  # no [DONE]
            assert json.loads(last)["error"]["code"] == "shutting_down"
            for rank in (0, 1):
                await engines.wait_for(rank, lambda v: len(v.aborted()) == 1)
            late = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert late.status_code == 503
            await app.wait_drained()

    on_uvicorn(run, tmp_path, body, 2)


def test_a_request_cancelled_by_uvicorn_is_answered_503_without_a_traceback(
    tmp_path: Path, run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn cancels the tasks of requests still live `timeout_graceful_shutdown`
    after its shutdown began (and `asyncio.run` cancels any left at its end). The app
    answers a JSON 503 and ends the task quietly: a `CancelledError` reaching uvicorn
    is logged as "Exception in ASGI application" with a traceback, and answered with a
    bare text 500."""
    with EngineThread(url_in(tmp_path), 1, engine=TokenEngine) as engines:

        async def main() -> None:
            engines.attach()
            app = create_app(engines.url, 1, frontend=ScriptFrontend(), ready_timeout=READY_TIMEOUT)
            config = uvicorn.Config(
                app,
                host="127.0.0.1",
                port=0,
                lifespan="on",
                loop="none",
                log_config=None,  # uvicorn's records reach caplog
                timeout_graceful_shutdown=0,
            )
            server = _Server(config)
            serving = asyncio.create_task(server.serve())
            async with asyncio.timeout(STEP):
                await server.listening.wait()
                host, port = server.servers[0].sockets[0].getsockname()[:2]
                async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                    post = asyncio.create_task(client.post("/v1/completions", json=hold()))
                    [wire] = (await engines.wait_for(0, lambda v: bool(v.held))).held
                    server.should_exit = True  # the held request outlives the grace
                    response = await post
                await serving
                await engines.wait_for(0, lambda v: bool(v.aborted()))
            assert response.status_code == 503, response.text
            assert response.headers["content-type"] == "application/json"
            assert response.json()["error"]["code"] == "shutting_down"
            assert engines.views[0].aborted() == [wire]
            assert stats(app).aborted == 1

        with caplog.at_level(logging.INFO):
            run(main)
    assert "Cancel 1 running task(s)" in caplog.text  # uvicorn did cancel it
    assert "Exception in ASGI application" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info], caplog.text

"""The HTTP gateway (`zmqdp.gateway`) on asyncio: httpx against uvicorn, served in the
test's own loop on 127.0.0.1 (an OS-assigned port), the group being
`zmqdp.aio.AsyncioEngineGroup` (trio as a guest of that loop). tests/test_gateway.py
checks every behaviour on hypercorn's trio worker; this file checks that each of them
holds on uvicorn: the JSON and SSE formats, the status of every failure, that a client
that goes away stops the generation on its rank exactly once (streaming or not), probes
and metrics, the drain, and the `serve --server uvicorn` command's SIGTERM drain.

Every in-process test runs under both `asyncio.run` and `uvloop.run` (the `run` fixture)
with an `asyncio.timeout` around its body. The engines are `TokenEngine`s in a trio run
of their own, in another thread (`EngineThread`, tests/fakes/threaded.py): the test
sees what reached them (an ADD, an ABORT) through their snapshots, and drives them from
a worker thread. Nothing waits on the clock to synchronize: waits are on engine
snapshots or, for state the guest trio run changes in its own steps, a check at every
turn of the loop (`wait_until`).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import uvicorn

from tests.fakes.threaded import (
    RUNNERS,
    EngineThread,
    Run,
    loop_runner,
    run_limited,
    url_in,
    wait_until,
)
from zmqdp import GroupStatistics
from zmqdp.aio import AsyncioEngineGroup
from zmqdp.gateway import GatewayApp, create_app

from .gateway_helpers import (
    BANNER_END,
    Metrics,
    ScriptFrontend,
    TokenEngine,
    all_events,
    check_sigterm_drain,
    events,
    hold,
    serve_command,
    served_url,
)
from .helpers import READY_TIMEOUT

run = pytest.fixture(params=sorted(RUNNERS), name="run")(loop_runner)


# -- serving --------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn's `Server`, telling when it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.listening.set()


def uvicorn_server(app: GatewayApp) -> _Server:
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        lifespan="on",
        log_level="warning",
        loop="none",  # the test's loop: serve() runs in it
        timeout_graceful_shutdown=2,
    )
    return _Server(config)


@asynccontextmanager
async def serving(app: GatewayApp) -> AsyncIterator[httpx.AsyncClient]:
    """`app` on uvicorn in this loop on 127.0.0.1:0, and a client of it. The server
    stops (lifespan shutdown: drain and close) when the block ends."""
    server = uvicorn_server(app)

    async def serve() -> None:
        try:
            await server.serve()
        except SystemExit as exc:  # a failed lifespan startup
            raise AssertionError(f"uvicorn exited with {exc.code} at startup") from None

    serving = asyncio.create_task(serve())
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait([serving, listening], return_when=asyncio.FIRST_COMPLETED)
    if not listening.done():
        listening.cancel()
        await serving
        raise AssertionError("uvicorn stopped before it listened")
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    try:
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=15) as client:
            yield client
    finally:
        server.should_exit = True
        await serving


Body = Callable[[httpx.AsyncClient, GatewayApp, EngineThread], Awaitable[None]]


def on_uvicorn(run: Run, tmp_path: Path, body: Body, n: int = 1, **kw: Any) -> None:
    """`body(client, app, engines)` in `run`'s loop, against a gateway on uvicorn over
    `n` `TokenEngine`s (`ScriptFrontend`); `kw` go to `create_app`."""
    with EngineThread(url_in(tmp_path), n, engine=TokenEngine) as engines:

        async def main() -> None:
            engines.attach()
            app = create_app(
                engines.url, n, frontend=ScriptFrontend(), ready_timeout=READY_TIMEOUT, **kw
            )
            async with serving(app) as client:
                assert isinstance(app.group, AsyncioEngineGroup)  # the asyncio flavour
                await body(client, app, engines)
            # the lifespan shutdown closed the group and ended its guest trio run
            assert app.group.closed is not None and not trio.lowlevel.in_trio_run()

        run(main)


def stats(app: GatewayApp) -> GroupStatistics:
    assert app.group is not None
    return app.group.statistics()


async def finish_held(engines: EngineThread, rank: int = 0) -> None:
    """Finish the one request rank `rank` holds (" tdone", finish "stop")."""
    [wire] = (await engines.wait_for(rank, lambda v: len(v.held) == 1)).held
    await engines.finish(rank, wire.rpartition("#")[0])


async def assert_aborted_once(
    client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread, rank: int, wire: str
) -> None:
    """Rank `rank` got an ABORT for `wire`, and no second one: a request sent after it
    reaches the rank after any second ABORT would (one queue per rank, in order)."""
    await engines.wait_for(rank, lambda v: wire in v.aborted())
    await wait_until(lambda: stats(app).aborted == 1)
    await wait_until(lambda: app.counters.disconnects["completions"] == 1)
    assert stats(app).ranks[rank].inflight == 0
    adds = len(engines.views[rank].adds())
    after = await client.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"X-Data-Parallel-Rank": str(rank)},
    )
    assert after.status_code == 200, after.text
    view = await engines.wait_for(rank, lambda v: len(v.adds()) == adds + 1)
    assert view.aborted() == [wire]
    assert stats(app).aborted == 1 and app.counters.disconnects["completions"] == 1


# -- the happy paths --------------------------------------------------------------------


def test_a_completion_is_one_openai_text_completion(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        response = await client.post(
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
            {"text": " t0 t1 t2 t3", "index": 0, "logprobs": None, "finish_reason": "length"}
        ]
        assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        view = await engines.wait_for(1, lambda v: bool(v.adds()))  # published after it
        assert view.adds() == [answer["id"]] and engines.views[0].adds() == []
        models = await client.get("/v1/models")
        assert models.json()["data"][0]["id"] == "zmqdp"

    on_uvicorn(run, tmp_path, body, 2)


def test_a_stream_is_sse_chunks_then_usage_then_done(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        request = hold(tokens=2, stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert response.headers["cache-control"] == "no-cache"
            stream = events(response)
            chunks = []
            while "".join(c["choices"][0]["text"] for c in chunks) != " t0 t1":
                chunks.append(json.loads(await anext(stream)))  # one event or two
            await finish_held(engines)
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
        assert stats(app).finished == 1

    on_uvicorn(run, tmp_path, body)


# -- client errors ------------------------------------------------------------------------


def test_client_errors_are_4xx_and_submit_nothing(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
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
        assert stats(app).submitted == 0 and engines.views[0].adds() == []

    on_uvicorn(run, tmp_path, body, max_body_size=64)


# -- client disconnects -------------------------------------------------------------------


def test_a_client_leaving_a_stream_aborts_the_request_on_its_rank_once(
    tmp_path: Path, run: Run
) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        async with client.stream(
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
        wire = (await engines.wait_for(1, lambda v: v.holds(request_id))).wire(request_id)
        await assert_aborted_once(client, app, engines, 1, wire)
        assert engines.views[0].inbox == ()
        st = stats(app)
        assert [r.inflight for r in st.ranks] == [0, 0] and st.finished == 1  # the later one

    on_uvicorn(run, tmp_path, body, 2)


def test_a_client_leaving_before_a_plain_answer_aborts_the_request(
    tmp_path: Path, run: Run
) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        post = asyncio.create_task(client.post("/v1/completions", json=hold()))
        [wire] = (await engines.wait_for(0, lambda v: bool(v.held))).held
        post.cancel()  # the client gives up: httpx closes the connection
        with pytest.raises(asyncio.CancelledError):
            await post
        await assert_aborted_once(client, app, engines, 0, wire)
        assert stats(app).finished == 1  # the later one

    on_uvicorn(run, tmp_path, body)


# -- admission, deadlines, engine failures --------------------------------------------------


def test_no_room_is_a_429_with_retry_after(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        first = asyncio.create_task(client.post("/v1/completions", json=hold()))
        await engines.wait_for(0, lambda v: bool(v.held))
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert response.status_code == 429
        assert response.headers["retry-after"] == "3"
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "overloaded")
        assert response.headers["x-request-id"] in error["message"]
        assert "requests in flight" in error["message"]
        await finish_held(engines)
        answer = await first
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " tdone"
        assert stats(app).overloaded == 1 and engines.views[0].adds() == [answer.json()["id"]]

    on_uvicorn(run, tmp_path, body, max_inflight=1, retry_after=3)


def test_a_queue_time_waits_for_room_then_serves(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        first = asyncio.create_task(client.post("/v1/completions", json=hold()))
        await engines.wait_for(0, lambda v: bool(v.held))
        second = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        )
        await wait_until(lambda: stats(app).waiting == 1)
        assert len(engines.views[0].adds()) == 1
        await finish_held(engines)
        answers = await asyncio.gather(first, second)
        assert [r.status_code for r in answers] == [200, 200]
        assert answers[1].json()["choices"][0]["text"] == " t0 t1"
        st = stats(app)
        assert (st.overloaded, st.finished, st.waiting) == (0, 2, 0)

    on_uvicorn(run, tmp_path, body, max_inflight=1, queue_timeout=15)


def test_no_room_within_the_queue_time_is_a_429(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        first = asyncio.create_task(client.post("/v1/completions", json=hold()))
        await engines.wait_for(0, lambda v: bool(v.held))
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "queue_timeout"
        await wait_until(lambda: stats(app).waiting == 0)  # the guest's waiter is gone
        assert stats(app).submitted == 1 and len(engines.views[0].adds()) == 1
        await finish_held(engines)
        assert (await first).status_code == 200

    on_uvicorn(run, tmp_path, body, max_inflight=1, queue_timeout=0.05)


def test_a_deadline_before_the_answer_is_a_504(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        response = await client.post("/v1/completions", json=hold())
        assert response.status_code == 504
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
        request_id = response.headers["x-request-id"]
        assert f"rank 0, request {request_id!r}" in error["message"]
        view = await engines.wait_for(0, lambda v: bool(v.aborted()))
        assert view.aborted() == [view.wire(request_id)]
        assert stats(app).timed_out == 1

    on_uvicorn(run, tmp_path, body, request_timeout=0.2)


def test_a_deadline_mid_stream_is_an_sse_error_then_the_end(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        request = {**hold(tokens=2), "stream": True}
        async with client.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            data = await all_events(response)
        assert "[DONE]" not in data
        *tokens, last = [json.loads(d) for d in data]
        assert "".join(t["choices"][0]["text"] for t in tokens) == " t0 t1"
        assert last["error"]["code"] == "request_timeout" and "rank 0" in last["error"]["message"]
        assert stats(app).timed_out == 1
        view = await engines.wait_for(0, lambda v: bool(v.aborted()))
        assert view.aborted() == [view.wire(response.headers["x-request-id"])]

    on_uvicorn(run, tmp_path, body, request_timeout=0.3)


def test_a_dead_engine_is_a_502(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        response = await client.post(
            "/v1/completions",
            json={"prompt": "x", "script": {"die": True}},
            headers={"X-Data-Parallel-Rank": "0"},
        )
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "engine_dead" and "rank 0" in error["message"]
        assert stats(app).failed == 1

    on_uvicorn(run, tmp_path, body, 2)


# -- probes and metrics ---------------------------------------------------------------------


def test_probes_and_metrics_with_per_rank_series(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
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
        http = metrics.http()
        assert http[("completions", "200")] == 3 and http[("completions", "400")] == 1
        assert http[("health", "200")] == 1 and http[("ready", "200")] == 1
        assert metrics.samples("zmqdp_gateway_completion_tokens", "_total")[0].value == 6
        assert metrics.samples("zmqdp_group_ready")[0].value == 1

    on_uvicorn(run, tmp_path, body, 2, max_inflight=4)


# -- lifecycle ------------------------------------------------------------------------------


def test_a_drain_turns_ready_off_first_and_lets_a_live_stream_finish(
    tmp_path: Path, run: Run
) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        group = app.group
        assert isinstance(group, AsyncioEngineGroup)
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
            await finish_held(engines)
            rest = [d async for d in stream]
        assert json.loads(rest[0])["choices"][0] == {
            "text": " tdone",
            "index": 0,
            "logprobs": None,
            "finish_reason": "stop",
        }
        assert rest[-1] == "[DONE]"
        await app.wait_drained()
        assert group.closed is not None  # drained, then closed
        assert stats(app).finished == 1 and stats(app).aborted == 0
        assert engines.views[0].aborted() == []
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["live"] is False
        late = await client.post("/v1/completions", json={"prompt": "x"})
        assert late.status_code == 503

    on_uvicorn(run, tmp_path, body)


def test_a_drain_grace_keeps_serving_while_ready_is_off(tmp_path: Path, run: Run) -> None:
    async def body(client: httpx.AsyncClient, app: GatewayApp, engines: EngineThread) -> None:
        app.begin_drain()
        assert (await client.get("/ready")).status_code == 503
        served = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert served.status_code == 200  # the load balancer has not noticed yet
        assert app.group is not None and not app.group.health().draining
        # leaving: the server's shutdown cuts the 30 s grace short (the time limit is 20 s)

    on_uvicorn(run, tmp_path, body, drain_grace=30)


def test_an_app_serves_a_group_it_was_given_and_leaves_it_open(tmp_path: Path, run: Run) -> None:
    with EngineThread(url_in(tmp_path), 1, engine=TokenEngine) as engines:

        async def main() -> None:
            engines.attach()
            async with AsyncioEngineGroup.connect(
                engines.url, 1, ready_timeout=READY_TIMEOUT
            ) as group:
                app = create_app(group=group, frontend=ScriptFrontend())
                async with serving(app) as client:
                    response = await client.post(
                        "/v1/completions", json={"prompt": "x", "max_tokens": 2}
                    )
                    assert response.json()["choices"][0]["text"] == " t0 t1"
                assert group.closed is None and group.health().ready  # after the shutdown
                assert group.statistics().finished == 1

        run(main)


def test_a_group_that_does_not_form_fails_the_startup(tmp_path: Path, run: Run) -> None:
    async def main() -> None:
        server = uvicorn_server(create_app(url_in(tmp_path), 1, ready_timeout=0.2))
        with pytest.raises(SystemExit) as info:
            await server.serve()
        assert info.value.code == 3  # uvicorn's STARTUP_FAILURE
        assert not server.started and not trio.lowlevel.in_trio_run()  # the guest run ended
        assert not list(tmp_path.iterdir())  # noqa: ASYNC240 (tmp_path, instant)  sockets closed

    run(main)


# -- the serve command ----------------------------------------------------------------------


def test_serve_uvicorn_drains_on_sigterm_then_exits_0() -> None:
    """`python -m zmqdp serve --mock --server uvicorn`: as the hypercorn test in
    tests/test_gateway.py. The client's loop is plain asyncio; the server's is uvicorn's
    choice (uvloop when installed)."""

    async def main() -> None:
        proc = await asyncio.create_subprocess_exec(
            *serve_command("--server", "uvicorn"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            assert proc.stdout is not None
            out = b""
            while BANNER_END not in out:
                data = await proc.stdout.read(4096)
                assert data, out
                out += data
            assert b"(uvicorn, asyncio)" in out
            await check_sigterm_drain(served_url(out), lambda: proc.send_signal(signal.SIGTERM))
            out += await proc.stdout.read()
            assert await proc.wait() == 0, out.decode(errors="replace")
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    run_limited(asyncio.run, main)

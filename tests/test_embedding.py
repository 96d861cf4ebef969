"""Embedding the gateway in another app (issue 35 §1): `create_app()` mounted in FastAPI
at ``/`` and under ``/llm`` (routes below `root_path`, its lifespan run by the host
through `GatewayApp.lifespan`), the official OpenAI client against it, a mounted app
whose lifespan never ran, `until_disconnected` in a hand-written endpoint, and the
trio-side embedding: `lifespan()` on trio, and `run_mock_group` started before its
client.

The FastAPI tests run uvicorn for real on loopback (port 0) in the test's asyncio loop,
under `TIME_LIMIT`; their mock group is the asyncio backend's (a ``zmqdp mock``
subprocess)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import pydoc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.fakes.threaded import run_limited, wait_until
from zmqdp import EngineGroup, Request
from zmqdp.gateway import ClientDisconnected, GatewayApp, create_app, until_disconnected
from zmqdp.gateway.app import _route_path
from zmqdp.mock import MockConfig, run_mock_group

fastapi = pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

FAST = MockConfig(engines=2, step_time=0.001)


class _Server(uvicorn.Server):  # type: ignore[misc]
    """uvicorn's `Server`, telling when it listens."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.listening.set()


@asynccontextmanager
async def served(app: Any, **options: Any) -> AsyncIterator[str]:
    """`app` on uvicorn in this loop on 127.0.0.1 (port 0): its base URL. `options`:
    more of uvicorn's `Config` (`root_path`)."""
    config = uvicorn.Config(
        app,
        **options,
        host="127.0.0.1",
        port=0,
        lifespan="on",
        log_level="warning",
        loop="none",
        timeout_graceful_shutdown=2,
    )
    server = _Server(config)
    running = asyncio.create_task(server.serve())
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait([running, listening], return_when=asyncio.FIRST_COMPLETED)
    if not listening.done():
        listening.cancel()
        await running
        raise AssertionError("uvicorn stopped before it listened")
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await running


def host_app(gateway: GatewayApp, prefix: str) -> Any:
    """A FastAPI app of the embedder's: a route of its own, the gateway mounted at
    `prefix` and run by the host's lifespan."""
    app = fastapi.FastAPI(lifespan=gateway.lifespan)

    @app.get("/own")
    async def own() -> dict[str, str]:
        return {"own": "route"}

    app.mount(prefix, gateway)
    return app


# -- routing below root_path -----------------------------------------------------------


def test_route_path_strips_root_path_only_where_the_path_keeps_it() -> None:
    assert _route_path({"path": "/llm/v1/models", "root_path": "/llm"}) == "/v1/models"
    assert _route_path({"path": "/v1/models", "root_path": "/llm"}) == "/v1/models"  # stripped
    assert _route_path({"path": "/llm", "root_path": "/llm"}) == "/"
    assert _route_path({"path": "/llmx/v1/models", "root_path": "/llm"}) == "/llmx/v1/models"
    assert _route_path({"path": "/v1/models", "root_path": ""}) == "/v1/models"
    assert _route_path({"path": "/v1/models"}) == "/v1/models"


# -- FastAPI, uvicorn and the OpenAI client ----------------------------------------------


@pytest.mark.parametrize("prefix", ["/llm", "/"])
def test_fastapi_mounts_the_gateway_and_the_openai_client_completes_chats_and_streams(
    prefix: str,
) -> None:
    gateway = create_app(mock=FAST, model="tiny")
    app = host_app(gateway, prefix)

    async def main() -> None:
        async with served(app) as base:
            api = f"{base}{prefix.rstrip('/')}/v1"
            async with openai.AsyncOpenAI(base_url=api, api_key="k", max_retries=0) as oa:
                done = await oa.completions.create(model="tiny", prompt="hi", max_tokens=3)
                assert done.usage is not None and done.usage.completion_tokens == 3
                assert done.choices[0].finish_reason == "length"
                chat = await oa.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                assert chat.usage is not None and chat.usage.completion_tokens == 2
                assert chat.choices[0].message.role == "assistant"
                chunks = [
                    c
                    async for c in await oa.completions.create(
                        model="tiny", prompt="hi", max_tokens=4, stream=True
                    )
                ]
                assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                assert text == " t1001 t1002 t1003 t1004"  # (a chunk may carry several)
                assert [m.id async for m in oa.models.list()] == ["tiny"]
            async with httpx.AsyncClient(base_url=base) as client:
                own = await client.get("/own")  # the host's own route, beside the mount
                assert own.status_code == 200 and own.json() == {"own": "route"}
                ready = await client.get(f"{prefix.rstrip('/')}/ready")
                assert ready.status_code == 200
        assert gateway.group is not None and gateway.group.health().live is False  # closed

    run_limited(asyncio.run, main)


def test_a_mounted_gateway_whose_lifespan_never_ran_says_what_to_call() -> None:
    gateway = create_app(mock=FAST)
    app = fastapi.FastAPI()  # no lifespan=: Starlette never runs a mounted app's lifespan
    app.mount("/llm", gateway)

    async def main() -> None:
        async with served(app) as base, httpx.AsyncClient(base_url=base) as client:
            answer = await client.post(
                "/llm/v1/completions", json={"model": "zmqdp", "prompt": "hi", "max_tokens": 1}
            )
            assert answer.status_code == 503
            error = answer.json()["error"]
            assert error["code"] == "not_started"
            assert "FastAPI(lifespan=gateway.lifespan)" in error["message"]

    run_limited(asyncio.run, main)


def test_lifespan_raises_the_startup_failure_as_itself() -> None:
    gateway = create_app(
        "ipc:///nonexistent-dir-zmqdp/g", 1, ready_timeout=0.5, raise_fd_limit=False
    )

    async def main() -> None:
        with pytest.raises(RuntimeError, match="the gateway's startup failed: "):
            async with gateway.lifespan():
                raise AssertionError("started")  # pragma: no cover

    run_limited(asyncio.run, main)


def test_uvicorn_root_path_routes_below_the_prefix() -> None:
    gateway = create_app(mock=FAST, model="tiny")

    async def main() -> None:
        # `serve --root-path`: behind a proxy that strips /llm, uvicorn puts it back in
        # front of every path (scope["path"] "/llm/v1/models"), as ASGI says
        async with (
            served(gateway, root_path="/llm") as base,
            httpx.AsyncClient(base_url=base) as client,
        ):
            answer = await client.get("/v1/models")
            assert answer.status_code == 200
            assert answer.json()["data"][0]["id"] == "tiny"
            missing = await client.get("/v2/models")
            assert missing.status_code == 404
            said = missing.json()["error"]["message"]
            assert said == "no route '/v2/models' below the root path '/llm'"
            # the prefix sent anyway (the proxy strips it): not '/llm/llm/v1/models'
            twice = await client.get("/llm/v1/models")
            said = twice.json()["error"]["message"]
            assert said == "no route '/llm/v1/models' below the root path '/llm'"

    run_limited(asyncio.run, main)


# -- an embedder's own endpoint: until_disconnected --------------------------------------


async def test_until_disconnected_on_trio_cancels_the_work_or_returns_its_value() -> None:
    left = trio.Event()
    cancelled: list[bool] = []

    async def receive() -> dict[str, Any]:
        await left.wait()
        return {"type": "http.disconnect"}

    async def forever() -> int:
        try:
            left.set()  # the client leaves while the work runs
            await trio.sleep_forever()
        finally:
            cancelled.append(True)
        return 0  # pragma: no cover

    async def quick() -> int:
        return 7

    with trio.fail_after(5):
        with pytest.raises(ClientDisconnected):
            await until_disconnected(receive, forever)
        assert cancelled == [True]
        left = trio.Event()  # a client that stays
        assert await until_disconnected(receive, quick) == 7


def test_a_hand_written_endpoint_aborts_its_request_when_its_client_leaves() -> None:
    gateway = create_app(mock=MockConfig(engines=1, step_time=0.01), drain_timeout=1)
    app = host_app(gateway, "/llm")
    outcomes: list[str] = []

    @app.post("/generate")
    async def generate(request: fastapi.Request) -> Any:
        body = await request.json()
        group = gateway.group
        assert group is not None

        async def answer() -> dict[str, Any]:
            async with group.submit(Request("own-1", body)) as stream:
                return {"tokens": [out.body["token"] async for out in stream]}

        try:
            return await until_disconnected(request.receive, answer)
        except ClientDisconnected:
            outcomes.append("disconnected")
            return fastapi.Response(status_code=499)

    async def main() -> None:
        async with served(app) as base:
            group = gateway.group
            assert group is not None
            host, port = base.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port))
            body = b'{"prompt": [1], "max_tokens": 100000}'  # 1000 s of steps
            writer.write(
                b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            await wait_until(lambda: group.health().inflight == 1)
            writer.close()  # the client leaves before its answer
            await writer.wait_closed()
            async with asyncio.timeout(5):  # within a bound: the rank is told at once
                await wait_until(lambda: group.statistics().aborted == 1)
            assert group.health().inflight == 0
            await wait_until(lambda: outcomes == ["disconnected"])
            # and an answer that comes first is returned as it is
            async with httpx.AsyncClient(base_url=base) as client:
                ok = await client.post("/generate", json={"prompt": [1], "max_tokens": 2})
                assert ok.status_code == 200 and ok.json() == {"tokens": [1001, 1002]}

    run_limited(asyncio.run, main)


# -- the trio side: lifespan() and the mock group --------------------------------------


async def test_lifespan_runs_the_gateway_on_trio_and_closes_its_group(tmp_path: Path) -> None:
    gateway = create_app(mock=FAST)
    with trio.fail_after(20):
        async with gateway.lifespan():
            group = gateway.group
            assert group is not None and group.health().ready
            async with group.submit(Request("r", {"prompt": [1], "max_tokens": 2})) as stream:
                assert [out.body["token"] async for out in stream] == [1001, 1002]
        assert group.health().live is False
        with pytest.raises(RuntimeError, match="already run"):
            async with gateway.lifespan():
                pass  # pragma: no cover


async def test_lifespan_entered_twice_at_once_runs_once() -> None:
    """Two tasks entering `lifespan()` together: one runs the gateway, the other gets
    the RuntimeError (before, both passed the check before either had started, and two
    groups were connected, the first one's never closed)."""
    gateway = create_app(mock=FAST)
    outcomes: list[str] = []
    release = trio.Event()

    async def enter() -> None:
        try:
            async with gateway.lifespan():
                outcomes.append("ran")
                await release.wait()
        except RuntimeError as exc:
            outcomes.append(str(exc))
            release.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(enter)
            nursery.start_soon(enter)
    assert sorted(outcomes) == ["ran", "the gateway's lifespan has already run (or is running)"]


async def test_lifespan_cancelled_by_its_host_drains_and_returns() -> None:
    """A cancel of the host's block around `lifespan()` (here a `move_on_after`) ends
    it: the group drained and closed, the cancel caught by its scope. Before, the
    cancel killed the gateway's lifespan task too, and the shielded shutdown waited
    for its reply forever (a hang no deadline could break)."""
    gateway = create_app(mock=FAST)
    with trio.fail_after(20):
        with trio.CancelScope() as host:
            async with gateway.lifespan():
                group = gateway.group
                assert group is not None
                async with group.submit(Request("r", {"prompt": [1], "max_tokens": 10**6})) as s:
                    await s.receive()
                    host.cancel()
                    await trio.sleep_forever()
    assert host.cancelled_caught
    assert group.health().live is False


async def test_lifespan_cancelled_while_starting_returns(tmp_path: Path) -> None:
    """A cancel while the gateway waits for ranks that never come ends the block."""
    gateway = create_app(url=f"ipc://{tmp_path}/nobody", engines=1)
    with trio.fail_after(20):
        with trio.move_on_after(0.2) as host:
            async with gateway.lifespan():
                raise AssertionError("started")  # pragma: no cover
    assert host.cancelled_caught


async def test_run_mock_group_started_before_its_client_does_not_hang(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            ranks = await nursery.start(run_mock_group, url, FAST)
            assert ranks == (0, 1)
            request = Request("r", {"prompt": [], "max_tokens": 1})
            async with EngineGroup.connect(url, 2) as group, group.submit(request) as stream:
                assert [out.finish async for out in stream] == ["length"]
            nursery.cancel_scope.cancel()


# -- connect's options, visible to help(), IDEs and type checkers ------------------------


def test_connect_keywords_and_signatures_list_every_connect_option_as_connect_options() -> None:
    from zmqdp import ConnectKeywords, ConnectOptions
    from zmqdp.aio import AsyncioEngineGroup
    from zmqdp.vllm import connect as vllm_connect

    fields = {f.name: f for f in dataclasses.fields(ConnectOptions)}
    keywords = {n: t.__forward_arg__ for n, t in ConnectKeywords.__annotations__.items()}
    assert keywords == {n: f.type for n, f in fields.items()}  # same names, same types
    for connect in (EngineGroup.connect, AsyncioEngineGroup.connect, vllm_connect):
        params = inspect.signature(connect).parameters
        shown = {n: p.default for n, p in params.items() if n in fields}
        assert shown == {n: f.default for n, f in fields.items()}, connect
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
        # evaluated, not strings: pdoc would read a string in connect's own module,
        # where `Literal` need not be imported ("Error parsing type annotation")
        assert not any(isinstance(params[n].annotation, str) for n in fields), connect
        shown_by_help = pydoc.render_doc(connect, renderer=pydoc.plaintext)
        assert "ready_timeout: float | None = None," in shown_by_help
    # create_app takes them too, with two defaults of its own
    params = inspect.signature(create_app).parameters
    shown = {n: p.default for n, p in params.items() if n in fields}
    ours = {"max_buffered": 4096, "recover": True}
    assert shown == {n: ours.get(n, f.default) for n, f in fields.items()}


def test_mypy_rejects_a_misspelt_or_mistyped_connect_option(tmp_path: Path) -> None:
    api = pytest.importorskip("mypy.api")
    source = tmp_path / "host.py"
    source.write_text(
        "from zmqdp import EngineGroup\n"
        "from zmqdp.aio import AsyncioEngineGroup\n\n\n"
        "async def main() -> None:\n"
        '    async with EngineGroup.connect("ipc:///x", 2, ready_timout=5):\n'
        "        pass\n"
        '    async with AsyncioEngineGroup.connect("ipc:///x", 2, max_inflight="all"):\n'
        "        pass\n"
        '    async with EngineGroup.connect("ipc:///x", 2, ready_timeout=5, routing="speed"):\n'
        "        pass\n"
    )
    out, _, status = api.run(["--strict", "--cache-dir", str(tmp_path / "cache"), str(source)])
    assert status == 1, out
    assert 'host.py:6: error: Unexpected keyword argument "ready_timout"' in out
    assert 'host.py:8: error: Argument "max_inflight"' in out
    assert "Found 2 errors in 1 file" in out  # the third, correct call passes

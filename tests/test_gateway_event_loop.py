"""The gateway's event loop keeps serving while a hostile client's long prompt is
tokenized or its large body parsed (a hostile-peer review of the gateway, findings 3
and 4), and an engine's finish strings cannot grow the metric series (finding 8). Over
real HTTP (hypercorn on 127.0.0.1, and uvicorn for the parse), in front of
tests/fakes/vllm.py's fake engine cores with the real-engine suite's tiny model, its
context raised to 128k tokens as in the finding.

Nothing here times anything: each test synchronizes on events set by the work it
watches, and asserts that the loop answered `/health` *before* that work was done.
benchmarks/bench_gateway_gil.py measures how long a victim's stream stalls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.fakes.engines import ScriptedEngine
from tools.aiperf_smoke import model_dir
from zmqdp._core.messages import Output
from zmqdp.engine import Add
from zmqdp.gateway import VllmFrontend, completions, create_app

from .gateway_helpers import SERVERS, Metrics, ScriptFrontend, Served, on_server
from .test_gateway import READY_TIMEOUT, serving
from .test_vllm_group import vllm_group

pytest.importorskip("tokenizers", reason="the vllm extra (tokenizers)")

MODEL = Path(__file__).parent / "data" / "tiny-model"
CONTEXT = 131072
LONG_ENGINES = {"max_model_len": CONTEXT}
"""Fake engines of that context too: the gateway takes the least of the model's and the
engines' lengths, as vLLM's frontend does."""


def long_context_model(tmp: Path) -> Path:
    """The tiny model with a 128k context."""
    return model_dir(tmp, MODEL, CONTEXT)


class Watched:
    """A tokenizer whose encoding calls set `started` as they begin and `finished` as
    they end (from the thread they run in)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.started = threading.Event()
        self.finished = threading.Event()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.real, name)
        if not name.startswith("encode"):
            return attr

        def watched(*args: Any, **kwargs: Any) -> Any:
            self.started.set()
            try:
                return attr(*args, **kwargs)
            finally:
                self.finished.set()

        return watched


async def answered_before(client: httpx.AsyncClient, done: Callable[[], bool]) -> bool:
    """`GET /health` once: was it answered while `done()` was still false?"""
    response = await client.get("/health")
    assert response.status_code == 200, response.text
    return not done()


async def test_the_loop_answers_while_a_long_prompt_is_tokenized(tmp_path: Path) -> None:
    """Finding 3: tokenizers' `encode` holds the GIL for its whole run, so in a worker
    thread it still froze the event loop (and every stream) for the seconds a 2 MiB
    prompt takes. The gateway now tokenizes with `encode_batch_fast`, which lets go of
    the GIL: `/health` is answered while the tokenizer works."""
    frontend = VllmFrontend(long_context_model(tmp_path))
    width = frontend.model.widest
    tokenizer = Watched(frontend.model.tokenizer)
    frontend.model = dataclasses.replace(frontend.model, tokenizer=tokenizer)
    # as long as the cheap check lets through (one token left for the completion): it
    # is tokenized, and then refused for its token count
    words = "the quick brown fox jumps over the lazy dog and 12 more; "
    size = (CONTEXT - 1) * width
    prompt = (words * (size // len(words) + 1))[:size]
    async with (
        vllm_group(1, fake_kw=LONG_ENGINES) as (group, _),
        serving(create_app(group=group, frontend=frontend)) as client,
        trio.open_nursery() as nursery,
    ):
        answers: list[httpx.Response] = []

        async def attacker() -> None:
            body = {"prompt": prompt, "max_tokens": 1}
            answers.append(await client.post("/v1/completions", json=body))

        nursery.start_soon(attacker)
        await trio.to_thread.run_sync(tokenizer.started.wait)
        assert await answered_before(client, tokenizer.finished.is_set), (
            "the event loop answered nothing while the tokenizer ran"
        )
    [answer] = answers
    assert answer.status_code == 400 and "maximum context length" in answer.text


def hold_parse(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> tuple[threading.Event, threading.Event, threading.Event]:
    """The gateway's `name` (`parse_completion`, `parse_chat`) held once it starts,
    until `release` (at most 5 s: on the loop's own thread nothing could release it):
    the events (`started`, `release`, `parsed`)."""
    real = getattr(completions, name)
    started, release, parsed = threading.Event(), threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        started.set()
        release.wait(5)
        try:
            return real(*args, **kwargs)
        finally:
            parsed.set()

    monkeypatch.setattr(completions, name, held)
    return started, release, parsed


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_the_loop_answers_while_a_large_body_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chat: bool
) -> None:
    """Finding 4: a large body was parsed on the event loop (0.4 to 1.2 s for 4 MiB of
    token ids, 0.4 s for 140k chat messages), holding up every stream. The parse now
    runs in a worker thread: here it is held until `/health` has been answered (on
    the loop's own thread, the hold would freeze the loop and `/health` with it)."""
    started, release, parsed = hold_parse(monkeypatch, "parse_chat" if chat else "parse_completion")
    frontend = VllmFrontend(long_context_model(tmp_path))
    if chat:  # more messages than the context has tokens, in 4 MiB
        path, body = "/v1/chat/completions", {"messages": [{"role": "user"}] * 200_000}
    else:  # about 2 million token ids in 4 MiB
        path, body = "/v1/completions", {"prompt": [1] * 2_000_000, "max_tokens": 1}
    data = json.dumps(body, separators=(",", ":")).encode()
    assert 3 << 20 < len(data) < 4 << 20
    async with (
        vllm_group(1, fake_kw=LONG_ENGINES) as (group, _),
        serving(create_app(group=group, frontend=frontend)) as client,
        trio.open_nursery() as nursery,
    ):
        answers: list[httpx.Response] = []

        async def attacker() -> None:
            answers.append(await client.post(path, content=data))

        nursery.start_soon(attacker)
        await trio.to_thread.run_sync(started.wait)
        healthy = await answered_before(client, parsed.is_set)
        release.set()
        assert healthy, "the event loop answered nothing while the body was parsed"
    [answer] = answers
    # refused for its count, before any element was looked at
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == ("messages" if chat else "input_tokens")
    said = (
        "has 200000 messages: more than this model's maximum context length"
        if chat
        else "your prompt contains 2000000 input tokens, which exceeds this limit"
    )
    assert said in error["message"]


@pytest.mark.parametrize("server", [s for s in SERVERS if s.startswith("uvicorn")])
def test_the_loop_answers_while_a_large_body_is_parsed_on_uvicorn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: str
) -> None:
    """Finding 4 on asyncio: the parse of a large body runs in the worker thread of
    the heavy lane there too."""
    started, release, parsed = hold_parse(monkeypatch, "parse_completion")
    data = json.dumps({"prompt": [1] * 100_000, "max_tokens": 1}).encode()

    async def body(s: Served) -> None:
        client = s.client
        async with asyncio.timeout(15):
            attacker = asyncio.create_task(client.post("/v1/completions", content=data))
            await asyncio.to_thread(started.wait)
            healthy = await answered_before(client, parsed.is_set)
            release.set()
            assert healthy, "the event loop answered nothing while the body was parsed"
            answer = await attacker
            assert answer.status_code == 200, answer.text

    on_server(server, tmp_path, body)


class FinishEngine(ScriptedEngine):
    """Ends each request at once with the finish string its body names."""

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Add) and isinstance(msg.body, dict) and "finish" in msg.body:
            await self.emit((Output(msg.id, 0, msg.body["finish"]),))
        else:
            await super().handle(msg)


async def test_an_engines_finish_strings_cannot_grow_the_metric_series(tmp_path: Path) -> None:
    """Finding 8: the engine's finish string was a label value (``finished_reason`` of
    ``vllm:request_success``) and a key of the gateway's finish counters: each unique
    string one more series, for good. Label values now come from a fixed set; any
    other finish counts as ``other``."""
    url = f"ipc://{tmp_path}/g"
    finishes = [f"weird-{i}" for i in range(40)] + ["stop", "length"]
    async with trio.open_nursery() as nursery:
        engine = FinishEngine(url, 0, 1)
        nursery.start_soon(engine.run)
        app = create_app(
            url, 1, frontend=ScriptFrontend(), vllm_metric_names=True, ready_timeout=READY_TIMEOUT
        )
        async with serving(app) as client:
            for finish in finishes:
                body = {"prompt": "x", "max_tokens": 1, "script": {"finish": finish}}
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
            metrics = Metrics((await client.get("/metrics")).text)
        nursery.cancel_scope.cancel()
    assert set(app.counters.finished) == {"other", "stop", "length"}
    success = metrics.samples("vllm:request_success", "_total")
    counted = {s.labels["finished_reason"]: s.value for s in success if s.value}
    assert counted == {"other": 40.0, "stop": 1.0, "length": 1.0}

"""The gateway (`python -m zmqdp serve --vllm`) in front of real vLLM engine cores, driven
by clients nobody here wrote: the official OpenAI client (sync and async, chat and
completions, streaming and not) and aiperf's default run.

Two groups, one per HTTP server: a dense DP=2 group behind hypercorn (trio), and an MoE
DP=2 group behind uvicorn (asyncio). The model directories are copies of the suite's
tiny models with a 4096-token context, and the engines run with ``--max-model-len``
`MAX_MODEL_LEN`: aiperf's default prompts are about 550 tokens. Each group starts once
per module (real engines do the handshake once); the gateway runs as a subprocess,
exactly as a user starts it, and its log is named in every failure.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer

from .engines import EngineProcs, free_port

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 1024
KEY = "sk-real-engines"
NAME = "tiny"
ALIAS = "tiny-alias"
PROMPT = "The quick brown fox jumps over the lazy dog, and then"


@dataclass
class Gateway:
    base: str
    model: Path
    engines: EngineProcs
    proc: subprocess.Popen[bytes]
    log: Path
    moe: bool

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"--- gateway {self.log}\n" + "\n".join(text) + "\n" + self.engines.tail(15)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base + "/v1", api_key=KEY, max_retries=0, timeout=120
        )

    def metrics(self) -> dict[str, float]:
        """/metrics: each series' samples summed over their labels."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.fullmatch(r"([a-zA-Z_:]+)(?:\{.*\})? (\S+)", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def wait_metric(self, name: str, want: float, timeout: float = 60.0) -> None:
        """Poll /metrics (another process: there is no event to wait on) until `name` is `want`."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.metrics().get(name)
            if value == want:
                return
            time.sleep(0.1)
        raise AssertionError(f"{name} = {value}, not {want}, after {timeout} s\n{self.tail()}")


def aiperf_smoke() -> Any:
    """tools/aiperf_smoke.py (aiperf's venv, the 4096-token model copy, error counts)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import aiperf_smoke
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return aiperf_smoke


def _wait_ready(gw: Gateway, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gw.proc.poll() is not None:
            raise AssertionError(f"the gateway exited ({gw.proc.returncode})\n{gw.tail()}")
        try:
            with urllib.request.urlopen(gw.base + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the gateway was not ready in {timeout} s\n{gw.tail()}")


@pytest.fixture(
    scope="module",
    params=[("dense", "hypercorn"), ("moe", "uvicorn")],
    ids=["dense-hypercorn", "moe-uvicorn"],
)
def gateway(
    request: pytest.FixtureRequest,
    vllm_venv: Path,
    models: Path,
    engine_logs: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateway]:
    kind, server = request.param
    moe = kind == "moe"
    logs = engine_logs / f"gateway-{kind}"
    model = aiperf_smoke().model_dir(tmp_path_factory.mktemp(kind), models / kind)
    engines = EngineProcs(
        vllm_venv, model, 2, logs, moe=moe, extra=("--max-model-len", str(MAX_MODEL_LEN))
    )
    port = free_port()
    log = logs / "gateway.log"
    cmd = [
        sys.executable,
        "-m",
        "zmqdp",
        "serve",
        "--vllm",
        str(model),
        "--url",
        engines.url,
        "--data-parallel-size",  # vLLM's flags where it has them (issue 35)
        "2",
        "--insecure",
        "--ready-timeout",
        "400",
        "--port",
        str(port),
        "--server",
        server,
        "--served-model-name",
        NAME,
        ALIAS,
        # the key: the flag for one group, vLLM's environment variable for the other
        *([] if moe else ["--api-key", KEY]),
        # an MoE group's 4 busy-waiting processes on this 2-core machine starved the
        # gateway of CPU for 3-4 s at a time (measured): 3 s heartbeats lost both ranks
        *(["--moe", "--heartbeat-timeout", "10"] if moe else []),
    ]
    env = {**os.environ, "VLLM_API_KEY": KEY} if moe else None
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    gw = Gateway(f"http://127.0.0.1:{port}", model, engines, proc, log, moe)
    try:
        engines.start_all()
        _wait_ready(gw, 420)
        yield gw
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        engines.stop_all()


def test_models_and_the_api_key(gateway: Gateway) -> None:
    models = gateway.client().models.list()
    assert [m.id for m in models.data] == [NAME, ALIAS]
    # vLLM answers with the first served name, whichever the request named
    by_alias = gateway.client().completions.create(model=ALIAS, prompt="hi", max_tokens=1)
    assert by_alias.model == NAME
    bad = openai.OpenAI(base_url=gateway.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError) as e:
        gateway.client().completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    assert "gpt-4" in str(e.value)


def test_completions_with_real_token_counts(gateway: Gateway) -> None:
    tok = Tokenizer.from_file(str(gateway.model / "tokenizer.json"))
    prompt_tokens = len(tok.encode(PROMPT, add_special_tokens=False).ids)
    client = gateway.client()
    r = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == prompt_tokens
    # the same request streamed (greedy: the same text, whichever rank runs it)
    stream = client.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 24
    # a token prompt gives the same answer as its text
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    by_ids = client.completions.create(
        model=NAME, prompt=ids, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == r.choices[0].text


def test_chat_sync_and_async_streaming_and_not(gateway: Gateway) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    client = gateway.client()
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=16, seed=7, extra_body={"ignore_eos": True}
    )  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens == 16
    assert r.usage.prompt_tokens > 5  # the template's markers count

    # the async client on asyncio (httpx), as applications run it
    streamed = asyncio.run(asyncio.wait_for(streamed_asyncio(gateway, messages), 120))
    assert streamed == r.choices[0].message.content


async def streamed_asyncio(gateway: Gateway, messages: list[dict[str, str]]) -> str:
    async with gateway.async_client() as client:
        stream = await client.chat.completions.create(
            model=NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=16,
            seed=7,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


def test_a_stop_string_ends_the_text_before_it(gateway: Gateway) -> None:
    client = gateway.client()
    body = {"model": NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 64}
    full = client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0].text  # type: ignore[call-overload]
    # a stop string from the middle of the greedy answer, at its first occurrence
    words = [w for w in re.findall(r"\S{2,}", full[len(full) // 3 :]) if w.strip()]
    if not words:
        pytest.skip(f"the dummy model's greedy answer has no usable stop string: {full!r}")
    stop = words[0]
    r = client.completions.create(**body, stop=[stop], extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    # vLLM's stop_reason: the string matched, streamed or not; null for a length finish
    assert r.choices[0].model_dump()["stop_reason"] == stop
    chunks = list(
        client.completions.create(**body, stop=[stop], stream=True, extra_body={"ignore_eos": True})
    )  # type: ignore[call-overload]
    assert chunks[-1].choices[0].model_dump()["stop_reason"] == stop
    long = client.completions.create(**body, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    assert long.choices[0].model_dump()["stop_reason"] is None


def test_bad_prompts_are_400s_and_the_engines_live_on(gateway: Gateway) -> None:
    client = gateway.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=[5, 6, 99999], max_tokens=4)
    assert "out of vocabulary" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=[5] * (MAX_MODEL_LEN + 10), max_tokens=4)
    # (the model directory says 4096; the engines' READY says MAX_MODEL_LEN, which wins,
    # as in vLLM's frontend; vLLM's message)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in str(e.value), e.value
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", max_tokens=4, logprobs=2)
    assert e.value.body is not None and "logprobs" in json.dumps(e.value.body)
    # the engines took none of it: the next request runs
    r = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 4


def test_a_client_that_goes_away_mid_stream_frees_its_request(gateway: Gateway) -> None:
    before = gateway.metrics().get("zmqdp_requests_aborted_total", 0.0)
    host, port = gateway.base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps(
        {
            "model": NAME,
            "prompt": PROMPT,
            "max_tokens": MAX_MODEL_LEN - 40,
            "ignore_eos": True,
            "stream": True,
        }
    )
    conn.request(
        "POST",
        "/v1/completions",
        body,
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # detokenized text is flowing
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    gateway.wait_metric("zmqdp_group_inflight", 0.0)
    after = gateway.metrics()
    assert after.get("zmqdp_requests_aborted_total", 0.0) == before + 1, gateway.tail()
    # the engines stopped it too: nothing left running on either rank
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if after.get("vllm:num_requests_running", 0.0) == 0:
            break
        time.sleep(0.2)
        after = gateway.metrics()
    assert after.get("vllm:num_requests_running", 0.0) == 0, gateway.tail()


def test_a_default_aiperf_run_has_no_errors(gateway: Gateway, tmp_path: Path) -> None:
    """aiperf's default profile run (chat, 10 requests, no output limit: each answer runs
    to EOS or the model's length)."""
    smoke = aiperf_smoke()
    exe = smoke.aiperf()
    cmd = [
        str(exe),
        "profile",
        "--model",
        NAME,
        "--tokenizer",
        str(gateway.model),
        "--url",
        gateway.base,
        "--api-key",
        KEY,
        "--artifact-dir",
        str(tmp_path / "artifacts"),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600, env={**os.environ}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + gateway.tail()
    records, errors = smoke.errors_of(tmp_path / "artifacts")
    assert records == 10 and errors == 0, (records, errors, gateway.tail())


def test_the_engines_length_is_checked_and_clamped_as_vllm_does(gateway: Gateway) -> None:
    """The gateway is given no --max-model-len: the engines' ready responses say
    MAX_MODEL_LEN under a config of 4096. A max_tokens over it is vLLM's 400; one that
    fits alone but not with the prompt is lowered to what is left (before issue 35: a
    200 cut short by the engine)."""
    client = gateway.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=MAX_MODEL_LEN + 1)
    assert (
        f"max_tokens={MAX_MODEL_LEN + 1} cannot be greater than max_model_len={MAX_MODEL_LEN}"
    ) in str(e.value)
    assert "BadRequestError" in json.dumps(e.value.body)  # vLLM's error type
    prompt = [5] * (MAX_MODEL_LEN - 24)
    r = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=100, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 24

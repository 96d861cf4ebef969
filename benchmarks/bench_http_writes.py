"""What one streamed HTTP write costs, per server: hypercorn's trio worker with and
without zmqdp's fast paths, the floor on trio, and uvicorn (issue 34).

    .venv/bin/python benchmarks/bench_http_writes.py [SERVER ...] [--c 256]
        [--writes 16] [--tick 0.002] [--rounds 3] [--window 2]

Not a gateway benchmark (no engines, no zmqdp client): the same minimal ASGI app on
every server, so that only the HTTP write path differs. Per request the app reads the
body, then writes ``--writes`` SSE chunks of ~200 bytes (the response head before the
first), one per tick of a ticker that wakes every waiting request each ``--tick`` s (as
the gateway's dispatcher wakes its streams), and ends the response with the last one.
Each server is a process of its own, all up for the whole run; a uvloop load generator
(this process; no HTTP library) keeps ``--c`` keep-alive connections busy, one server
after the other, the order rotating each round. Per server and round: its process CPU
(user + system, /proc) and, on trio, its task steps (a `trio.abc.Instrument`), over a
window of ``--window`` s, divided by the writes in it; medians over the rounds.

SERVERs (all by default, each if its library is installed):

* ``hypercorn``: hypercorn's trio worker as shipped (a `trio.Lock` and a shielded
  `send_all` per write, a keep-alive timer task started per response);
* ``hypercorn-zmqdp``: the same with `install_hypercorn_fast_paths`, as `zmqdp serve`
  runs it;
* ``trio-h11``: a bare trio loop, h11 framing, ``await stream.send_all``;
* ``trio-h11-direct``: the same, the write one non-blocking ``os.write``;
* ``trio-raw``: hand-framed HTTP/1.1 chunks, one non-blocking ``os.write``: the floor
  on trio (a task's wake and a syscall per write);
* ``uvicorn-h11``, ``uvicorn-httptools``: uvicorn on uvloop, each HTTP implementation.

Absolute numbers are context: the machine's cores are shared by the servers and the
load generator. Compare servers within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
CHUNK = (
    b"data: "
    + json.dumps(
        {
            "id": "cmpl-0123456789abcdef",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [
                {"index": 0, "text": " t1001" * 7, "logprobs": None, "finish_reason": None}
            ],
        }
    ).encode()
    + b"\n\n"
)
SERVERS = {
    "hypercorn": "hypercorn",
    "hypercorn-zmqdp": "hypercorn",
    "trio-h11": "h11",
    "trio-h11-direct": "h11",
    "trio-raw": "trio",
    "uvicorn-h11": "uvicorn",
    "uvicorn-httptools": "httptools",
}
HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-request-id", b"cmpl-0123456789abcdef"),
]
Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# -- the servers --------------------------------------------------------------------------


def make_app(
    wait: Callable[[], Awaitable[None]], stats: dict[str, int], writes: int
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI app: ``GET /stats`` answers `stats`; any other request is answered with
    `writes` SSE chunks, one per `wait()`."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/stats":
            body = json.dumps(stats).encode()
            head = [(b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": body})
            return
        while (await receive()).get("more_body"):
            pass
        await wait()
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        for i in range(writes):
            if i:
                await wait()
            stats["writes"] += 1
            more = i < writes - 1
            await send({"type": "http.response.body", "body": CHUNK, "more_body": more})

    return app


def serve_trio(server: str, port: int, writes: int, tick: float) -> None:
    import trio

    stats = {"writes": 0, "steps": 0}
    ticked = [trio.Event()]

    class Steps(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            stats["steps"] += 1

    async def wait() -> None:
        await ticked[0].wait()

    async def ticker() -> None:
        while True:
            await trio.sleep(tick)
            event, ticked[0] = ticked[0], trio.Event()
            event.set()

    app = make_app(wait, stats, writes)

    async def main() -> None:
        trio.lowlevel.add_instrument(Steps())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            if server.startswith("hypercorn"):
                from hypercorn.config import Config
                from hypercorn.trio import serve

                config = Config()
                config.bind = [f"127.0.0.1:{port}"]
                config.backlog = 4096
                config.accesslog = None
                if server == "hypercorn-zmqdp":
                    from zmqdp.gateway.connections import install_hypercorn_fast_paths

                    install_hypercorn_fast_paths(config)
                await serve(app, config, mode="asgi")  # type: ignore[arg-type]
            else:
                await trio.serve_tcp(guarded, port, host="127.0.0.1", backlog=4096)

    async def guarded(stream: trio.SocketStream) -> None:
        try:
            if server == "trio-raw":
                await raw_connection(stream)
            else:
                await h11_connection(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def write(stream: trio.SocketStream, data: bytes, direct: bool) -> None:
        if direct:
            sent = os.write(stream.socket.fileno(), data)
            if sent < len(data):
                await stream.send_all(data[sent:])
        else:
            await stream.send_all(data)

    async def h11_connection(stream: trio.SocketStream) -> None:
        import h11

        direct = server == "trio-h11-direct"
        conn = h11.Connection(h11.SERVER)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                conn.receive_data(data)
                continue
            if not isinstance(event, h11.Request):
                return
            path = event.target.decode()
            body = b""
            while not isinstance(event, h11.EndOfMessage):
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Data):
                    body += event.data

            async def receive(body: bytes = body) -> dict[str, Any]:
                return {"type": "http.request", "body": body, "more_body": False}

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    head = h11.Response(status_code=message["status"], headers=message["headers"])
                    data = conn.send(head)
                else:
                    chunk = message.get("body", b"")
                    data = conn.send(h11.Data(data=chunk)) if chunk else b""
                    if not message.get("more_body"):
                        data += conn.send(h11.EndOfMessage())
                await write(stream, data, direct)

            await app({"type": "http", "path": path}, receive, send)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def raw_connection(stream: trio.SocketStream) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buffer += data
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            path = lines[0].split()[1].decode()
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(buffer) < length:
                buffer += await stream.receive_some(65536)
            body, buffer = buffer[:length], buffer[length:]
            chunked = [True]

            async def receive(body: bytes = body) -> dict[str, Any]:
                return {"type": "http.request", "body": body, "more_body": False}

            async def send(message: dict[str, Any], chunked: list[bool] = chunked) -> None:
                if message["type"] == "http.response.start":
                    headers = message["headers"]
                    chunked[0] = all(k != b"content-length" for k, _ in headers)
                    data = b"HTTP/1.1 %d OK\r\n" % message["status"]
                    data += b"".join(k + b": " + v + b"\r\n" for k, v in headers)
                    data += b"transfer-encoding: chunked\r\n\r\n" if chunked[0] else b"\r\n"
                else:
                    chunk = message.get("body", b"")
                    if not chunked[0]:
                        data = chunk
                    else:
                        data = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunk else b""
                        if not message.get("more_body"):
                            data += b"0\r\n\r\n"
                await write(stream, data, True)

            await app({"type": "http", "path": path}, receive, send)
            if path == "/stats":  # connection: close
                return

    trio.run(main)


def serve_uvicorn(server: str, port: int, writes: int, tick: float) -> None:
    import uvicorn

    stats = {"writes": 0, "steps": 0}
    ticked: list[asyncio.Event] = []

    async def wait() -> None:
        if not ticked:
            ticked.append(asyncio.Event())
            asyncio.get_running_loop().create_task(ticker())
        await ticked[0].wait()

    async def ticker() -> None:
        while True:
            await asyncio.sleep(tick)
            event, ticked[0] = ticked[0], asyncio.Event()
            event.set()

    http = "httptools" if server == "uvicorn-httptools" else "h11"
    app = make_app(wait, stats, writes)
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http=http, log_level="warning")


# -- the load generator -------------------------------------------------------------------

REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 2\r\n\r\n{}"
)


class Client(asyncio.Protocol):
    """One keep-alive connection: a request, its chunked answer to the end, the next."""

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport  # uvloop's is no asyncio.Transport subclass
        transport.write(REQUEST)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.buffer.endswith(b"\r\n0\r\n\r\n"):
            self.buffer = b""
            self.transport.write(REQUEST)


async def stats_of(port: int) -> dict[str, int]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /stats HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    data = await reader.read()
    writer.close()
    result: dict[str, int] = json.loads(data.split(b"\r\n\r\n", 1)[1])
    return result


async def one_round(port: int, pid: int, c: int, window: float) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    transports = []
    for _ in range(c):
        transport, _ = await loop.create_connection(Client, "127.0.0.1", port)
        transports.append(transport)
    await asyncio.sleep(1.0)  # warm-up
    before, cpu0 = await stats_of(port), cpu_seconds(pid)
    await asyncio.sleep(window)
    after, cpu1 = await stats_of(port), cpu_seconds(pid)
    for transport in transports:
        transport.close()
    await asyncio.sleep(0.3)
    writes = max(after["writes"] - before["writes"], 1)
    return {
        "us_per_write": 1e6 * (cpu1 - cpu0) / writes,
        "writes_per_s": writes / window,
        "steps_per_write": (after["steps"] - before["steps"]) / writes,
        "core": (cpu1 - cpu0) / window,
    }


async def measure(
    servers: dict[str, tuple[int, int]], c: int, rounds: int, window: float
) -> dict[str, dict[str, float]]:
    names = list(servers)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            port, pid = servers[name]
            result = await one_round(port, pid, c, window)
            results[name].append(result)
            figures = " ".join(f"{k} {v:,.2f}" for k, v in result.items())
            print(f"round {r} {name:18} {figures}", flush=True)
    return {
        name: {k: sorted(x[k] for x in rs)[len(rs) // 2] for k in rs[0]}
        for name, rs in results.items()
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("servers", nargs="*", help=f"of {', '.join(SERVERS)} (default: all)")
    parser.add_argument("--c", type=int, default=256, help="connections")
    parser.add_argument("--writes", type=int, default=16, help="SSE writes per response")
    parser.add_argument("--tick", type=float, default=0.002, help="s between two wakes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=2.0, help="s counted a round")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serving = serve_uvicorn if args.serve.startswith("uvicorn") else serve_trio
        serving(args.serve, args.port, args.writes, args.tick)
        return
    asked = args.servers or list(SERVERS)
    if unknown := set(asked) - set(SERVERS):
        parser.error(f"no server {', '.join(sorted(unknown))}: one of {', '.join(SERVERS)}")
    wanted = [s for s in asked if find_spec(SERVERS[s]) is not None]
    for missing in [s for s in asked if s not in wanted]:
        print(f"(no {missing}: {SERVERS[missing]} is not installed)")
    servers: dict[str, tuple[int, int]] = {}
    procs = []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        for name in wanted:
            port = free_port()
            cmd = [sys.executable, __file__, "--serve", name, "--port", str(port)]
            cmd += ["--writes", str(args.writes), "--tick", str(args.tick)]
            proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
            procs.append(proc)
            servers[name] = (port, proc.pid)
        for port, _ in servers.values():
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port)).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        import uvloop

        medians = uvloop.run(measure(servers, args.c, args.rounds, args.window))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    base = medians.get("hypercorn", {}).get("us_per_write")
    print(f"\nc={args.c}, {args.writes} writes per response, medians of {args.rounds} rounds")
    print(f"{'server':18} {'µs/write':>9} {'÷hypercorn':>10} {'steps/write':>11} {'writes/s':>9}")
    for name, m in medians.items():
        ratio = f"{m['us_per_write'] / base:.2f}" if base else "-"
        steps = f"{m['steps_per_write']:.2f}" if not name.startswith("uvicorn") else "-"
        print(
            f"{name:18} {m['us_per_write']:9.1f} {ratio:>10} {steps:>11} {m['writes_per_s']:9,.0f}"
        )


if __name__ == "__main__":
    main()

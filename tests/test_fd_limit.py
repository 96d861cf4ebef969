"""A full descriptor table no longer aborts the process (hostile-peer review, finding 2).

libzmq 4.3.5 asserts ("Too many open files (src/ipc_listener.cpp:297)", SIGABRT) when an
ipc accept finds the descriptor table full. Each test runs the process under attack in a
subprocess whose soft RLIMIT_NOFILE is 1,024 (this machine's is higher), with real
sockets and real HTTP:

* a client (`EngineGroup.connect`) with 1,104 idle connections to its ipc URL from
  another process: it raises its soft limit to the hard one (4,096) and serves on;
  with `raise_fd_limit=False` it leaves the limit alone;
* `zmqdp serve` on an ipc URL with 1,100 slowloris HTTP connections (a request head
  that never completes, re-opened when closed) and one ordinary rank restart (the
  rank's engine process stopped, a new one started): with a hard limit of 4,096 it
  raises its limit and holds every connection; with a hard limit of 1,024 (no raise
  possible) it answers the connections past its bound 503 ``too_many_connections``,
  on hypercorn and on uvicorn; either way the restarted rank rejoins and a completion
  is served;
* `--max-connections` answers the connection past it 503 and admits one again once
  another has closed;
* a slowloris connection is closed after `--header-timeout`, on uvicorn too (which has
  no deadline for a request head of its own), and a response that outlasts it is not.

What involves uvicorn runs on each of its parsers (`SERVERS`: ``--http h11`` and
``--http httptools``).

Every test has its own `trio.fail_after`; nothing waits on the clock to synchronize
(the slowloris connections pace their re-opening, as an attacker would).
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio

if not os.path.isdir("/proc/self/fd"):
    pytest.skip("counts a process's descriptors in /proc (Linux)", allow_module_level=True)

from zmqdp.mock import mock_process

from .gateway_helpers import read_banner, served_url
from .helpers import wait_until

CLIENT = """
import resource, sys
soft, hard = int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
import logging, trio
from zmqdp import EngineGroup, Request
logging.basicConfig(level="INFO", format="%(name)s: %(message)s")

async def main():
    keep = {} if sys.argv[4] == "raise" else {"raise_fd_limit": False}  # the default raises
    async with EngineGroup.connect(sys.argv[1], 2, ready_timeout=20, **keep) as group:
        print("up", resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        async with group.submit(Request("r1", {"prompt": [1], "max_tokens": 3})) as stream:
            outs = [out async for out in stream]
        print("served", len(outs), flush=True)

trio.run(main)
"""


def limited(soft: int, hard: int) -> Callable[[], None]:
    """A `preexec_fn`: the child starts with these open-files limits."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def read_line(stream: trio.abc.ReceiveStream, buffer: bytearray) -> bytes:
    while b"\n" not in buffer:
        data = await stream.receive_some()
        if not data:
            raise EOFError(bytes(buffer))
        buffer += data
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


async def drain(stream: trio.abc.ReceiveStream | None, into: bytearray) -> None:
    """Keep reading a child's pipe (so that it never blocks on a full one)."""
    assert stream is not None
    while data := await stream.receive_some():
        into += data


def fds(proc: trio.Process) -> int:
    """Descriptors open in a child process now."""
    try:
        return len(os.listdir(f"/proc/{proc.pid}/fd"))
    except OSError:  # it has exited
        return 0


def open_idle_ipc_connections(path: str, count: int) -> list[socket.socket]:
    """`count` connections to an ipc socket that never say a word (the ZMTP greeting
    included), as another process of the same user can open; stops at the first that
    fails (the listener gone). Blocking connects: one waits while the listener's
    backlog is full."""
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            break
        socks.append(sock)
    return socks


# -- the client -----------------------------------------------------------------------------


@pytest.mark.timeout_s(30)
async def test_a_client_survives_1104_idle_ipc_connections_at_soft_limit_1024(
    tmp_path: Path,
) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(28):
        async with mock_process(url, 2):
            client = await trio.lowlevel.open_process(
                [sys.executable, "-c", CLIENT, url, "1024", "4096", "raise"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            assert client.stdin is not None and client.stdout is not None
            err = bytearray()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(drain, client.stderr, err)
                    out = bytearray()
                    up = await read_line(client.stdout, out)
                    socks = await trio.to_thread.run_sync(
                        open_idle_ipc_connections, f"{tmp_path}/g", 1104, abandon_on_cancel=True
                    )
                    try:
                        await client.stdin.send_all(b"go\n")
                        line = await read_line(client.stdout, out)
                    except (trio.BrokenResourceError, EOFError):  # it died
                        line = b""
                    finally:
                        for sock in socks:
                            sock.close()
                    await client.wait()
            finally:
                if client.returncode is None:
                    client.kill()
                    await client.wait()
    text = err.decode(errors="replace")
    assert client.returncode == 0, text[-2000:]  # 362b651: -6 (SIGABRT), "Too many open files"
    assert up == b"up 4096"
    assert len(socks) == 1104
    assert line == b"served 3"
    assert "open-files limit raised from 1024 to 4096 (hard 4096)" in text, text[-2000:]


@pytest.mark.timeout_s(30)
async def test_a_client_told_not_to_leaves_the_open_files_limit_alone(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(28):
        async with mock_process(url, 2):
            result = await trio.run_process(
                [sys.executable, "-c", CLIENT, url, "1024", "4096", "keep"],
                stdin=b"go\n",
                capture_stdout=True,
                capture_stderr=True,
            )
    assert result.stdout.split(b"\n")[:2] == [b"up 1024", b"served 3"], result.stderr
    assert b"open-files limit" not in result.stderr


# -- the gateway ------------------------------------------------------------------------------

SERVERS = [
    "hypercorn",
    "uvicorn-h11",
    pytest.param(
        "uvicorn-httptools",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("httptools") is None,
            reason="the gateway extra (httptools is not installed)",
        ),
    ),
]
"""`serve --server hypercorn`, and `--server uvicorn` with each of its HTTP parsers."""


def server_options(server: str) -> list[str]:
    """The `serve` options that choose `server` (one of `SERVERS`)."""
    name, _, http = server.partition("-")
    return ["--server", name, *(["--http", http] if http else [])]


class Slowloris:
    """`count` HTTP connections that send half a request head and wait; each re-opens
    once the server closes it, after `pause` s (5 times that after a 503: a refused
    connection costs the machine a round trip, shared by the server and the test).
    `connected` is set once every one has connected once, `refused` once the server has
    answered one 503."""

    HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"

    def __init__(self, port: int, count: int, pause: float = 0.2) -> None:
        self.port = port
        self.count = count
        self.pause = pause
        self.once = 0
        self.refusals = 0
        self.answer = b""  # the first 503
        self.connected = trio.Event()
        self.refused = trio.Event()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(self.count):
                nursery.start_soon(self._one)

    async def _one(self) -> None:
        first = True
        while True:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            except OSError:
                await trio.sleep(self.pause)
                continue
            if first:
                first = False
                self.once += 1
                if self.once == self.count:
                    self.connected.set()
            async with stream:
                answer = b""
                try:
                    await stream.send_all(self.HEAD)
                    answer = await stream.receive_some()
                except (trio.BrokenResourceError, OSError):
                    pass
                refused = answer.startswith(b"HTTP/1.1 503")
                if refused:
                    self.refusals += 1
                    self.answer = self.answer or answer
                    self.refused.set()
            await trio.sleep(5 * self.pause if refused else self.pause)


async def started_mock(url: str, rank: int) -> tuple[trio.Process, bytearray]:
    """`zmqdp mock` for one rank of a group of 2, stdout piped: it prints a line once
    the client has taken the rank (its handshake is done)."""
    cmd = [sys.executable, "-m", "zmqdp", "mock", "--url", url, "--engines", "2"]
    proc = await trio.lowlevel.open_process(
        [*cmd, "--ranks", str(rank)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    return proc, bytearray()


async def wait_until_up(proc: trio.Process, buffer: bytearray) -> None:
    assert proc.stdout is not None
    while b" up at " not in (line := await read_line(proc.stdout, buffer)):
        assert line.startswith(b"zmqdp mock:"), line


async def stop(proc: trio.Process) -> None:
    proc.terminate()
    with trio.move_on_after(5):
        await proc.wait()
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def check_serve_under_slowloris(tmp_path: Path, server: str, hard: int) -> str:
    """`serve` (soft limit 1,024, hard `hard`) on an ipc URL in front of two mock ranks,
    each its own process; 1,100 slowloris connections; rank 1 restarted meanwhile. The
    serve process must live on, take the restarted rank back and serve a completion.
    Returns its log."""
    url = f"ipc://{tmp_path}/g"
    cmd = [sys.executable, "-m", "zmqdp", "serve", "--url", url, "--engines", "2"]
    cmd += ["--port", "0", *server_options(server), "--log-level", "INFO"]
    serve = await trio.lowlevel.open_process(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=limited(1024, hard),
    )
    log = bytearray()
    ranks: list[trio.Process] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, serve.stderr, log)
            for rank in (0, 1):
                ranks.append((await started_mock(url, rank))[0])
            base = served_url(await read_banner(serve))
            port = int(base.rsplit(":", 1)[1])
            flood = Slowloris(port, 1100)
            async with trio.open_nursery() as attack:
                attack.start_soon(flood.run)
                await flood.connected.wait()
                if hard == 1024:  # no raise possible: the table fills, or the bound refuses
                    await wait_until(
                        lambda: (
                            flood.refused.is_set()
                            or fds(serve) >= 1020  # 362b651: the table is full
                            or serve.returncode is not None
                        )
                    )
                # an ordinary restart of rank 1, while the table is as full as it gets
                await stop(ranks[1])
                ranks[1], buffer = await started_mock(url, 1)
                async with trio.open_nursery() as race:

                    async def serve_died() -> None:
                        await serve.wait()
                        race.cancel_scope.cancel()

                    async def rank_back() -> None:
                        await wait_until_up(ranks[1], buffer)
                        race.cancel_scope.cancel()

                    race.start_soon(serve_died)
                    race.start_soon(rank_back)
                # 362b651: -6 (SIGABRT, "Too many open files (src/ipc_listener.cpp:297)")
                assert serve.returncode is None, log.decode(errors="replace")[-3000:]
                attack.cancel_scope.cancel()
            if hard == 1024:
                assert flood.answer.startswith(b"HTTP/1.1 503"), flood.answer
                error = json.loads(flood.answer.split(b"\r\n\r\n", 1)[1])["error"]
                assert error["code"] == "too_many_connections", error
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                while (await client.get("/ready")).status_code != 200:
                    pass  # rank 1 rejoins within a second of its HELLO
                reply = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == " t1001 t1002 t1003"
            serve.send_signal(signal.SIGTERM)
            await serve.wait()
            assert serve.returncode == 0
            nursery.cancel_scope.cancel()
    finally:
        for proc in [serve, *ranks]:
            if proc.returncode is None:
                await stop(proc)
    return log.decode(errors="replace")


@pytest.mark.timeout_s(30)
async def test_serve_raises_its_limit_and_survives_slowloris_and_a_rank_restart(
    tmp_path: Path,
) -> None:
    with trio.fail_after(28):
        log = await check_serve_under_slowloris(tmp_path, "hypercorn", 4096)
    assert "open-files limit raised from 1024 to 4096 (hard 4096)" in log, log[-2000:]
    assert "refusing HTTP connections" not in log  # 1,100 fit under the raised limit


@pytest.mark.timeout_s(30)
@pytest.mark.parametrize("server", SERVERS)
async def test_serve_at_hard_limit_1024_refuses_connections_past_its_bound(
    tmp_path: Path, server: str
) -> None:
    with trio.fail_after(28):
        log = await check_serve_under_slowloris(tmp_path, server, 1024)
    assert "HTTP connections: at most " in log, log[-2000:]
    assert "refusing HTTP connections" in log, log[-2000:]


@pytest.mark.timeout_s(20)
@pytest.mark.parametrize("server", SERVERS)
async def test_a_connection_whose_request_head_never_completes_is_closed(server: str) -> None:
    cmd = [sys.executable, "-m", "zmqdp", "serve", "--mock", "--port", "0"]
    cmd += [*server_options(server), "--header-timeout", "0.5", "--step-time", "0.01"]
    serve = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
    try:
        with trio.fail_after(18):
            base = served_url(await read_banner(serve))
            port = int(base.rsplit(":", 1)[1])
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(Slowloris.HEAD)
                with trio.fail_after(5):  # 362b651: held open for good
                    assert await stream.receive_some() == b""
            # a response that outlasts the deadline is not cut: 150 steps of 10 ms
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                body = {"prompt": "hi", "max_tokens": 150, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    last = [line async for line in response.aiter_lines() if line][-1]
            assert last == "data: [DONE]"
    finally:
        serve.terminate()
        await serve.wait()


@pytest.mark.timeout_s(20)
@pytest.mark.parametrize("server", SERVERS)
async def test_max_connections_refuses_the_next_connection_and_admits_after_one_closes(
    server: str,
) -> None:
    cmd = [sys.executable, "-m", "zmqdp", "serve", "--mock", "--port", "0"]
    cmd += [*server_options(server), "--max-connections", "2", "--step-time", "0.01"]
    serve = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
    try:
        with trio.fail_after(18):
            base = served_url(await read_banner(serve))
            port = int(base.rsplit(":", 1)[1])
            request = b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n"
            first = await trio.open_tcp_stream("127.0.0.1", port)
            second = await trio.open_tcp_stream("127.0.0.1", port)
            for stream in (first, second):  # both admitted: each is answered
                await stream.send_all(request)
                assert (await stream.receive_some()).startswith(b"HTTP/1.1 200")
            async with await trio.open_tcp_stream("127.0.0.1", port) as third:
                answer = b""
                while chunk := await third.receive_some():
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 503"), answer
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "too_many_connections"
            await second.aclose()
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                while True:  # the server sees the closed connection go within a round trip
                    try:
                        health = await client.get("/health")
                    except httpx.TransportError:  # refused before its request was read
                        continue
                    if health.status_code != 503:
                        break
                assert health.status_code == 200
            await first.aclose()
    finally:
        serve.terminate()
        await serve.wait()

"""Fast engines for the benchmarks: plain blocking pyzmq in a process of their own, so an
engine never shares the client's GIL and is never the bottleneck it is measuring.

Each engine does the revision-2 handshake by hand (HELLO, INIT, READY, REGISTER with
the epoch) and then plays one part:

* `blast`: waits for `requests` ADDs, then sends `tokens` outputs for each, in batches
  of `batch` outputs (one token of many requests per batch, as a real engine steps),
  the last output terminal; then waits for the next round of ADDs;
* `echo`: answers every ADD at once with one terminal output;
* `paced`: answers each ADD with `tokens` outputs, one every `interval` seconds, each
  carrying `time.monotonic()` at the moment it was sent (monotonic is one clock for
  every process of this machine);
* `sink`: reads every request and never answers (for the submit benchmark).

`plain_*` variants send the same batches to a bare ROUTER address (no handshake), for
the baselines that receive with a bare pyzmq loop.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import cbor2
import zmq


def _dealer(ctx: Any, rank: int, address: str) -> Any:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, rank.to_bytes(2, "little"))
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    return sock


class Engine:
    """One rank on blocking sockets."""

    def __init__(self, url: str, rank: int = 0, size: int = 1) -> None:
        self.ctx = zmq.Context()
        self.rank = rank
        self.hs = _dealer(self.ctx, rank, url)
        hello = {"type": "hello", "version": 1, "rank": rank, "size": size, "lockstep": False}
        self.hs.send(cbor2.dumps(hello))
        while True:
            init = cbor2.loads(self.hs.recv())
            if init["type"] == "init":
                break
        self.epoch = init["epoch"]
        self.inp = _dealer(self.ctx, rank, init["input"])
        self.out = _dealer(self.ctx, rank, init["output"])
        self.hs.send(cbor2.dumps({"type": "ready", "info": {"engine": "bench"}}))
        self.inp.send(cbor2.dumps({"type": "register", "epoch": self.epoch}))

    def adds(self, n: int) -> list[str]:
        """The wire ids of the next `n` ADDs (other requests are skipped)."""
        ids = []
        while len(ids) < n:
            kind, body = self.inp.recv_multipart()
            if kind == b"\x00":
                ids.append(cbor2.loads(body)["id"])
        return ids

    def batch(self, outputs: list[dict[str, Any]]) -> bytes:
        return cbor2.dumps({"rank": self.rank, "epoch": self.epoch, "outputs": outputs})


def _batches(ids: list[str], tokens: int, batch: int) -> Iterator[list[dict[str, Any]]]:
    for t in range(tokens):
        finish = "length" if t == tokens - 1 else None
        for i in range(0, len(ids), batch):
            yield [{"id": wid, "body": t, "finish": finish} for wid in ids[i : i + batch]]


def blast(url: str, requests: int, tokens: int, batch: int) -> None:
    engine = Engine(url)
    while True:
        ids = engine.adds(requests)
        bodies = [engine.batch(b) for b in _batches(ids, tokens, batch)]
        for body in bodies:
            engine.out.send(body)


def plain_blast(address: str, requests: int, tokens: int, batch: int, rounds: int) -> None:
    ctx = zmq.Context()
    out = _dealer(ctx, 0, address)
    ids = [f"r{i}#{i}" for i in range(requests)]
    bodies = [
        cbor2.dumps({"rank": 0, "epoch": 1, "outputs": b}) for b in _batches(ids, tokens, batch)
    ]
    out.send(b"hi")  # so that the ROUTER knows this peer
    for _ in range(rounds):
        out.recv()  # "go"
        for body in bodies:
            out.send(body)
    out.close(linger=-1)


def echo(url: str) -> None:
    engine = Engine(url)
    while True:
        [wid] = engine.adds(1)
        engine.out.send(engine.batch([{"id": wid, "body": 0, "finish": "stop"}]))


def paced(url: str, tokens: int, interval: float) -> None:
    engine = Engine(url)
    while True:
        [wid] = engine.adds(1)
        for t in range(tokens):
            time.sleep(interval)
            finish = "stop" if t == tokens - 1 else None
            engine.out.send(engine.batch([{"id": wid, "body": time.monotonic(), "finish": finish}]))


def plain_paced(address: str, tokens: int, interval: float) -> None:
    ctx = zmq.Context()
    out = _dealer(ctx, 0, address)
    out.send(b"hi")
    out.recv()  # "go"
    for _ in range(tokens):
        time.sleep(interval)
        out.send(cbor2.dumps({"rank": 0, "outputs": [{"id": "p#0", "body": time.monotonic()}]}))
    out.close(linger=-1)


def sink(url: str, rank: int = 0, size: int = 1) -> None:
    engine = Engine(url, rank, size)
    while True:
        engine.inp.recv_multipart()


def plain_sink(address: str, count: int) -> None:
    ctx = zmq.Context()
    sock = _dealer(ctx, 0, address)
    sock.send(b"ready")
    while True:
        for _ in range(count):
            sock.recv_multipart()
        sock.send(b"done")


@contextmanager
def engine_process(target: Any, *args: Any) -> Iterator[mp.process.BaseProcess]:
    """Run `target(*args)` in a fresh process for the block."""
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    try:
        yield proc
    finally:
        proc.kill()
        proc.join()

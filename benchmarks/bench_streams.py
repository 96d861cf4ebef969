"""Delivered outputs/s through EngineGroup streams: zmqdp's coalescing per-request buffer
against a per-output memory channel, in the same run and through the same sockets.

    .venv/bin/python benchmarks/bench_streams.py [--requests 64] [--tokens 300] [--rounds 3]

An engine in a separate process (built on `zmqdp.engine`) runs every request it holds
one token per step and sends one batch per step carrying one output per running
request, as a real engine does. `--requests` consumers read their streams concurrently.

* zmqdp: the dispatcher appends to each request's buffer and wakes each consumer at
  most once per drained batch of messages;
* baseline: the same client with a `RequestStream` subclass that does one
  `trio.open_memory_channel` send per output (the obvious design).

Rounds alternate; the best of each is kept; the ratio is zmqdp / baseline.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import shutil
import tempfile
import time
from typing import Any

import trio

from zmqdp import EngineGroup, Output, Request
from zmqdp.client import RequestStream


def engine_main(url: str) -> None:
    from zmqdp.engine import Add, OutputBatch, connect_engine

    async def main() -> None:
        async with connect_engine(url, rank=0, size=1) as eng:
            work: dict[str, int] = {}
            while True:
                msg = await eng.receive() if not work else None
                while msg is not None or work:
                    if isinstance(msg, Add):
                        work[msg.id] = int(msg.body["tokens"])
                    try:
                        msg = eng.receive_nowait()
                        continue
                    except trio.WouldBlock:
                        msg = None
                    outs = []
                    for rid in list(work):
                        work[rid] -= 1
                        left = work[rid]
                        outs.append(Output(rid, left, None if left else "length"))
                        if not left:
                            del work[rid]
                    await eng.send(OutputBatch(0, outputs=tuple(outs)))
                    if not work:
                        break

    trio.run(main)


class ChannelStream(RequestStream):
    """The baseline: one memory-channel send per output, one receive per output."""

    __slots__ = ("_rx", "_tx")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._tx, self._rx = trio.open_memory_channel[Output](math.inf)

    def deliver(self, out: Output) -> None:
        self._tx.send_nowait(out)

    def notify(self) -> None:
        pass

    def finish(self, outcome: Any, error: BaseException | None = None) -> None:
        super().finish(outcome, error)
        self._tx.close()

    async def receive(self) -> Output:
        return await self._rx.receive()


async def one_round(url: str, requests: int, tokens: int, baseline: bool) -> float:
    async with EngineGroup.connect(url, 1, ready_timeout=30) as group:
        if baseline:
            group._for_testing_stream_class = ChannelStream
        # warm-up request so the engine is connected and hot
        async with group.submit(Request("warm", {"tokens": 2})) as s:
            async for _ in s:
                pass
        delivered = 0

        async def consume(i: int) -> None:
            nonlocal delivered
            async with group.submit(Request(f"r{i}", {"tokens": tokens})) as stream:
                async for _ in stream:
                    delivered += 1

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(requests):
                nursery.start_soon(consume, i)
        elapsed = time.perf_counter() - start
        assert delivered == requests * tokens, delivered
        return delivered / elapsed


def run(kind: str, directory: str, i: int, requests: int, tokens: int) -> float:
    url = f"ipc://{directory}/{kind}{i}"
    proc = mp.get_context("spawn").Process(target=engine_main, args=(url,), daemon=True)
    proc.start()
    try:
        return trio.run(one_round, url, requests, tokens, kind == "channel")
    finally:
        proc.kill()
        proc.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="zmqdp-bench-")
    ours, base = [], []
    try:
        for i in range(args.rounds):
            base.append(run("channel", directory, i, args.requests, args.tokens))
            ours.append(run("buffer", directory, i, args.requests, args.tokens))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{args.requests} concurrent streams x {args.tokens} tokens, 1 engine process, ipc")
    for name, rounds in (("per-output channel", base), ("zmqdp buffer", ours)):
        shown = ", ".join(f"{x:,.0f}" for x in rounds)
        print(f"{name:<20}: {max(rounds):>10,.0f} outputs/s (best of: {shown})")
    print(f"ratio zmqdp/baseline: {max(ours) / max(base):.2f}")


if __name__ == "__main__":
    main()

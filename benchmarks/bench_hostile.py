"""What one hostile or stuck engine costs everybody else, measured in one process.

    .venv/bin/python benchmarks/bench_hostile.py [--outputs 2000000] [--requests 20]

1. **A long batch and the event loop.** One engine sends one legal batch of `--outputs`
   outputs (about 64 MiB at the default) for live requests. A ticker task measures the
   longest time the event loop went without running it while the client took the batch
   in. zmqdp decodes a body of 512 KiB or more in steps and applies 4096 entries at a
   time; the baseline is the same client with those limits lifted (`slice_entries` and
   `incremental_bytes` set beyond the batch), i.e. the batch decoded and applied in one
   go, as before. Ratio: longest stall, zmqdp / baseline (lower is better), and the
   total time to take the batch in, zmqdp / baseline (the price of slicing).
2. **A rank that stops reading.** Rank 1's engine stops reading its input; its pipe
   fills. Then `--requests` requests go to rank 0, one after the other. Ratio: their
   median latency with rank 1 blocked / with rank 1 healthy (1.0: nobody is held up).
   Also: the input task's wake-ups per second while rank 1 is blocked.

Absolute numbers are context only; these machines are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import cbor2
import trio
import trio.testing
import zmq

import zmqdp.testing
from zmqdp import EngineGroup, Request
from zmqdp._core import cbor
from zmqdp._core.codec import decode_request
from zmqdp._core.handshake import rank_identity
from zmqdp._core.state import GroupCore


class Raw:
    """One rank played on raw pyzmq DEALERs (the client's peer, in this process)."""

    def __init__(self, ctx: Any, url: str, rank: int, size: int, **opts: int) -> None:
        self.ctx, self.rank, self.size, self.opts = ctx, rank, size, opts
        self.hs = self._dealer()
        self.hs.connect(url)

    def _dealer(self) -> Any:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, rank_identity(self.rank))
        for k, v in self.opts.items():
            sock.setsockopt(getattr(zmq, k), v)
        return sock

    async def recv(self, sock: Any) -> list[bytes]:
        while True:
            try:
                frames: list[bytes] = sock.recv_multipart(zmq.NOBLOCK)
                return frames
            except zmq.Again:
                await trio.sleep(0.001)

    async def handshake(self) -> None:
        hello = {"type": "hello", "version": 1, "rank": self.rank, "size": self.size}
        self.hs.send(cbor2.dumps({**hello, "lockstep": False}), zmq.NOBLOCK)
        while True:
            init = cbor2.loads((await self.recv(self.hs))[0])
            if init["type"] == "init":
                break
        self.epoch = init["epoch"]
        self.inp, self.out = self._dealer(), self._dealer()
        self.inp.connect(init["input"])
        self.out.connect(init["output"])
        self.hs.send(cbor2.dumps({"type": "ready", "info": {}}), zmq.NOBLOCK)
        self.inp.send(cbor2.dumps({"type": "register", "epoch": self.epoch}), zmq.NOBLOCK)

    async def add(self) -> str:
        while True:
            kind, body = await self.recv(self.inp)
            msg = decode_request(kind, body)
            if msg is not None and hasattr(msg, "body"):
                return str(msg.id)

    def close(self) -> None:
        for s in (self.hs, getattr(self, "inp", None), getattr(self, "out", None)):
            if s is not None:
                s.close()


async def long_batch(outputs: int, whole: bool) -> tuple[float, float]:
    """(longest event-loop stall, seconds to take the batch in)."""
    saved = GroupCore.slice_entries, GroupCore.incremental_bytes, cbor.GC_PAUSE_BYTES
    if whole:  # as before: one decode (no GC pause) and one application
        GroupCore.slice_entries, GroupCore.incremental_bytes = 1 << 40, 1 << 40
        cbor.GC_PAUSE_BYTES = 1 << 40
    ctx: Any = zmq.Context()
    url = f"ipc://{tempfile.mkdtemp()}/g"
    try:
        async with trio.open_nursery() as nursery:
            engine = Raw(ctx, url, 0, 1)
            nursery.start_soon(engine.handshake)
            async with EngineGroup.connect(url, 1, ready_timeout=10) as group:
                streams = [group.submit(Request(f"r{i}", None)) for i in range(100)]
                ids = [await engine.add() for _ in streams]
                body = cbor2.dumps(
                    {
                        "rank": 0,
                        "epoch": engine.epoch,
                        "outputs": [
                            {"id": ids[i % len(ids)], "body": i, "finish": None}
                            for i in range(outputs)
                        ],
                    }
                )
                stalls = [0.0]
                stop = trio.Event()

                async def ticker() -> None:
                    last = time.perf_counter()
                    while not stop.is_set():
                        await trio.lowlevel.checkpoint()
                        now = time.perf_counter()
                        stalls[0] = max(stalls[0], now - last)
                        last = now

                nursery.start_soon(ticker)
                start = time.perf_counter()
                engine.out.send(body, zmq.NOBLOCK)
                while sum(len(s._buffer or ()) for s in streams) < outputs:  # noqa: ASYNC110
                    await trio.sleep(0.001)  # a coarse poll: the ticker measures the stalls
                took = time.perf_counter() - start
                stop.set()
            engine.close()
            nursery.cancel_scope.cancel()
    finally:
        GroupCore.slice_entries, GroupCore.incremental_bytes, cbor.GC_PAUSE_BYTES = saved
        ctx.destroy(linger=0)
    return stalls[0], took


async def blocked_rank(requests: int, block: bool) -> tuple[float, float]:
    """(median latency of rank 0's requests, input-task wake-ups per second over one
    idle second afterwards)."""
    ctx: Any = zmq.Context()
    url = f"ipc://{tempfile.mkdtemp()}/g"
    opts = {"RCVHWM": 1, "RCVBUF": 4096}
    try:
        async with trio.open_nursery() as nursery:
            fast, slow = Raw(ctx, url, 0, 2), Raw(ctx, url, 1, 2, **opts)
            nursery.start_soon(fast.handshake)
            nursery.start_soon(slow.handshake)
            async with EngineGroup.connect(url, 2, ready_timeout=10, send_timeout=60) as group:
                if block:  # fill rank 1's pipe: it never reads again
                    n = 0
                    while group.statistics().ranks[1].queued == 0:
                        for _ in range(64):
                            group.submit(Request(f"s{n}", "x" * 1000, 1))
                            n += 1
                        await trio.testing.wait_all_tasks_blocked()
                latencies = []
                for i in range(requests):
                    start = time.perf_counter()
                    async with group.submit(Request(f"f{i}", None, 0)) as stream:
                        wid = await fast.add()
                        fast.out.send(
                            cbor2.dumps(
                                {
                                    "rank": 0,
                                    "epoch": fast.epoch,
                                    "outputs": [{"id": wid, "finish": "stop"}],
                                }
                            ),
                            zmq.NOBLOCK,
                        )
                        async for _ in stream:
                            pass
                    latencies.append(time.perf_counter() - start)
                waits = zmqdp.testing.input_statistics(group).waits
                await trio.sleep(1.0)  # idle: only a blocked rank's retries wake the task
                rate = zmqdp.testing.input_statistics(group).waits - waits
            fast.close()
            slow.close()
            nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
    return statistics.median(latencies), rate


async def main(args: argparse.Namespace) -> None:
    print(f"1. one batch of {args.outputs} outputs")
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for whole in (True, False):
            results[whole].append(await long_batch(args.outputs, whole))
    best = {w: (min(r[0] for r in results[w]), min(r[1] for r in results[w])) for w in results}
    (stall, took), (stall0, took0) = best[False], best[True]
    print(f"   longest stall    zmqdp {stall * 1e3:8.1f} ms   whole {stall0 * 1e3:8.1f} ms", end="")
    print(f"   ratio {stall / stall0:.3f}")
    print(f"   time to take in  zmqdp {took:8.2f} s    whole {took0:8.2f} s", end="")
    print(f"    ratio {took / took0:.2f}")
    print(f"2. {args.requests} requests to rank 0 while rank 1 does or does not read")
    healthy = await blocked_rank(args.requests, False)
    blocked = await blocked_rank(args.requests, True)
    print(f"   median latency   blocked {blocked[0] * 1e3:6.2f} ms", end="")
    print(f"   healthy {healthy[0] * 1e3:6.2f} ms", end="")
    print(f"   ratio {blocked[0] / healthy[0]:.2f}")
    print(f"   input task wake-ups/s: rank 1 blocked {blocked[1]:.0f}, healthy {healthy[1]:.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--outputs", type=int, default=2_000_000)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    trio.run(main, parser.parse_args())

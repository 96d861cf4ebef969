"""Drain rate of zmqdp's trio adapter against a bare blocking pyzmq loop, same run.

    .venv/bin/python benchmarks/bench_drain.py [--messages 200000] [--rounds 3]

A separate process (a blocking DEALER, so the sender never shares the GIL with the
receiver) sends N messages of 120 bytes over ipc to a ROUTER. The receiver is either

* baseline: `recv_multipart()` in a plain blocking loop (no event loop at all), or
* zmqdp: `ZSocket.receive_batch()` under trio (EVENTS checks, batches of 256, one
  checkpoint per batch, fd waits with the safety timeout).

Rounds alternate between the two and the best of each is kept; the ratio is what the
adapter keeps of the blocking rate. Absolute rates are context only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time

import trio
import zmq

from zmqdp._zmq import ZSocket

PAYLOAD = b"x" * 120


def sender(address: str, count: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"\x00\x00")
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    for _ in range(count):
        sock.send(PAYLOAD)
    sock.close(linger=-1)  # flush everything before exiting
    ctx.term()


def _router(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def run_blocking(address: str, count: int) -> float:
    ctx = zmq.Context()
    sock = _router(ctx, address)
    proc = mp.get_context("spawn").Process(target=sender, args=(address, count))
    proc.start()
    sock.recv_multipart()
    start = time.perf_counter()
    for _ in range(count - 1):
        sock.recv_multipart()
    elapsed = time.perf_counter() - start
    proc.join()
    sock.close()
    ctx.term()
    return (count - 1) / elapsed


def run_trio(address: str, count: int) -> tuple[float, int]:
    async def main() -> tuple[float, int]:
        ctx = zmq.Context()
        zs = ZSocket(_router(ctx, address))
        proc = mp.get_context("spawn").Process(target=sender, args=(address, count))
        proc.start()
        got = len(await zs.receive_batch(1))
        start = time.perf_counter()
        while got < count:
            got += len(await zs.receive_batch(256))
        elapsed = time.perf_counter() - start
        fallbacks = zs.statistics().fallbacks
        await trio.to_thread.run_sync(proc.join)
        zs.close()
        ctx.term()
        return (count - 1) / elapsed, fallbacks

    return trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="zmqdp-bench-")
    blocking, adapter, fallbacks = [], [], 0
    for i in range(args.rounds):
        blocking.append(run_blocking(f"ipc://{directory}/b{i}", args.messages))
        rate, fb = run_trio(f"ipc://{directory}/t{i}", args.messages)
        adapter.append(rate)
        fallbacks += fb
    shutil.rmtree(directory, ignore_errors=True)
    b, a = max(blocking), max(adapter)
    print(f"messages per round: {args.messages}, rounds: {args.rounds}, ipc, 120 B")
    for name, best, rounds in (
        ("blocking pyzmq loop", b, blocking),
        ("zmqdp trio adapter", a, adapter),
    ):
        shown = ", ".join(f"{x:,.0f}" for x in rounds)
        print(f"{name:<20}: {best:>10,.0f} msg/s (best of: {shown})")
    print(f"ratio adapter/blocking: {a / b:.2f}   safety-timeout fallbacks: {fallbacks}")


if __name__ == "__main__":
    main()

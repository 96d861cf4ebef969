"""P2: submits per second, end to end, against a bare ROUTER send loop.

    .venv/bin/python benchmarks/bench_p2_submit.py [--quick] [--rounds 5]

zmqdp: `group.submit()` of `--requests` requests (a small body, least-loaded choice among
`--engines` ranks), checkpointing every 64 so that the input task sends as it goes,
until the input task has handed every ADD to libzmq. The engines (`_engines.sink`) read
them and never answer, so every request stays in flight.

Baseline: a bare pyzmq ROUTER in this process sending the same pre-encoded ADD frames
to one DEALER (`_engines.plain_sink`), in a plain loop: the cost of the wire alone.
Rounds alternate; medians are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import tempfile
import time
from typing import Any

import trio
import zmq
from _engines import engine_process, plain_sink, sink
from _harness import Row, median, save

import zmqdp.testing
from zmqdp import EngineGroup, Request
from zmqdp._core.codec import encode_request
from zmqdp._core.messages import Add

BODY = {"prompt": list(range(16)), "max_tokens": 64}


async def zmqdp_round(group: EngineGroup, n: int, serial: int) -> float:
    input_stats = functools.partial(zmqdp.testing.input_statistics, group)
    sent = input_stats().sent
    streams = []
    start = time.perf_counter()
    for i in range(n):
        streams.append(group.submit(Request(f"s{serial}-{i}", BODY)))
        if i % 64 == 63:
            await trio.lowlevel.checkpoint()
    while input_stats().sent < sent + n:
        await trio.lowlevel.checkpoint()
    elapsed = time.perf_counter() - start
    for stream in streams:  # abort them, outside the timing
        await group.abort(stream.request_id)
    return n / elapsed


def plain_round(router: Any, n: int) -> float:
    frames = [b"\x00\x00", *encode_request(Add("s0-0#0", BODY))]
    send = router.send_multipart
    start = time.perf_counter()
    for _ in range(n):
        send(frames)
    elapsed = time.perf_counter() - start
    router.recv_multipart()  # the peer has read them all
    return n / elapsed


async def measure(n: int, engines: int, rounds: int) -> dict[str, list[float]]:
    directory = tempfile.mkdtemp(prefix="zmqdp-p2-")
    url, plain = f"ipc://{directory}/g", f"ipc://{directory}/plain"
    ctx: Any = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind(plain)
    out: dict[str, list[float]] = {"zmqdp": [], "plain": []}
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(engine_process(plain_sink, plain, n))
            for rank in range(engines):
                stack.enter_context(engine_process(sink, url, rank, engines))
            async with EngineGroup.connect(url, engines, ready_timeout=30) as group:
                router.recv_multipart()  # the plain peer is there
                await zmqdp_round(group, min(n, 2000), -1)  # warm up
                for r in range(rounds):
                    out["zmqdp"].append(await zmqdp_round(group, n, r))
                    out["plain"].append(plain_round(router, n))
    finally:
        router.close(linger=0)
        ctx.term()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--engines", type=int, default=2)
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    n = 5000 if args.quick else args.requests
    m = {k: median(v) for k, v in trio.run(measure, n, args.engines, rounds).items()}
    save(
        "p2_submit",
        [
            Row(
                "P2",
                "submits/s end to end ÷ a bare ROUTER send loop of the same pre-encoded ADDs",
                m["zmqdp"] / m["plain"],
                "≥ 0.5",
                f"{m['zmqdp']:,.0f} vs {m['plain']:,.0f} messages/s ({args.engines} ranks)",
            )
        ],
    )


if __name__ == "__main__":
    main()

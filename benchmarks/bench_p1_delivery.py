"""P1: outputs delivered per second to many consuming streams.

    .venv/bin/python benchmarks/bench_p1_delivery.py [--quick] [--rounds 5]

An engine process (`_engines.blast`) sends `tokens` outputs for each of `streams`
requests, 64 outputs per batch, as fast as it can; `streams` consumer tasks read their
streams to the end. Outputs/s is counted from the last submit to the last stream end.

* P1a, ÷ the decode ceiling: the same batches, from the same kind of engine process,
  received by a bare blocking `recv_multipart` loop and decoded by plain `cbor2.loads`
  (what any client must at least do, with no checks, no routing, no streams).
* P1a', ÷ the same ceiling inside trio: the same batches received by this package's
  trio socket wrapper (`ZSocket.receive_batch`, what the dispatcher uses) and decoded
  by plain `cbor2.loads`. This is the ceiling of any trio client; P1a ÷ P1a' is what
  waking up in trio costs on this machine (context for P1a, not a target).
* P1b, ÷ a per-output memory channel: the same client with a `RequestStream` subclass
  that does one `trio` memory-channel send per output and one receive per output (the
  obvious design).

Rounds alternate; medians are kept. A plot of outputs/s against the number of streams
goes to benchmarks/plots/p1_delivery.png.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import cbor2
import trio
import zmq
from _engines import blast, engine_process, plain_blast
from _harness import Row, median, plain_numbers, plot, save

from zmqdp import EngineGroup, Output, Request
from zmqdp._zmq import ZSocket
from zmqdp.stream import RequestStream

BATCH = 64


class ChannelStream(RequestStream):
    """The baseline stream: one memory-channel send per output, one receive per output."""

    __slots__ = ("_rx", "_tx")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._tx, self._rx = trio.open_memory_channel[Output](math.inf)

    def deliver(self, out: Output) -> bool:
        self._tx.send_nowait(out)
        return True

    def notify(self) -> None:
        pass

    def finish(self, outcome: Any, error: BaseException | None = None) -> None:
        super().finish(outcome, error)
        self._tx.close()

    async def receive(self) -> Output:
        return await self._rx.receive()


async def client_round(group: EngineGroup, streams: int, tokens: int, channel: bool) -> float:
    type(group).stream_class = ChannelStream if channel else RequestStream
    delivered = 0

    async def consume(stream: RequestStream) -> None:
        nonlocal delivered
        async with stream:
            async for _ in stream:
                delivered += 1

    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(consume, group.submit(Request(f"r{i}", None)))
        start = time.perf_counter()
    elapsed = time.perf_counter() - start
    type(group).stream_class = RequestStream
    assert delivered == streams * tokens, delivered
    return delivered / elapsed


def plain_round(router: Any, streams: int, tokens: int) -> float:
    """The decode ceiling: blocking receive and plain cbor2 decode, nothing else."""
    total = streams * tokens
    router.send_multipart([b"\x00\x00", b"go"])
    start = time.perf_counter()
    seen = 0
    recv = router.recv_multipart
    loads = cbor2.loads
    while seen < total:
        _, body = recv()
        seen += len(loads(body)["outputs"])
    return total / (time.perf_counter() - start)


async def trio_round(zs: ZSocket, streams: int, tokens: int) -> float:
    """The decode ceiling inside trio: async receive in batches, plain cbor2 decode."""
    total = streams * tokens
    zs.send_nowait([b"\x00\x00", b"go"])
    start = time.perf_counter()
    seen = 0
    loads = cbor2.loads
    while seen < total:
        for _, body in await zs.receive_batch(256):
            seen += len(loads(body)["outputs"])
    return total / (time.perf_counter() - start)


async def measure(streams: int, tokens: int, rounds: int) -> dict[str, list[float]]:
    directory = tempfile.mkdtemp(prefix="zmqdp-p1-")
    url, plain = f"ipc://{directory}/g", f"ipc://{directory}/plain"
    ctx: Any = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(plain)
    zs = ZSocket(router)
    try:
        with (
            engine_process(blast, url, streams, tokens, BATCH),
            engine_process(plain_blast, plain, streams, tokens, BATCH, 2 * rounds),
        ):
            async with EngineGroup.connect(url, 1, ready_timeout=30) as group:
                await client_round(group, streams, tokens, False)  # warm up
                router.recv_multipart()  # the plain engine is connected
                results: dict[str, list[float]] = {
                    "zmqdp": [],
                    "plain": [],
                    "trio": [],
                    "channel": [],
                }
                for _ in range(rounds):
                    results["zmqdp"].append(await client_round(group, streams, tokens, False))
                    results["plain"].append(plain_round(router, streams, tokens))
                    results["trio"].append(await trio_round(zs, streams, tokens))
                    results["channel"].append(await client_round(group, streams, tokens, True))
                return results
    finally:
        zs.close()
        ctx.term()


def medians(results: dict[str, list[float]]) -> dict[str, float]:
    return {k: median(v) for k, v in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one size, fewer rounds (CI)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=100)
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    sizes = [1000] if args.quick else [10, 100, 1000]
    by_size = {}
    for streams in sizes:
        tokens = max(args.tokens, 100_000 // streams) if not args.quick else 50
        by_size[streams] = medians(trio.run(measure, streams, tokens, rounds))
        m = by_size[streams]
        print(
            f"{streams:5} streams: zmqdp {m['zmqdp']:,.0f}  plain decode {m['plain']:,.0f}"
            f"  in trio {m['trio']:,.0f}"
            f"  channel {m['channel']:,.0f} outputs/s"
        )
    m = by_size[1000]
    save(
        "p1_delivery",
        [
            Row(
                "P1a",
                "outputs/s to 1000 consuming streams ÷ receive + plain cbor2 decode",
                m["zmqdp"] / m["plain"],
                "≥ 0.40",
                f"{m['zmqdp']:,.0f} vs {m['plain']:,.0f} outputs/s",
            ),
            Row(
                "P1a'",
                "the same ÷ receive in trio (ZSocket) + plain cbor2 decode (context)",
                m["zmqdp"] / m["trio"],
                "",
                f"{m['zmqdp']:,.0f} vs {m['trio']:,.0f} outputs/s",
            ),
            Row(
                "P1b",
                "outputs/s to 1000 consuming streams ÷ one memory-channel send per output",
                m["zmqdp"] / m["channel"],
                "≥ 2.5",
                f"{m['zmqdp']:,.0f} vs {m['channel']:,.0f} outputs/s",
            ),
        ],
        {"by_size": by_size},
    )

    draw({"by_size": by_size})


P1_LABELS = {  # the series -> the legend
    "zmqdp": "zmqdp's streams",
    "channel": "streams that send each output on a trio memory channel",
    "plain": "bare blocking receive + cbor2 decode (no streams)",
    "trio": "receive in trio + cbor2 decode (no streams)",
}


def draw(extra: dict[str, Any], directory: Path | None = None) -> None:
    """plots/p1_delivery.png from the saved results' `by_size`."""
    by_size = {int(k): v for k, v in extra["by_size"].items()}
    sizes = sorted(by_size)

    def lines(ax: Any) -> None:
        for name, label in P1_LABELS.items():
            ax.plot(sizes, [by_size[s][name] for s in sizes], marker="o", label=label)
        ax.set_xscale("log")
        plain_numbers(ax.xaxis)
        plain_numbers(ax.yaxis)
        ax.set_xlabel("consuming streams")
        ax.set_ylabel("outputs delivered per second")

    plot(
        "p1_delivery",
        lines,
        "P1: outputs/s against the number of streams",
        size=(9.0, 4.0),
        legend_outside=True,
        directory=directory,
    )


if __name__ == "__main__":
    main()

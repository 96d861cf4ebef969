"""Latency from an engine's send to the consumer, one output every 2 ms.

    .venv/bin/python benchmarks/bench_lat_delivery_latency.py [--quick] [--tokens 500] [--rounds 3]

An engine process (`_engines.paced`) streams one output every `--interval` seconds,
stamped with `time.monotonic()` when sent (one clock for all processes of a machine);
the consumer takes the difference when `async for` hands it the output. The baseline is
a blocking `recv_multipart` + `cbor2.loads` loop in this process, reading the same
stamped outputs from the same kind of engine process (`_engines.plain_paced`): the
lowest latency pyzmq offers. Ratio of the medians (p50); p99 as context; a CDF plot
goes to benchmarks/plots/latency_cdf.png.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import cbor2
import trio
import zmq
from _engines import engine_process, paced, plain_paced
from _harness import Row, pct, plain_numbers, plot, save

from zmqdp import EngineGroup, Request


async def zmqdp_round(group: EngineGroup, serial: int) -> list[float]:
    delays = []
    async with group.submit(Request(f"lat-{serial}", None)) as stream:
        async for out in stream:
            delays.append(time.monotonic() - out.body)
    return delays


def plain_round(address: str, tokens: int, interval: float) -> list[float]:
    ctx: Any = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    delays = []
    try:
        with engine_process(plain_paced, address, tokens, interval):
            identity, _ = router.recv_multipart()  # the engine says hi
            router.send_multipart([identity, b"go"])
            for _ in range(tokens):
                _, body = router.recv_multipart()
                delays.append(time.monotonic() - cbor2.loads(body)["outputs"][0]["body"])
    finally:
        router.close(linger=0)
        ctx.term()
    return delays


async def measure(tokens: int, interval: float, rounds: int) -> dict[str, list[float]]:
    directory = tempfile.mkdtemp(prefix="zmqdp-lat-")
    url = f"ipc://{directory}/g"
    out: dict[str, list[float]] = {"zmqdp": [], "plain": []}
    with engine_process(paced, url, tokens, interval):
        async with EngineGroup.connect(url, 1, ready_timeout=30) as group:
            await zmqdp_round(group, -1)  # warm up
            for r in range(rounds):
                out["zmqdp"] += await zmqdp_round(group, r)
                out["plain"] += plain_round(f"ipc://{directory}/plain{r}", tokens, interval)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--interval", type=float, default=0.002)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokens, rounds = (100, 1) if args.quick else (args.tokens, args.rounds)
    m = trio.run(measure, tokens, args.interval, rounds)
    ours, base = statistics.median(m["zmqdp"]), statistics.median(m["plain"])
    samples = {"samples": m}
    save(
        "latency",
        [
            Row(
                "lat",
                "engine send -> consumer p50, one output / 2 ms ÷ blocking pyzmq recv",
                ours / base,
                "≤ 1.5",
                f"p50 {ours * 1e6:.0f} vs {base * 1e6:.0f} µs; p99 "
                f"{pct(m['zmqdp'], 0.99) * 1e6:.0f} vs {pct(m['plain'], 0.99) * 1e6:.0f} µs",
            )
        ],
        samples,
    )
    draw(samples)


LAT_LABELS = {
    "zmqdp": "zmqdp (EngineGroup stream)",
    "plain": "blocking pyzmq receive (no client library)",
}


def draw(extra: dict[str, Any], directory: Path | None = None) -> None:
    """plots/latency_cdf.png from the saved results' `samples` (seconds per output)."""

    def lines(ax: Any) -> None:
        for name, label in LAT_LABELS.items():
            xs = sorted(v * 1e6 for v in extra["samples"][name])
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.set_xscale("log")
        plain_numbers(ax.xaxis)
        ax.set_xlabel("engine send -> consumer, µs")
        ax.set_ylabel("fraction of outputs")

    plot(
        "latency_cdf",
        lines,
        "Latency CDF, one output every 2 ms",
        size=(9.0, 4.0),
        legend_outside=True,
        directory=directory,
    )


if __name__ == "__main__":
    main()

"""P5: tail completion time when one rank is 3x slower, zmqdp's routing ÷ round-robin.

    .venv/bin/python benchmarks/bench_p5_slow_rank.py [--quick] [--rounds 3]

A mock group of 2 ranks (`python -m zmqdp mock`, rank 1 with `slow=3`: every step takes
three times as long; `max_num_seqs` 16 each) serves `--requests` requests of 8 to 64
tokens, `--concurrency` at a time (closed loop, like a gateway at its limit), after
`WARMUP` requests that are not measured (each round connects a new group). Completion
time is from `submit` to the end of the stream. Three policies in rotating rounds of
the same process: ``routing="speed"`` (by step time and capacity, the default),
``routing="least-loaded"``, and plain round-robin (a `Routing` that ignores load). Rows:

* P5: p99 completion, speed ÷ round-robin (lower is better; target ≤ 0.6);
* P5ll: the same for least-loaded ÷ round-robin (context: the policy before);
* P5u: the same group with both ranks equally fast (a second mock group, no fault),
  speed ÷ least-loaded, p99 and requests/s: speed-aware routing must do no worse there
  (target ≤ 1.05: this figure moves by a few % between runs of the same policy).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _harness import Row, median, pct, plot, save

from zmqdp import EngineGroup, Request
from zmqdp._core.routing import Routing
from zmqdp._core.state import GroupCore
from zmqdp.mock import mock_process


class RoundRobin(Routing):
    """The baseline policy: the next up rank in turn, whatever the load."""

    __slots__ = ()

    def score(self, rank: int) -> float:
        return 0.0


POLICIES = ("speed", "least-loaded", "round-robin")
WARMUP = 48
"""Requests each round runs before the measured ones: a gateway's group serves for days,
so the figures are the steady state, not the first seconds in which speed-aware
routing has no step times yet (until then it spreads as least-loaded does)."""


async def one_round(
    url: str, requests: int, concurrency: int, seed: int, policy: str
) -> tuple[list[float], float]:
    """Completion times of one round's requests, and its wall time."""
    rng = random.Random(seed)
    lengths = [rng.randint(8, 64) for _ in range(WARMUP + requests)]
    times: list[float] = []
    limiter = trio.CapacityLimiter(concurrency)
    routing = "speed" if policy == "speed" else "least-loaded"
    GroupCore.routing_cls = RoundRobin if policy == "round-robin" else Routing
    try:
        return await _round(url, lengths, limiter, seed, routing, times)
    finally:
        GroupCore.routing_cls = Routing


async def _round(
    url: str,
    lengths: list[int],
    limiter: trio.CapacityLimiter,
    seed: int,
    routing: str,
    times: list[float],
) -> tuple[list[float], float]:
    first: list[float] = []  # when the first measured request started
    async with EngineGroup.connect(url, 2, ready_timeout=30, routing=routing) as group:

        async def one(i: int) -> None:
            async with limiter:
                start = time.perf_counter()
                if i == WARMUP:
                    first.append(start)
                body = {"prompt": [1, 2, 3], "max_tokens": lengths[i]}
                async with group.submit(Request(f"p5-{seed}-{i}", body)) as stream:
                    async for _ in stream:
                        pass
                if i >= WARMUP:
                    times.append(time.perf_counter() - start)

        async with trio.open_nursery() as nursery:
            for i in range(len(lengths)):
                nursery.start_soon(one, i)
                await trio.lowlevel.checkpoint()  # start in order: the limiter is FIFO
        wall = time.perf_counter() - first[0]
    return times, wall


async def measure(requests: int, concurrency: int, rounds: int, step: float) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="zmqdp-p5-")
    slow, even = f"ipc://{directory}/slow", f"ipc://{directory}/even"
    out: dict[str, Any] = {"slow": {p: [] for p in POLICIES}, "even": {p: [] for p in POLICIES[:2]}}
    async with (
        mock_process(slow, 2, "--step-time", str(step), "--fault", "1:slow=3"),
        mock_process(even, 2, "--step-time", str(step)),
    ):
        for r in range(rounds):
            for policy in POLICIES:
                out["slow"][policy].append(await one_round(slow, requests, concurrency, r, policy))
            for policy in POLICIES[:2]:
                out["even"][policy].append(await one_round(even, requests, concurrency, r, policy))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--step", type=float, default=0.005, help="mock step time, s")
    args = parser.parse_args()
    rounds, requests = (1, 120) if args.quick else (args.rounds, args.requests)
    m = trio.run(measure, requests, args.concurrency, rounds, args.step)

    def p(group: str, policy: str, q: float) -> float:
        return median([pct(times, q) for times, _ in m[group][policy]])

    def rate(group: str, policy: str) -> float:
        return median([len(times) / wall for times, wall in m[group][policy]])

    sp, ll, rr = POLICIES
    plotted = {"slow": {policy: [times for times, _ in m["slow"][policy]] for policy in POLICIES}}
    c = f"concurrency {args.concurrency}, {requests} requests of 8-64 tokens, median of {rounds}"
    save(
        "p5_slow_rank",
        [
            Row(
                "P5",
                "p99 completion, one rank 3x slower, speed-aware ÷ round-robin",
                p("slow", sp, 0.99) / p("slow", rr, 0.99),
                "≤ 0.6",
                f"p99 {p('slow', sp, 0.99) * 1e3:.0f} vs {p('slow', rr, 0.99) * 1e3:.0f} ms; "
                f"p50 {p('slow', sp, 0.5) * 1e3:.0f} vs {p('slow', rr, 0.5) * 1e3:.0f} ms ({c})",
            ),
            Row(
                "P5ll",
                "p99 completion, one rank 3x slower, least-loaded ÷ round-robin (context)",
                p("slow", ll, 0.99) / p("slow", rr, 0.99),
                "",
                f"p99 {p('slow', ll, 0.99) * 1e3:.0f} vs {p('slow', rr, 0.99) * 1e3:.0f} ms; "
                f"p50 {p('slow', ll, 0.5) * 1e3:.0f} vs {p('slow', rr, 0.5) * 1e3:.0f} ms",
            ),
            Row(
                "P5u",
                "p99 completion, equally fast ranks, speed-aware ÷ least-loaded",
                p("even", sp, 0.99) / p("even", ll, 0.99),
                "≤ 1.05",
                f"p99 {p('even', sp, 0.99) * 1e3:.0f} vs {p('even', ll, 0.99) * 1e3:.0f} ms; "
                f"requests/s ratio {rate('even', sp) / rate('even', ll):.3f} "
                f"({rate('even', sp):.0f} vs {rate('even', ll):.0f}); {c}",
            ),
        ],
        plotted,
    )
    draw(plotted)


P5_LABELS = {
    "speed": "speed-aware routing (the default)",
    "least-loaded": "least-loaded routing",
    "round-robin": "round-robin",
}


def draw(extra: dict[str, Any], directory: Path | None = None) -> None:
    """plots/p5_slow_rank.png from the saved results' `slow`: each policy's completion
    times (s) in each round, one rank three times slower."""

    def lines(ax: Any) -> None:
        for policy, label in P5_LABELS.items():
            xs = sorted(t * 1e3 for times in extra["slow"][policy] for t in times)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.set_xlabel("completion time, ms")
        ax.set_ylabel("fraction of requests")

    plot(
        "p5_slow_rank",
        lines,
        "P5: completion times, rank 1 three times slower",
        directory=directory,
    )


if __name__ == "__main__":
    main()

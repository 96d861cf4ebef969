"""P5: tail completion time when one rank is 3x slower, least-loaded ÷ round-robin.

    .venv/bin/python benchmarks/bench_p5_slow_rank.py [--quick] [--rounds 3]

A mock group of 2 ranks (`python -m zmqdp mock`, rank 1 with `slow=3`: every step takes
three times as long) serves `--requests` requests of 8 to 64 tokens, `--concurrency` at
a time (closed loop, like a gateway at its limit). Completion time is from `submit` to
the end of the stream. zmqdp's least-loaded selection against plain round-robin (a
`Routing` that ignores load), in alternating rounds of the same process: the ratio of
the p99s (lower is better); p50s as context.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
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


async def one_round(url: str, requests: int, concurrency: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    lengths = [rng.randint(8, 64) for _ in range(requests)]
    times: list[float] = []
    limiter = trio.CapacityLimiter(concurrency)
    async with EngineGroup.connect(url, 2, ready_timeout=30) as group:

        async def one(i: int) -> None:
            async with limiter:
                start = time.perf_counter()
                body = {"prompt": [1, 2, 3], "max_tokens": lengths[i]}
                async with group.submit(Request(f"p5-{seed}-{i}", body)) as stream:
                    async for _ in stream:
                        pass
                times.append(time.perf_counter() - start)

        async with trio.open_nursery() as nursery:
            for i in range(requests):
                nursery.start_soon(one, i)
    return times


async def measure(requests: int, concurrency: int, rounds: int, step: float) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="zmqdp-p5-")
    url = f"ipc://{directory}/g"
    out: dict[str, Any] = {"least-loaded": [], "round-robin": []}
    args = ["--step-time", str(step), "--fault", "1:slow=3"]
    async with mock_process(url, 2, *args):
        for r in range(rounds):
            for policy in ("least-loaded", "round-robin"):
                GroupCore.routing_cls = RoundRobin if policy == "round-robin" else Routing
                try:
                    out[policy].append(await one_round(url, requests, concurrency, r))
                finally:
                    GroupCore.routing_cls = Routing
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
    p99 = {k: median([pct(r, 0.99) for r in v]) for k, v in m.items()}
    p50 = {k: median([pct(r, 0.5) for r in v]) for k, v in m.items()}
    ll, rr = "least-loaded", "round-robin"
    save(
        "p5_slow_rank",
        [
            Row(
                "P5",
                "p99 completion, one rank 3x slower, least-loaded ÷ round-robin",
                p99[ll] / p99[rr],
                "≤ 0.75",
                f"p99 {p99[ll] * 1e3:.0f} vs {p99[rr] * 1e3:.0f} ms; p50 {p50[ll] * 1e3:.0f} vs "
                f"{p50[rr] * 1e3:.0f} ms (concurrency {args.concurrency})",
            )
        ],
    )

    def draw(ax: Any) -> None:
        for policy in (ll, rr):
            xs = sorted(t * 1e3 for r in m[policy] for t in r)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=policy)
        ax.set_xlabel("completion time, ms")
        ax.set_ylabel("fraction of requests")

    plot("p5_slow_rank", draw, "P5: completion times, rank 1 three times slower")


if __name__ == "__main__":
    main()

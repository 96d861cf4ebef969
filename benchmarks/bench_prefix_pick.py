"""Cost of one pick with prefix affinity: `Routing.select` + `release` of a 4,096-token
prompt, against the plain pick.

    .venv/bin/python benchmarks/bench_prefix_pick.py [--quick]

For 2 and 8 ranks, in interleaved rounds (the median of each kept), in this process:

* plain: `Routing(n, speed=True)`, an unpinned pick with no token ids (the baseline);
* no tokens: the same with the prefix index on, a request without token ids (must cost
  what plain does);
* hit: a 4,096-token prompt whose first 3,584 tokens one rank caches (a session's
  next turn): chain, match, band, `pick`, insert;
* miss: a 4,096-token prompt no rank caches (a new session): chain, match, the load
  decision, insert.

The index holds 256 sessions of 4,096 tokens spread over the ranks (65,536 blocks). The
per-token cost (hashing the prompt's 256 blocks, walking them) dominates: a pick is
O(blocks + N), and the selection itself stays the load decision's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from zmqdp._core.messages import Load
from zmqdp._core.prefix import PrefixIndex
from zmqdp._core.routing import Routing

PROMPT = 4096
SESSIONS = 256


def group(size: int, prefix: bool) -> Routing:
    index = PrefixIndex(size) if prefix else None
    routing = Routing(size, up=True, speed=True, prefix=index)
    rng = random.Random(1)
    for rank in range(size):
        routing.observe_load(rank, Load(rng.randint(0, 2), rng.randint(0, 8), 0.2), 1)
    if index is not None:
        for s in range(SESSIONS):
            tokens = [s * 100_000 + t for t in range(PROMPT)]
            index.insert(s % size, index.chain(tokens))
    return routing


def timer(routing: Routing, tokens: list[int] | None) -> Callable[[int], float]:
    prefix = None if tokens is None else (tokens, 0)

    def run(n: int) -> float:
        select, release = routing.select, routing.release
        start = time.perf_counter()
        for i in range(n):
            rid = f"b{i}"
            rank = select(rid, prefix=prefix)
            release(rank, (rid,))
        return (time.perf_counter() - start) / n * 1e6

    return run


def measure(size: int, rounds: int, n: int) -> dict[str, float]:
    session = [7 * 100_000 + t for t in range(PROMPT - 512)]  # session 7's first 3,584
    cases = {
        "plain": timer(group(size, False), None),
        "no tokens": timer(group(size, True), None),
        "hit": timer(group(size, True), session + list(range(512))),
        "miss": timer(group(size, True), [9_000_000 + t for t in range(PROMPT)]),
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            samples[name].append(run(n))
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, n = (3, 50) if args.quick else (9, 300)
    print("| ranks | plain µs | no tokens µs | hit µs | miss µs | hit / plain |")
    print("|---|---|---|---|---|---|")
    for size in (2, 8):
        m = measure(size, rounds, n)
        print(
            f"| {size} | {m['plain']:.2f} | {m['no tokens']:.2f} | {m['hit']:.1f} | "
            f"{m['miss']:.1f} | {m['hit'] / m['plain']:.0f}x |"
        )


if __name__ == "__main__":
    main()

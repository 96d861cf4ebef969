"""P3: a lockstep group against an independent one, 8 ranks, ADDs in runs of 8.

    .venv/bin/python benchmarks/bench_p3_lockstep.py [--quick] [--rounds 5]

Two mock groups of 8 ranks run in processes of their own (`python -m zmqdp mock`), one
lockstep (MoE-style: every step is a collective, the group parks between waves and a
request that reaches a parked rank makes it send `start_wave`), one independent. The
workload submits 8 requests at once (least-loaded spreads them over the ranks), waits
for all 8 to finish, and starts the next run: every run wakes a parked lockstep group.
Requests/s of the lockstep group ÷ the independent one, rounds alternating, medians.
Also shown: WAKE messages sent per ADD.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _harness import Row, median, plot, save

from zmqdp import EngineGroup, Request
from zmqdp.mock import mock_process

RANKS = 8


async def one_round(group: EngineGroup, runs: int, tokens: int, tag: str) -> float:
    before = group.statistics().submitted
    start = time.perf_counter()
    for run in range(runs):
        async with trio.open_nursery() as nursery:
            for i in range(RANKS):

                async def one(i: int = i, run: int = run) -> None:
                    body = {"prompt": [1, 2, 3], "max_tokens": tokens}
                    async with group.submit(Request(f"{tag}{run}-{i}", body)) as stream:
                        async for _ in stream:
                            pass

                nursery.start_soon(one)
    elapsed = time.perf_counter() - start
    assert group.statistics().submitted - before == runs * RANKS
    return runs * RANKS / elapsed


async def measure(runs: int, tokens: int, rounds: int, step: float) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="zmqdp-p3-")
    urls = {"lockstep": f"ipc://{directory}/l", "independent": f"ipc://{directory}/i"}
    args = ["--step-time", str(step), "--max-num-seqs", "64"]
    out: dict[str, Any] = {"lockstep": [], "independent": []}
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(mock_process(urls["lockstep"], RANKS, *args, "--lockstep"))
        await stack.enter_async_context(mock_process(urls["independent"], RANKS, *args))
        groups = {
            kind: await stack.enter_async_context(EngineGroup.connect(url, RANKS, ready_timeout=30))
            for kind, url in urls.items()
        }
        for kind, group in groups.items():
            await one_round(group, 2, tokens, f"warm-{kind}-")
        for r in range(rounds):
            for kind, group in groups.items():
                out[kind].append(await one_round(group, runs, tokens, f"{kind}{r}-"))
        stats = groups["lockstep"].statistics()
        out["wakes_per_add"] = stats.wakes * RANKS / stats.submitted
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--step", type=float, default=0.001, help="mock step time, s")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    runs = 10 if args.quick else args.runs
    m = trio.run(measure, runs, args.tokens, rounds, args.step)
    lock, ind = median(m["lockstep"]), median(m["independent"])
    save(
        "p3_lockstep",
        [
            Row(
                "P3",
                "lockstep N=8 ÷ independent N=8, ADDs in runs of 8 (requests/s)",
                lock / ind,
                "≥ 0.9",
                f"{lock:,.0f} vs {ind:,.0f} requests/s; {m['wakes_per_add']:.2f} WAKE messages"
                " per ADD",
            )
        ],
        {"rounds": {k: m[k] for k in ("lockstep", "independent")}},
    )

    draw({"rounds": {k: m[k] for k in ("lockstep", "independent")}})


P3_LABELS = {
    "lockstep": "lockstep group (MoE waves: ranks step together)",
    "independent": "independent ranks",
}


def draw(extra: dict[str, Any], directory: Path | None = None) -> None:
    """plots/p3_lockstep.png from the saved results' `rounds` (requests/s per round)."""
    by_kind: dict[str, list[float]] = extra["rounds"]

    def lines(ax: Any) -> None:
        for kind, label in P3_LABELS.items():
            rounds = range(1, len(by_kind[kind]) + 1)
            ax.plot(rounds, by_kind[kind], marker="o", label=label)
        ax.set_xticks(range(1, max(len(v) for v in by_kind.values()) + 1))
        ax.set_xlabel("measurement round (the two groups alternate)")
        ax.set_ylabel("requests/s")
        ax.set_ylim(bottom=0)

    plot("p3_lockstep", lines, "P3: 8 ranks, runs of 8 requests", directory=directory)


if __name__ == "__main__":
    main()

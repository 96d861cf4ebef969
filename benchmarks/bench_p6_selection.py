"""Cost of one least-loaded pick (P6): the selection index against the linear scan.

    .venv/bin/python benchmarks/bench_p6_selection.py [--quick]

One step is an unpinned `Routing.select` and the `release` of that id, in steady state:
every rank is up, holds 0 to 4 pinned requests and has reported a random load (waiting
0-8, running 0-32, KV usage 0-1), so the scores are realistic and mostly distinct. For
each group size three objects are timed in interleaved rounds (the median of each is
kept), in this process:

* ours: `Routing(n)`, as the client builds it (the index from `TREE_MIN_SIZE` ranks on),
* linear: `Routing(n, tree=False)`, today's scan of every rank (the baseline),
* tree: `Routing(n, tree=True)`, the index forced on, to show where it starts to win.

The ratio is ours / linear; absolute microseconds are context only. The table is printed
and, if matplotlib is importable, plotted to benchmarks/plots/select_scaling.png
(log-log). `run(quick)` measures N = 256 only, for a runner.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from _harness import PLOTS, Row, save

from zmqdp._core.messages import Load
from zmqdp._core.routing import Routing

SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 1024)
PLOT = PLOTS / "select_scaling.png"
TARGET_US = 20.0


def loaded(size: int, tree: bool | None, seed: int = 1) -> Routing:
    """A group of `size` up ranks with pinned requests and reported loads."""
    routing = Routing(size, up=True, tree=tree)
    rng = random.Random(seed)
    for rank in range(size):
        for j in range(rng.randint(0, 4)):
            routing.select(f"held-{rank}-{j}", rank)
        load = Load(rng.randint(0, 8), rng.randint(0, 32), rng.random())
        routing.observe_load(rank, load, 1)
    return routing


def timer(routing: Routing, steps: int) -> Callable[[], float]:
    """A round of `steps` select + release pairs; returns µs per pair."""
    select, release = routing.select, routing.release
    ids = [f"req-{i}" for i in range(steps)]

    def run() -> float:
        start = time.perf_counter()
        for request_id in ids:
            release(select(request_id), (request_id,))
        return (time.perf_counter() - start) / steps * 1e6

    return run


def measure(size: int, quick: bool) -> dict[str, float]:
    """Median µs per pair for ours, linear and tree at `size`."""
    rounds = 5 if quick else 15
    steps = max(20, (8_000 if quick else 40_000) // size)
    runs = {
        "ours": timer(loaded(size, None), steps),
        "linear": timer(loaded(size, False), steps),
        "tree": timer(loaded(size, True), steps),
    }
    for run in runs.values():  # warm-up round, discarded
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(run())
    return {name: statistics.median(values) for name, values in times.items()}


def run(quick: bool) -> dict[str, Any]:
    """The P6 figure: µs per pick at N = 256, ours against the linear scan."""
    m = measure(256, quick)
    return {
        "name": "P6 selection at N=256",
        "ours_us": m["ours"],
        "linear_us": m["linear"],
        "ratio": m["ours"] / m["linear"],
    }


def plot(rows: dict[int, dict[str, float]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot (.venv/bin/pip install matplotlib)")
        return
    sizes = sorted(rows)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(sizes, [rows[n]["linear"] for n in sizes], "o-", label="linear scan (baseline)")
    ax.plot(sizes, [rows[n]["ours"] for n in sizes], "s-", label="Routing (ours)")
    ax.plot(sizes, [rows[n]["tree"] for n in sizes], ":", color="gray", label="index forced")
    ax.axhline(TARGET_US, color="red", linewidth=0.8, linestyle="--", label="target at N=256")
    ax.axvline(Routing.TREE_MIN_SIZE, color="gray", linewidth=0.6, linestyle="-.")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks in the group (N)")
    ax.set_ylabel("µs per select + release")
    ax.set_title(f"Least-loaded selection (index from N = {Routing.TREE_MIN_SIZE})")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)
    print(f"plot: {PLOT}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    args = parser.parse_args()
    rows: dict[int, dict[str, float]] = {}
    print(f"µs per select + release (median); the index is used from N = {Routing.TREE_MIN_SIZE}")
    print(f"{'N':>6} {'ours':>9} {'linear':>9} {'tree':>9} {'ours/linear':>12}")
    for size in SIZES:
        m = rows[size] = measure(size, args.quick)
        ratio = m["ours"] / m["linear"]
        print(f"{size:>6} {m['ours']:>9.2f} {m['linear']:>9.2f} {m['tree']:>9.2f} {ratio:>12.3f}")
    at = rows[256]
    verdict = "met" if at["ours"] < TARGET_US else "NOT met"
    print(f"P6 target < {TARGET_US:g} µs at N=256: {at['ours']:.2f} µs, {verdict}")
    plot(rows)
    save(
        "p6_select",
        [
            Row(
                "P6",
                "one least-loaded selection (+ release) at N=256, µs",
                at["ours"],
                f"≤ {TARGET_US:g} µs",
                f"{at['ours']:.2f} µs vs {at['linear']:.2f} µs for the linear scan "
                f"(ratio {at['ours'] / at['linear']:.3f}); 1024 ranks: {rows[1024]['ours']:.2f} µs",
            )
        ],
    )


if __name__ == "__main__":
    main()

"""Before and after: the same benchmark scripts run from two checkouts, interleaved.

A refactor must not slow the hot path, and on this noisy VM two runs of the same code
differ by more than most regressions. So each script runs from the *before* checkout,
then from the *after* one, alternating, `--repeat` times each; every run reports its
rows as ratios against a baseline measured in its own process (`_harness.py`), and this
script compares the medians of those ratios per row: after ÷ before, where 1.0 means
"no change" (above 1 is faster for throughput rows).

    python benchmarks/compare_trees.py --before ../wt-before --after . \\
        --repeat 3 bench_p1_delivery.py bench_p2_submit.py -- --quick

Arguments after `--` go to every script. A script runs from each checkout's own
`benchmarks/` directory, so it imports that checkout's `zmqdp` (`_harness.py` puts the
checkout first on `sys.path`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(tree: Path, script: str, args: list[str]) -> dict[str, float]:
    """One run of `script` from `tree`: its rows, key -> ratio."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, ZMQDP_BENCH_DIR=out)
        subprocess.run(
            [sys.executable, str(tree / "benchmarks" / script), *args],
            check=True,
            env=env,
            cwd=tree,
            stdout=subprocess.DEVNULL,
        )
        rows: dict[str, float] = {}
        for saved in (Path(out) / "results").glob("*.json"):
            for row in json.loads(saved.read_text())["rows"]:
                rows[row["key"]] = row["ratio"]
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout of the old code")
    ap.add_argument("--after", type=Path, default=Path("."), help="checkout of the new code")
    ap.add_argument("--repeat", type=int, default=3, help="runs per checkout and script")
    ap.add_argument("scripts", nargs="+", help="benchmark scripts (names in benchmarks/)")
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    a = ap.parse_args(argv)
    trees = {"before": a.before.resolve(), "after": a.after.resolve()}
    for script in a.scripts:
        seen: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
        for i in range(a.repeat):
            for side, tree in trees.items():
                for key, ratio in run(tree, script, extra).items():
                    seen[side].setdefault(key, []).append(ratio)
                print(f"{script}: {side} run {i + 1}/{a.repeat} done", file=sys.stderr)
        for key in sorted(seen["before"].keys() & seen["after"].keys()):
            before = statistics.median(seen["before"][key])
            after = statistics.median(seen["after"][key])
            change = after / before if before else float("nan")
            print(
                f"{key:5} before {before:.3g} {sorted(round(r, 3) for r in seen['before'][key])}"
                f"  after {after:.3g} {sorted(round(r, 3) for r in seen['after'][key])}"
                f"  after/before {change:.3f}"
            )


if __name__ == "__main__":
    main()

"""What the benchmark scripts share: interleaved rounds, rows of the results table, plots.

These machines are noisy, so every figure is a *ratio* against a baseline measured in
the same process, in rounds that alternate between the two (the median of each side is
kept); absolute numbers are printed as context only. Each script can be run on its own
(`python benchmarks/bench_x.py [--quick]`) or by `benchmarks/run_all.py`, which collects
the rows each script saved under `benchmarks/results/` into `benchmarks/RESULTS.md`.

Where a run writes (`outputs()`): a full run saves its rows in `benchmarks/results/`
(untracked) and its plots in `benchmarks/plots/` (tracked, the ones RESULTS.md links);
a `--quick` run writes rows, plots and its table under `benchmarks/results/quick/`
(untracked), so a smoke run never touches the tracked figures; `ZMQDP_BENCH_DIR=DIR`
puts everything under DIR (the test suite's smoke run).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Outputs:
    """Where a run writes: its rows (JSON), its plots and `run_all.py`'s table."""

    results: Path
    plots: Path
    report: Path
    tracked: bool
    """True only for a full run into the checkout (RESULTS.md and plots/ are in git)."""


def outputs(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, here: Path = HERE
) -> Outputs:
    """The places of this run: `ZMQDP_BENCH_DIR` if set, else benchmarks/results/quick/
    for a `--quick` run (untracked), else benchmarks/ itself (a full run)."""
    argv = sys.argv[1:] if argv is None else argv
    env = os.environ if env is None else env
    if env.get("ZMQDP_BENCH_DIR"):
        base = Path(env["ZMQDP_BENCH_DIR"])
        return Outputs(base / "results", base / "plots", base / "RESULTS.md", tracked=False)
    if "--quick" in argv:
        quick = here / "results" / "quick"
        return Outputs(quick, quick / "plots", quick / "RESULTS.md", tracked=False)
    return Outputs(here / "results", here / "plots", here / "RESULTS.md", tracked=True)


OUTPUTS = outputs()
RESULTS = OUTPUTS.results
PLOTS = OUTPUTS.plots
sys.path.insert(0, str(HERE.parent))  # `zmqdp` from this checkout, `tests` helpers


@dataclass
class Row:
    """One row of the results table."""

    key: str
    """The row of the performance issue it answers (P1a, P2, ...)."""
    figure: str
    ratio: float
    target: str
    """Like "≥ 0.40" or "≤ 1.5"."""
    context: str
    """Absolute numbers behind the ratio (context only)."""

    @property
    def met(self) -> bool | None:
        """None for a row without a target (context only)."""
        if not self.target:
            return None
        op, _, value = self.target.partition(" ")
        bound = float(value.rstrip(" µsKB"))
        return self.ratio >= bound if op == "≥" else self.ratio <= bound


def interleave(rounds: int, **runs: Callable[[], float]) -> dict[str, list[float]]:
    """Run each callable once per round, alternating; every measurement, by name."""
    out: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            out[name].append(run())
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)


def pct(values: list[float], q: float) -> float:
    """The `q` quantile (0.99: p99) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def save(name: str, rows: list[Row], extra: dict[str, Any] | None = None) -> None:
    """Print the rows and save them in `RESULTS` (`outputs()`) for `run_all.py`."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"rows": [asdict(r) for r in rows], "extra": extra or {}}
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1))
    for r in rows:
        verdict = "met" if r.met else "NOT met"
        mark = "context" if r.met is None else f"target {r.target}, {verdict}"
        print(f"{r.key:4} {r.figure}: ratio {r.ratio:.3g} ({mark}); {r.context}")


def plain_numbers(axis: Any) -> None:
    """Tick labels as plain numbers: 0.01, 100, 1,000,000 (not 10^2, nor a 1e6 offset)."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.10g}"))


def plot(
    name: str,
    draw: Callable[[Any], None],
    title: str,
    size: tuple[float, float] = (6.4, 4.0),
    legend_outside: bool = False,
    directory: Path | None = None,
) -> Path | None:
    """Draw with matplotlib (the `bench` extra) into `<directory>/<name>.png` (default
    `PLOTS`, `outputs()`); `legend_outside`: the legend right of the axes (many series,
    or tall bars)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        print(f"(no plot {name}.png: pip install 'zmqdp[bench]' for matplotlib)")
        return None
    directory = PLOTS if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=size, dpi=100)
    draw(ax)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        if legend_outside:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        else:
            ax.legend()
    fig.tight_layout()
    path = directory / f"{name}.png"
    fig.savefig(path, bbox_inches="tight" if legend_outside else None)
    plt.close(fig)
    print(f"plot: {path}")
    return path

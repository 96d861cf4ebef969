"""Draw the plots of recorded results, without running a benchmark.

    .venv/bin/python benchmarks/replot.py [--table benchmarks/RESULTS.md] [--results DIR]
        [--plots DIR]

Two plots are drawn from the table's rows (RESULTS.md, tracked), so a fresh clone can
redraw them; `run_all.py` draws them from the rows it has just collected:

* plots/gateway_vs_peers.png: tokens/s and CPU µs per token of zmqdp's gateway (both
  servers) next to SMG's and vLLM's two frontends, from the S, V and R rows. Each peer
  is shown with the zmqdp figures measured in the same session (the S run and the V/R
  run are two sessions, so zmqdp's bars differ a little between them).
* plots/liveness.png: seconds from an engine's death to its rank reported down, for
  each case of the L rows, against the case's bound.

The other plots are drawn by the benchmark that measured them, and again here from its
saved results (`results/*.json`, untracked) when they hold what the plot needs:
gateway_cpu.png (bench_gateway.py), breakdown.png (bench_breakdown.py), p1_delivery.png,
p3_lockstep.png, p5_slow_rank.png and latency_cdf.png.

Legends and axes use the words of the docs (the server, the number of concurrent
requests, streaming or not), never a script's internal names.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from _harness import HERE, PLOTS, RESULTS, plain_numbers, plot

ZMQDP_SERVERS = {  # the row suffix -> the legend
    "a": "zmqdp serve, uvicorn (asyncio; the default)",
    "t": "zmqdp serve, hypercorn (trio)",
}
PEERS = {  # the row letter -> the legend of the gateway zmqdp's is compared with
    "S": "SMG (Rust)",
    "V": "vLLM's Python frontend",
    "R": "vLLM's Rust frontend",
}
PEER_TICKS = {"S": "SMG", "V": "vLLM Python", "R": "vLLM Rust"}
CONCURRENCY = (256, 32)
MODES = {"": "streaming", "j": "non-streaming"}

_NUM = r"([\d,]+(?:\.\d+)?)"
_S = re.compile(rf"{_NUM} vs {_NUM} tok/s; gateway CPU {_NUM} vs {_NUM} µs/token")
_VR_SSE = re.compile(rf"^{_NUM} vs {_NUM} tok/s; CPU {_NUM} vs {_NUM} µs/token")
_VR_JSON = re.compile(
    rf"non-streaming {_NUM} vs {_NUM} tok/s \(ratio [\d.]+\), {_NUM} vs {_NUM} µs/token"
)
_LIVE = re.compile(rf"median {_NUM} s, p90 {_NUM} s, max {_NUM} s \(bound {_NUM} s\)")


def _floats(match: re.Match[str] | None) -> list[float] | None:
    return None if match is None else [float(g.replace(",", "")) for g in match.groups()]


def table_rows(path: Path) -> dict[str, str]:
    """Row key -> its "absolute numbers" cell, from a RESULTS.md table."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        # | key | figure | ratio | target | met | at issue | absolute numbers |
        if len(cells) == 9 and cells[0] == "" and cells[-1] == "" and cells[1] != "row":
            rows[cells[1]] = cells[7]
    return rows


Pair = tuple[float, float]  # (zmqdp, peer)
"""A figure of zmqdp's gateway and of the peer it was measured against."""


def peer_figures(rows: Mapping[str, str]) -> dict[tuple[str, int, str, str], dict[str, Pair]]:
    """(peer, concurrency, mode, server) -> {"tok_s": pair, "cpu_us": pair}, from the S,
    V and R rows' absolute numbers (whichever are present)."""
    found: dict[tuple[str, int, str, str], dict[str, Pair]] = {}
    for c in CONCURRENCY:
        for server in ZMQDP_SERVERS:
            for mode in MODES:
                s = _floats(_S.search(rows.get(f"S{c}{server}{mode}", "")))
                if s is not None:
                    found["S", c, mode, server] = {"tok_s": (s[0], s[1]), "cpu_us": (s[2], s[3])}
            for peer in "VR":
                text = rows.get(f"{peer}{c}{server}", "")
                for mode, pattern in (("", _VR_SSE), ("j", _VR_JSON)):
                    v = _floats(pattern.search(text))
                    if v is not None:
                        found[peer, c, mode, server] = {
                            "tok_s": (v[0], v[1]),
                            "cpu_us": (v[2], v[3]),
                        }
    return found


def gateway_vs_peers(rows: Mapping[str, str], directory: Path = PLOTS) -> Path | None:
    """plots/gateway_vs_peers.png: one panel per figure (tokens/s, CPU per token) and
    concurrency; in each, a group of bars per peer and mode: the peer, then zmqdp's two
    servers measured in the same session."""
    found = peer_figures(rows)
    if not found:
        return None
    groups = [
        (peer, mode)
        for peer in PEERS
        for mode in MODES
        if any((peer, c, mode, s) in found for c in CONCURRENCY for s in ZMQDP_SERVERS)
    ]
    panels = [(figure, c) for figure in ("tok_s", "cpu_us") for c in CONCURRENCY]
    ylabels = {
        "tok_s": "tokens/s to the HTTP clients (higher is better)",
        "cpu_us": "gateway CPU µs per token (lower is better)",
    }
    peers = ", ".join(PEERS[p] for p in PEERS if any(g[0] == p for g in groups))
    series = [("peer", f"the other gateway (below each group: {peers})")]
    series += ZMQDP_SERVERS.items()
    colours = {"peer": "0.6", "a": "tab:blue", "t": "tab:orange"}

    def bar_of(key: str, peer: str, c: int, mode: str, figure: str) -> float:
        if key == "peer":  # the same peer figure sits in either server's row
            pairs = [found.get((peer, c, mode, s)) for s in ZMQDP_SERVERS]
            return next((p[figure][1] for p in pairs if p is not None), 0.0)
        pair = found.get((peer, c, mode, key))
        return 0.0 if pair is None else pair[figure][0]

    def draw(fig: Any, axes: Any) -> None:
        width = 0.8 / len(series)
        for ax, (figure, c) in zip(axes.flat, panels, strict=True):
            for i, (key, label) in enumerate(series):
                xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
                heights = [bar_of(key, p, c, m, figure) for p, m in groups]
                ax.bar(xs, heights, width, label=label, color=colours[key])
            ax.set_xticks(
                range(len(groups)),
                [f"{PEER_TICKS[p]}\n{MODES[m]}" for p, m in groups],
                fontsize=8,
            )
            plain_numbers(ax.yaxis)
            ax.set_title(f"{c} concurrent requests", fontsize=10)
            ax.set_ylabel(ylabels[figure], fontsize=8)
            ax.grid(True, axis="y", alpha=0.3)
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=1, fontsize=9)

    return _figure(
        "gateway_vs_peers",
        draw,
        "zmqdp's gateway and other gateways in front of the same fake vLLM engines\n"
        "(2 ranks, 64-token completions; the bars of a group were measured in one session)",
        directory,
        grid=(2, 2),
        size=(12.0, 8.5),
    )


LIVENESS_CASES = {  # the L row key's letters -> words
    "n": "native engines",
    "v": "vLLM engines",
    "k": "killed (kill -9)",
    "s": "frozen (SIGSTOP)",
    "i": "idle",
    "b": "busy",
}


def liveness(rows: Mapping[str, str], directory: Path = PLOTS) -> Path | None:
    """plots/liveness.png: per case, the median and worst time from an engine's death to
    its rank reported down, and the case's bound, on a log scale (a kill is seen in
    milliseconds, a frozen engine after the heartbeat timeout)."""
    cases = []
    for w in "nv":
        for f in "ks":
            for load in "ib":
                v = _floats(_LIVE.search(rows.get(f"L{w}{f}{load}", "")))
                if v is not None:
                    words = ", ".join(LIVENESS_CASES[x] for x in (w, f, load))
                    cases.append((words, *v))
    if not cases:
        return None
    reps = re.search(r"(\d+) reps", rows.get("Lnki", "") or rows.get("Lvki", ""))
    each = f" ({reps.group(1)} repetitions per case)" if reps else ""

    def draw(ax: Any) -> None:
        ys = list(range(len(cases)))[::-1]
        ax.barh(ys, [c[1] for c in cases], 0.6, label="median", color="tab:blue")
        ax.scatter([c[3] for c in cases], ys, marker="D", color="black", label="worst", zorder=3)
        ax.scatter(
            [c[4] for c in cases],
            ys,
            marker="|",
            s=400,
            color="tab:red",
            label="bound: 1 s for a kill,\nheartbeat timeout + 1 s\nfor a freeze",
            zorder=3,
        )
        ax.set_yticks(ys, [c[0] for c in cases], fontsize=8)
        ax.set_xscale("log")
        plain_numbers(ax.xaxis)
        ax.set_xlabel("seconds from the engine's death to its rank reported down")

    return plot(
        "liveness",
        draw,
        f"Liveness: when a dead engine's rank is reported down{each}",
        size=(8.0, 4.2),
        legend_outside=True,
        directory=directory,
    )


def _figure(
    name: str,
    draw: Callable[[Any, Any], None],
    title: str,
    directory: Path,
    grid: tuple[int, int],
    size: tuple[float, float],
) -> Path | None:
    """Like `_harness.plot`, for a figure of several panels with one legend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        print(f"(no plot {name}.png: pip install 'zmqdp[bench]' for matplotlib)")
        return None
    directory.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(*grid, figsize=size, dpi=100)
    draw(fig, axes)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    path = directory / f"{name}.png"
    fig.savefig(path)
    plt.close(fig)
    print(f"plot: {path}")
    return path


def from_rows(rows: Mapping[str, str], directory: Path = PLOTS) -> None:
    """The plots drawn from the table's rows (key -> absolute numbers)."""
    gateway_vs_peers(rows, directory)
    liveness(rows, directory)


def from_results(results: Path, directory: Path = PLOTS) -> None:
    """The benchmarks' own plots, from their saved results where these hold the data."""
    import bench_breakdown
    import bench_gateway
    import bench_lat_delivery_latency
    import bench_p1_delivery
    import bench_p3_lockstep
    import bench_p5_slow_rank

    bench_gateway.plot_stacks(results, directory)
    drawers: dict[str, Callable[[dict[str, Any], Path], None]] = {
        "breakdown": lambda extra, d: bench_breakdown.draw(extra.get("cells", {}), d),
        "p1_delivery": bench_p1_delivery.draw,
        "p3_lockstep": bench_p3_lockstep.draw,
        "p5_slow_rank": bench_p5_slow_rank.draw,
        "latency": bench_lat_delivery_latency.draw,
    }
    for name, draw in drawers.items():
        path = results / f"{name}.json"
        if path.exists():
            try:
                draw(json.loads(path.read_text())["extra"], directory)
            except KeyError as exc:  # results saved before the plot's data was
                print(f"(no plot from {path.name}: it has no {exc})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plots", type=Path, default=PLOTS)
    args = parser.parse_args()
    from_rows(table_rows(args.table), args.plots)
    from_results(args.results, args.plots)


if __name__ == "__main__":
    main()

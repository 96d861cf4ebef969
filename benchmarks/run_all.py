"""Run every benchmark and write the results table.

    .venv/bin/python benchmarks/run_all.py [--quick] [--table-only] [--out FILE]

(`python3 dev.py bench` does this in the project's virtualenv, with the `bench` extra.)
Each script runs in a process of its own and saves its rows under benchmarks/results/;
this collects them into a markdown table (one row per figure of the performance issue:
the ratio, its target, whether it is met, and the absolute numbers behind it), draws the
plots made from the table's rows (`replot.py`: the gateway against its peers, liveness)
and lists the plots.

Only a full run in which every script succeeded (or `--table-only`) writes the tracked
benchmarks/RESULTS.md. `--quick` runs short versions, for a smoke test (their figures
are noisier), and writes rows, plots and table under benchmarks/results/quick/ (not
tracked); a full run with a failed script writes its table to
benchmarks/results/RESULTS.md (not tracked). The file written is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import replot  # noqa: E402
from _harness import OUTPUTS, PLOTS, RESULTS, Row  # noqa: E402

SCRIPTS = [
    "bench_p1_delivery.py",
    "bench_p2_submit.py",
    "bench_p3_lockstep.py",
    "bench_p4_memory.py",
    "bench_p5_slow_rank.py",
    "bench_p6_selection.py",
    "bench_lat_delivery_latency.py",
    "bench_gateway.py",
    "bench_breakdown.py",
    "bench_v1_vllm_delivery.py",
    "bench_vs_vllm.py",
    "bench_liveness.py",
    "bench_prefix.py",
]
ORDER = ["P1a", "P1a'", "P1b", "P2", "P3", "P4", "P6", "lat", "P5", "P5ll", "P5u", "V1"]
ORDER += ["P7a", "P7b", "P7cpu", "P7c"]  # bench_vs_vllm.py: zmqdp ÷ vLLM's own DP client
ORDER += ["G32t", "G256t", "G32a", "G256a"]  # bench_gateway.py: HTTP ÷ direct (context)
# bench_gateway.py: zmqdp's gateway ÷ SMG (t: trio, a: asyncio; j: non-streaming JSON)
ORDER += [f"S{c}{x}{f}{j}" for x in "ta" for c in (256, 32) for f in ("", "cpu") for j in ("", "j")]
ORDER += ["V32t", "V256t", "V256tcpu", "V32a", "V256a", "V256acpu"]  # ÷ vLLM's Python frontend
ORDER += ["R32t", "R256t", "R256tcpu", "R256tcpuj", "R32a", "R256a", "R256acpu", "R256acpuj"]
# bench_breakdown.py: zmqdp serve's CPU µs per token (its table follows the rows)
ORDER += [f"B{c}{x}{j}" for x in "ta" for c in (256, 32) for j in ("", "j")]
# bench_liveness.py: death -> DOWN, max ÷ bound (native/vllm, kill/stop, idle/busy)
ORDER += [f"L{w}{f}{load}" for w in "nv" for f in "ks" for load in "ib"]
# bench_prefix.py (native mock, vLLM fakes) and bench_prefix_real.py (`dev.py realvllm`):
# prefix affinity's cached fraction ÷ ideal, TTFT p50 ÷ least-loaded (heavy, control), balance
ORDER += [f"P{w}{x}" for w in "nvR" for x in "htcb"]
ISSUE = {  # the figure as the performance issue measured it on the main it was filed on
    "P1a": "0.24",
    "P1b": "1.4 (2.0)",
    "P2": "0.21",
    "P3": "0.66",
    "P4": "1.1 KB",
    "P6": "147 µs",
    "lat": "2.4",
    "P5": "0.87",
    # issue 34 (zmqdp ÷ vLLM's DP client: two runs on 362b651; issue 21 had filed P7a
    # 0.55, P7b 1.03, P7cpu 1.81, P7c 1.13-1.30):
    "P7a": "1.02-1.13",
    "P7b": "1.04-1.35",
    "P7cpu": "0.89-1.00",
    "P7c": "1.59-2.02",
    # issue 34: the gateway ÷ SMG (S), ÷ vLLM's Python frontend (V) and Rust one (R), and
    # its CPU µs per token (B), measured with py-spy on main at 362b651
    **{"S256t": "0.56", "S256tj": "0.64", "S256a": "0.82", "S256aj": "0.92"},
    **{"S256tcpu": "2.17", "S256acpu": "1.49", "S32tcpu": "4.45", "S32acpu": "2.78"},
    **{"V256t": "1.32", "V256a": "1.99", "V256tcpu": "0.74", "V256acpu": "0.49"},
    **{"R256tcpu": "2.75", "R256acpu": "1.85", "R256tcpuj": "4.34", "R256acpuj": "2.57"},
    **{"B256t": "48 µs", "B256a": "33 µs", "B32t": "141 µs", "B32a": "85 µs"},
    # issue 20: no DOWN 9 s after a kill -9 of an idle engine, 53 s after a SIGSTOP; a
    # busy one was seen after silence_timeout (30 s). As ratios to the bounds:
    **{f"L{w}ki": "> 9" for w in "nv"},
    **{f"L{w}kb": "30" for w in "nv"},
    **{f"L{w}si": "> 13" for w in "nv"},
    **{f"L{w}sb": "7.5" for w in "nv"},
}


def run(quick: bool) -> list[str]:
    failed = []
    for script in SCRIPTS:
        cmd = [sys.executable, str(HERE / script), *(["--quick"] if quick else [])]
        print(f"+ {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        if subprocess.run(cmd, cwd=HERE).returncode != 0:
            failed.append(script)
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    return failed


def table(quick: bool, out: Path) -> str:
    rows = {}
    sections = []  # a script's own table (its saved "markdown"), after the rows
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        for row in data["rows"]:
            rows[row["key"]] = row
        if data.get("extra", {}).get("markdown"):
            sections.append(data["extra"]["markdown"])
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, "
        f"{'quick runs (noisy)' if quick else 'full runs'}, with "
        "`python benchmarks/run_all.py`. Each ratio is against a baseline run in the same "
        "process (interleaved rounds, medians); P4, P6 and the B rows (µs) are absolute. "
        "`at issue`: the figure when its issue was filed (issue 34's for P7, S, V, R, B).",
        "",
        "| row | figure | ratio | target | met | at issue | absolute numbers |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in ORDER:
        r = rows.get(key)
        if r is None:
            lines.append(f"| {key} | (not run) | | | | {ISSUE.get(key, '')} | |")
            continue
        met = Row(**r).met
        lines.append(
            f"| {key} | {r['figure']} | {r['ratio']:.3g} | {r['target']} | "
            f"{'' if met is None else 'yes' if met else 'no'} | {ISSUE.get(key, '')} | "
            f"{r['context']} |"
        )
    for section in sections:
        lines += ["", section]
    replot.from_rows({key: row["context"] for key, row in rows.items()}, PLOTS)
    plots = sorted(PLOTS.glob("*.png"))
    links = [f"[{p.name}]({Path(os.path.relpath(p, out.parent)).as_posix()})" for p in plots]
    lines += ["", "Plots: " + ", ".join(links), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write the table (default: benchmarks/RESULTS.md after a complete "
        "full run, benchmarks/results/quick/RESULTS.md with --quick)",
    )
    parser.add_argument(
        "--table-only", action="store_true", help="rebuild the table from the saved results"
    )
    args = parser.parse_args()
    failed = [] if args.table_only else run(args.quick)
    out = args.out or report_path(failed)
    text = table(args.quick, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# Benchmark results\n\n" + text)
    print(text)
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    print(f"table: {out}; rows: {RESULTS}; plots: {PLOTS}")
    if args.out is None and not OUTPUTS.tracked:
        print("(the tracked benchmarks/RESULTS.md and plots/ are left alone)")
    elif args.out is None and failed:
        print("(a partial run: the tracked benchmarks/RESULTS.md is left alone)")
    return 1 if failed else 0


def report_path(failed: list[str]) -> Path:
    """The tracked RESULTS.md only for a full run in which every script succeeded."""
    if OUTPUTS.tracked and failed:
        return RESULTS / "RESULTS.md"
    return OUTPUTS.report


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark scripts still run (`benchmarks/run_all.py --quick`), so they do not rot
between the runs that produce benchmarks/RESULTS.md. Nothing here looks at a figure:
performance is measured by the scripts, never asserted by tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_every_benchmark_runs_and_reports_its_rows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra: pip install -e '.[bench]'")
    pytest.importorskip("hypercorn", reason="the gateway extra: pip install -e '.[gateway]'")
    out = tmp_path / "RESULTS.md"
    env = {**os.environ, "ZMQDP_BENCH_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = out.read_text()
    gateway = ("G32t", "G256t", "G32a", "G256a")  # bench_gateway.py
    liveness = ("Lnki", "Lnsb", "Lvki", "Lvsb")  # bench_liveness.py (of its 8)
    vs_vllm = ("P7a", "P7b", "P7cpu", "P7c")  # bench_vs_vllm.py (skipped without .venv-vllm)
    prefix = ("Pnh", "Pnt", "Pnc", "Pnb", "Pvh", "Pvt", "Pvc", "Pvb")  # bench_prefix.py
    rows = ("P1a", "P1b", "P2", "P3", "P4", "P5", "P6", "lat", "V1", *gateway, *liveness, *vs_vllm)
    rows += prefix
    for row in rows:
        assert f"| {row} |" in text and f"| {row} | (not run)" not in text, row
    assert len(list((tmp_path / "plots").glob("*.png"))) >= 5
    assert (tmp_path / "plots" / "liveness.png").exists()  # drawn from the table's L rows
    # every benchmark's plot can be drawn again from what its run saved
    replots = tmp_path / "replots"
    results = ["--results", str(tmp_path / "results"), "--plots", str(replots)]
    again = subprocess.run(
        [sys.executable, str(BENCHMARKS / "replot.py"), "--table", str(out), *results],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    drawn = {p.name for p in replots.glob("*.png")}
    for name in ("p1_delivery", "p3_lockstep", "p5_slow_rank", "latency_cdf", "liveness"):
        assert f"{name}.png" in drawn, (name, again.stdout)


def test_the_comparison_plots_come_from_the_tracked_table(tmp_path: Path) -> None:
    """plots/gateway_vs_peers.png and plots/liveness.png need no results file: every S, V
    and R row of benchmarks/RESULTS.md gives both figures of both sides."""
    pytest.importorskip("matplotlib", reason="the bench extra: pip install -e '.[bench]'")
    _load("_harness")
    replot = _load("replot")
    rows = replot.table_rows(BENCHMARKS / "RESULTS.md")
    found = replot.peer_figures(rows)
    # 3 peers x 2 concurrencies x 2 modes x zmqdp's 2 servers, each with tokens/s and CPU
    assert len(found) == 24, sorted(found)
    assert found["S", 256, "", "t"] == {"tok_s": (29539, 37145), "cpu_us": (34.0, 23.4)}
    assert found["R", 256, "j", "a"] == {"tok_s": (40532, 35778), "cpu_us": (20, 9)}
    assert replot.gateway_vs_peers(rows, tmp_path) == tmp_path / "gateway_vs_peers.png"
    assert replot.liveness(rows, tmp_path) == tmp_path / "liveness.png"
    assert replot.gateway_vs_peers({}, tmp_path / "none") is None  # no rows, no plot


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # run_all imports _harness by name
    spec.loader.exec_module(module)
    return module


def test_only_a_full_run_writes_the_tracked_results(tmp_path: Path) -> None:
    """`dev.py bench --quick` must not overwrite benchmarks/RESULTS.md and plots/ (issue 23)."""
    harness = _load("_harness")
    here = tmp_path / "benchmarks"
    full = harness.outputs([], {}, here)
    assert full.tracked
    assert (full.results, full.plots, full.report) == (
        here / "results",
        here / "plots",
        here / "RESULTS.md",
    )
    quick = harness.outputs(["--quick", "--rounds", "2"], {}, here)
    assert not quick.tracked
    for path in (quick.results, quick.plots, quick.report):
        assert path.is_relative_to(here / "results" / "quick")  # results/ is ignored
    ignored = (BENCHMARKS.parent / ".gitignore").read_text().split()
    assert "benchmarks/results/" in ignored
    smoke = harness.outputs(["--quick"], {"ZMQDP_BENCH_DIR": str(tmp_path)}, here)
    assert (smoke.results, smoke.plots, smoke.report) == (
        tmp_path / "results",
        tmp_path / "plots",
        tmp_path / "RESULTS.md",
    )

    run_all = _load("run_all")
    run_all.OUTPUTS, run_all.RESULTS = full, full.results
    assert run_all.report_path([]) == here / "RESULTS.md"
    assert run_all.report_path(["bench_p2_submit.py"]) == here / "results" / "RESULTS.md"
    run_all.OUTPUTS = quick
    assert run_all.report_path([]) == quick.report

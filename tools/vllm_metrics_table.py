"""Print the table of vLLM's ``vllm:`` metric families, read from vLLM's own source.

    python3 tools/vllm_metrics_table.py [SITE-PACKAGES/vllm] > tests/data/vllm_metrics.json

Reads `v1/metrics/loggers.py` (`PrometheusStatLogger.__init__`) and
`v1/metrics/buckets.py` with `ast`: vLLM is not imported (importing it takes 30 s and a
torch install), so it runs with any Python. For each family: its name, type
(counter, gauge, histogram), label names, and buckets (a list, or
``"1-2-5 to max_model_len"`` for the token counts vLLM sizes from the model).
tests/real_vllm/test_metrics_table.py checks the committed table against the installed
vLLM; tests/test_vllm_metrics.py checks the gateway's ``/metrics`` against the table.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TYPES = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}
BASE_LABELS = ["model_name", "engine"]


def find_vllm() -> Path | None:
    """vLLM's package directory in `$ZMQDP_REAL_VLLM` (a virtualenv) or .venv-vllm/."""
    for venv in (os.environ.get("ZMQDP_REAL_VLLM"), ROOT / ".venv-vllm"):
        if venv:
            found = sorted(glob.glob(f"{venv}/lib/python3.*/site-packages/vllm/v1/metrics"))
            if found:
                return Path(found[-1]).parents[1]
    return None


def _buckets(source: str) -> dict[str, Any]:
    """bucket family key -> bounds (buckets.py's `_STATIC_FAMILY_DEFAULTS`)."""
    tree = ast.parse(source)
    constants: dict[str, Any] = {}
    families: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if not isinstance(target, ast.Name) or node.value is None:
                continue
            if target.id == "_STATIC_FAMILY_DEFAULTS":
                assert isinstance(node.value, ast.Dict)
                for key, value in zip(node.value.keys, node.value.values, strict=True):
                    assert isinstance(key, ast.Constant) and isinstance(value, ast.Name)
                    families[key.value] = constants[value.id]
            else:
                with contextlib.suppress(ValueError, TypeError, SyntaxError):
                    constants[target.id] = [float(v) for v in ast.literal_eval(node.value)]
    families["request_tokens"] = "1-2-5 to max_model_len"
    return families


def _labels(node: ast.expr) -> list[str] | None:
    """A `labelnames=` expression: `labelnames`, `labelnames + [...]`, a list of
    strings; None for what cannot be read statically (LoRA's attribute names)."""
    if isinstance(node, ast.Name) and node.id == "labelnames":
        return list(BASE_LABELS)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _labels(node.left), _labels(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.List):
        out = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        return out if len(out) == len(node.elts) else None
    return None


def table(vllm: Path) -> list[dict[str, Any]]:
    buckets = _buckets((vllm / "v1/metrics/buckets.py").read_text())
    tree = ast.parse((vllm / "v1/metrics/loggers.py").read_text())
    [cls] = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PrometheusStatLogger"
    ]
    [init] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    variables: dict[str, str] = {}  # xxx_buckets = histogram_buckets("family", ...)
    out = []
    for node in ast.walk(init):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "histogram_buckets"
        ):
            first = node.value.args[0]
            assert isinstance(first, ast.Constant)
            variables[node.targets[0].id] = first.value
    for node in ast.walk(init):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        kind = TYPES.get(node.func.attr)
        if kind is None:
            continue
        kw = {k.arg: k.value for k in node.keywords}
        name = kw["name"]
        assert isinstance(name, ast.Constant)
        family: dict[str, Any] = {
            "name": name.value,
            "type": kind,
            "labels": _labels(kw["labelnames"]) if "labelnames" in kw else None,
        }
        if kind == "histogram":
            bucket = kw["buckets"]
            assert isinstance(bucket, ast.Name)
            family["buckets"] = buckets[variables[bucket.id]]
        out.append(family)
    # `log_metrics_info`'s info gauge (labels: every CacheConfig field)
    out.append({"name": "vllm:cache_config_info", "type": "gauge", "labels": None})
    return sorted(out, key=lambda f: f["name"])


def main() -> None:
    vllm = Path(sys.argv[1]) if len(sys.argv) > 1 else find_vllm()
    if vllm is None:
        raise SystemExit("no vLLM found: give the path of vLLM's package directory")
    json.dump(table(vllm), sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

"""The shipped Grafana dashboard (docs/grafana/zmqdp-gateway.json, made by
tools/grafana_dashboard.py with Grafana's Python SDK): a dashboard Grafana's schema
accepts, and one whose every query names only series the gateway exports (a renamed
series would leave a panel empty with no error anywhere)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client", reason="needs the gateway extra")

from .gateway_helpers import Metrics
from .test_gateway_openai import mock_gateway

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs/grafana/zmqdp-gateway.json"
SERIES = re.compile(r"\b(?:zmqdp_|process_|vllm:)[a-zA-Z0-9_:]+")
PANEL_TYPES = {"row", "stat", "timeseries", "state-timeline"}


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]


def test_the_dashboard_has_the_shape_grafana_loads() -> None:
    """Schema version, variables, a grid of 24 columns, and panels whose every query
    has an expression, a unique refId and the dashboard's data source variable."""
    d = _dashboard()
    assert d["uid"] == "zmqdp-gateway" and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= set(variables)
    kinds = set()
    for panel in d["panels"]:
        kinds.add(panel["type"])
        grid = panel["gridPos"]
        assert all(type(grid[k]) is int and grid[k] >= 0 for k in "xywh"), panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    assert kinds == PANEL_TYPES


async def test_every_query_names_only_series_the_gateway_exports() -> None:
    """Each series a panel queries is on a gateway's /metrics page (a mock gateway
    after one answer), and each query selects by the dashboard's job and instance."""
    async with mock_gateway() as (client, _app):
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert response.status_code == 200
        metrics = Metrics((await client.get("/metrics")).text)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    exported = {  # (a family with no series yet, disconnects by route, counts too)
        family.name + suffix
        for family in metrics.families.values()
        for suffix in suffixes.get(family.type, ("",))
    }
    queries = _queries(_dashboard())
    named = {name for q in queries for name in SERIES.findall(q)}
    assert named and named <= exported, sorted(named - exported)
    assert all('job=~"$job", instance=~"$instance"' in q for q in queries)


def _subset(small: Any, big: Any, path: str = "") -> list[str]:
    """Where `small` is not part of `big` (a map's keys and values, recursively)."""
    if isinstance(small, dict) and isinstance(big, dict):
        out = []
        for k, v in small.items():
            out += [f"{path}/{k} missing"] if k not in big else _subset(v, big[k], f"{path}/{k}")
        return out
    if isinstance(small, list) and isinstance(big, list) and len(small) == len(big):
        return [
            e
            for i, (a, b) in enumerate(zip(small, big, strict=True))
            for e in _subset(a, b, f"{path}[{i}]")
        ]
    return [] if small == big else [f"{path}: {small!r} != {big!r}"]


def test_grafanas_schema_models_keep_every_field_of_the_dashboard() -> None:
    """Read by Grafana's SDK (models generated from Grafana's dashboard schema, its
    panel and Prometheus query plugins registered) and written back, the dashboard
    loses no field and changes no value: every key is one the schema knows. And the
    generator still builds exactly the committed file. Needs `grafana-foundation-sdk`
    (not a test dependency: tools/grafana_dashboard.py says how to install it)."""
    pytest.importorskip("grafana_foundation_sdk")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    committed = _dashboard()
    back = json.loads(json.dumps(Dashboard.from_json(committed), cls=JSONEncoder))
    assert _subset(committed, back) == []
    spec = importlib.util.spec_from_file_location("gd", ROOT / "tools/grafana_dashboard.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.render() == DASHBOARD.read_text()

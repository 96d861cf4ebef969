"""The gateway's ``vllm:`` metrics against vLLM 0.32's own (issue 35 §3): the same
family names, types, label names and histogram buckets as vLLM's `PrometheusStatLogger`,
from a table read out of vLLM's source (tests/data/vllm_metrics.json, made by
tools/vllm_metrics_table.py; tests/real_vllm/test_metrics_table.py checks it against an
installed vLLM), and values computed as vLLM's frontend computes them, from the fake
engines' events, prefill stats and scheduler stats (tests/fakes/vllm.py)."""

from __future__ import annotations

import json
import math
import re
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client", reason="needs the gateway extra")
pytest.importorskip("tokenizers", reason="the vllm extra (tokenizers)")

from zmqdp._core.metrics import build_1_2_5_buckets
from zmqdp.gateway import VllmFrontend, create_app
from zmqdp.vllm.stats import EngineStats

from .gateway_helpers import Metrics
from .test_gateway import serving
from .test_vllm_group import vllm_group

MODEL = Path(__file__).parent / "data" / "tiny-model"
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings
TABLE = {
    f["name"]: f for f in json.loads((Path(__file__).parent / "data/vllm_metrics.json").read_text())
}

NOT_EXPORTED = {
    "vllm:admission_rejections",
    "vllm:cache_config_info",
    "vllm:corrupted_requests",
    "vllm:kv_block_idle_before_evict_seconds",
    "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_reuse_gap_seconds",
    "vllm:lora_requests_info",
    "vllm:mm_cache_hits",
    "vllm:mm_cache_queries",
    "vllm:num_requests_kv_fetch_by_stage",
    "vllm:watermark_requests",
}
"""vLLM's families the gateway leaves out, each for the reason docs/guides/metrics.md
gives (a test there keeps the two lists equal)."""

VLLM_DASHBOARD = {
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
}
"""The series vLLM's example Grafana dashboard queries
(examples/observability/prometheus_grafana/grafana.json in vLLM's repository)."""

PROMPTS = ["x", "hello", "a b c", "zz"]


async def _scrape(n: int = 2, **app_kw: Any) -> tuple[Metrics, list[dict[str, Any]]]:
    """`PROMPTS` through a gateway with vLLM's names over `n` fake vLLM engines, half
    streamed; the /metrics page after, and the usage of each answer."""
    usages = []
    async with vllm_group(n) as (group, _fake):
        app = create_app(
            group=group,
            frontend=VllmFrontend(MODEL),
            model="tiny",
            vllm_metric_names=True,
            **app_kw,
        )
        async with serving(app) as client:
            for i, prompt in enumerate(PROMPTS):
                body = {"prompt": prompt, "max_tokens": 5 + i, "temperature": 0}
                if i % 2:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        lines = [line async for line in response.aiter_lines() if line]
                    usages.append(json.loads(lines[-2].removeprefix("data: "))["usage"])
                else:
                    response = await client.post("/v1/completions", json=body)
                    assert response.status_code == 200, response.text
                    usages.append(response.json()["usage"])
            metrics = Metrics((await client.get("/metrics")).text)
    return metrics, usages


def _buckets(family: Any) -> dict[str, list[float]]:
    """engine -> finite bucket bounds of a histogram family."""
    out: dict[str, list[float]] = {}
    for s in family.samples:
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf":
            out.setdefault(s.labels["engine"], []).append(float(s.labels["le"]))
    return out


async def test_the_vllm_families_have_vllms_names_types_labels_and_buckets() -> None:
    """Every family of vLLM's table but `NOT_EXPORTED` is on the page, with vLLM's type,
    label names and buckets (the token counts' 1-2-5 up to the model's length), with a
    series per engine (the DP rank) from the start, as vLLM's; and nothing else
    ``vllm:`` is. Before issue 35 the page had 11 of them, request_success and the token
    series without an ``engine`` label, and other buckets."""
    metrics, _ = await _scrape()
    exported = {name for name in metrics.families if name.startswith("vllm:")}
    assert exported == set(TABLE) - NOT_EXPORTED
    for name in exported:
        family, want = metrics.families[name], TABLE[name]
        assert family.type == want["type"], name
        labels = {frozenset(s.labels) - {"le"} for s in family.samples}
        assert labels == {frozenset(want["labels"])}, name
        if want["labels"][:2] == ["model_name", "engine"]:
            assert {s.labels["engine"] for s in family.samples} == {"0", "1"}, name
            assert {s.labels["model_name"] for s in family.samples} == {"tiny"}, name
        if family.type == "histogram":
            bounds = want["buckets"]
            if bounds == "1-2-5 to max_model_len":
                bounds = list(build_1_2_5_buckets(MAX_MODEL_LEN))
            assert _buckets(family) == {"0": bounds, "1": bounds}, name


async def test_vllms_own_dashboard_finds_every_series_it_queries() -> None:
    """vLLM's example dashboard works on the gateway as it is: each series it queries
    is on the page, by ``model_name``."""
    metrics, _ = await _scrape(1)
    exported = {s.name for f in metrics.families.values() for s in f.samples}
    assert exported >= VLLM_DASHBOARD, sorted(VLLM_DASHBOARD - exported)


def test_the_guide_lists_exactly_the_families_left_out() -> None:
    """docs/guides/metrics.md's "Not exported" table names `NOT_EXPORTED`, each with a
    reason, and its other tables name every family that is exported."""
    guide = (Path(__file__).resolve().parents[1] / "docs/guides/metrics.md").read_text()
    exported_part, _, left_out = guide.partition("### Not exported")
    left_out = left_out.partition("\n## ")[0]
    rows = re.findall(r"^\| `(vllm:[a-z0-9_:]+)` \| (.+) \|$", left_out, re.MULTILINE)
    assert {name for name, _ in rows} == NOT_EXPORTED
    assert all(len(reason) > 20 for _, reason in rows)
    named = set(re.findall(r"`(vllm:[a-z0-9_:]+)`", exported_part))
    assert named >= set(TABLE) - NOT_EXPORTED


def _total(metrics: Metrics, name: str, suffix: str = "", **labels: str) -> float:
    return sum(
        s.value
        for s in metrics.samples(name, suffix)
        if all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_the_values_are_counted_as_vllms_frontend_counts_them() -> None:
    """Per request and per step, from the engines' reports: every finished request has
    its queue, prefill, decode and inference time and its preemptions observed once;
    every output but a request's first one inter-token latency; the generation tokens,
    prompt tokens and tokens per step add up to the answers' usage; the prefix cache
    was queried for every prompt token (the fakes cache nothing)."""
    metrics, usages = await _scrape()
    n = len(PROMPTS)
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert _total(metrics, "vllm:request_success", "_total") == n
    assert _total(metrics, "vllm:request_success", "_total", finished_reason="length") == n
    for name in (
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_num_preemptions",
        "vllm:request_time_per_output_token_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_params_n",
        "vllm:request_params_max_tokens",
    ):
        assert _total(metrics, name, "_count") == n, name
    assert _total(metrics, "vllm:request_params_max_tokens", "_sum") == sum(5 + i for i in range(n))
    # the fakes emit one token per step: an inter-token latency for each token but the first
    assert _total(metrics, "vllm:inter_token_latency_seconds", "_count") == generated - n
    assert _total(metrics, "vllm:generation_tokens", "_total") == generated
    assert _total(metrics, "vllm:request_generation_tokens", "_sum") == generated
    assert _total(metrics, "vllm:prompt_tokens", "_total") == prompt
    assert (
        _total(metrics, "vllm:prompt_tokens_by_source", "_total", source="local_compute") == prompt
    )
    assert _total(metrics, "vllm:request_prefill_kv_computed_tokens", "_sum") == prompt
    assert _total(metrics, "vllm:iteration_tokens_total", "_sum") == prompt + generated
    assert _total(metrics, "vllm:prefix_cache_queries", "_total") == prompt
    assert _total(metrics, "vllm:prefix_cache_hits", "_total") == 0
    assert _total(metrics, "vllm:num_preemptions", "_total") == 0
    awake = metrics.samples("vllm:engine_sleep_state")
    assert {(s.labels["sleep_state"], s.value) for s in awake} == {
        ("awake", 1.0),
        ("weights_offloaded", 0.0),
        ("discard_all", 0.0),
    }


async def test_params_max_tokens_is_the_max_tokens_the_engine_got() -> None:
    """`vllm:request_params_max_tokens` observes the request's `max_tokens` as vLLM's
    frontend sent it to the engine (lowered to the room the prompt leaves), not the
    client's: 10 prompt tokens and max_tokens 60 with engines of 64 observe 54 (before,
    60; and a chat that gives none observed the gateway's placeholder of 4096)."""
    async with vllm_group(1, fake_kw={"max_model_len": 64}) as (group, fake):
        app = create_app(
            group=group, frontend=VllmFrontend(MODEL), model="tiny", vllm_metric_names=True
        )
        async with serving(app) as client:
            body = {"prompt": list(range(10, 20)), "max_tokens": 60}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            metrics = Metrics((await client.get("/metrics")).text)
    assert [a[3]["max_tokens"] for a in fake.engines[0].got("add")] == [54]
    assert _total(metrics, "vllm:request_params_max_tokens", "_sum") == 54


def _out(
    rid: str, tokens: int, finish: int | None = None, events: Any = None, prefill: Any = None
) -> Any:
    return types.SimpleNamespace(
        request_id=rid,
        new_token_ids=[7] * tokens,
        finish_reason=finish,
        events=events,
        prefill_stats=prefill,
    )


def test_the_phases_of_a_request_are_vllms_intervals_between_engine_clocks() -> None:
    """QUEUED at 1.0, SCHEDULED at 1.5, first token at 2.0, preempted, tokens at 2.1 and
    2.4 (the last finishing it): queue 0.5, prefill 0.5, decode 0.4, inference 0.9,
    time per output token 0.2, inter-token latencies 0.1 and 0.3, one preemption (vLLM's
    `IterationStats.update_from_finished_request`)."""
    stats = EngineStats(max_model_len=100)
    events = [{"type": 1, "timestamp": 1.0}, {"type": 2, "timestamp": 1.5}]
    prefill = {"num_prompt_tokens": 10, "num_computed_tokens": 6, "num_cached_tokens": 4}
    stats.add("a")
    stats.step(0, 2.0, [_out("a", 1, events=events, prefill=prefill)], None)
    stats.step(0, 2.1, [_out("a", 1, events=[{"type": 3, "timestamp": 2.05}])], None)
    stats.step(0, 2.4, [_out("a", 1, finish=1, events=[{"type": 2, "timestamp": 2.3}])], None)
    r = stats.rank(0)

    def one(h: Any) -> float:
        snap = h.snapshot()
        assert snap.count == 1
        return round(snap.sum, 9)

    assert one(r.queue_time) == 0.5 and one(r.prefill_time) == 0.5
    assert one(r.decode_time) == 0.4 and one(r.inference_time) == 0.9
    assert one(r.time_per_output_token) == 0.2 and one(r.num_preemptions) == 1
    assert one(r.prefill_kv_computed) == 6  # 10 prompt tokens, 4 of them cached
    itl = r.inter_token_latency.snapshot()
    assert (itl.count, round(itl.sum, 9)) == (2, 0.4)
    assert r.preemptions == 1 and r.generation_tokens == 3
    assert r.prompt_tokens == 10 and r.prompt_tokens_cached == 4
    assert r.iteration_tokens.snapshot().sum == 6 + 3  # computed prompt tokens + new tokens
    assert not stats._requests  # a finished request's state is dropped


def test_an_aborted_request_is_forgotten_and_junk_stats_count_as_absent() -> None:
    """An abort drops the request's state, and its late outputs are not counted (as
    those of a request never added); stats of the wrong types never raise."""
    stats = EngineStats()
    for rid in "abc":
        stats.add(rid)
    stats.step(0, 1.0, [_out("a", 1)], None)
    stats.forget(["a"])
    stats.step(0, 2.0, [_out("a", 1, 1), _out("z", 5, 1)], None)
    assert stats.rank(0).generation_tokens == 1
    assert stats.rank(0).queue_time.snapshot().count == 0
    junk: Any = {"num_running_reqs": "x", "kv_cache_usage": None, "prefix_cache_stats": [1]}
    stats.step(1, "t", [_out("b", 0, 2, events="e", prefill=5), _out("c", 1, events=[3, {}])], junk)
    r = stats.rank(1)
    assert (r.reports, r.running, r.kv_cache_usage, r.prefix_cache_queries) == (1, 0, 0.0, 0)
    assert r.generation_tokens == 1 and set(stats._requests) == {"c"}


def test_an_engines_junk_clock_never_makes_a_histogram_sum_go_down() -> None:
    """Timestamps from a hostile or broken engine (a clock that goes back, NaN, an
    event after the output it precedes) make no negative or NaN observation: each
    histogram's sum is a Prometheus counter, and before, an inter-token latency of
    -4 s made it go down (a counter reset to every dashboard) and NaN poisoned it."""
    stats = EngineStats(max_model_len=100)
    stats.add("a")
    nan = float("nan")
    r = stats.rank(0)
    histograms = [v for v in vars(r).values() if hasattr(v, "snapshot")]
    steps: list[tuple[Any, Any]] = [
        (5.0, _out("a", 1, events=[{"type": 1, "timestamp": 9.0}, {"type": 2, "timestamp": nan}])),
        (1.0, _out("a", 1)),  # the clock went back
        (nan, _out("a", 1)),
        (float("inf"), _out("a", 1, finish=0, events=[{"type": 2, "timestamp": 7.0}])),
    ]
    sums = [0.0] * len(histograms)
    for timestamp, output in steps:
        stats.step(0, timestamp, [output], None)
        now = [h.snapshot().sum for h in histograms]
        assert all(math.isfinite(x) and x >= before for x, before in zip(now, sums, strict=True))
        sums = now
    assert r.queue_time.snapshot().count == 1 and r.inter_token_latency.snapshot().count == 3


def test_real_engines_reports_decode_into_vllms_values() -> None:
    """Messages captured from real vLLM 0.32 engine cores (tests/data/
    vllm_capture_v0320_dense.json: per rank, a 3-token prompt, 3 tokens, LENGTH): the
    events (maps of type and timestamp) and PrefillStats (a map, 12th field) are read,
    and the request's phases are the differences of the engine's own timestamps."""
    import msgspec

    from zmqdp.vllm.codec import decode_outputs_with_stats

    capture = json.loads((Path(__file__).parent / "data/vllm_capture_v0320_dense.json").read_text())
    stats = EngineStats(max_model_len=512)
    stats.add("r0")
    stats.add("r1")
    for rank, messages in capture["outputs"].items():
        for message in messages:
            batch = decode_outputs_with_stats([msgspec.msgpack.encode(message)], stats, int(rank))
            assert batch.rank == int(rank)
        r = stats.rank(int(rank))
        [first, _, last, _] = messages
        queued, scheduled = (e["timestamp"] for e in first[1][0][7])
        assert r.queue_time.snapshot().sum == pytest.approx(scheduled - queued)
        assert r.prefill_time.snapshot().sum == pytest.approx(first[3] - scheduled)
        assert r.decode_time.snapshot().sum == pytest.approx(last[3] - first[3])
        assert r.inter_token_latency.snapshot().count == 2
        assert (r.prompt_tokens, r.generation_tokens, r.reports) == (3, 3, 4)
        assert r.prefill_kv_computed.snapshot().sum == 3
        assert r.iteration_tokens.snapshot().sum == 3 + 3
    assert not stats._requests


async def test_without_vllm_names_the_engines_stats_are_not_decoded() -> None:
    """The decoder reads events and prefill stats only for a gateway that exports
    ``vllm:`` names: any other group pays nothing per token for them."""
    async with vllm_group(1) as (group, _fake):
        create_app(group=group, frontend=VllmFrontend(MODEL))
        assert group._wire.stats is None  # type: ignore[attr-defined]
        app = create_app(group=group, frontend=VllmFrontend(MODEL), vllm_metric_names=True)
        assert group._wire.stats is app.collector.engine_stats is not None  # type: ignore[attr-defined]

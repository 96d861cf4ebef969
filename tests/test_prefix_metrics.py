"""`routing="prefix"`'s options and what it reports: `ConnectOptions` checks,
`GroupStatistics.prefix` as JSON, and the gateway's ``zmqdp_prefix_*`` families."""

from __future__ import annotations

import pytest

from zmqdp.values import ConnectOptions, PrefixStatistics

metrics = pytest.importorskip("zmqdp.gateway.metrics")

STATS = PrefixStatistics(
    routed=10,
    hits=7,
    cached_tokens=700,
    prompt_tokens=1000,
    blocks=50,
    rank_blocks=(30, 20),
    exact_ranks=(1,),
    kv_events={"stored": 40, "Removed": 3, "bad name!": 5},
)


def test_the_options_take_prefix_routing_and_a_bool_kv_events() -> None:
    assert ConnectOptions(routing="prefix").kv_events is True
    assert ConnectOptions(routing="prefix", kv_events=False).kv_events is False
    with pytest.raises(ValueError, match="'least-loaded', 'speed' or 'prefix'"):
        ConnectOptions(routing="round-robin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_events must be a bool"):
        ConnectOptions(kv_events=1)  # type: ignore[arg-type]


def test_prefix_statistics_are_json() -> None:
    data = STATS  # (frozen, JSON-safe through GroupStatistics.to_json)
    from zmqdp.values import _json

    assert _json(data) == {
        "routed": 10,
        "hits": 7,
        "cached_tokens": 700,
        "prompt_tokens": 1000,
        "blocks": 50,
        "rank_blocks": [30, 20],
        "exact_ranks": [1],
        "kv_events": {"stored": 40, "Removed": 3, "bad name!": 5},
    }


def test_the_gateway_exports_the_prefix_families() -> None:
    collector = metrics.GatewayCollector(lambda: None, lambda: None, metrics.HTTPCounters())
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector._prefix(STATS)
        for s in family.samples
    }
    assert samples[("zmqdp_prefix_requests_total", ())] == 10
    assert samples[("zmqdp_prefix_hits_total", ())] == 7
    assert samples[("zmqdp_prefix_cached_tokens_total", ())] == 700
    assert samples[("zmqdp_prefix_prompt_tokens_total", ())] == 1000
    assert samples[("zmqdp_prefix_blocks", (("rank", "0"),))] == 30
    assert samples[("zmqdp_prefix_exact", (("rank", "1"),))] == 1
    assert samples[("zmqdp_prefix_exact", (("rank", "0"),))] == 0
    assert samples[("zmqdp_prefix_kv_events_stored_total", ())] == 40
    assert samples[("zmqdp_prefix_kv_events_removed_total", ())] == 3
    assert not any("bad" in name for name, _ in samples)  # no name a peer could shape

"""The gateway's Prometheus collector: its counters never go down."""

from __future__ import annotations

import dataclasses
import types

import pytest

pytest.importorskip("prometheus_client", reason="needs the gateway extra")

from zmqdp import RankState
from zmqdp._core.messages import Load
from zmqdp._core.metrics import HistogramSnapshot
from zmqdp.gateway.metrics import GatewayCollector, HTTPCounters
from zmqdp.values import RankStatistics

EMPTY = HistogramSnapshot((1.0,), (0, 0), 0.0, 0)
RANK = RankStatistics(
    rank=0,
    state=RankState.UP,
    inflight=0,
    load=Load(),
    batches=0,
    protocol_errors=0,
    queued=0,
    cap=None,
    ttft=EMPTY,
    latency=EMPTY,
)


def scrape(collector: GatewayCollector, batches: int, errors: int) -> tuple[float, float]:
    """zmqdp_rank_batches_total and zmqdp_rank_protocol_errors_total of rank 0 at one
    scrape, the rank's own counts being `batches` and `errors`."""
    rank = dataclasses.replace(RANK, batches=batches, protocol_errors=errors)
    found = {}
    for family in collector._ranks(types.SimpleNamespace(ranks=(rank,))):  # type: ignore[arg-type]
        for sample in family.samples:
            found[sample.name] = sample.value
    return found["zmqdp_rank_batches_total"], found["zmqdp_rank_protocol_errors_total"]


def test_a_rank_restart_never_makes_a_counter_go_down() -> None:
    """A rank's own counts restart with each incarnation (200 batches, then 0 after a
    restart inside a live gateway); the exported counters carry on from 200. They used
    to drop to 0, which Prometheus and aiperf read as a counter reset."""
    collector = GatewayCollector(lambda: None, lambda: None, HTTPCounters())
    seen = [scrape(collector, b, e) for b, e in [(150, 1), (200, 3), (0, 0), (5, 1), (0, 0)]]
    assert seen == [(150, 1), (200, 3), (200, 3), (205, 4), (205, 4)]

"""`to_json()` of `GroupStatistics`, `RankStatistics`, `GroupHealth` (and the
histograms they hold): JSON-safe dicts a gateway can serve as they are."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import trio

from tests.helpers import READY_TIMEOUT, collect
from zmqdp import (
    EngineGroup,
    GroupHealth,
    GroupStatistics,
    HistogramSnapshot,
    Load,
    RankState,
    RankStatistics,
    Request,
)
from zmqdp.mock import MockConfig, run_mock_group


def _round_trip(data: object) -> object:
    """Through strict JSON (no NaN, no Infinity) and back."""
    return json.loads(json.dumps(data, allow_nan=False))


async def test_statistics_and_health_of_a_real_mock_group_round_trip(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_mock_group, url, MockConfig(engines=2, step_time=0.001))
            async with EngineGroup.connect(
                url, 2, ready_timeout=READY_TIMEOUT, max_inflight=4
            ) as group:
                for i in range(6):
                    outs = await collect(group, Request(f"r{i}", {"max_tokens": 3}))
                    assert outs[-1].finish == "length"
                stats = group.statistics()
                health = group.health()
            nursery.cancel_scope.cancel()

    data = stats.to_json()
    assert _round_trip(data) == data
    assert set(data) == {f.name for f in dataclasses.fields(GroupStatistics)}
    assert data["submitted"] == data["finished"] == 6 and data["lockstep"] is False
    assert data["wave"] is None
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for rank, stat in zip(data["ranks"], stats.ranks, strict=True):
        assert set(rank) == {f.name for f in dataclasses.fields(RankStatistics)}
        assert rank["state"] == "up" and rank["cap"] == 4
        assert set(rank["load"]) == {"waiting", "running", "kv"}
        for name in ("ttft", "latency"):
            snap: HistogramSnapshot = getattr(stat, name)
            assert rank[name] == {
                "buckets": list(snap.buckets),
                "counts": list(snap.counts),
                "sum": snap.sum,
                "count": snap.count,
            }
            assert len(rank[name]["counts"]) == len(rank[name]["buckets"]) + 1
    assert sum(r["latency"]["count"] for r in data["ranks"]) == 6

    h = health.to_json()
    assert _round_trip(h) == h
    assert h == {
        "live": True,
        "ready": True,
        "draining": False,
        "ranks_up": 2,
        "size": 2,
        "inflight": 0,
        "room": 8,
        "recovering": False,
    }


def test_what_json_has_no_form_for_becomes_none() -> None:
    empty = HistogramSnapshot((1.0,), (0, 0), 0.0, 0)
    rank = RankStatistics(
        rank=3,
        state=RankState.DOWN,
        inflight=0,
        load=Load(waiting=1, running=2, kv=math.nan),  # NaN: unknown
        batches=0,
        protocol_errors=0,
        queued=0,
        cap=None,
        ttft=empty,
        latency=HistogramSnapshot((1.0,), (0, 1), math.inf, 1),
    )
    data = rank.to_json()
    assert _round_trip(data) == data
    assert data["state"] == "down" and data["cap"] is None
    assert data["load"] == {"waiting": 1, "running": 2, "kv": None}
    assert data["latency"]["sum"] is None and data["ttft"]["counts"] == [0, 0]
    health = GroupHealth(False, False, True, 0, 4, 0, None)
    assert health.to_json()["room"] is None

"""The chaos soak (tests/soak.py), short: a few hundred requests against a mock group
that is killed, frozen and restarted while the client restarts too. The long run is
`scripts/soak.py` (>= 10 000 requests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .soak import SoakConfig, soak


@pytest.mark.timeout_s(120)
@pytest.mark.parametrize("seed", [1, 2])
async def test_a_short_chaos_soak_ends_every_request_once_and_crosses_nothing(
    tmp_path: Path, seed: int
) -> None:
    report = await soak(f"ipc://{tmp_path}/g", SoakConfig(requests=300, seed=seed, deadline=90))
    assert report.violations() == []
    endings = report.endings()
    assert sum(endings.values()) == 300
    assert endings.get("finished", 0) > 0  # the group served between the blows
    assert all(report.chaos.get(k, 0) >= 1 for k in ("kill", "freeze", "client"))

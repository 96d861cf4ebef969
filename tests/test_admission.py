"""What a gateway needs from `EngineGroup`: admission control, waiting for room,
request deadlines, drain and health, over real sockets (ScriptedEngines hold requests
until told to finish them).

The sans-IO rules behind them (no pick past a cap, exactly the due requests expire)
are property-tested in tests/models/lifecycle.py and tests/core/test_routing.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from zmqdp import (
    EngineGroup,
    GroupClosed,
    GroupDraining,
    Outcome,
    Overloaded,
    Request,
    RequestTimeout,
)
from zmqdp.engine import Abort, Add
from zmqdp.mock import MockConfig, run_mock_group

from .helpers import READY_TIMEOUT, group_of, wait_until

HOLD = {"hold": True}


def adds(engine: object) -> list[str]:
    """Application ids of the ADDs an engine got, in order."""
    return [m.id.rpartition("#")[0] for m in engine.inbox if isinstance(m, Add)]  # type: ignore[attr-defined]


def aborted(engine: object) -> list[str]:
    return [i for m in engine.inbox if isinstance(m, Abort) for i in m.ids]  # type: ignore[attr-defined]


async def test_a_submit_past_the_cap_raises_overloaded_and_keeps_nothing(
    tmp_path: Path,
) -> None:
    async with group_of(tmp_path, 2, max_inflight=1) as (group, engines):
        a = group.submit(Request("a", HOLD))
        b = group.submit(Request("b", HOLD))
        assert {a.rank, b.rank} == {0, 1}
        with pytest.raises(Overloaded, match="every up rank is at its in-flight cap"):
            group.submit(Request("c", HOLD))
        with pytest.raises(Overloaded, match=r"rank 1 is at its in-flight cap \(1\)") as info:
            group.submit(Request("d", HOLD, rank=1))
        assert (info.value.rank, info.value.cap, info.value.request_id) == (1, 1, "d")
        st = group.statistics()
        assert st.overloaded == 2 and st.submitted == 2
        assert [r.inflight for r in st.ranks] == [1, 1] and [r.cap for r in st.ranks] == [1, 1]
        await engines[a.rank].wait_for(lambda: engines[a.rank].holds("a"))
        await engines[a.rank].finish("a")
        async with a:
            assert [o.body async for o in a] == ["done"]
        c = group.submit(Request("c", HOLD))  # room again, on the rank that freed it
        assert c.rank == a.rank


async def test_wait_submit_admits_waiters_in_arrival_order(tmp_path: Path) -> None:
    async with group_of(tmp_path, 1, max_inflight=1) as (group, [engine]):
        group.submit(Request("first", HOLD))
        streams: dict[str, object] = {}

        async def wait(rid: str) -> None:
            streams[rid] = await group.wait_submit(Request(rid, HOLD))

        async with trio.open_nursery() as nursery:
            for i, rid in enumerate(["w1", "w2", "w3"]):
                nursery.start_soon(wait, rid)
                await wait_until(lambda k=i + 1: group.statistics().waiting == k)
            for rid in ["first", "w1", "w2"]:
                await engine.wait_for(lambda rid=rid: engine.holds(rid))
                await engine.finish(rid)
        await engine.wait_for(lambda: engine.holds("w3"))
        assert adds(engine) == ["first", "w1", "w2", "w3"]
        assert group.statistics().waiting == 0 and group.statistics().overloaded == 0


async def test_a_cancelled_wait_submit_submits_nothing(tmp_path: Path) -> None:
    async with group_of(tmp_path, 1, max_inflight=1) as (group, [engine]):
        group.submit(Request("first", HOLD))
        with trio.move_on_after(0.05) as scope:
            await group.wait_submit(Request("late", HOLD))
        assert scope.cancelled_caught
        assert group.statistics().waiting == 0
        await engine.wait_for(lambda: engine.holds("first"))
        await engine.finish("first")
        second = await group.wait_submit(Request("second", HOLD))  # no queue: at once
        await engine.wait_for(lambda: engine.holds("second"))
        assert adds(engine) == ["first", "second"] and second.rank == 0


async def test_a_request_past_its_deadline_is_aborted_on_its_rank(tmp_path: Path) -> None:
    async with group_of(tmp_path, 1, request_timeout=30.0) as (group, [engine]):
        async with group.submit(Request("slow", HOLD, timeout=0.2)) as stream:
            with pytest.raises(RequestTimeout, match=r"rank 0, request 'slow'.*0\.2 s") as info:
                async for _ in stream:
                    pass
        assert info.value.timeout == 0.2 and stream.outcome is Outcome.TIMED_OUT
        await engine.wait_for(lambda: aborted(engine) == [engine.wire("slow")])
        st = group.statistics()
        assert st.timed_out == 1 and st.ranks[0].inflight == 0


async def test_the_group_request_timeout_applies_to_requests_without_their_own(
    tmp_path: Path,
) -> None:
    async with group_of(tmp_path, 1, request_timeout=0.1) as (group, _):
        async with group.submit(Request("held", HOLD)) as stream:
            with pytest.raises(RequestTimeout):
                await stream.receive()
        assert await group.submit(Request("quick", "x")).receive_batch()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1", True])
async def test_a_bad_timeout_is_an_invalid_request(tmp_path: Path, bad: object) -> None:
    async with group_of(tmp_path, 1) as (group, _):
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            group.submit(Request("r", None, timeout=bad))  # type: ignore[arg-type]
        assert group.statistics().ranks[0].inflight == 0


async def test_drain_takes_nothing_new_and_closes_once_the_last_request_ends(
    tmp_path: Path,
) -> None:
    async with group_of(tmp_path, 1, max_inflight=1) as (group, [engine]):
        held = group.submit(Request("held", HOLD))
        waiter_error: list[BaseException] = []

        async def waiter() -> None:
            try:
                await group.wait_submit(Request("waiter", HOLD))
            except GroupDraining as exc:
                waiter_error.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await wait_until(lambda: group.statistics().waiting == 1)
            nursery.start_soon(group.drain)
            await wait_until(lambda: group.draining)
            health = group.health()
            assert (health.live, health.ready, health.draining, health.inflight) == (
                True,
                False,
                True,
                1,
            )
            with pytest.raises(GroupDraining, match="draining"):
                group.submit(Request("new", None))
            await wait_until(lambda: bool(waiter_error))
            await engine.wait_for(lambda: engine.holds("held"))
            await engine.finish("held")  # the last live request ends: drain returns
        assert group.closed is not None and not group.health().live
        async with held:
            assert [o.body async for o in held] == ["done"]  # it finished, not aborted
        assert adds(engine) == ["held"]


async def test_drain_aborts_what_is_left_at_its_timeout(tmp_path: Path) -> None:
    async with group_of(tmp_path, 1) as (group, [engine]):
        async with group.submit(Request("stuck", HOLD)) as stream:
            await engine.wait_for(lambda: engine.holds("stuck"))
            await group.drain(timeout=0.1)
            with pytest.raises(GroupClosed, match=r"1 request.*still live after 0\.1 s"):
                await stream.receive()
        await engine.wait_for(lambda: aborted(engine) == [engine.wire("stuck")])


async def test_health_counts_up_ranks_and_room(tmp_path: Path) -> None:
    async with group_of(tmp_path, 2, max_inflight=3) as (group, _):
        group.submit(Request("a", HOLD))
        health = group.health()
        assert (health.live, health.ready, health.ranks_up, health.size) == (True, True, 2, 2)
        assert (health.inflight, health.room) == (1, 5)
    async with group_of(tmp_path / "uncapped", 1) as (group, _):
        assert group.health().room is None


async def test_max_inflight_info_caps_each_rank_at_its_max_num_seqs(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_mock_group, url, MockConfig(engines=2, max_num_seqs=3))
        async with EngineGroup.connect(
            url, 2, ready_timeout=READY_TIMEOUT, max_inflight="info"
        ) as group:
            assert [r.cap for r in group.statistics().ranks] == [3, 3]
            streams = [
                group.submit(Request(f"r{i}", {"prompt": [1], "max_tokens": 2})) for i in range(6)
            ]
            with pytest.raises(Overloaded):
                group.submit(Request("r6", {"prompt": [1], "max_tokens": 2}))
            for s in streams:
                async with s:
                    assert len([o async for o in s]) == 2
            st = group.statistics()
            assert sum(r.ttft.count for r in st.ranks) == 6
            assert sum(r.latency.count for r in st.ranks) == 6
            assert all(r.ttft.sum <= r.latency.sum for r in st.ranks)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("bad", [0, -2, 1.5, "many"])
async def test_a_bad_max_inflight_is_refused(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="max_inflight must be"):
        async with EngineGroup.connect(f"ipc://{tmp_path}/g", 1, max_inflight=bad):  # type: ignore[arg-type]
            pass

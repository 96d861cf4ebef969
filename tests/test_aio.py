"""`zmqdp.aio`: the `EngineGroup` API on asyncio and uvloop, trio running as a guest.

Every test runs under both `asyncio.run` and `uvloop.run` (the `run` fixture), with an
`asyncio.timeout` around its body. The engines run in a trio run of their own, in
another thread (`EngineThread`, tests/fakes/threaded.py), so the loop under test never
runs them and a blocked loop does not block them; the test sees them through the
snapshots they publish (`View`) and drives them from a worker thread.

No test waits on the clock to synchronize: waits are on engine snapshots or, for state
the trio side changes in its own steps, a check at every turn of the loop
(`wait_until`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.fakes.threaded import RUNNERS, EngineThread, Run, loop_runner, url_in, wait_until
from zmqdp import (
    CallFailed,
    CallTimeout,
    DuplicateRequestId,
    EngineDead,
    GroupClosed,
    GroupDraining,
    HandshakeTimeout,
    InvalidRank,
    Outcome,
    Overloaded,
    RankState,
    Request,
    RequestAborted,
    RequestTimeout,
)
from zmqdp.aio import AsyncioEngineGroup, AsyncioRequestStream
from zmqdp.engine import Add, Output
from zmqdp.mock import MockConfig

from .helpers import READY_TIMEOUT

HOLD = {"hold": True}

run = pytest.fixture(params=sorted(RUNNERS), name="run")(loop_runner)


# -- asyncio helpers ----------------------------------------------------------------------


@asynccontextmanager
async def aio_group(engines: EngineThread, n: int, **kw: Any) -> AsyncIterator[AsyncioEngineGroup]:
    engines.attach()
    async with AsyncioEngineGroup.connect(
        engines.url, n, ready_timeout=READY_TIMEOUT, **kw
    ) as group:
        yield group


async def collect(group: AsyncioEngineGroup, request: Request) -> list[Any]:
    async with group.submit(request) as stream:
        return [out.body async for out in stream]


# -- tests ----------------------------------------------------------------------------------


def test_a_group_streams_outputs_to_asyncio_consumers(tmp_path: Path, run: Run) -> None:
    with EngineThread(url_in(tmp_path), 2) as engines:

        async def main() -> None:
            async with aio_group(engines, 2) as group:
                assert (group.size, group.lockstep, group.draining, group.closed) == (
                    2,
                    False,
                    False,
                    None,
                )
                assert [e.info["rank"] for e in group.engines] == [0, 1]
                assert all(e.state is RankState.UP for e in group.engines)
                stream = group.submit(Request("r1", {"tokens": 5}))
                assert type(stream) is AsyncioRequestStream
                async with stream:
                    outs = [out async for out in stream]
                assert [o.body for o in outs] == [0, 1, 2, 3, 4]
                assert outs[-1].finish == "length" and stream.outcome is Outcome.FINISHED
                assert stream.rank in (0, 1) and stream.wire_id.startswith("r1#")
                async with group.submit(Request("r2", "echo")) as echo:
                    assert [o.body for o in await echo.receive_batch()] == ["echo"]
                    with pytest.raises(trio.EndOfChannel):
                        await echo.receive()
                    with pytest.raises(trio.EndOfChannel):
                        echo.receive_nowait()
                    with pytest.raises(trio.EndOfChannel):
                        echo.drain_nowait()
                bodies = await asyncio.gather(
                    *(collect(group, Request(f"c{i}", {"tokens": 3})) for i in range(20))
                )
                assert bodies == [[0, 1, 2]] * 20
                st = group.statistics()
                assert (st.submitted, st.finished, st.aborted, st.fallbacks) == (22, 22, 0, 0)
                assert group.health().ready
                with pytest.raises(RuntimeError, match="already active in this thread"):
                    async with AsyncioEngineGroup.connect(f"{engines.url}2", 1):
                        pass
            assert not trio.lowlevel.in_trio_run()  # leaving the block ended the guest run

        run(main)


def test_submit_raises_synchronously_and_a_closed_group_refuses(tmp_path: Path, run: Run) -> None:
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            async with aio_group(engines, 1, max_inflight=1) as group:
                held = group.submit(Request("a", HOLD))
                with pytest.raises(DuplicateRequestId):
                    group.submit(Request("a", HOLD))
                with pytest.raises(Overloaded, match=r"rank 0 is at its in-flight cap \(1\)"):
                    group.submit(Request("b", HOLD, rank=0))
                with pytest.raises(Overloaded, match="every up rank is at its in-flight cap"):
                    group.submit(Request("b", HOLD))
                with pytest.raises(InvalidRank):
                    group.submit(Request("c", HOLD, rank=3))
                st = group.statistics()
                assert (st.submitted, st.overloaded, st.ranks[0].inflight) == (1, 2, 1)
                with pytest.raises(RuntimeError, match="another thread"):
                    await asyncio.to_thread(group.submit, Request("d", None))
                await engines.wait_for(0, lambda v: v.holds("a"))
            assert group.closed is not None and not group.health().live
            with pytest.raises(GroupClosed, match="closed") as info:
                group.submit(Request("late", None))
            assert info.value.request_id == "late"
            with pytest.raises(GroupClosed):
                await group.wait_submit(Request("late", None))
            with pytest.raises(GroupClosed):
                await group.call(0, "echo")
            await group.drain()  # closed: returns at once
            await group.abort("a")  # ended: a no-op
            with pytest.raises(GroupClosed):
                await held.receive()
            view = await engines.wait_for(0, lambda v: bool(v.aborted()))  # §9
            assert view.aborted() == [view.wire("a")] and view.adds() == ["a"]

        run(main)


def test_a_cancelled_read_keeps_the_request_and_leaving_aborts_it_once(
    tmp_path: Path, run: Run
) -> None:
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            async with aio_group(engines, 1) as group:
                async with group.submit(Request("a", HOLD)) as stream:
                    wire = (await engines.wait_for(0, lambda v: v.holds("a"))).wire("a")
                    reader = asyncio.create_task(stream.receive())
                    await asyncio.sleep(0)  # the reader runs and waits
                    reader.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await reader
                    with pytest.raises(TimeoutError):
                        async with asyncio.timeout(0.05):
                            async for _ in stream:
                                pass
                    assert stream.outcome is None and group.health().inflight == 1
                    await engines.emit(0, Output(wire, "still here", None))
                    assert (await stream.receive()).body == "still here"
                view = await engines.wait_for(0, lambda v: bool(v.aborted()))
                assert view.aborted() == [wire] and stream.outcome is Outcome.ABORTED
                await stream.__aexit__(None, None, None)  # leaving again does nothing
                assert group.statistics().aborted == 1

                entered = asyncio.Event()

                async def consume() -> None:
                    async with group.submit(Request("b", HOLD)) as s:
                        entered.set()
                        async for _ in s:
                            pass

                task = asyncio.create_task(consume())
                await entered.wait()
                wire_b = (await engines.wait_for(0, lambda v: v.holds("b"))).wire("b")
                task.cancel()  # cancelled inside the stream's block
                with pytest.raises(asyncio.CancelledError):
                    await task
                # A request sent after them reaches the engine after any second ABORT would
                assert await collect(group, Request("c", "x")) == ["x"]
                view = await engines.wait_for(0, lambda v: "c" in v.adds())
                assert view.aborted() == [wire, wire_b]
                st = group.statistics()
                assert (st.aborted, st.ranks[0].inflight) == (2, 0)

        run(main)


def test_abort_ends_a_stream_with_request_aborted(tmp_path: Path, run: Run) -> None:
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            async with aio_group(engines, 1) as group:
                async with group.submit(Request("a", HOLD)) as stream:
                    wire = (await engines.wait_for(0, lambda v: v.holds("a"))).wire("a")
                    with pytest.raises(trio.WouldBlock):
                        stream.receive_nowait()
                    assert stream.drain_nowait() == []
                    reader = asyncio.create_task(stream.receive())
                    await asyncio.sleep(0)  # the reader runs and waits
                    with pytest.raises(trio.BusyResourceError):
                        await stream.receive()
                    await group.abort("a")
                    with pytest.raises(RequestAborted, match="'a'"):
                        await reader
                await group.abort("a")  # ended: a no-op
                await group.abort("never-sent")
                assert await collect(group, Request("c", "x")) == ["x"]
                view = await engines.wait_for(0, lambda v: "c" in v.adds())
                assert view.aborted() == [wire]

        run(main)


def test_wait_submit_admits_in_arrival_order_and_a_cancelled_waiter_submits_nothing(
    tmp_path: Path, run: Run
) -> None:
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            async with aio_group(engines, 1, max_inflight=1) as group:
                group.submit(Request("first", HOLD))
                waiters = {}
                for k, rid in enumerate(["w1", "w2", "w3"], 1):
                    waiters[rid] = asyncio.create_task(group.wait_submit(Request(rid, HOLD)))
                    await wait_until(lambda k=k: group.statistics().waiting == k)
                waiters["w2"].cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiters["w2"]
                assert group.statistics().waiting == 2  # its trio waiter went with it
                await engines.wait_for(0, lambda v: v.holds("first"))
                await engines.finish(0, "first")
                assert (await waiters["w1"]).request_id == "w1"
                await engines.wait_for(0, lambda v: v.holds("w1"))
                await engines.finish(0, "w1")
                assert (await waiters["w3"]).request_id == "w3"
                view = await engines.wait_for(0, lambda v: v.holds("w3"))
                assert view.adds() == ["first", "w1", "w3"]
                st = group.statistics()
                assert (st.waiting, st.overloaded) == (0, 0)

        run(main)


def test_a_waiter_cancelled_as_it_is_admitted_leaves_no_request_behind(
    tmp_path: Path, run: Run
) -> None:
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            async with aio_group(engines, 1, max_inflight=1) as group:
                async with group.submit(Request("first", HOLD)):
                    waiter = asyncio.create_task(group.wait_submit(Request("w", HOLD)))
                    await wait_until(lambda: group.statistics().waiting == 1)
                    waiter.cancel()  # the caller is cancelled and, in the same turn...
                # ...leaving `first`'s block frees its slot: the group admits "w" at once
                with pytest.raises(asyncio.CancelledError):
                    await waiter
                view = await engines.wait_for(0, lambda v: len(v.aborted()) == 2)
                assert view.adds() == ["first", "w"]
                assert view.aborted() == [view.wire("first"), view.wire("w")]
                health = group.health()
                assert (health.inflight, group.statistics().aborted) == (0, 2)

        run(main)


def test_a_request_past_its_deadline_raises_request_timeout(tmp_path: Path, run: Run) -> None:
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            loop = asyncio.get_running_loop()
            async with aio_group(engines, 1, request_timeout=30.0) as group:
                start = loop.time()
                async with group.submit(Request("slow", HOLD, timeout=0.2)) as stream:
                    with pytest.raises(RequestTimeout, match=r"'slow'.*0\.2 s"):
                        async for _ in stream:
                            pass
                # The dispatcher was parked up to 1 s ahead; the submit, made from asyncio,
                # moved its deadline to 0.2 s and woke the guest.
                assert 0.19 <= loop.time() - start < 0.8
                assert stream.outcome is Outcome.TIMED_OUT
                view = await engines.wait_for(0, lambda v: bool(v.aborted()))
                assert view.aborted() == [view.wire("slow")]
                assert group.statistics().timed_out == 1

        run(main)


def test_a_submit_from_asyncio_reaches_the_engine_at_once(tmp_path: Path, run: Run) -> None:
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            async with aio_group(engines, 1) as group:
                delays = []
                for i in range(10):
                    sent = time.monotonic()
                    group.submit(Request(f"r{i}", HOLD))
                    view = await engines.wait_for(0, lambda v, i=i: f"r{i}" in v.adds())
                    index = next(
                        k
                        for k, m in enumerate(view.inbox)
                        if isinstance(m, Add) and m.id.startswith(f"r{i}#")
                    )
                    delays.append(view.times[index] - sent)
                # Nothing else wakes the guest: its I/O wait has a timeout of up to 1 s.
                assert max(delays) < 0.25, delays

        run(main)


def test_drain_takes_nothing_new_and_closes_once_the_last_request_ends(
    tmp_path: Path, run: Run
) -> None:
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            async with aio_group(engines, 1, max_inflight=1) as group:
                held = group.submit(Request("held", HOLD))
                waiter = asyncio.create_task(group.wait_submit(Request("waiter", HOLD)))
                await wait_until(lambda: group.statistics().waiting == 1)
                with pytest.raises(TimeoutError):  # cancelled: still draining, nothing lost
                    async with asyncio.timeout(0.05):
                        await group.drain()
                assert group.draining and group.closed is None
                with pytest.raises(GroupDraining):
                    await waiter
                with pytest.raises(GroupDraining):
                    group.submit(Request("new", None))
                health = group.health()
                assert (health.live, health.ready, health.draining, health.inflight) == (
                    True,
                    False,
                    True,
                    1,
                )
                drain = asyncio.create_task(group.drain())
                await engines.wait_for(0, lambda v: v.holds("held"))
                await engines.finish(0, "held")  # the last live request ends: drain returns
                await drain
                assert group.closed is not None and not group.health().live
                async with held:
                    assert [o.body async for o in held] == ["done"]  # finished, not aborted
                view = engines.views[0]
                assert view.adds() == ["held"] and view.aborted() == []

        run(main)


def test_drain_aborts_what_is_left_at_its_timeout(tmp_path: Path, run: Run) -> None:
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            async with aio_group(engines, 1) as group:
                async with group.submit(Request("stuck", HOLD)) as stream:
                    await engines.wait_for(0, lambda v: v.holds("stuck"))
                    await group.drain(timeout=0.1)
                    with pytest.raises(GroupClosed, match=r"1 request.*still live after 0\.1 s"):
                        await stream.receive()
                view = await engines.wait_for(0, lambda v: bool(v.aborted()))
                assert view.aborted() == [view.wire("stuck")]

        run(main)


def test_call_runs_a_utility_method(tmp_path: Path, run: Run) -> None:
    with EngineThread(url_in(tmp_path), 2) as engines:

        async def main() -> None:
            async with aio_group(engines, 2) as group:
                assert await group.call(1, "echo", 1, "two") == [1, "two"]
                with pytest.raises(CallFailed, match="no method nope"):
                    await group.call(0, "nope")
                with pytest.raises(InvalidRank):
                    await group.call(2, "echo")
                with pytest.raises(CallTimeout):
                    await group.call(0, "echo", timeout=0)
                results = await asyncio.gather(*(group.call(i % 2, "echo", i) for i in range(10)))
                assert results == [[i] for i in range(10)]
                await group.wait_rank_state(1, RankState.UP)  # it is: at once
                with pytest.raises(InvalidRank):
                    await group.wait_rank_state(5, RankState.UP)

        run(main)


def test_an_engine_dying_mid_stream_ends_it_with_engine_dead(tmp_path: Path, run: Run) -> None:
    with EngineThread(url_in(tmp_path), 2) as engines:

        async def main() -> None:
            async with aio_group(engines, 2, silence_timeout=0.5) as group:
                async with group.submit(Request("r", HOLD, rank=0)) as stream:
                    wire = (await engines.wait_for(0, lambda v: v.holds("r"))).wire("r")
                    await engines.emit(0, Output(wire, "first", None))
                    assert (await stream.receive()).body == "first"
                    await engines.kill(0)
                    with pytest.raises(EngineDead, match="rank 0") as info:
                        await stream.receive()
                assert info.value.rank == 0 and stream.outcome is Outcome.FAILED
                await group.wait_rank_state(0, RankState.DOWN)
                assert group.engines[0].state is RankState.DOWN
                async with group.submit(Request("s", "x")) as other:
                    assert [o.body async for o in other] == ["x"] and other.rank == 1

        run(main)


def test_a_handshake_timeout_is_one_plain_exception_and_leaves_nothing(
    tmp_path: Path, run: Run
) -> None:
    async def main() -> None:
        with pytest.raises(HandshakeTimeout) as info:
            async with AsyncioEngineGroup.connect(url_in(tmp_path), 2, ready_timeout=0.2):
                pytest.fail("connected without engines")
        assert type(info.value) is HandshakeTimeout and sorted(info.value.missing) == [0, 1]
        assert not trio.lowlevel.in_trio_run()  # the guest run has ended
        assert not list(tmp_path.iterdir())  # noqa: ASYNC240 (tmp_path, instant)  its sockets are closed and their files gone

    run(main)


def test_cancelled_while_connecting_it_cancels_the_trio_side(tmp_path: Path, run: Run) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                async with AsyncioEngineGroup.connect(url_in(tmp_path), 1, ready_timeout=30):
                    pytest.fail("connected without engines")
        assert loop.time() - start < 5
        assert not trio.lowlevel.in_trio_run()
        assert not list(tmp_path.iterdir())  # noqa: ASYNC240 (tmp_path, instant)
        current = asyncio.current_task()
        assert current is not None and current.cancelling() == 0

    run(main)


def test_an_error_in_the_block_passes_out_unchanged(tmp_path: Path, run: Run) -> None:
    with EngineThread(url_in(tmp_path), 1) as engines:

        async def main() -> None:
            with pytest.raises(ExceptionGroup) as info:
                async with aio_group(engines, 1) as group:
                    stream = group.submit(Request("a", HOLD))
                    await engines.wait_for(0, lambda v: v.holds("a"))
                    raise ExceptionGroup("mine", [ValueError("x")])
            assert info.value.message == "mine" and stream.outcome is Outcome.FAILED
            assert not trio.lowlevel.in_trio_run()

        run(main)


def test_a_blocked_host_loop_does_not_kill_a_rank_that_kept_sending(
    tmp_path: Path, run: Run
) -> None:
    with EngineThread(url_in(tmp_path), mock=MockConfig(engines=1, step_time=0.02)) as engines:

        async def main() -> None:
            async with aio_group(engines, 1, silence_timeout=0.5) as group:
                body = {"prompt": [1], "max_tokens": 10_000}
                async with group.submit(Request("long", body)) as stream:
                    await stream.receive()
                    # Block the loop, and trio with it, for three silence timeouts; the
                    # engine thread keeps stepping and sending meanwhile.
                    time.sleep(1.5)  # noqa: ASYNC251 (the point of the test)
                    during = await stream.receive_batch()
                    assert len(during) > 10  # what it sent during the block
                    for _ in range(5):
                        await stream.receive()  # and it goes on
                    assert stream.outcome is None
                st = group.statistics()
                assert (st.failed, st.ranks[0].state, st.aborted) == (0, RankState.UP, 1)

        run(main)

"""EngineGroup over real ipc sockets, with scripted engines built on `zmqdp.engine`.

The SMG connector's test list (the SMG connector's own list) is ported here; each test says
which SMG test it stands for; beyond them, misuse from other threads and impossible group
sizes. Every test runs under the absolute time limit of conftest.py.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio
import trio.testing

import zmqdp.testing
from tests.fakes.engines import ScriptedEngine, start_engines
from zmqdp import (
    CallFailed,
    DuplicateRequestId,
    EngineDead,
    EngineGroup,
    GroupClosed,
    HandshakeTimeout,
    InvalidRank,
    InvalidRequest,
    Load,
    Output,
    RankState,
    Request,
    RequestAborted,
    StreamTruncated,
    SubmitRefused,
)
from zmqdp._core.codec import decode_request
from zmqdp.engine import Abort, Add, Resync, Wake
from zmqdp.mock import MockConfig, run_mock_group

from .helpers import (
    READY_TIMEOUT,
    RawEngine,
    collect,
    group_in_background,
    group_of,
    inflight,
    wait_until,
    wakes,
)

# -- SMG §7.2 ports -------------------------------------------------------------------


async def test_submit_streams_tokens_until_finish(tmp_path: Path) -> None:  # SMG 1
    async with group_of(tmp_path, 1) as (group, engines):
        outs = await collect(group, Request("r1", {"tokens": 3}))
        assert outs == [Output("r1", 0), Output("r1", 1), Output("r1", 2, "length")]
        first = engines[0].inbox[0]
        assert isinstance(first, Add) and first.id.startswith("r1#")  # a wire id (§3)
        assert inflight(group) == [0]
        assert group.statistics().fallbacks == 0


async def test_closing_the_group_errors_live_streams(tmp_path: Path) -> None:  # SMG 2
    async with group_of(tmp_path, 1) as (group, _):
        stream = group.submit(Request("orphan", {"hold": True}))
    with pytest.raises(GroupClosed, match="closed"):
        await stream.receive()
    with pytest.raises(GroupClosed):
        group.submit(Request("late"))


async def test_load_surfaces_in_statistics(tmp_path: Path) -> None:  # SMG 3
    async with group_of(tmp_path, 1) as (group, engines):
        engines[0].load_override = Load(waiting=5, running=3, kv=0.25)
        async with group.submit(Request("held", {"hold": True})) as stream:
            await engines[0].wait_for(lambda: engines[0].holds("held"))
            await engines[0].emit((Output(engines[0].wire("held"), "tick"),))
            assert await stream.receive() == Output("held", "tick")
            assert group.statistics().ranks[0].load == Load(5, 3, 0.25)


async def test_unpinned_prefers_the_least_loaded(tmp_path: Path) -> None:  # SMG 4 + KV
    async with group_of(tmp_path, 3) as (group, engines):
        for rank in (0, 1, 2):
            group.submit(Request(f"held{rank}", {"hold": True}, rank=rank))
        engines[0].load_override = Load(waiting=5, running=3, kv=0.2)  # score 8
        engines[1].load_override = Load(waiting=2, running=3, kv=1.0)  # 5 + 2*6*0.5 = 11
        engines[2].load_override = Load(waiting=4, running=5, kv=0.4)  # 9
        for e in engines:
            await e.wait_for(lambda e=e: bool(e.held))
            await e.emit()
        await wait_until(lambda: group.statistics().ranks[1].load.kv == 1.0)
        await wait_until(lambda: group.statistics().ranks[2].load.waiting == 4)
        assert group.submit(Request("next", {"hold": True})).rank == 0


async def test_a_cold_burst_spreads_evenly(tmp_path: Path) -> None:  # SMG 5
    async with group_of(tmp_path, 2) as (group, _):
        ranks = [group.submit(Request(f"r{i}", {"hold": True})).rank for i in range(6)]
        assert sorted(ranks) == [0, 0, 0, 1, 1, 1]


async def test_failed_duplicate_submit_keeps_the_reservation(tmp_path: Path) -> None:  # SMG 6
    async with group_of(tmp_path, 2) as (group, _):
        assert group.submit(Request("dup", {"hold": True})).rank == 0
        with pytest.raises(DuplicateRequestId, match="'dup'"):
            group.submit(Request("dup", {"hold": True}))
        assert inflight(group) == [1, 0]
        assert group.submit(Request("next", {"hold": True})).rank == 1


async def test_aborting_twice_frees_only_its_own_slot(tmp_path: Path) -> None:  # SMG 7
    async with group_of(tmp_path, 2) as (group, engines):
        async with group.submit(Request("doomed", {"hold": True}, rank=0)) as doomed:
            group.submit(Request("held", {"hold": True}, rank=0))
            await group.abort("doomed")
            await group.abort("doomed")
        with pytest.raises(RequestAborted):
            await doomed.receive()
        assert inflight(group) == [1, 0]
        assert group.submit(Request("next", {"hold": True})).rank == 1
        e0 = engines[0]
        await e0.wait_for(lambda: any(isinstance(m, Abort) for m in e0.inbox))
        assert [m.ids for m in e0.inbox if isinstance(m, Abort)] == [(doomed.wire_id,)]


async def test_dropping_a_stream_sends_abort_to_its_rank_only(tmp_path: Path) -> None:  # SMG 10
    async with group_of(tmp_path, 2) as (group, engines):
        async with group.submit(Request("req-abort", {"hold": True}, rank=1)) as stream:
            pass
        e1 = engines[1]
        await e1.wait_for(lambda: any(isinstance(m, Abort) for m in e1.inbox))
        assert [m for m in e1.inbox if isinstance(m, Abort)] == [Abort((stream.wire_id,))]
        assert not any(isinstance(m, Abort) for m in engines[0].inbox)
        assert inflight(group) == [0, 0]


async def test_engine_dead_fails_inflight_requests(tmp_path: Path) -> None:  # SMG 11
    async with group_of(tmp_path, 2) as (group, engines):
        async with group.submit(Request("r", {"hold": True}, rank=0)) as stream:
            await engines[0].wait_for(lambda: engines[0].holds("r"))
            await engines[0].emit((Output(stream.wire_id, "partial"),), dead="out of memory")
            assert await stream.receive() == Output("r", "partial")
            with pytest.raises(EngineDead, match=r"rank 0.*'r'.*out of memory") as info:
                await stream.receive()
        assert info.value.rank == 0
        assert group.engines[0].state is RankState.DOWN
        with pytest.raises(InvalidRank, match="down"):
            group.submit(Request("pinned", rank=0))
        assert (await collect(group, Request("other", "x")))[-1].finish == "stop"


async def test_an_undecodable_batch_kills_the_rank_at_once(tmp_path: Path) -> None:  # SMG 12
    """SMG kills after several in a row; revision 2 (§7) makes one a connection error:
    the outputs it carried are lost, so waiting for them would only hang the requests."""
    async with group_of(tmp_path, 1) as (group, engines):
        async with group.submit(Request("r", {"hold": True})) as stream:
            await engines[0].wait_for(lambda: engines[0].holds("r"))
            out = await engines[0].started()
            await out.send_raw_for_testing([b"\xc1"])  # not CBOR at all
            with pytest.raises(EngineDead, match=r"connection error.*invalid CBOR"):
                await stream.receive()
        assert group.statistics().protocol_errors == 1


# -- waves (SMG 14-19, under docs/protocol.md §5) ------------------------------------------


async def test_first_submit_wakes_the_parked_lockstep_group(tmp_path: Path) -> None:  # 14, 15
    async with group_of(tmp_path, 2, lockstep=True) as (group, engines):
        assert group.lockstep
        group.submit(Request("a", {"hold": True}, rank=1))
        for e in engines:
            await e.wait_for(lambda e=e: wakes(e) == [0])
        assert isinstance(engines[1].inbox[0], Add)  # the ADD goes before the WAKE
        # A wave_complete moves the clock; the next wake names it, identically.
        await engines[0].emit(wave_complete=4)
        await wait_until(lambda: group.statistics().wave == 5)
        group.submit(Request("b", {"hold": True}, rank=0))
        for e in engines:
            await e.wait_for(lambda e=e: wakes(e) == [0, 5])


async def test_start_wave_wakes_the_whole_group(tmp_path: Path) -> None:  # 17
    async with group_of(tmp_path, 2, lockstep=True) as (_group, engines):
        await engines[0].emit(start_wave=7)
        for e in engines:
            await e.wait_for(lambda e=e: wakes(e) == [7])


async def test_wave_complete_does_not_wake(tmp_path: Path) -> None:  # 18
    async with group_of(tmp_path, 2, lockstep=True) as (group, engines):
        await engines[1].emit(wave_complete=3)
        await wait_until(lambda: group.statistics().wave == 4)
        group.submit(Request("x", {"hold": True}, rank=0))
        await engines[1].wait_for(lambda: wakes(engines[1]) == [4])
        assert not any(isinstance(m, Add) for m in engines[1].inbox)


async def test_independent_ranks_are_never_woken(tmp_path: Path) -> None:  # 16, 19
    async with group_of(tmp_path, 2) as (group, engines):
        await engines[0].emit(start_wave=2)
        outs = await collect(group, Request("x", "y", rank=0))
        assert outs[-1].finish == "stop"
        assert group.statistics().wave is None
        assert not any(isinstance(m, Wake) for e in engines for m in e.inbox)


# -- beyond SMG -----------------------------------------------------------------------


@pytest.mark.timeout_s(60)
async def test_many_concurrent_streams_complete_and_leave_nothing_in_flight(
    tmp_path: Path,
) -> None:
    async with group_of(tmp_path, 4) as (group, _):
        results: dict[str, list[Output]] = {}

        async def one(i: int) -> None:
            results[f"r{i}"] = await collect(group, Request(f"r{i}", {"tokens": 1 + i % 4}))

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, i)
        assert len(results) == 1000
        assert all(len(v) == 1 + int(k[1:]) % 4 for k, v in results.items())
        assert inflight(group) == [0, 0, 0, 0]
        stats = group.statistics()
        assert stats.finished == 1000 and stats.failed == 0 and stats.fallbacks == 0
        assert min(r.batches for r in stats.ranks) > 0  # every rank served


@pytest.mark.parametrize("point", ["on-entry", "waiting", "mid-stream"])
async def test_cancellation_aborts_on_the_owning_rank_and_releases_once(
    tmp_path: Path, point: str
) -> None:
    async with group_of(tmp_path, 2) as (group, engines):
        e1 = engines[1]
        got: list[Output] = []
        with trio.CancelScope() as scope:
            if point == "on-entry":
                scope.cancel()
            async with group.submit(Request("slow", {"hold": True}, rank=1)) as stream:
                await e1.wait_for(lambda: e1.holds("slow"))
                if point == "mid-stream":
                    await e1.emit((Output(stream.wire_id, "first"),))
                    got.append(await stream.receive())
                scope.cancel()
                got.append(await stream.receive())  # cancelled here
        assert scope.cancelled_caught
        assert got == ([Output("slow", "first")] if point == "mid-stream" else [])
        await e1.wait_for(lambda: any(isinstance(m, Abort) for m in e1.inbox))
        assert [m for m in e1.inbox if isinstance(m, Abort)] == [Abort((stream.wire_id,))]
        assert not any(isinstance(m, Abort) for m in engines[0].inbox)
        assert inflight(group) == [0, 0]
        stats = group.statistics()
        assert stats.aborted == 1 and stats.finished == stats.failed == 0
        # the engine's confirmation (`finished: ["slow"]`) changes nothing
        await e1.wait_for(lambda: not e1.held)
        assert (await collect(group, Request("next", "x", rank=1)))[0].body == "x"
        assert group.statistics().aborted == 1 and group.statistics().late_outputs == 1


async def test_late_output_of_an_aborted_request_never_reaches_its_successor(
    tmp_path: Path,
) -> None:
    async with group_of(tmp_path, 1) as (group, engines):
        e0 = engines[0]
        async with group.submit(Request("r", {"hold": True})):
            await e0.wait_for(lambda: e0.holds("r"))
        # The engine has not yet seen the ABORT; it keeps emitting for the old "r".
        old = e0.wire("r")
        del e0.held[old]
        await e0.emit((Output(old, "old", None),))
        await e0.emit((Output(old, "old-end", "stop"),))
        outs = await collect(group, Request("r", {"tokens": 2}))
        assert [o.body for o in outs] == [0, 1]
        assert group.statistics().late_outputs == 2


async def test_finished_without_a_terminal_output_raises_stream_truncated(tmp_path: Path) -> None:
    async with group_of(tmp_path, 1) as (group, engines):
        stream = group.submit(Request("r", {"hold": True}))
        async with stream:
            await engines[0].wait_for(lambda: engines[0].holds("r"))
            await engines[0].emit(finished=(stream.wire_id,))
            with pytest.raises(StreamTruncated, match="rank 0, request 'r'"):
                await stream.receive()


async def test_unencodable_body_is_refused_and_rolled_back(tmp_path: Path) -> None:
    async with group_of(tmp_path, 1) as (group, _):
        with pytest.raises(InvalidRequest, match="'bad'"):
            group.submit(Request("bad", {1: "int key"}))
        assert inflight(group) == [0] and group.statistics().rolled_back == 1


async def test_silent_rank_is_declared_dead_and_others_keep_serving(tmp_path: Path) -> None:
    async with group_of(tmp_path, 2, silence_timeout=0.5) as (group, engines):
        async with group.submit(Request("r", {"hold": True}, rank=0)) as stream:
            with pytest.raises(EngineDead, match=r"silent for .* holding 1 request"):
                async for _ in stream:
                    pass
        assert (await collect(group, Request("s", "x")))[0].body == "x"
        assert group.engines[1].state is RankState.UP
        # the silent engine is still alive: the client's RESYNC brings it back
        await group.rank_state(0).wait_value(RankState.UP)
        assert (await collect(group, Request("back", "y", rank=0)))[0].body == "y"
        assert isinstance(engines[0].inbox[-2], Resync)


async def test_rejoin_fails_the_old_incarnation_and_the_rank_comes_back(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        first = [ScriptedEngine(url, r, 2) for r in range(2)]
        scopes = []
        for e in first:
            scope = trio.CancelScope()
            scopes.append(scope)

            async def run(e: ScriptedEngine = e, scope: trio.CancelScope = scope) -> None:
                with scope:
                    await e.run()

            nursery.start_soon(run)
        async with EngineGroup.connect(url, 2, ready_timeout=READY_TIMEOUT) as group:
            async with group.submit(Request("r", {"hold": True}, rank=1)) as stream:
                await first[1].wait_for(lambda: first[1].holds("r"))
                scopes[1].cancel()  # rank 1 "crashes" ...
                again = ScriptedEngine(url, 1, 2)
                nursery.start_soon(again.run)  # ... and restarts
                # its connection's close or its new HELLO, whichever the client sees first
                with pytest.raises(EngineDead, match=r"rejoin|connection closed"):
                    await stream.receive()
            await group.rank_state(1).wait_value(RankState.UP)
            outs = await collect(group, Request("after", "ok", rank=1))
            assert outs == [Output("after", "ok", "stop")]
        nursery.cancel_scope.cancel()


async def test_lockstep_group_fails_as_a_whole(tmp_path: Path) -> None:
    async with group_of(tmp_path, 2, lockstep=True) as (group, engines):
        s0 = group.submit(Request("a", {"hold": True}, rank=0))
        s1 = group.submit(Request("b", {"hold": True}, rank=1))
        await engines[1].wait_for(lambda: engines[1].holds("b"))
        await engines[1].emit(dead="NCCL timeout")
        with pytest.raises(EngineDead, match=r"rank 1.*'b'.*NCCL timeout"):
            await s1.receive()
        with pytest.raises(GroupClosed, match=r"lockstep group failed.*rank 1"):
            await s0.receive()
        with pytest.raises(GroupClosed, match="lockstep group failed"):
            group.submit(Request("c"))
        assert group.closed is not None


async def test_call_returns_the_result_and_an_engine_error_raises_call_failed(
    tmp_path: Path,
) -> None:
    async with group_of(tmp_path, 2) as (group, _):
        assert await group.call(1, "echo", 1, "two") == [1, "two"]
        with pytest.raises(CallFailed, match="no method nope") as info:
            await group.call(0, "nope")
        assert (info.value.rank, info.value.method) == (0, "nope")


@pytest.mark.parametrize(
    "body",
    [cbor2.dumps({"rank": 1}), b"\xa1", cbor2.dumps({"rank": 0, "seq": -1})],
    ids=["wrong rank", "truncated", "bad seq"],
)
async def test_an_invalid_batch_kills_only_its_rank_which_comes_back(
    tmp_path: Path, body: bytes
) -> None:
    async with group_of(tmp_path, 2) as (group, engines):
        out = await engines[0].started()
        await out.send_raw_for_testing([body])
        await group.rank_state(0).wait_value(RankState.DOWN)
        assert group.statistics().protocol_errors == 1
        assert (await collect(group, Request("ok", 1)))[0].body == 1  # rank 1 serves
        await group.rank_state(0).wait_value(RankState.UP)  # RESYNC brought it back
        assert (await collect(group, Request("back", 2, rank=0)))[0].body == 2


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize("self_wake", [False, True], ids=["waits-for-wake", "self-wake"])
async def test_lockstep_sequential_pattern_never_hangs(tmp_path: Path, self_wake: bool) -> None:
    """Submit, run to finish, let the group park, submit again: 50 times, against the
    in-process lockstep mock (ranks block in a per-step collective, no wave agreement)."""
    url = f"ipc://{tmp_path}/g"
    cfg = MockConfig(
        engines=2,
        lockstep=True,
        step_time=0.0005,
        sync_interval=2,
        self_wake=self_wake,
        wave_agreement=False,
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_mock_group, url, cfg)
        async with EngineGroup.connect(url, 2, ready_timeout=READY_TIMEOUT) as group:
            for i in range(50):
                parked_at = group.wave.value
                outs = await collect(group, Request(f"r{i}", {"max_tokens": 1 + i % 3}))
                assert outs[-1].finish == "length"
                await group.wave.wait_value(lambda w, p=parked_at: w > p)  # parked again
            stats = group.statistics()
            assert stats.finished == 50 and stats.stall_wakes == 0
            assert stats.wave is not None and stats.wave >= 50
        nursery.cancel_scope.cancel()


async def test_a_send_to_a_rank_whose_engine_is_gone_fails_its_request_at_once(
    tmp_path: Path,
) -> None:
    """Rank 1's engine process is gone and the client's input socket has dropped its
    connection: the ADD cannot be sent (EHOSTUNREACH under ROUTER_MANDATORY), so the
    request fails at once with `EngineDead` saying so, and rank 0 keeps serving. (The
    silence watchdog, at its default 30 s, cannot be what fails it here.)"""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        engines = [ScriptedEngine(url, r, 2) for r in range(2)]
        killer = trio.CancelScope()

        async def fragile() -> None:
            with killer:
                await engines[1].run()

        nursery.start_soon(engines[0].run)
        nursery.start_soon(fragile)
        async with EngineGroup.connect(url, 2, ready_timeout=READY_TIMEOUT) as g:

            def fd_wakeups() -> int:
                """How often the input task woke up because the socket's fd became
                readable (not because the adapter's safety timeout expired)."""
                stats = zmqdp.testing.input_statistics(g)
                return stats.waits - stats.fallbacks

            await trio.testing.wait_all_tasks_blocked()  # the input task is parked
            parked = fd_wakeups()
            killer.cancel()
            await wait_until(lambda: killer.cancelled_caught)  # rank 1's sockets are closed
            # libzmq tells the client's input socket that the connection is gone with a
            # command on the socket's mailbox, which makes its fd readable and wakes the
            # parked input task; nothing else is sent to that socket meanwhile. Once the
            # task has read EVENTS and parked again, the socket has processed the command:
            # no route to rank 1 is left, so the ADD below cannot go into a pipe that is
            # going away (it would be lost, and only silence would fail the request).
            await wait_until(lambda: fd_wakeups() > parked)
            # The handshake socket's monitor may have seen the connection close first
            # (issue 20): then rank 1 is down already and the submit is refused.
            try:
                async with g.submit(Request("lost", {"hold": True}, rank=1)) as stream:
                    with pytest.raises(
                        EngineDead,
                        match=r"rank 1, request 'lost'.*(EHOSTUNREACH|connection closed)",
                    ):
                        await stream.receive()
            except InvalidRank:
                assert g.rank_state(1).value is RankState.DOWN
            assert (await collect(g, Request("fine", "x")))[0].body == "x"
        nursery.cancel_scope.cancel()


async def test_a_request_whose_engine_says_nothing_after_taking_it_fails_by_silence(
    tmp_path: Path,
) -> None:
    """Rank 1's engine takes the ADD, then says nothing, its connections open (a hung
    engine whose libzmq still answers heartbeats). The client sends nothing more to
    rank 1, so no send can fail: the silence watchdog declares the rank dead
    (silence_timeout=1 s) and fails the request, and rank 0 keeps serving. (An engine
    whose process is gone is seen at once by its connection's close:
    tests/test_liveness.py.)"""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        engines = [ScriptedEngine(url, r, 2) for r in range(2)]
        killer = trio.CancelScope()

        async def fragile() -> None:
            with killer:
                await engines[1].run()

        nursery.start_soon(engines[0].run)
        nursery.start_soon(fragile)
        async with EngineGroup.connect(url, 2, ready_timeout=READY_TIMEOUT, silence_timeout=1) as g:
            async with g.submit(Request("lost", {"hold": True}, rank=1)) as stream:
                await engines[1].wait_for(lambda: engines[1].holds("lost"))
                with pytest.raises(
                    EngineDead, match=r"rank 1, request 'lost'.*silent for .* holding 1 request"
                ):
                    await stream.receive()
            assert (await collect(g, Request("fine", "x")))[0].body == "x"
        nursery.cancel_scope.cancel()


async def test_connect_timeout_is_one_clear_exception(tmp_path: Path) -> None:
    with pytest.raises(HandshakeTimeout, match="rank 0: no HELLO yet"):
        async with EngineGroup.connect(f"ipc://{tmp_path}/g", 1, ready_timeout=0.3):
            pass  # pragma: no cover


LOCKSTEP_DEATHS = {
    "dead": "bye",
    "decode errors": "connection error",
    "silence": "silent for",
    "rejoin": r"said HELLO again \(rejoin\)",
}
"""How rank 1 dies, and what its `EngineDead` says."""


async def report_load_forever(engine: ScriptedEngine) -> None:
    """A live engine's scheduler loop: a load report every 50 ms."""
    while True:
        await engine.emit()
        await trio.sleep(0.05)


@pytest.mark.parametrize("cause", LOCKSTEP_DEATHS)
async def test_lockstep_group_fails_whole_for_every_cause(tmp_path: Path, cause: str) -> None:
    """Rank 1 of a lockstep group announces `dead`, sends an undecodable batch, falls
    silent (while rank 0 keeps reporting its load, so rank 1 is the only silent one), or
    says HELLO again. Its request ends with `EngineDead` naming that cause, rank 0's with
    `GroupClosed` naming rank 1, and the group takes no more requests."""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        engines = await start_engines(nursery, url, 2, lockstep=True)
        # A second process for rank 1 while the first is connected is held and refused
        # once heartbeats show the first alive (issue 24 #2); without heartbeats the
        # newest wins, which is how this test makes rank 1 say HELLO again.
        heartbeats = {"heartbeat_interval": None} if cause == "rejoin" else {}
        async with EngineGroup.connect(
            url, 2, ready_timeout=READY_TIMEOUT, silence_timeout=0.5, **heartbeats
        ) as g:
            s0 = g.submit(Request("a", {"hold": True}, rank=0))
            s1 = g.submit(Request("b", {"hold": True}, rank=1))
            e0, e1 = engines
            await e0.wait_for(lambda: e0.holds("a"))
            await e1.wait_for(lambda: e1.holds("b"))
            if cause == "dead":
                await e1.emit(dead="bye")
            elif cause == "decode errors":
                await (await e1.started()).send_raw_for_testing([b"\xff"])
            elif cause == "rejoin":
                nursery.start_soon(ScriptedEngine(url, 1, 2, lockstep=True).run)
            else:  # silence: rank 0 keeps talking, rank 1 says nothing more
                nursery.start_soon(report_load_forever, e0)
            with pytest.raises(EngineDead, match=rf"rank 1, request 'b'.*{LOCKSTEP_DEATHS[cause]}"):
                await s1.receive()
            with pytest.raises(GroupClosed, match=r"request 'a'.*lockstep group failed.*rank 1"):
                await s0.receive()
            with pytest.raises(GroupClosed, match="lockstep group failed"):
                g.submit(Request("c"))
            assert all(e.state is RankState.DOWN for e in g.engines)
        nursery.cancel_scope.cancel()


async def test_silent_lockstep_rank_fails_the_group(tmp_path: Path) -> None:
    async with group_of(tmp_path, 2, lockstep=True, silence_timeout=0.5) as (group, _):
        stream = group.submit(Request("a", {"hold": True}, rank=0))
        with pytest.raises(EngineDead, match=r"rank 0.*silent"):
            await stream.receive()
        with pytest.raises(GroupClosed):
            group.submit(Request("b"))


@pytest.mark.parametrize("enabled", [True, False])
async def test_the_dispatcher_leaves_the_garbage_collector_as_it_found_it(
    tmp_path: Path, enabled: bool
) -> None:
    """Each pass runs with the collector paused (issue 21); the application's own
    setting, on or off, is what it finds after every pass."""
    import gc

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        async with group_of(tmp_path, 1) as (group, _):
            assert await collect(group, Request("r", "x")) == [Output("r", "x", "stop")]
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


class _BusyCore:
    """A `GroupCore` that always has work and gives the dispatcher nothing to do with it."""

    def next_loss(self) -> float:
        return math.inf

    def next_deadline(self) -> float:
        return math.inf

    def has_work(self) -> bool:
        return True

    def in_hand(self) -> None:
        return None

    def on_output(self, frames: Any, now: float) -> None:
        pass

    def end_pass(self) -> None:
        pass

    def take_effects(self) -> None:
        return None


class _Flood:
    """An output socket with 64 messages queued at every read, for 10,000 reads."""

    def __init__(self) -> None:
        self.reads = 0

    def receive_nowait(self, limit: int) -> list[list[bytes]]:
        self.reads += 1
        if self.reads > 10_000:
            raise RuntimeError("the dispatcher was never cancelled")
        return [[b""]] * 64


async def test_a_dispatcher_reading_a_flood_can_be_cancelled() -> None:
    """A group that always has a long batch in hand and 64 messages at every read (a
    flooding rank): its dispatcher still stops when its group closes. After a pass of
    32 or more it used to yield only through shielded checkpoints (issue 34's pause of
    the collector), so it ran on for as long as the flood lasted."""
    from zmqdp._dispatch import Dispatcher

    flood = _Flood()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            dispatcher = Dispatcher(_BusyCore(), flood, lambda fx, dirty: None)  # type: ignore[arg-type]
            nursery.start_soon(dispatcher.run)
            while flood.reads < 10:
                await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()
    assert flood.reads < 20


async def test_two_busy_dispatchers_let_the_garbage_collector_run_between_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two groups in one process, each reading 64 messages a pass without a pause: the
    collector is turned back on between passes. A dispatcher that kept it paused
    through the consumers' turn after every pass (issue 34) did so while the other
    group's pass was paused too, each overlapping the other's: the count of pausers
    never fell to zero, and the collector stayed off for as long as both were busy."""
    import gc

    from zmqdp._dispatch import Dispatcher

    enables = 0
    enable = gc.enable

    def counted() -> None:
        nonlocal enables
        enables += 1
        enable()

    monkeypatch.setattr(gc, "enable", counted)
    was = gc.isenabled()
    gc.enable()
    floods = [_Flood(), _Flood()]
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for flood in floods:
                    dispatcher = Dispatcher(_BusyCore(), flood, lambda fx, dirty: None)  # type: ignore[arg-type]
                    nursery.start_soon(dispatcher.run)
                while min(flood.reads for flood in floods) < 100:
                    await trio.lowlevel.checkpoint()
                nursery.cancel_scope.cancel()
    finally:
        (enable if was else gc.disable)()
    assert enables >= 50  # (about one per pass of either)


# -- threads (issue 24 #10) ----------------------------------------------------------------


def _in_other_thread(fn: Any) -> BaseException | None:
    """Run the coroutine function `fn` in a trio run of a new thread; its exception."""
    caught: list[BaseException] = []

    def main() -> None:
        try:
            trio.run(fn)
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=main)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the other thread is stuck"
    return caught[0] if caught else None


async def test_a_stream_read_from_another_thread_raises(tmp_path: Path) -> None:
    """It used to park on a run the dispatcher never wakes: a silent stall."""
    async with (
        group_of(tmp_path, 1) as (group, engines),
        group.submit(Request("r", {"hold": True})) as stream,
    ):
        await wait_until(engines[0].holds, "r")
        error = await trio.to_thread.run_sync(_in_other_thread, stream.receive)
        assert isinstance(error, RuntimeError)
        assert "'r'" in str(error) and "another thread" in str(error)
        await engines[0].finish("r")  # the group's own thread still reads it
        assert [out.finish async for out in stream] == ["stop"]


async def test_leaving_a_stream_in_another_thread_still_aborts_on_the_engine(
    ctx: Any, tmp_path: Path
) -> None:
    """It used to end the request on the client and never send the ABORT: the input
    task was rescheduled from a foreign thread, which does not wake the group's run.
    The other thread waits for the ABORT itself, so nothing else wakes that run."""
    url = f"ipc://{tmp_path}/g"
    async with group_in_background(url, 1) as box:
        engine = RawEngine(ctx, url, 0, 1)
        await engine.handshake()
        group = await box.wait()
        stream = group.submit(Request("r", "x"))
        added = await engine.request()
        assert isinstance(added, Add)
        assert engine.inp is not None
        sock = engine.inp.sock

        def leave_then_read() -> Any:
            async def leave() -> None:
                async with stream:
                    pass

            trio.run(leave)
            # Blocking, in this thread, while the group's run is idle. The dispatcher's
            # 1 s backstop wake used to deliver the ABORT (late, by luck): wait less.
            if not sock.poll(700):
                return None
            return decode_request(*sock.recv_multipart())

        got = await trio.to_thread.run_sync(leave_then_read)
        assert isinstance(got, Abort) and got.ids == (added.id,), got
        assert group.statistics().ranks[0].inflight == 0
        engine.close()


async def test_group_methods_refuse_another_thread(tmp_path: Path) -> None:
    async with group_of(tmp_path, 1) as (group, _):

        async def submit() -> None:
            group.submit(Request("r", "x"))

        error = await trio.to_thread.run_sync(_in_other_thread, submit)
        assert isinstance(error, RuntimeError) and "another thread" in str(error)
        error = await trio.to_thread.run_sync(_in_other_thread, lambda: group.abort("r"))
        assert isinstance(error, RuntimeError)
        assert group.statistics().ranks[0].inflight == 0


# -- group size (issue 24 #12) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("engines", "error"),
    [(70000, ValueError), (0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)],
)
async def test_an_impossible_group_size_is_refused_before_binding(
    tmp_path: Path, engines: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="engines must be"):
        async with EngineGroup.connect(f"ipc://{tmp_path}/g", engines):
            pass
    assert not (tmp_path / "g").exists()


# -- submit of something that is not a Request ------------------------------------------


async def test_submit_of_a_dict_is_an_invalid_request(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_mock_group, url, MockConfig(engines=1, step_time=0.001))
            async with EngineGroup.connect(url, 1) as group:
                with pytest.raises(InvalidRequest, match="not a dict") as refused:
                    group.submit({"id": "x"})  # type: ignore[arg-type]
                assert isinstance(refused.value, SubmitRefused)
                assert "submit takes a zmqdp.Request" in str(refused.value)
                with pytest.raises(InvalidRank, match="CALL needs an int rank"):
                    await group.call("0", "ping")  # type: ignore[arg-type]
                assert await group.call(0, "ping") == "pong"  # the group serves on
            nursery.cancel_scope.cancel()

"""End-to-end checks of docs/protocol.md revision 2, one or a few tests per observation.

Each test names the observation it stands for (a failure mode of revision 1 that a
revision-2 client must not show) and asserts something that revision 1 got wrong. They
run over real ipc sockets against `zmqdp.engine` engines (`ScriptedEngine`, or a small
loop on `connect_engine`) or, where a test must misbehave on the wire, against raw
pyzmq DEALERs (`RawEngine`).

Every test runs under the absolute time limit of conftest.py. Nothing waits on the
clock to synchronise: tests wait on events and predicates. Where a test must let real
time pass (a watchdog must get its chance to fire, or must not fire), it waits for the
event that would show the failure, bounded by `trio.move_on_after`, and asserts that it
did not come. Fake engines that keep reporting load pace their reports with a short
sleep, as a real engine's scheduler loop would.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio
import trio.testing
import zmq

from tests.fakes.engines import ScriptedEngine, start_engines
from zmqdp import (
    EngineDead,
    EngineGroup,
    GroupClosed,
    InvalidRank,
    InvalidRequest,
    Load,
    Output,
    ProtocolError,
    RankState,
    Request,
)
from zmqdp._core.handshake import rank_identity
from zmqdp._core.messages import Init, Reject, Resync
from zmqdp.engine import Abort, Add, Engine, OutputBatch, connect_engine

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

INT_MAX = 2**63 - 1
"""§1: the largest `wave` (or `seq`, `epoch`, call id) on the wire."""


# -- helpers --------------------------------------------------------------------------


async def finish(scripted: ScriptedEngine, wire_id: str, how: str = "stop") -> None:
    """Make `scripted` end the request it holds as `wire_id` with one terminal output."""
    scripted.held.pop(wire_id)
    await scripted.emit((Output(wire_id, "done", how),))


def the_engine(scripted: ScriptedEngine) -> Engine:
    assert scripted.engine is not None
    return scripted.engine


async def echo_engine(url: str, rank: int, size: int, inbox: list[Any], **kw: Any) -> None:
    """Answers every ADD with one terminal output echoing its body; records its inbox."""
    async with connect_engine(url, rank=rank, size=size, **kw) as eng:
        async for msg in eng:
            inbox.append(msg)
            if isinstance(msg, Add):
                out = Output(msg.id, msg.body, "stop")
                await eng.send(OutputBatch(rank=rank, outputs=(out,)))


# -- 1. an id reused right after its abort ----------------------------------------------


class ConfirmsLate(ScriptedEngine):
    """Processes ABORT(x) and then ADD(x) before it sends anything, and sends ONE
    batch: the `finished` confirmation of the old x and the new x's first output."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.unconfirmed: list[str] = []

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Abort):
            self.unconfirmed += [i for i in msg.ids if self.held.pop(i, None) is not None]
        elif isinstance(msg, Add) and self.unconfirmed:
            self.held[msg.id] = msg.body
            finished, self.unconfirmed = tuple(self.unconfirmed), []
            await self.emit((Output(msg.id, "first"),), finished=finished)
        else:
            await super().handle(msg)


async def test_reused_id_gets_its_output_from_a_batch_that_confirms_the_abort(
    tmp_path: Path,
) -> None:
    """Observation 1: ABORT(x), ADD(x), then one batch with `finished: [old x]` and the
    new x's first output: the new x receives that output; only the confirmation is
    late, and nothing is truncated."""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        e0 = ConfirmsLate(url, 0, 1)
        nursery.start_soon(e0.run)
        async with EngineGroup.connect(url, 1, ready_timeout=READY_TIMEOUT) as group:
            async with group.submit(Request("x", {"hold": True})) as old:
                await e0.wait_for(lambda: old.wire_id in e0.held)
            new = group.submit(Request("x", {"hold": True}))  # right after the abort
            async with new:
                assert new.wire_id != old.wire_id
                assert await new.receive() == Output("x", "first")
                # the engine saw the ABORT of the old wire id, then the ADD of the new
                assert [m for m in e0.inbox if isinstance(m, Abort)] == [Abort((old.wire_id,))]
                await finish(e0, new.wire_id)
                assert [o async for o in new] == [Output("x", "done", "stop")]
            stats = group.statistics()
            assert stats.late_outputs == 1  # the `finished` of the old x
            assert stats.truncated == 0 and stats.unknown_outputs == 0
            assert stats.finished == 1 and stats.aborted == 1
            assert inflight(group) == [0]
        nursery.cancel_scope.cancel()


# -- 2. outputs and REGISTERs of a dead incarnation -------------------------------------


async def test_a_dead_incarnations_batch_never_reaches_a_new_request(tmp_path: Path) -> None:
    """Observation 2: the rank is declared silent and RESYNCed, the engine says HELLO
    again; a batch stamped with the dead incarnation's epoch that arrives afterwards
    (naming the new request's wire id too) is not applied: the new request gets
    exactly its own outputs, and the batch's load and `dead` change nothing."""
    async with group_of(tmp_path, 1, silence_timeout=0.5) as (group, engines):
        e0 = engines[0]
        eng = the_engine(e0)
        old_epoch = eng.epoch
        assert old_epoch is not None
        async with group.submit(Request("r", {"hold": True}, rank=0)) as first:
            old_wire_id = first.wire_id
            with pytest.raises(EngineDead, match="silent"):
                async for _ in first:
                    pass
        await group.rank_state(0).wait_value(RankState.UP)  # RESYNC, HELLO, READY...
        assert any(isinstance(m, Resync) for m in e0.inbox)
        assert eng.epoch is not None and eng.epoch != old_epoch
        stale_before = group.statistics().stale_messages
        async with group.submit(Request("r", {"hold": True}, rank=0)) as second:
            await e0.wait_for(lambda: second.wire_id in e0.held)
            # the old incarnation's last words, delivered late on the same route
            await eng.send(
                OutputBatch(
                    rank=0,
                    epoch=old_epoch,
                    outputs=(
                        Output(second.wire_id, "ghost"),
                        Output(old_wire_id, "ghost-end", "stop"),
                    ),
                    load=Load(waiting=9, running=9, kv=0.9),
                    dead="the old incarnation is gone",
                )
            )
            await finish(e0, second.wire_id)
            assert [o async for o in second] == [Output("r", "done", "stop")]
        stats = group.statistics()
        assert stats.stale_messages == stale_before + 1
        assert stats.ranks[0].load.waiting != 9
        assert group.rank_state(0).value is RankState.UP
        assert (await collect(group, Request("after", "ok", rank=0)))[0].body == "ok"


async def test_a_register_of_a_dead_epoch_does_not_bring_the_rank_up(
    ctx: Any, tmp_path: Path
) -> None:
    """Observation 2: HELLO -> INIT(e1), HELLO again -> INIT(e2); a REGISTER echoing
    e1 (the dead incarnation's) leaves the rank down; one with e2 brings it up. A
    batch of e1 that follows is stale; the batch of e2 is applied."""
    url = f"ipc://{tmp_path}/g"
    eng = RawEngine(ctx, url, 0, 1)
    async with group_in_background(url, 1) as box:
        e0 = (await eng.handshake()).epoch
        group = await box.wait()
        assert group.rank_state(0).value is RankState.UP
        e1 = await eng.hello()  # a rejoin: the previous incarnation is dead
        assert isinstance(e1, Init) and e1.epoch is not None
        await group.rank_state(0).wait_value(RankState.DOWN)
        e2 = await eng.hello()
        assert isinstance(e2, Init) and e2.epoch is not None
        assert len({e0, e1.epoch, e2.epoch}) == 3
        await eng.ready()
        await eng.register(e1.epoch)
        await wait_until(lambda: group.statistics().stale_registers == 1)
        assert group.rank_state(0).value is RankState.DOWN
        with pytest.raises(InvalidRank):
            group.submit(Request("too-early", rank=0))
        await eng.register(e2.epoch)
        await group.rank_state(0).wait_value(RankState.UP)
        assert group.statistics().stale_registers == 1
        stale_before = group.statistics().stale_messages
        async with group.submit(Request("q", rank=0)) as stream:
            add = await eng.request()
            assert add == Add(stream.wire_id, None)
            ghost = {"id": add.id, "body": "ghost", "finish": "stop"}
            await eng.send_batch({"epoch": e1.epoch, "outputs": [ghost]})
            real = {"id": add.id, "body": "real", "finish": "stop"}
            await eng.send_batch({"epoch": e2.epoch, "outputs": [real]})
            assert [o async for o in stream] == [Output("q", "real", "stop")]
        assert group.statistics().stale_messages == stale_before + 1
    eng.close()


# -- 3. an ADD larger than the engine accepts -------------------------------------------


async def test_an_oversized_request_is_refused_at_submit(tmp_path: Path) -> None:
    """Observation 3: a body larger than the engine's `max_message_size` (announced in
    its HELLO) raises `InvalidRequest` at submit: nothing is sent or reserved, and the
    rank, and the id, go on serving."""
    url = f"ipc://{tmp_path}/g"
    inbox: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(echo_engine, url, 0, 1, inbox, max_message_size=4096))
        async with EngineGroup.connect(url, 1, ready_timeout=READY_TIMEOUT) as group:
            for rank in (0, None):
                with pytest.raises(InvalidRequest, match=r"'big'.*4096") as info:
                    group.submit(Request("big", "x" * 10_000, rank=rank))
                assert "max_message_size" in str(info.value)
                assert group.statistics().ranks[0].inflight == 0
            assert group.statistics().rolled_back == 2
            assert group.statistics().submitted == 0
            outs = await collect(group, Request("small", "y", rank=0))
            assert outs == [Output("small", "y", "stop")]
            assert (await collect(group, Request("big", "fits")))[0].body == "fits"
            adds = [m for m in inbox if isinstance(m, Add)]
            assert [a.body for a in adds] == ["y", "fits"]  # the big one never went
            assert inflight(group) == [0]
            assert group.rank_state(0).value is RankState.UP
        nursery.cancel_scope.cancel()


# -- 4. ids, bodies and ranks that cannot be sent ---------------------------------------


BAD_SUBMITS: dict[str, Request] = {
    "surrogate id": Request("\ud800", "x", rank=0),
    "surrogate in a longer id": Request("ok\udfffok", "x", rank=0),
    "empty id": Request("", "x", rank=0),
    "10000-char id": Request("i" * 10_000, "x", rank=0),
    "float rank": Request("float-rank", "x", rank=1.0),  # type: ignore[arg-type]
    "str rank": Request("str-rank", "x", rank="0"),  # type: ignore[arg-type]
}


async def test_unsendable_ids_bodies_and_ranks_are_invalid_requests_that_leak_nothing(
    tmp_path: Path,
) -> None:
    """Observation 4: a lone surrogate in an id or a body, an empty or 10 000-char id,
    `rank=1.0` and `rank="0"` all raise `InvalidRequest` (not TypeError or
    UnicodeEncodeError), reserve nothing, and leave no phantom in-flight request: the
    idle rank is not declared silent afterwards (silence_timeout=0.3), and the id of
    the bad body can be used at once."""
    async with group_of(tmp_path, 1, silence_timeout=0.3) as (group, engines):
        for name, request in BAD_SUBMITS.items():
            with pytest.raises(InvalidRequest) as info:
                group.submit(request)
            assert type(info.value) is InvalidRequest, name
            str(info.value)  # printable, even with a surrogate in it
            assert inflight(group) == [0], name
        with pytest.raises(InvalidRequest, match="'sb'"):
            group.submit(Request("sb", "bad \ud800 body", rank=0))
        with pytest.raises(InvalidRequest, match="'sb'"):
            group.submit(Request("sb", {"nested": ["\udcff"]}))
        assert inflight(group) == [0]
        assert group.statistics().submitted == 0
        assert not any(isinstance(m, Add) for m in engines[0].inbox)  # nothing sent
        # A leaked reservation would make the idle rank "hold" a request that never
        # answers: the silence watchdog would declare it dead within 0.3 s.
        with trio.move_on_after(1.0) as idle:
            await group.rank_state(0).wait_value(RankState.DOWN)
        assert idle.cancelled_caught, "the idle rank was declared dead"
        assert (await collect(group, Request("sb", "good body", rank=0)))[0].body == ("good body")
        assert (await collect(group, Request("good", "x")))[0].body == "x"
        stats = group.statistics()
        assert stats.submitted == stats.finished == 2 and stats.failed == 0
        assert inflight(group) == [0]


# -- 5. one malformed entry in a valid batch --------------------------------------------


async def test_a_malformed_entry_fails_only_the_request_it_names(tmp_path: Path) -> None:
    """Observation 5: one batch carries a valid terminal output for `a` and an output
    for `b` whose `finish` is an int. `a` completes, `b` raises `ProtocolError` naming
    rank 0 and request 'b', and the rank stays up and keeps serving. A malformed
    entry that names no id is only counted."""
    async with group_of(tmp_path, 1) as (group, engines):
        e0 = engines[0]
        eng = the_engine(e0)
        async with (
            group.submit(Request("a", {"hold": True})) as a,
            group.submit(Request("b", {"hold": True})) as b,
        ):
            await e0.wait_for(lambda: a.wire_id in e0.held and b.wire_id in e0.held)
            body = {
                "rank": 0,
                "epoch": eng.epoch,
                "outputs": [
                    {"id": a.wire_id, "body": "A", "finish": "stop"},
                    {"id": b.wire_id, "body": "B", "finish": 7},
                ],
            }
            await eng.send_raw_for_testing([cbor2.dumps(body)])
            assert [o async for o in a] == [Output("a", "A", "stop")]
            with pytest.raises(ProtocolError, match=r"rank 0, request 'b'.*finish") as info:
                await b.receive()
            assert info.value.rank == 0 and info.value.request_id == "b"
        stats = group.statistics()
        assert stats.finished == 1 and stats.protocol_failed == 1
        assert stats.malformed_entries == 1 and stats.protocol_errors == 0
        assert group.rank_state(0).value is RankState.UP
        assert inflight(group) == [0]
        # an entry without a usable id: counted, nothing else happens
        await eng.send_raw_for_testing(
            [cbor2.dumps({"rank": 0, "epoch": eng.epoch, "finished": [42]})]
        )
        await wait_until(lambda: group.statistics().malformed_entries == 2)
        assert (await collect(group, Request("c", "still serving")))[0].body == ("still serving")
        assert group.rank_state(0).value is RankState.UP
        assert group.statistics().protocol_errors == 0


# -- 6. a message with the wrong frame count --------------------------------------------


async def test_a_message_with_the_wrong_frame_count_kills_the_rank_at_once(
    tmp_path: Path,
) -> None:
    """Observation 6: one message of two frames on the output socket is a connection
    error: the rank is declared dead at once (its request ends with `EngineDead`), and
    in an independent group the other rank keeps serving. (The engine is alive: the
    client's RESYNC brings the rank back.)"""
    async with group_of(tmp_path, 2) as (group, engines):
        e0 = engines[0]
        async with group.submit(Request("r", {"hold": True}, rank=0)) as stream:
            await e0.wait_for(lambda: stream.wire_id in e0.held)
            await the_engine(e0).send_raw_for_testing([b"x", b"y"])
            with pytest.raises(EngineDead, match=r"rank 0, request 'r'.*2 frames") as info:
                await stream.receive()
        assert "connection error" in info.value.cause
        assert group.statistics().protocol_errors == 1
        assert group.engines[1].state is RankState.UP
        assert (await collect(group, Request("s", "x", rank=1)))[0].body == "x"
        assert (await collect(group, Request("t", "y")))[0].body == "y"
        await group.rank_state(0).wait_value(RankState.UP)
        assert (await collect(group, Request("back", "z", rank=0)))[0].body == "z"


# -- 7. a restarted client; closing with live requests ----------------------------------


async def test_a_restarted_client_picks_up_engines_that_kept_running(tmp_path: Path) -> None:
    """Observation 7: engines outlive their client. A new `EngineGroup` on the same URL
    gets them to handshake again (RESYNC) without restarting them, and serves."""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        engines = await start_engines(nursery, url, 2)
        async with EngineGroup.connect(url, 2, ready_timeout=READY_TIMEOUT) as first:
            assert (await collect(first, Request("before", "a", rank=1)))[0].body == "a"
        # the engines keep running; a new client binds the same URL
        async with EngineGroup.connect(url, 2, ready_timeout=READY_TIMEOUT) as second:
            assert all(e.state is RankState.UP for e in second.engines)
            for rank in (0, 1):
                outs = await collect(second, Request(f"after{rank}", rank, rank=rank))
                assert outs == [Output(f"after{rank}", rank, "stop")]
            assert second.statistics().resyncs >= 2
        for e in engines:
            assert any(isinstance(m, Resync) for m in e.inbox)
            assert the_engine(e).statistics().handshakes == 2
        nursery.cancel_scope.cancel()


async def test_closing_the_group_aborts_its_live_requests_on_the_engines(
    tmp_path: Path,
) -> None:
    """Observation 7 (§9): leaving `connect`'s block with a live request sends ABORT
    of its wire id to its engine before the sockets close."""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        engines = await start_engines(nursery, url, 2)
        e0, e1 = engines
        async with EngineGroup.connect(url, 2, ready_timeout=READY_TIMEOUT) as group:
            held = group.submit(Request("live", {"hold": True}, rank=1))
            done = group.submit(Request("done", "x", rank=0))
            assert [o async for o in done] == [Output("done", "x", "stop")]
            await e1.wait_for(lambda: held.wire_id in e1.held)
        # the client is gone; the engines are not
        await e1.wait_for(lambda: Abort((held.wire_id,)) in e1.inbox)
        assert not any(isinstance(m, Abort) for m in e0.inbox)
        with pytest.raises(GroupClosed):
            await held.receive()
        nursery.cancel_scope.cancel()


# -- 8. stall detection in a lockstep group ---------------------------------------------


async def test_a_stuck_lockstep_rank_that_keeps_reporting_load_is_declared_dead(
    tmp_path: Path,
) -> None:
    """Observation 8: a lockstep rank reports `waiting: 1` but never outputs, and keeps
    sending load-only batches. After the stall WAKE and the silence timeout it is dead
    for "no progress" (not silence: it talked all along), and the group fails."""
    async with group_of(tmp_path, 2, lockstep=True, stall_timeout=0.2, silence_timeout=0.5) as (
        group,
        engines,
    ):
        e0, e1 = engines
        e0.load_override = Load(waiting=1, running=0, kv=0.0)
        stream = group.submit(Request("stuck", {"hold": True}, rank=0))
        await e0.wait_for(lambda: stream.wire_id in e0.held)

        async def report_load() -> None:  # the stuck engine's scheduler loop
            while True:
                await e0.emit()
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report_load)
            with pytest.raises(EngineDead, match=r"rank 0, request 'stuck'.*no progress"):
                await stream.receive()
            nursery.cancel_scope.cancel()
        stats = group.statistics()
        assert stats.stall_wakes == 1
        assert stats.ranks[0].batches >= 5  # it kept talking past the silence timeout
        await e1.wait_for(lambda: wakes(e1) == [0, 0])  # after the ADD, then the stall
        with pytest.raises(GroupClosed, match="lockstep group failed"):
            group.submit(Request("next"))


async def test_no_stall_wake_after_an_idle_period(tmp_path: Path) -> None:
    """Observation 8: a lockstep group idle for longer than `stall_timeout`, then a
    request that reports waiting work and completes promptly: no stall WAKE (the
    stall clock starts when the rank starts holding the request)."""
    async with group_of(tmp_path, 2, lockstep=True, stall_timeout=0.2, silence_timeout=5.0) as (
        group,
        engines,
    ):
        e0, e1 = engines
        e0.load_override = Load(waiting=1, running=0, kv=0.0)
        assert (await collect(group, Request("warm-up", "x", rank=0)))[0].body == "x"
        # idle for twice the stall timeout (nothing should happen meanwhile)
        with trio.move_on_after(0.4) as idle:
            await group.rank_state(0).wait_value(RankState.DOWN)
        assert idle.cancelled_caught
        async with group.submit(Request("prompt", {"hold": True}, rank=0)) as stream:
            await e0.wait_for(lambda: stream.wire_id in e0.held)
            # the client has applied `waiting: 1` and has had its chance to act on it
            await wait_until(lambda: group.statistics().ranks[0].load.waiting == 1)
            await trio.testing.wait_all_tasks_blocked()
            await finish(e0, stream.wire_id)
            assert [o async for o in stream] == [Output("prompt", "done", "stop")]
        stats = group.statistics()
        assert stats.stall_wakes == 0
        assert stats.finished == 2
        await e1.wait_for(lambda: len(wakes(e1)) >= 2)
        assert wakes(e1) == [0, 0]  # one WAKE after each request's ADD, nothing more


# -- 9. a wave report outside [0, 2^63 - 1] ---------------------------------------------


@pytest.mark.parametrize("key", ["start_wave", "wave_complete"])
async def test_a_wave_of_2_64_minus_1_is_a_connection_error_and_never_a_wake(
    tmp_path: Path, key: str
) -> None:
    """Observation 9: `start_wave` (or `wave_complete`) 2**64 - 1 is a connection
    error: the rank dies and the lockstep group fails; the client never sends a WAKE
    above 2**63 - 1 (an engine would have to refuse it)."""
    async with group_of(tmp_path, 2, lockstep=True) as (group, engines):
        e0, e1 = engines
        s0 = group.submit(Request("a", {"hold": True}, rank=0))
        s1 = group.submit(Request("b", {"hold": True}, rank=1))
        await e0.wait_for(lambda: s0.wire_id in e0.held)
        await e1.wait_for(lambda: s1.wire_id in e1.held)
        eng = the_engine(e0)
        body = {"rank": 0, "epoch": eng.epoch, key: 2**64 - 1}
        await eng.send_raw_for_testing([cbor2.dumps(body)])
        with pytest.raises(EngineDead, match=r"rank 0, request 'a'.*connection error"):
            await s0.receive()
        with pytest.raises(GroupClosed, match=r"lockstep group failed.*rank 0"):
            await s1.receive()
        with pytest.raises(GroupClosed):
            group.submit(Request("c", rank=1))
        clock = group.statistics().wave
        assert clock is not None and clock <= INT_MAX
        # The ABORT sent to rank 1 at the failure follows any WAKE sent before it.
        await e1.wait_for(lambda: Abort((s1.wire_id,)) in e1.inbox)
        for e in engines:
            assert all(0 <= w <= INT_MAX for w in wakes(e)), wakes(e)
            assert the_engine(e).statistics().undecodable == 0


# -- 10. invalid HELLO from an up rank; invalid READY -----------------------------------


@pytest.mark.parametrize(
    "fields",
    [{"lockstep": "yes"}, {"size": 3}],
    ids=["undecodable HELLO", "wrong size"],
)
async def test_an_invalid_hello_from_an_up_rank_is_a_rejoin_and_a_reject(
    ctx: Any, tmp_path: Path, fields: dict[str, Any]
) -> None:
    """Observation 10: an invalid HELLO from the identity of an up rank is answered with
    REJECT naming HELLO, and makes that rank's previous incarnation dead: its requests
    fail with `EngineDead` saying that the rank said HELLO again (a rejoin), whatever
    was wrong with the HELLO. The other rank keeps serving."""
    url = f"ipc://{tmp_path}/g"
    async with group_of(tmp_path, 2) as (group, engines):
        e1 = engines[1]
        async with group.submit(Request("r", {"hold": True}, rank=1)) as stream:
            await e1.wait_for(lambda: stream.wire_id in e1.held)
            intruder = RawEngine(ctx, url, 1, 2)
            reply = await intruder.hello(intruder.hello_body(**fields))
            intruder.close()
            assert isinstance(reply, Reject), reply
            assert "HELLO" in reply.reason
            if "lockstep" in fields:
                assert "invalid HELLO" in reply.reason
            with pytest.raises(EngineDead, match=r"rank 1, request 'r'") as info:
                await stream.receive()
        assert "said HELLO again (rejoin)" in info.value.cause
        assert group.engines[1].state is RankState.DOWN
        assert (await collect(group, Request("s", "x", rank=0)))[0].body == "x"
        # ROUTER_HANDOVER gave rank 1's handshake identity to the intruder and left the
        # real engine's connection open with no route. Once the intruder left, the
        # RESYNC found no route, so the client ended that connection: the engine
        # reconnected, heard the next RESYNC and came back (issue 24 #2).
        with trio.fail_after(5):
            await group.rank_state(1).wait_value(RankState.UP)
        assert (await collect(group, Request("t", "y", rank=1)))[0].body == "y"
        assert group.statistics().routes_restored >= 1


async def test_an_invalid_ready_is_rejected_as_ready(ctx: Any, tmp_path: Path) -> None:
    """Observation 10: a malformed READY after a valid HELLO is answered with a REJECT
    whose reason says "invalid READY" (not "invalid HELLO"); the group still forms
    once a valid engine takes the rank."""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ScriptedEngine(url, 0, 2).run)
        async with group_in_background(url, 2) as box:
            eng = RawEngine(ctx, url, 1, 2)
            init = await eng.hello()
            assert isinstance(init, Init)
            await eng.ready(info=[1])
            reply = await eng.reply()
            eng.close()
            assert isinstance(reply, Reject), reply
            assert "invalid READY" in reply.reason
            assert "invalid HELLO" not in reply.reason
            assert not box.ready.is_set()
            nursery.start_soon(ScriptedEngine(url, 1, 2).run)
            group = await box.wait()
            assert (await collect(group, Request("ok", "x", rank=1)))[0].body == "x"
        nursery.cancel_scope.cancel()


# -- 11. an ExceptionGroup raised in the user's block -----------------------------------


async def test_a_users_exception_group_passes_out_unchanged(tmp_path: Path) -> None:
    """Observation 11: an `ExceptionGroup` raised inside `async with
    EngineGroup.connect(...)` comes out as it was raised: the same object, with the
    same leaves, so `except*` works."""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        await start_engines(nursery, url, 1)
        mine = ExceptionGroup("mine", [ValueError("v"), KeyError("k")])
        with pytest.raises(ExceptionGroup) as info:
            async with EngineGroup.connect(url, 1, ready_timeout=READY_TIMEOUT):
                raise mine
        assert info.value is mine
        assert [type(e) for e in info.value.exceptions] == [ValueError, KeyError]
        assert not getattr(info.value, "__notes__", None)

        caught: list[BaseException] = []
        try:
            async with EngineGroup.connect(url, 1, ready_timeout=READY_TIMEOUT):
                raise ExceptionGroup("again", [ValueError("only")])
        except* ValueError as eg:
            caught += eg.exceptions
        assert [str(e) for e in caught] == ["only"]
        nursery.cancel_scope.cancel()


# -- 12. one stream, two readers ---------------------------------------------------------


async def test_a_second_reader_of_one_stream_gets_busy_resource_error(tmp_path: Path) -> None:
    """Observation 12: while one task waits on a `RequestStream`, a second task that
    iterates it gets `trio.BusyResourceError`; the first still gets every output."""
    async with group_of(tmp_path, 1) as (group, engines):
        e0 = engines[0]
        got: list[Output] = []
        async with group.submit(Request("r", {"hold": True})) as stream:
            await e0.wait_for(lambda: stream.wire_id in e0.held)

            async def reader() -> None:
                got.extend([out async for out in stream])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                await trio.testing.wait_all_tasks_blocked()  # the reader is parked
                with pytest.raises(trio.BusyResourceError):
                    await stream.receive()
                with pytest.raises(trio.BusyResourceError):
                    async for _ in stream:
                        pass  # pragma: no cover
                await finish(e0, stream.wire_id)
        assert got == [Output("r", "done", "stop")]
        with pytest.raises(trio.EndOfChannel):  # the clean end, for any later reader
            await stream.receive()
        assert [out async for out in stream] == []


# -- found by a hostile review of revision 2 ------------------------------------------


@pytest.mark.parametrize(
    "serial", ["\u00b2", "9" * 5000, ""], ids=["unicode digit", "5000 digits", "empty"]
)
async def test_a_stray_wire_id_of_any_form_is_counted_not_fatal(
    tmp_path: Path, serial: str
) -> None:
    """`int()` refuses Unicode digits and huge strings; the stray check must not."""
    async with group_of(tmp_path, 1) as (group, engines):
        await engines[0].emit((Output(f"zz#{serial}", 1, "stop"),))
        await wait_until(lambda: group.statistics().unknown_outputs == 1)
        assert (await collect(group, Request("ok", 1)))[0].body == 1


async def test_a_cancelled_read_can_be_retried_by_the_same_task(tmp_path: Path) -> None:
    async with group_of(tmp_path, 1) as (group, engines):
        stream = group.submit(Request("r", {"hold": True}))
        async with stream:
            await engines[0].wait_for(lambda: engines[0].holds("r"))
            scope = trio.CancelScope()

            async def cancel_once_parked() -> None:
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_once_parked)
                with scope:
                    await stream.receive()  # parks, then is cancelled
            assert scope.cancelled_caught
            await engines[0].finish("r")
            assert await stream.receive() == Output("r", "done", "stop")


async def test_an_abort_queued_just_before_close_reaches_the_engine(tmp_path: Path) -> None:
    """§9: the ABORT of a stream left early, right before the group closes."""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        [engine] = await start_engines(nursery, url, 1)
        async with EngineGroup.connect(url, 1, ready_timeout=READY_TIMEOUT) as group:
            stream = group.submit(Request("r", {"hold": True}))
            async with stream:
                await engine.wait_for(lambda: engine.holds("r"))
        await engine.wait_for(lambda: any(isinstance(m, Abort) for m in engine.inbox))
        assert [m.ids for m in engine.inbox if isinstance(m, Abort)] == [(stream.wire_id,)]
        nursery.cancel_scope.cancel()


async def holding_engine(url: str, inbox: list[Any], **kw: Any) -> None:
    """Rank 0 of 1: holds every request, records every inbound message."""
    async with connect_engine(url, rank=0, size=1, **kw) as eng:
        async for msg in eng:
            inbox.append(msg)


async def test_the_aborts_at_close_fit_the_engines_max_message_size(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    inbox: list[Any] = []
    ids = [f"{i:03d}" + "x" * 400 for i in range(40)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(holding_engine, url, inbox, max_message_size=4096))
        async with EngineGroup.connect(url, 1, ready_timeout=READY_TIMEOUT) as group:
            streams = [group.submit(Request(i, {"hold": True})) for i in ids]
            await wait_until(lambda: sum(isinstance(m, Add) for m in inbox) == len(ids))
        aborted: set[str] = set()
        await wait_until(
            lambda: (
                aborted.update(i for m in inbox if isinstance(m, Abort) for i in m.ids)
                or len(aborted) == len(ids)
            )
        )
        assert aborted == {s.wire_id for s in streams}
        nursery.cancel_scope.cancel()


async def test_unknown_or_malformed_handshake_messages_from_an_up_rank_do_not_kill_it(
    ctx: Any, tmp_path: Path
) -> None:
    """Only an invalid HELLO is a rejoin (§7)."""
    url = f"ipc://{tmp_path}/g"
    async with group_in_background(url, 1) as box:
        engine = RawEngine(ctx, url, 0, 1)
        await engine.handshake()
        group = await box.wait()
        for body in ({"type": "ping"}, {"type": "register", "epoch": -1}):
            await engine.hs.send([cbor2.dumps(body)])
        await wait_until(lambda: group.statistics().ignored_handshake_messages == 2)
        assert group.engines[0].state is RankState.UP
        engine.close()


async def test_a_peer_that_floods_hellos_and_never_reads_holds_up_nobody(
    ctx: Any, tmp_path: Path
) -> None:
    url = f"ipc://{tmp_path}/g"
    async with group_in_background(url, 1) as box:
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.setsockopt(zmq.ROUTING_ID, rank_identity(7))
        rogue.setsockopt(zmq.RCVHWM, 10)
        rogue.connect(url)
        hello = cbor2.dumps(
            {"type": "hello", "version": 1, "rank": 7, "size": 1, "lockstep": False}
        )
        rogue.setsockopt(zmq.SNDHWM, 100_000)
        for _ in range(3000):
            rogue.send(hello, zmq.NOBLOCK)  # never a blocking zmq call inside trio
        engine = RawEngine(ctx, url, 0, 1)
        await engine.handshake()  # answered although the rogue's pipe is full
        group = await box.wait()
        await wait_until(lambda: group.statistics().rejected_hellos == 3000)
        assert group.statistics().dropped_answers > 0  # not waited for
        engine.close()
        rogue.close()

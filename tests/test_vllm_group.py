"""`zmqdp.vllm.connect`'s group end to end against the fake vLLM engines of tests/fakes/vllm.py:
dense and MoE groups, outputs and finish reasons, aborts, pinned ranks, utility calls,
load from scheduler_stats, and the fault modes of the native tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

import zmqdp.testing
import zmqdp.vllm
from tests.fakes.vllm import ENGINE_CORE_DEAD, FakeVllmGroup, output_entry, outputs_message
from zmqdp import RankState
from zmqdp._core.errors import (
    CallFailed,
    CallTimeout,
    EngineDead,
    GroupClosed,
    HandshakeTimeout,
    InvalidRank,
    InvalidRequest,
    ProtocolError,
    RequestAborted,
)
from zmqdp.vllm import SamplingParams, VllmGroup, VllmOutput, VllmRequest

from .helpers import wait_until


@asynccontextmanager
async def vllm_group(
    n: int,
    *,
    moe: bool = False,
    start: Any = None,
    fake_kw: dict[str, Any] | None = None,
    **kw: Any,
) -> AsyncIterator[tuple[VllmGroup, FakeVllmGroup]]:
    d = tempfile.mkdtemp(prefix="zv", dir="/tmp")
    fake = FakeVllmGroup(f"ipc://{d}/hs", n, moe=moe, **(fake_kw or {}))
    try:
        async with trio.open_nursery() as nursery:
            fake.nursery = nursery
            for e in fake.engines:
                if start is None or e.rank in start:
                    nursery.start_soon(e.run)
            kw.setdefault("ready_timeout", 5.0)
            async with zmqdp.vllm.connect(fake.url, n, moe=moe, **kw) as group:
                yield group, fake
            nursery.cancel_scope.cancel()
    finally:
        fake.close()
        shutil.rmtree(d, ignore_errors=True)


def req(rid: str, max_tokens: int = 4, **kw: Any) -> VllmRequest:
    sampling = kw.pop("sampling", SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return VllmRequest(rid, kw.pop("prompt", [10, 20]), sampling, **kw)


async def collect(group: VllmGroup, r: VllmRequest) -> tuple[list[int], list[Any]]:
    tokens: list[int] = []
    outs = []
    async with group.submit(r) as stream:
        async for out in stream:
            assert isinstance(out.body, VllmOutput)
            tokens += out.body.token_ids
            outs.append(out)
    return tokens, outs


async def test_dense_group_streams_tokens_and_spreads_requests() -> None:
    async with vllm_group(2) as (group, fake):
        assert [e.info["max_num_seqs"] for e in group.engines] == [256, 256]
        results: dict[str, tuple[list[int], list[Any]]] = {}

        async def one(i: int) -> None:
            results[f"r{i}"] = await collect(group, req(f"r{i}", max_tokens=5))

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
        for tokens, outs in results.values():
            assert tokens == [21, 22, 23, 24, 25]
            assert [o.finish for o in outs][-1] == "length"
            assert all(o.finish is None for o in outs[:-1])
        adds = [len(e.got("add")) for e in fake.engines]
        assert sum(adds) == 6 and min(adds) >= 1
        stats = group.statistics()
        assert stats.finished == 6 and stats.protocol_errors == 0 and stats.fallbacks == 0


async def test_finish_reasons_eos_and_stop_token() -> None:
    async with vllm_group(1) as (group, _):
        tokens, outs = await collect(group, req("eos", max_tokens=50, eos_token_id=23))
        assert tokens == [21, 22, 23]
        assert (outs[-1].finish, outs[-1].body.stop_reason) == ("stop", None)
        sp = SamplingParams(max_tokens=50, stop_token_ids=[22])
        tokens, outs = await collect(group, req("stop", sampling=sp))
        assert tokens == [21, 22]
        assert (outs[-1].finish, outs[-1].body.stop_reason) == ("stop", 22)
        sp = SamplingParams(max_tokens=3, ignore_eos=True)
        tokens, outs = await collect(group, req("ign", sampling=sp, eos_token_id=22))
        assert tokens == [21, 22, 23] and outs[-1].finish == "length"


async def test_the_add_carries_what_the_caller_gave() -> None:
    async with vllm_group(2) as (group, fake):
        r = req("p", max_tokens=2, rank=1, priority=3, eos_token_id=99)
        await collect(group, r)
        [add] = fake.engines[1].got("add")
        assert add[0].startswith("p#") and add[1] == [10, 20]
        assert add[8] == 1 and add[13] == 3 and add[16] == "p"  # rank, priority, external id
        assert add[3]["_eos_token_id"] == 99 and add[3]["max_tokens"] == 2
        assert fake.engines[0].got("add") == []


async def test_bad_sampling_params_are_refused_at_submit() -> None:
    async with vllm_group(1) as (group, fake):
        with pytest.raises(InvalidRequest, match="temperature"):
            group.submit(req("bad", sampling=SamplingParams(temperature=5.0)))
        with pytest.raises(InvalidRequest, match="prompt_token_ids"):
            group.submit(req("bad", prompt=[]))
        assert group.statistics().rolled_back == 2 and fake.engines[0].got("add") == []


async def test_requests_are_fitted_to_the_model_length_as_vllm_does() -> None:
    """max_tokens=None is "up to max_model_len" (the engine itself would fail on None);
    a prompt that leaves no room for one token is refused at submit, naming the limit."""
    async with vllm_group(1) as (group, fake):
        assert group.engines[0].info["max_model_len"] == 4096
        r = req("open", sampling=SamplingParams(max_tokens=None, stop_token_ids=[22]))
        tokens, _ = await collect(group, r)
        assert tokens == [21, 22]
        [add] = fake.engines[0].got("add")
        assert add[3]["max_tokens"] == 4096 - 2
        with pytest.raises(
            InvalidRequest,
            match=r"^request 'long' cannot be sent: the prompt has 4096 tokens; "
            r"the engines' max_model_len is 4096$",
        ):
            group.submit(req("long", prompt=[1] * 4096))
        assert len(fake.engines[0].got("add")) == 1


async def test_a_wave_past_the_wire_range_kills_its_rank_not_the_clock() -> None:
    """A start_wave of 2**64-1 would become the clock and every WAKE (and overflow the
    engines' wave counters): the message is a connection error of its rank."""
    async with vllm_group(2, silence_timeout=5.0) as (group, fake):
        fake.engines[1].send_raw([outputs_message(1, start_wave=2**64 - 1)])
        await group.rank_state(1).wait_value(lambda s: s is not RankState.UP)
        stats = group.statistics()
        assert group.wave.value != 2**64 - 1 and stats.protocol_errors == 1
        tokens, _ = await collect(group, req("after", rank=0))
        assert tokens == [21, 22, 23, 24]


async def test_abort_reaches_the_engine_and_ends_the_stream() -> None:
    async with vllm_group(2) as (group, fake):
        async with group.submit(req("long", max_tokens=10**9, rank=0)) as stream:
            first = await stream.receive()
            assert first.finish is None
            await group.abort("long")
            with pytest.raises(RequestAborted):
                async for _ in stream:
                    pass
        e = fake.engines[0]
        await e.wait_for(lambda: e.got("abort"))
        assert e.got("abort") == [[stream.wire_id]]
        await e.wait_for(lambda: not e.requests)
        assert group.statistics().aborted == 1


async def test_utility_calls() -> None:
    async with vllm_group(2) as (group, fake):
        assert await group.call(1, "is_sleeping") is False
        assert await group.call(0, "echo", 1, "a", [2]) == [1, "a", [2]]

        def boom() -> None:
            raise RuntimeError("boom")

        fake.engines[1].utilities["reset_prefix_cache"] = boom
        with pytest.raises(CallFailed, match="boom") as info:
            await group.call(1, "reset_prefix_cache")
        assert info.value.rank == 1
        with pytest.raises(CallTimeout):
            await group.call(0, "never_answers", timeout=0.2)
        ids = [u[1] for e in fake.engines for u in e.got("utility")]
        assert len(set(ids)) == 4 and all(0 <= i < 2**64 for i in ids)


async def test_least_loaded_uses_scheduler_stats() -> None:
    async with vllm_group(2) as (group, fake):
        fake.engines[0].stats_override = {
            "num_running_reqs": 1,
            "num_waiting_reqs": 50,
            "kv_cache_usage": 0.9,
        }
        async with group.submit(req("busy", max_tokens=10**9, rank=0)) as stream:
            await stream.receive()
            assert group.statistics().ranks[0].load.waiting == 50
            for i in range(3):
                await collect(group, req(f"x{i}", max_tokens=1))
            assert len(fake.engines[1].got("add")) == 3
            await group.abort("busy")


async def test_handshake_timeout_names_the_missing_ranks() -> None:
    d = tempfile.mkdtemp(prefix="zv", dir="/tmp")
    fake = FakeVllmGroup(f"ipc://{d}/hs", 3)
    fake.engines[2].no_ready = True
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fake.engines[0].run)
            nursery.start_soon(fake.engines[2].run)
            with pytest.raises(HandshakeTimeout) as info:
                async with zmqdp.vllm.connect(fake.url, 3, ready_timeout=1.0):
                    pass
            nursery.cancel_scope.cancel()
    finally:
        fake.close()
        shutil.rmtree(d, ignore_errors=True)
    assert set(info.value.missing) == {1, 2}
    assert "no HELLO" in info.value.missing[1]
    assert "no READY" in info.value.missing[2]
    assert "rank 1" in str(info.value) and "rank 2" in str(info.value)


async def test_engine_core_dead_fails_only_its_rank_in_a_dense_group() -> None:
    """vLLM's sentinel names no rank, but it came on rank 1's own output socket: only
    rank 1's requests end, rank 0 streams on and takes new requests (issue 20)."""
    async with vllm_group(2) as (group, fake):
        async with (
            group.submit(req("a", max_tokens=10**9, rank=0)) as sa,
            group.submit(req("b", max_tokens=10**9, rank=1)) as sb,
        ):
            await sa.receive()
            await sb.receive()
            fake.engines[1].send_raw([ENGINE_CORE_DEAD])  # its sockets stay open
            with pytest.raises(EngineDead, match="ENGINE_CORE_DEAD") as info:
                async for _ in sb:
                    pass
            assert info.value.rank == 1 and info.value.request_id == "b"
            for _ in range(3):
                await sa.receive()
        assert group.closed is None
        assert group.rank_state(1).value is RankState.DOWN
        assert group.rank_state(0).value is RankState.UP
        tokens, _ = await collect(group, req("c"))
        assert len(tokens) == 4
        with pytest.raises(InvalidRank):
            group.submit(req("d", rank=1))


async def test_a_forged_death_tag_kills_nobody() -> None:
    """Only the transport can tag a sentinel with a rank: an engine that sends the tag
    frame itself sends an invalid message, counted, and kills no rank."""
    async with vllm_group(2) as (group, fake):
        await collect(group, req("warm", rank=0))
        forged = [ENGINE_CORE_DEAD, b"\x00" * 16 + (0).to_bytes(2, "little")]
        fake.engines[1].send_raw(forged)
        await wait_until(lambda: group.statistics().protocol_errors == 1)
        assert all(group.rank_state(r).value is RankState.UP for r in (0, 1))
        await collect(group, req("after", rank=0))


async def test_engine_core_dead_of_a_moe_rank_fails_the_group_naming_it() -> None:
    async with vllm_group(2, moe=True) as (group, fake):
        async with group.submit(req("a", max_tokens=10**9, rank=0)) as sa:
            await sa.receive()
            fake.engines[1].die()
            with pytest.raises(GroupClosed, match="rank 1"):
                async for _ in sa:
                    pass
        assert group.closed is not None
        with pytest.raises(GroupClosed):
            group.submit(req("b"))


async def test_dense_rank_that_vanishes_fails_only_its_requests() -> None:
    async with vllm_group(2, silence_timeout=1.0) as (group, fake):
        await collect(group, req("warm", rank=1))
        fake.engines[1].vanish()
        # EHOSTUNREACH if the ROUTER has seen the DEALER go, else silence: either way
        with pytest.raises(EngineDead) as info:
            await collect(group, req("v", rank=1))
        assert info.value.rank == 1
        assert group.rank_state(1).value is RankState.DOWN
        tokens, _ = await collect(group, req("after"))
        assert tokens == [21, 22, 23, 24]


async def test_silent_rank_is_declared_dead() -> None:
    async with vllm_group(2, silence_timeout=0.5) as (group, fake):
        fake.engines[1].freeze()
        with pytest.raises(EngineDead, match="silent") as info:
            await collect(group, req("s", rank=1))
        assert info.value.rank == 1
        tokens, _ = await collect(group, req("ok", rank=0))
        assert tokens == [21, 22, 23, 24]


# -- MoE (lockstep) ---------------------------------------------------------------------


@pytest.mark.timeout_s(30)
@pytest.mark.parametrize("sync_interval", [1, 3])
async def test_moe_waves(sync_interval: int) -> None:
    """Requests pinned to one rank finish only if the other rank is woken (it must join
    every collective); the group parks between rounds and is woken again."""
    async with vllm_group(2, moe=True, fake_kw={"sync_interval": sync_interval}) as (group, fake):
        assert fake.engines[0].init is not None
        pc = fake.engines[0].init["parallel_config"]
        assert (
            pc["data_parallel_size"] == 2 and fake.engines[0].init["addresses"]["coordinator_input"]
        )
        seen = group.wave.value
        assert seen == 0
        for round_ in range(3):
            for rank in (0, 1):
                tokens, outs = await collect(
                    group, req(f"m{round_}{rank}", max_tokens=3, rank=rank)
                )
                assert tokens == [21, 22, 23] and outs[-1].finish == "length"
                await group.wave.wait_value(lambda w, s=seen: w > s)  # the group parked
                seen = group.wave.value
        # The group parks as one: every rank idle at the wave the client's clock is at (a
        # late START_DP_WAVE may run an empty wave first, so wait for it to settle).
        await wait_until(
            lambda: (
                all(not e.engines_running for e in fake.engines)
                and {e.current_wave for e in fake.engines} == {group.wave.value}
            )
        )
        adds = [a for e in fake.engines for a in e.got("add")]
        assert all(a[12] <= group.wave.value for a in adds)  # never stamped above c
        assert group.statistics().stall_wakes == 0


async def test_moe_concurrent_requests_both_ranks() -> None:
    async with vllm_group(2, moe=True) as (group, _fake):
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(collect, group, req(f"c{i}", max_tokens=4))
        assert group.statistics().finished == 8


async def test_moe_rank_death_fails_the_whole_group() -> None:
    async with vllm_group(2, moe=True, silence_timeout=0.5) as (group, fake):
        await collect(group, req("w", max_tokens=2, rank=0))
        fake.engines[1].freeze()
        fake.engines[0].freeze()
        with pytest.raises((EngineDead, GroupClosed)):
            await collect(group, req("x", max_tokens=2, rank=1))
        assert group.closed is not None and "lockstep" in group.closed.cause


# -- the native tests' fault modes, on vLLM's wire --------------------------------------


async def test_dense_rank_that_restarts_is_taken_back() -> None:
    """A new HELLO from a rank is a rejoin: its old incarnation's requests fail with
    EngineDead, the new one is handshaken again (init, ready response, READY) and serves.
    (vLLM has no RESYNC: a rank comes back only by saying HELLO again.)"""
    async with vllm_group(2, silence_timeout=10.0) as (group, fake):
        async with group.submit(req("held", max_tokens=10**9, rank=1)) as stream:
            await stream.receive()
            fake.engines[1].vanish()  # the engine process dies ...
            again = fake.restart(1)
            assert fake.nursery is not None
            fake.nursery.start_soon(again.run)  # ... and is restarted
            # its connection's close, or its HELLO, whichever the client sees first
            with pytest.raises(EngineDead, match=r"rejoin|connection closed") as info:
                async for _ in stream:
                    pass
            assert info.value.rank == 1
        await group.rank_state(1).wait_value(RankState.UP)
        tokens, _ = await collect(group, req("back", rank=1))
        assert tokens == [21, 22, 23, 24] and again.got("add")
        stats = group.statistics()
        assert stats.failed == 1 and stats.finished == 1


async def test_moe_rank_that_restarts_fails_the_group() -> None:
    async with vllm_group(2, moe=True, silence_timeout=10.0) as (group, fake):
        await collect(group, req("w", max_tokens=2, rank=0))
        fake.engines[1].vanish()
        assert fake.nursery is not None
        fake.nursery.start_soon(fake.restart(1).run)
        await group.rank_state(1).wait_value(RankState.DOWN)
        assert group.closed is not None
        assert "rejoin" in group.closed.cause or "connection closed" in group.closed.cause


@pytest.mark.timeout_s(30)
async def test_moe_stalled_rank_gets_a_stall_start_dp_wave() -> None:
    """A START_DP_WAVE lost on one rank (here dropped, as a vLLM engine drops them after
    a pause consensus) leaves the rank holding the request alone in its collective: it
    published waiting work and delivers nothing, so after `stall_timeout` the client
    sends zmqdp's stall WAKE, START_DP_WAVE(c, None), and the group runs again."""
    async with vllm_group(2, moe=True, stall_timeout=0.3, silence_timeout=5.0) as (group, fake):
        e0, e1 = fake.engines
        # Rank 1 drops every START_DP_WAVE before the stall WAKE: the post-ADD one and the
        # answer to rank 0's start_wave (one message or two: the client may coalesce).
        e1.ignore_start_dp_wave = lambda: group.statistics().stall_wakes == 0
        async with group.submit(req("s", max_tokens=3, rank=0)) as stream:
            tokens = [t async for out in stream for t in out.body.token_ids]
        assert tokens == [21, 22, 23]
        stats = group.statistics()
        assert stats.stall_wakes == 1 and stats.finished == 1
        starts = e1.got("start_dp_wave")
        dropped = e1.dropped_starts
        assert dropped in (1, 2) and starts[dropped] == [0, None]  # the stall WAKE
        await group.wave.wait_value(lambda w: w >= 1)  # and it parks again, as one
        await e1.wait_for(lambda: not e1.engines_running)
        assert e0.current_wave == e1.current_wave


async def test_garbage_output_messages_are_counted_not_fatal() -> None:
    """A message on the output PULL that is not an EngineCoreOutputs names no rank (vLLM's
    output socket carries no identity): counted and logged; nobody dies."""
    async with vllm_group(2) as (group, fake):
        async with group.submit(req("g", max_tokens=10**9, rank=0)) as stream:
            await stream.receive()
            for frames in ([b"\xc1garbage"], [b""], [b"\x93\x01\x02"], [outputs_message(7)]):
                fake.engines[0].send_raw(frames)
            while group.statistics().protocol_errors < 4:  # the stream keeps flowing
                await stream.receive()
            await group.abort("g")
        stats = group.statistics()
        assert stats.protocol_errors == 4
        assert [group.rank_state(r).value for r in (0, 1)] == [RankState.UP, RankState.UP]
        tokens, _ = await collect(group, req("after", rank=0))
        assert tokens == [21, 22, 23, 24]


async def test_a_malformed_entry_ends_only_its_request_and_aborts_it() -> None:
    async with vllm_group(1) as (group, fake):
        e = fake.engines[0]
        async with (
            group.submit(req("bad", max_tokens=10**9)) as bad,
            group.submit(req("good", max_tokens=10**9)) as good,
        ):
            await bad.receive()
            await good.receive()
            entries = [
                output_entry(bad.wire_id, "not a list", None),  # type: ignore[arg-type]
                output_entry(good.wire_id, [7], None),
            ]
            e.send_raw([outputs_message(0, entries)])
            with pytest.raises(ProtocolError, match="malformed entry"):
                async for _ in bad:
                    pass
            # the good entry of that message was delivered, in order
            seen: list[int] = []
            while 7 not in seen:
                seen += (await good.receive()).body.token_ids
            # the engine is told to stop the request zmqdp ended
            await e.wait_for(lambda: [bad.wire_id] in e.got("abort"))
            await e.wait_for(lambda: bad.wire_id not in e.requests)
            await group.abort("good")
        stats = group.statistics()
        assert stats.malformed_entries == 1 and stats.protocol_failed == 1
        assert group.rank_state(0).value is RankState.UP


async def test_parallel_config_hash_mismatch_names_the_rank() -> None:
    """MoE: a READY whose parallel_config_hash differs from the expected one is rejected
    (vLLM: "Configuration mismatch detected for engine N"); the rank stays down and the
    handshake timeout names it and why."""
    d = tempfile.mkdtemp(prefix="zv", dir="/tmp")
    fake = FakeVllmGroup(f"ipc://{d}/hs", 2, moe=True)
    fake.engines[1].config_hash = "other-hash"
    try:
        async with trio.open_nursery() as nursery:
            for e in fake.engines:
                nursery.start_soon(e.run)
            with pytest.raises(HandshakeTimeout) as info:
                async with zmqdp.vllm.connect(
                    fake.url, 2, moe=True, ready_timeout=1.0, parallel_config_hash="fake-hash"
                ):
                    pass
            nursery.cancel_scope.cancel()
    finally:
        fake.close()
        shutil.rmtree(d, ignore_errors=True)
    assert set(info.value.missing) == {1}
    assert "parallel_config_hash 'other-hash' differs from 'fake-hash'" in info.value.missing[1]


@pytest.mark.parametrize(
    ("url", "who"), [("tcp://0.0.0.0:0", "other machines"), ("tcp://127.0.0.1:0", "every local")]
)
async def test_a_tcp_url_needs_insecure(url: str, who: str) -> None:
    """Loopback too (issue 24 #3): vLLM's wire has no keys, and every local user can
    connect to a loopback port."""
    with pytest.raises(ValueError, match=rf"{who}.*no authentication.*insecure=True"):
        async with zmqdp.vllm.connect(url, 1, ready_timeout=0.1):
            pass  # pragma: no cover


async def test_every_receiving_socket_bounds_its_frames() -> None:
    async with vllm_group(1, max_message_size=1 << 20) as (group, _):
        limits = zmqdp.testing.message_size_limits(group)
        assert limits == {"handshake": (1 << 20,), "input": (1 << 20,), "output": (1 << 20,)}


async def test_an_output_over_max_message_size_fails_its_rank_instead_of_hanging() -> None:
    """libzmq drops a frame over `max_message_size` with the connection, and vLLM's PUSH
    reconnects: the requests of that rank used to wait forever (issue 24 #1). The close
    of the rank's output connection is now its connection error; the other rank serves
    on."""
    async with vllm_group(2, max_message_size=1 << 16) as (group, fake):
        async with (
            group.submit(req("a", max_tokens=10**9, rank=0)) as sa,
            group.submit(req("b", max_tokens=10**9, rank=1)) as sb,
        ):
            await sa.receive()
            await sb.receive()
            fake.engines[1].send_raw([b"x" * (1 << 17)])
            with pytest.raises(EngineDead, match="max_message_size=65536") as info:
                async for _ in sb:
                    pass
            assert info.value.rank == 1 and info.value.request_id == "b"
            for _ in range(3):
                await sa.receive()
        assert group.statistics().connections_lost == 1
        assert group.rank_state(0).value is RankState.UP


async def test_the_old_spelling_still_connects_and_warns() -> None:
    """`VllmEngineGroup.connect` (deprecated for one release) warns and yields the same
    `EngineGroup` as `zmqdp.vllm.connect`; the group speaks vLLM's wire."""
    from zmqdp import EngineGroup
    from zmqdp.vllm import VllmEngineGroup

    d = tempfile.mkdtemp(prefix="zv", dir="/tmp")
    fake = FakeVllmGroup(f"ipc://{d}/hs", 1)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fake.engines[0].run)
                with pytest.warns(DeprecationWarning, match="zmqdp.vllm.connect"):
                    cm = VllmEngineGroup.connect(fake.url, 1, ready_timeout=5.0)
                async with cm as group:
                    assert isinstance(group, EngineGroup)
                    assert group.wire_version(0) == "0.33"
                    tokens, _ = await collect(group, req("old"))
                    assert len(tokens) == 4
                nursery.cancel_scope.cancel()
    finally:
        fake.close()
        shutil.rmtree(d, ignore_errors=True)


async def test_options_come_as_keywords_or_as_one_record_not_both() -> None:
    from zmqdp import ConnectOptions

    with pytest.raises(TypeError, match="not both"):
        async with zmqdp.vllm.connect(
            "ipc:///tmp/zmqdp-never", 1, options=ConnectOptions(), ready_timeout=1.0
        ):
            pass
    with pytest.raises(TypeError):
        async with zmqdp.vllm.connect("ipc:///tmp/zmqdp-never", 1, no_such_option=1):
            pass
    with pytest.raises(ValueError, match="max_buffered"):
        ConnectOptions(max_buffered=0)


async def test_a_native_request_on_vllms_wire_is_refused_before_anything_is_sent() -> None:
    from zmqdp import InvalidRequest, Request

    async with vllm_group(1) as (group, fake):
        with pytest.raises(InvalidRequest, match="VllmRequest"):
            group.submit(Request("native", {"prompt": [1]}))  # type: ignore[arg-type]
        assert group.statistics().submitted == 0 and not fake.engines[0].got("add")


async def test_a_message_on_a_ranks_socket_is_that_ranks_whatever_its_engine_index() -> None:
    """Rank 1's engine (or whoever connects to rank 1's output socket) sends outputs
    that say engine_index 0 and finish rank 0's live request with a forged token. They
    used to be rank 0's. A message on rank r's socket is rank r's: it is counted
    against rank 1, rank 0's request runs on untouched, and garbage on rank 1's
    socket is counted against rank 1 too (it used to be counted against no rank)."""
    async with vllm_group(2) as (group, fake):
        async with group.submit(req("a", max_tokens=10**9, rank=0)) as stream:
            await stream.receive()
            (wire_id,) = fake.engines[0].requests
            forged = output_entry(wire_id, [999], 0)  # FinishReason.STOP
            fake.engines[1].send_raw([outputs_message(0, [forged])])
            await wait_until(lambda: group.statistics().ranks[1].protocol_errors == 1)
            fake.engines[1].send_raw([b"\xc1 not msgpack"])
            await wait_until(lambda: group.statistics().ranks[1].protocol_errors == 2)
            for _ in range(3):  # rank 0's own outputs go on; the forged one never came
                out = await stream.receive()
                assert out.finish is None and 999 not in out.body.token_ids
        stats = group.statistics()
        assert stats.ranks[0].protocol_errors == 0
        assert all(group.rank_state(r).value is RankState.UP for r in (0, 1))
        tokens, _ = await collect(group, req("after", rank=1))
        assert len(tokens) == 4

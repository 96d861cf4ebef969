"""A failed lockstep group that waits for its ranks instead of closing (issue 20,
`ConnectOptions.recover`), over real sockets on both wires.

While it waits: every request of the failed incarnation has ended, `submit` raises
`GroupRecovering` (a `GroupClosed`), `health()` is live and not ready, `closed` says
why. It serves again once every rank has completed a new handshake, and nothing of
the failed incarnation reaches the new one.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

import zmqdp.testing
import zmqdp.vllm
from tests.fakes.vllm import FakeVllmGroup, outputs_message
from zmqdp import EngineGroup, GroupClosed, GroupRecovering, RankState, Request
from zmqdp.mock import mock_process
from zmqdp.vllm import SamplingParams, VllmRequest

from .helpers import collect, wait_until


def body(tokens: int) -> dict[str, Any]:
    return {"prompt": [1, 2, 3], "max_tokens": tokens}


def assert_waiting(group: Any, make: Any) -> None:
    assert isinstance(group.closed, GroupRecovering), group.closed
    with pytest.raises(GroupRecovering, match="waits for every rank"):
        group.submit(make("refused"))
    health = group.health()
    assert health.live and not health.ready


async def back(group: Any) -> None:
    """Every rank is up again: the group serves (the last rank up ends the wait)."""
    with trio.fail_after(20):
        for rank in range(group.size):
            await group.rank_state(rank).wait_value(RankState.UP)
    assert group.closed is None and group.health().ready


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize("fault", ["kill", "dead"])
async def test_native_failed_group_replaced_by_a_new_one_is_taken_back(
    tmp_path: Path, fault: str
) -> None:
    """Rank 1 of a lockstep group dies (its process is killed: its connections close;
    or it announces `dead`): the group fails whole and waits. Its process is replaced
    by a new engine group on the same URL, and the client, still open, takes it back
    (SMG needs a new client for this). The RESYNCed survivors of a `dead` may say HELLO
    again first (a lockstep mock whose rank died cannot run on, as a real MoE group
    cannot): the replacement ends them, and the group waits again until it is whole."""
    url = f"ipc://{tmp_path}/g"
    args = ["--lockstep", "--step-time", "0.002"]
    first = mock_process(url, 2, *args, *(["--fault", "1:dead=3"] if fault == "dead" else []))
    proc = await first.__aenter__()
    try:
        async with EngineGroup.connect(url, 2, recover=True) as group:
            async with group.submit(Request("doomed", body(10**6), rank=1)) as stream:
                await stream.receive()
                if fault == "kill":
                    proc.kill()
                with trio.fail_after(5), pytest.raises((zmqdp.EngineDead, GroupClosed)):
                    async for _ in stream:
                        pass
            if isinstance(group.closed, GroupRecovering):
                assert_waiting(group, lambda rid: Request(rid, body(2)))
            await first.__aexit__(None, None, None)
            async with mock_process(url, 2, *args):
                await back(group)
                outs = [await collect(group, Request(f"b{r}", body(3), rank=r)) for r in (0, 1)]
                assert all(o[-1].finish == "length" for o in outs)
                assert group.closed is None and group.health().ranks_up == 2
    finally:
        await first.__aexit__(None, None, None)


@pytest.mark.timeout_s(60)
async def test_a_recovery_whose_rank_never_returns_ends_after_recover_timeout(
    tmp_path: Path,
) -> None:
    """A lockstep group whose killed rank never comes back used to wait forever, live
    (a gateway answered 503 while its /health said 200, so no liveness probe restarted
    it). The wait now ends after `recover_timeout`: the group is closed for good,
    naming the rank, and `health()` is not live. The request of the killed rank ends
    with the plain cause, not with the loss of outputs of a live engine."""
    url = f"ipc://{tmp_path}/g"
    async with (
        mock_process(url, 2, "--lockstep", "--step-time", "0.002") as proc,
        EngineGroup.connect(url, 2, recover=True, recover_timeout=1.0) as group,
    ):
        async with group.submit(Request("doomed", body(10**6), rank=1)) as stream:
            await stream.receive()
            proc.kill()
            # the first rank seen dead fails the group: EngineDead or GroupClosed
            with trio.fail_after(5), pytest.raises((zmqdp.EngineDead, GroupClosed)) as caught:
                async for _ in stream:
                    pass
        assert "may be lost" not in str(caught.value), caught.value
        assert group.health().recovering
        with trio.fail_after(10):
            await wait_until(lambda: not group.health().live)
        closed = group.closed
        assert isinstance(closed, GroupClosed) and not isinstance(closed, GroupRecovering)
        assert "did not complete a new handshake within recover_timeout=1 s" in str(closed)
        assert not group.health().recovering


@asynccontextmanager
async def moe_fakes(url: str, **kw: Any) -> AsyncIterator[FakeVllmGroup]:
    fake = FakeVllmGroup(url, 2, moe=True, **kw)
    try:
        async with trio.open_nursery() as nursery:
            fake.nursery = nursery
            for engine in fake.engines:
                nursery.start_soon(engine.run)
            yield fake
            nursery.cancel_scope.cancel()
    finally:
        fake.close()


def vreq(rid: str, tokens: int = 4, rank: int | None = None) -> VllmRequest:
    return VllmRequest(rid, [10, 20], SamplingParams(temperature=0.0, max_tokens=tokens), rank=rank)


@pytest.mark.timeout_s(60)
async def test_vllm_moe_group_restarted_while_a_survivor_lingers() -> None:
    """A MoE rank dies: the group waits (vLLM engines cannot be RESYNCed). The old rank
    0 lingers, still connected to its output socket and sending. A new engine group
    says HELLO: the survivor's messages, a wave far ahead among them, never reach the
    new group (they come on a connection of a previous incarnation), and the new group
    serves."""
    d = tempfile.mkdtemp(prefix="zr", dir="/tmp")
    url = f"ipc://{d}/hs"
    ctx: Any = zmq.Context()
    lingering = ctx.socket(zmq.PUSH)
    lingering.setsockopt(zmq.LINGER, 0)
    try:
        async with (
            moe_fakes(url) as old,
            zmqdp.vllm.connect(url, 2, moe=True, recover=True, ready_timeout=10) as group,
        ):
            await collect(group, vreq("warm", 2, rank=0))
            survivor = old.engines[0]
            lingering.connect(survivor.init["addresses"]["outputs"][0])
            old.engines[1].die()
            with trio.fail_after(5):
                await group.rank_state(1).wait_value(RankState.DOWN)
            assert_waiting(group, vreq)
            survivor.vanish()  # its own sockets go; the lingering connection stays
            lingering.send(outputs_message(0, wave_complete=10**6))
            with trio.fail_after(5):
                await wait_until(lambda: group.statistics().stale_messages >= 1)
            async with moe_fakes(url) as new:
                await back(group)
                stale = group.statistics().stale_messages
                lingering.send(outputs_message(0, wave_complete=10**6))
                with trio.fail_after(5):
                    await wait_until(lambda: group.statistics().stale_messages > stale)
                for rank in (0, 1):
                    tokens = await collect(group, vreq(f"new-{rank}", 3, rank=rank))
                    assert len(tokens) == 3
                assert group.wave.value is not None and group.wave.value < 1000
                assert all(new.engines[r].got("add") for r in (0, 1))
    finally:
        lingering.close()
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout_s(60)
async def test_vllm_moe_restart_while_the_old_group_hangs_keeps_the_new_handshakes() -> None:
    """A new engine group says HELLO while the old one is still connected and hung:
    each new HELLO is a rejoin, the first fails the lockstep group, and the handshakes
    those HELLOs started go on (a rejoin must not forget the incarnation that is
    joining): the group serves again, and the old engines' end kills nobody."""
    d = tempfile.mkdtemp(prefix="zr", dir="/tmp")
    url = f"ipc://{d}/hs"
    try:
        async with (
            moe_fakes(url) as old,
            zmqdp.vllm.connect(url, 2, moe=True, recover=True, ready_timeout=10) as group,
        ):
            await collect(group, vreq("warm", 2, rank=0))
            for engine in old.engines:
                engine.freeze()  # hung, their connections open
            async with moe_fakes(url) as new:  # its own DP collective, as new processes
                with trio.fail_after(5):  # the first new HELLO fails the group
                    await wait_until(lambda: group.closed is not None)
                await back(group)
                for rank in (0, 1):
                    assert len(await collect(group, vreq(f"after-{rank}", 2, rank=rank))) == 2
                before = zmqdp.testing.open_connections(group)
                for engine in old.engines:
                    engine.vanish()  # the hung predecessors finally go: nobody dies of it
                with trio.fail_after(5):
                    await wait_until(lambda: zmqdp.testing.open_connections(group) <= before - 2)
                assert all(group.rank_state(r).value is RankState.UP for r in (0, 1))
                assert group.statistics().connections_lost == 0
                assert len(await collect(group, vreq("after-all", 2, rank=0))) == 2
                assert all(new.engines[r].got("add") for r in (0, 1))
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout_s(60)
async def test_vllm_predecessor_closing_during_the_replacements_handshake_kills_nobody() -> None:
    """Dense group: rank 0's old engine is hung, its replacement says HELLO, and the old
    one dies between that HELLO and the replacement's ready response (a real engine
    loads its model in between). The old input connection is no longer rank 0's life:
    the replacement comes up and serves."""
    d = tempfile.mkdtemp(prefix="zr", dir="/tmp")
    url = f"ipc://{d}/hs"
    fake = FakeVllmGroup(url, 2)
    try:
        async with trio.open_nursery() as nursery:
            fake.nursery = nursery
            for engine in fake.engines:
                nursery.start_soon(engine.run)
            async with zmqdp.vllm.connect(url, 2, ready_timeout=10) as group:
                await collect(group, vreq("warm", 2, rank=0))
                old0 = fake.engines[0]
                old0.freeze()
                transport = group._transport
                answer = transport._on_handshake_message

                def then_kill_the_old_one(frames: list[bytes], fd: int) -> None:
                    answer(frames, fd)
                    if frames[0] == b"\0\0":  # the replacement's HELLO, answered
                        old0.vanish()

                transport._on_handshake_message = then_kill_the_old_one  # type: ignore[method-assign]
                nursery.start_soon(fake.restart(0).run)
                with trio.fail_after(10):
                    await wait_until(lambda: old0.stopped.is_set())
                    await group.rank_state(0).wait_value(RankState.UP)
                assert len(await collect(group, vreq("after", 2, rank=0))) == 2
                assert group.rank_state(0).value is RankState.UP
            nursery.cancel_scope.cancel()
    finally:
        fake.close()
        shutil.rmtree(d, ignore_errors=True)

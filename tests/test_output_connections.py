"""A rank's output connection on the native wire (`_sockets.py`, "liveness: the output
socket"): which connection is the current incarnation's, and what a lost output does.
Real sockets; each engine is played by hand (`RawEngine`) so that the order of events is
exactly the one under test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio
import zmq

from zmqdp import EngineDead, Output, Request
from zmqdp._addresses import parse_group_url
from zmqdp._core.handshake import rank_identity
from zmqdp._core.messages import Init
from zmqdp._zmq import ZSocket

from .helpers import RawEngine, group_in_background, raw, wait_until


async def _connect(zs: ZSocket, address: str) -> None:
    """Connects `zs` and waits until it has completed a ZMTP handshake. The monitor is
    attached before the connect: attached after it, a handshake already done is never
    reported, and the wait hangs (seen in CI under load)."""
    monitor = ZSocket(zs.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
    try:
        zs.sock.connect(address)
        await monitor.receive_batch(1)
    finally:
        zs.sock.disable_monitor()
        monitor.close()


async def test_a_previous_incarnations_output_connection_never_claims_the_rank(
    ctx: Any, tmp_path: Path
) -> None:
    """A restarted client: the engine's output socket of its previous incarnation
    reconnects to the new client and delivers a batch of the old epoch, while the
    engine says HELLO again and opens its new output connection. The old connection
    used to be missed by the snapshot taken at the HELLO (nobody had read the output
    monitor yet), so its stale batch claimed the rank, and the new incarnation's first
    output was judged a takeover (OUTPUT_TAKEN): the new client's first request failed.
    Under CPU load the same happened to rejoins; here the order is forced: the old
    connection is accepted before the HELLO, during the initial handshake."""
    url = f"ipc://{tmp_path}/g"
    output_address = parse_group_url(url, None).output
    async with group_in_background(url, 1) as box:
        old = raw(ctx, zmq.DEALER, rank_identity(0))
        await _connect(old, output_address)
        await old.send([cbor2.dumps({"rank": 0, "epoch": 7, "outputs": []})])
        engine = RawEngine(ctx, url, 0, 1)
        init = await engine.hello()
        assert isinstance(init, Init) and init.epoch != 7
        engine.inp = raw(ctx, zmq.DEALER, engine.identity)
        engine.inp.sock.connect(init.input)
        await engine.ready()
        await engine.register(init.epoch)
        group = await box.wait()
        # the stale batch is read while the old connection still has the identity
        await wait_until(lambda: group.statistics().stale_messages >= 1)
        engine.out = raw(ctx, zmq.DEALER, engine.identity)  # the new incarnation's
        engine.out.sock.connect(init.output)
        with trio.fail_after(10):
            async with group.submit(Request("first", None)) as stream:
                add = await engine.request()
                first = {"id": add.id, "body": "a", "finish": None}
                await engine.send_batch({"epoch": init.epoch, "outputs": [first]})
                assert await stream.receive() == Output("first", "a", None)
                await wait_until(lambda: group.statistics().ranks[0].batches >= 1)
                last = {"id": add.id, "body": "b", "finish": "stop"}
                await engine.send_batch({"epoch": init.epoch, "outputs": [last]})
                assert [out async for out in stream] == [Output("first", "b", "stop")]
        assert group.statistics().connections_lost == 0
        old.close()
        engine.close()


async def test_an_oversized_first_output_ends_its_request_with_the_rank(
    ctx: Any, tmp_path: Path
) -> None:
    """libzmq drops a message over `max_message_size` with its connection. When it was
    the engine's first output after its HELLO, nobody had claimed that connection, so
    its close killed nobody; the engine's DEALER reconnected, its next batches claimed
    the new connection, and the request stayed live for as long as the rank sent
    anything. The gap in `seq` (§4) now says what was lost: the rank's connection
    error, which ends the request."""
    url = f"ipc://{tmp_path}/g"
    limit = 1 << 16
    async with group_in_background(url, 1, max_message_size=limit) as box:
        engine = RawEngine(ctx, url, 0, 1)
        init = await engine.handshake()
        group = await box.wait()
        with trio.fail_after(10):
            async with group.submit(Request("big", None)) as stream:
                add = await engine.request()
                huge = {"id": add.id, "body": "x" * (2 * limit), "finish": None}
                await engine.send_batch({"epoch": init.epoch, "seq": 0, "outputs": [huge]})
                await engine.send_batch({"epoch": init.epoch, "seq": 1, "outputs": []})
                with pytest.raises(EngineDead, match="seq 0 never arrived") as caught:
                    await stream.receive()
                assert caught.value.rank == 0 and caught.value.request_id == "big"
        engine.close()


async def test_a_gap_in_seq_of_an_idle_rank_kills_nothing(ctx: Any, tmp_path: Path) -> None:
    """A rank that holds no request lost nothing anyone waits for: it stays up."""
    url = f"ipc://{tmp_path}/g"
    async with group_in_background(url, 1) as box:
        engine = RawEngine(ctx, url, 0, 1)
        init = await engine.handshake()
        group = await box.wait()
        await engine.send_batch({"epoch": init.epoch, "seq": 5, "outputs": []})
        await wait_until(lambda: group.statistics().ranks[0].batches == 1)
        with trio.fail_after(10):
            async with group.submit(Request("next", None)) as stream:
                add = await engine.request()
                done = {"id": add.id, "body": "ok", "finish": "stop"}
                await engine.send_batch({"epoch": init.epoch, "seq": 6, "outputs": [done]})
                assert [out async for out in stream] == [Output("next", "ok", "stop")]
        engine.close()

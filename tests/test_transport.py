"""The trio adapter for pyzmq, the grouped handshake and the engine-side API, over real
ipc and tcp loopback sockets. Every test runs under the absolute time limit of
conftest.py."""

from __future__ import annotations

import logging
import os
import random
import socket
import stat
from functools import partial
from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio
import trio.testing
import zmq

import zmqdp.testing
from zmqdp import EngineDead, HandshakeRejected, HandshakeTimeout, Request
from zmqdp._core.codec import decode_batch, decode_handshake, encode_request
from zmqdp._core.handshake import rank_identity
from zmqdp._core.messages import Add, Init, Output, OutputBatch, Reject, Resync, Wake
from zmqdp._sockets import GroupTransport, open_group_transport
from zmqdp._transport import TransportListener
from zmqdp._util import LogLimiter
from zmqdp._zmq import POLLIN, ZSocket
from zmqdp.engine import connect_engine

from .helpers import (
    READY_TIMEOUT,
    RawEngine,
    client_in_background,
    free_tcp_url,
    group_in_background,
    group_of,
    raw,
)


@pytest.fixture
def ipc_url(tmp_path: Path) -> str:
    directory = tmp_path / "run"
    return f"ipc://{directory}/g"


# -- the adapter ----------------------------------------------------------------------


async def test_burst_of_5000_is_drained_after_a_single_wakeup(ctx: Any) -> None:
    rx = raw(ctx, zmq.PULL)
    rx.sock.bind("inproc://burst")
    tx = ctx.socket(zmq.PUSH)
    tx.setsockopt(zmq.SNDHWM, 0)
    tx.connect("inproc://burst")
    for i in range(5000):
        tx.send(i.to_bytes(4, "little"), zmq.NOBLOCK)
    got: list[bytes] = []
    while len(got) < 5000:
        got += [m[0] for m in await rx.receive_batch(limit=256)]
    stats = rx.statistics()
    assert [int.from_bytes(m, "little") for m in got] == list(range(5000))
    assert stats.waits <= 1 and stats.fallbacks == 0
    assert stats.batches == -(-5000 // 256)  # one checkpoint per batch, not per message
    tx.close()
    rx.close()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_a_message_whose_fd_edge_was_consumed_is_still_received(
    ctx: Any, tmp_path: Path, transport: str
) -> None:
    """The missed-wakeup regression (docs/design.md, "The ZeroMQ fd rules"): reading
    EVENTS consumes the fd's edge while a message stays queued. A loop that waits on
    the fd without checking EVENTS first hangs."""
    address = f"ipc://{tmp_path}/mw" if transport == "ipc" else "tcp://127.0.0.1:*"
    router = raw(ctx, zmq.ROUTER)
    router.sock.bind(address)
    endpoint = router.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    dealer = raw(ctx, zmq.DEALER, b"\x01\x00")
    dealer.sock.connect(endpoint)
    assert router.receive_nowait() == []  # nothing queued yet
    await dealer.send([b"ping"])
    # Spin on EVENTS (each read may consume the edge) until the message is queued.
    while not router._getsockopt(zmq.EVENTS) & POLLIN:
        await trio.lowlevel.checkpoint()
    with trio.move_on_after(0.2) as naive:
        await trio.lowlevel.wait_readable(router.fd)  # the naive wait: edge is gone
    assert naive.cancelled_caught, "the fd was readable; the hazard did not occur"
    assert await router.receive_batch() == [[b"\x01\x00", b"ping"]]
    assert router.statistics().fallbacks == 0
    router.close()
    dealer.close()


async def test_cancelled_receive_loses_nothing(ctx: Any) -> None:
    rx = raw(ctx, zmq.PULL)
    rx.sock.bind("inproc://cancel")
    tx = ctx.socket(zmq.PUSH)
    tx.connect("inproc://cancel")
    with trio.CancelScope() as scope:
        scope.cancel()
        await rx.receive_batch()  # cancelled before touching the socket
    tx.send(b"one", zmq.NOBLOCK)
    with trio.CancelScope() as scope:
        scope.cancel()
        await rx.receive_batch()
    assert await rx.receive_batch() == [[b"one"]]
    rx.release()  # hand it to a task that will be cancelled while parked
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rx.receive_batch)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    rx.release()  # the cancelled task owned it
    tx.send(b"two", zmq.NOBLOCK)
    assert await rx.receive_batch() == [[b"two"]]
    tx.close()
    rx.close()


async def test_one_task_per_socket_is_enforced(ctx: Any) -> None:
    rx = raw(ctx, zmq.PULL)
    rx.sock.bind("inproc://owner")
    rx.receive_nowait()
    errors: list[BaseException] = []

    async def intruder() -> None:
        try:
            rx.receive_nowait()
        except trio.BusyResourceError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(intruder)
    assert len(errors) == 1 and "owned by task" in str(errors[0])
    rx.close()


async def test_closing_with_queued_messages_returns_promptly(ctx: Any, tmp_path: Path) -> None:
    context = zmq.Context()
    tx = ZSocket(context.socket(zmq.DEALER))
    tx.sock.setsockopt(zmq.SNDHWM, 100_000)
    tx.sock.connect(f"ipc://{tmp_path}/nobody-listens")
    for _ in range(5000):
        assert tx.send_nowait([b"x" * 100])
    start = trio.current_time()
    tx.close()
    # context.term() hangs on unsent messages unless LINGER is 0
    await trio.to_thread.run_sync(context.term, abandon_on_cancel=True)
    assert trio.current_time() - start < 1.0


# -- handshake ------------------------------------------------------------------------


async def run_engine(
    url: str, rank: int, size: int, *, started: trio.Event | None = None, **kw: Any
) -> None:
    """A small engine: answers every ADD with one terminal output."""
    async with connect_engine(url, rank=rank, size=size, info={"rank": rank}, **kw) as eng:
        if started is not None:
            started.set()  # INIT received: the client has admitted this rank's HELLO
        async for msg in eng:
            if isinstance(msg, Add):
                out = Output(msg.id, {"rank": rank, "echo": msg.body}, "stop")
                await eng.send(OutputBatch(rank=rank, outputs=(out,)))


async def round_trip(transport: GroupTransport) -> None:
    """Send one ADD to every rank and collect the answers on the output socket."""
    await round_trip_to(transport, *range(transport.size))


async def round_trip_to(transport: GroupTransport, *ranks: int) -> None:
    """Send one ADD to each of `ranks` and collect the answers on the output socket."""
    for rank in ranks:
        transport.send(rank, encode_request(Add(f"r{rank}", rank)))
    seen: dict[int, Any] = {}
    while len(seen) < len(ranks):
        for identity, body in await transport.output.receive_batch():
            batch = decode_batch(body)
            assert rank_identity(batch.rank) == identity
            seen[batch.rank] = batch.outputs[0].body
    assert seen == {r: {"rank": r, "echo": r} for r in ranks}


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["ipc", "tcp"])
async def test_handshake_in_random_start_order(n: int, kind: str, ipc_url: str) -> None:
    url = ipc_url if kind == "ipc" else free_tcp_url()
    rng = random.Random(n * 31 + len(kind))
    order = list(range(n))
    rng.shuffle(order)
    early = order[: rng.randint(0, n)]  # these start before the client binds
    async with trio.open_nursery() as nursery:
        for rank in early:
            nursery.start_soon(run_engine, url, rank, n)
        await trio.testing.wait_all_tasks_blocked()

        async def late() -> None:
            for rank in order:
                if rank not in early:
                    nursery.start_soon(run_engine, url, rank, n)
                    await trio.lowlevel.checkpoint()

        nursery.start_soon(late)
        async with open_group_transport(
            url, n, ready_timeout=READY_TIMEOUT, insecure=kind == "tcp"
        ) as transport:
            assert transport.state.ready()
            assert transport.state.lockstep is False
            assert [transport.state.info(r) for r in range(n)] == [{"rank": r} for r in range(n)]
            await round_trip(transport)
            stats = transport.statistics()
            assert stats.handshake.fallbacks == stats.input.fallbacks == 0
            assert stats.output.fallbacks == 0
        nursery.cancel_scope.cancel()


async def raw_hello(ctx: Any, url: str, identity: bytes, **fields: Any) -> Init | Reject:
    hello = {"type": "hello", "version": 1, "rank": 0, "size": 2, "lockstep": False, **fields}
    dealer = raw(ctx, zmq.DEALER, identity)
    dealer.sock.connect(url)
    await dealer.send([cbor2.dumps(hello)])
    while True:  # the client RESYNCs ranks it waits for: one may come first
        [[body]] = await dealer.receive_batch(1)
        reply = decode_handshake(body)
        if not isinstance(reply, Resync):
            break
    dealer.close()
    assert isinstance(reply, Init | Reject)
    return reply


BAD_HELLOS: dict[str, tuple[bytes, dict[str, Any], str]] = {
    "out-of-range rank": (rank_identity(5), {"rank": 5}, "rank 5 is out of range"),
    "identity differs": (rank_identity(1), {"rank": 0}, "identity is rank 1"),
    "wrong size": (rank_identity(1), {"rank": 1, "size": 3}, "size 3"),
    "wrong version": (rank_identity(1), {"rank": 1, "version": 2}, "version 2"),
    "mixed lockstep": (rank_identity(1), {"rank": 1, "lockstep": True}, "lockstep=True"),
    "bad identity": (b"\x01", {"rank": 1}, "2 little-endian bytes"),
    "undecodable": (rank_identity(1), {"lockstep": "yes"}, "lockstep"),
}


@pytest.mark.parametrize("case", BAD_HELLOS.values(), ids=BAD_HELLOS.keys())
async def test_bad_hellos_are_rejected_and_the_group_still_forms(
    ctx: Any, ipc_url: str, case: tuple[bytes, dict[str, Any], str]
) -> None:
    identity, fields, reason = case
    async with trio.open_nursery() as nursery, client_in_background(ipc_url, 2) as box:
        started = trio.Event()
        nursery.start_soon(partial(run_engine, ipc_url, 0, 2, started=started))
        await started.wait()
        reply = await raw_hello(ctx, ipc_url, identity, **fields)
        assert isinstance(reply, Reject) and reason in reply.reason, reply
        assert not box.ready.is_set()
        nursery.start_soon(run_engine, ipc_url, 1, 2)
        transport = await box.wait()
        assert transport.state.ready() and list(transport.state.rejected) == [reply.reason]
        await round_trip(transport)
        nursery.cancel_scope.cancel()


async def test_engine_sees_reject_with_the_clients_reason(ipc_url: str) -> None:
    async with client_in_background(ipc_url, 2):
        with pytest.raises(HandshakeRejected, match="size 3, the client expects 2") as info:
            await run_engine(ipc_url, 1, 3)
        assert info.value.rank == 1


async def test_engine_restarting_mid_handshake_is_admitted_again(ctx: Any, ipc_url: str) -> None:
    async with trio.open_nursery() as nursery, client_in_background(ipc_url, 2) as box:
        nursery.start_soon(run_engine, ipc_url, 0, 2)
        # rank 1's first incarnation says HELLO, gets INIT, and dies before READY
        reply = await raw_hello(ctx, ipc_url, rank_identity(1), rank=1)
        assert isinstance(reply, Init)
        nursery.start_soon(run_engine, ipc_url, 1, 2)
        transport = await box.wait()
        # Its connection's close (seen by the monitor) or the second HELLO (a rejoin)
        # ended the first incarnation, whichever the client saw first; never both.
        lost = transport.statistics().connections_lost
        assert transport.state.rejoins[0] == 0 and transport.state.rejoins[1] + lost == 1
        await round_trip(transport)
        nursery.cancel_scope.cancel()


async def test_resync_makes_the_engine_handshake_again(ipc_url: str) -> None:
    seen: list[object] = []

    async def engine() -> None:
        async with connect_engine(ipc_url, rank=0, size=1) as eng:
            async for msg in eng:
                seen.append(msg)
                if isinstance(msg, Add):
                    await eng.send(OutputBatch(0, outputs=(Output(msg.id, 1, "stop"),)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        async with open_group_transport(ipc_url, 1) as transport:
            first_epoch = transport.state.epoch(0)
            transport.forget(0)  # as the client does for a rank it declared dead
            assert not transport.state.ready()
            while not transport.state.ready():
                await transport.ranks_changed.wait()
            assert transport.state.epoch(0) == first_epoch + 1  # a new incarnation
            transport.send(0, encode_request(Add("after", None)))
            [[_, body]] = await transport.output.receive_batch()
            batch = decode_batch(body)
            assert batch.outputs[0].request_id == "after"
            assert batch.seq == 0  # seq starts afresh with each HELLO
            assert batch.epoch == transport.state.epoch(0)
            assert transport.statistics().resyncs >= 1
        nursery.cancel_scope.cancel()
    assert isinstance(seen[0], Resync) and isinstance(seen[1], Add)


async def test_missing_rank_is_named_by_the_timeout(ctx: Any, ipc_url: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_engine, ipc_url, 0, 3)
        async with client_in_background(ipc_url, 3, ready_timeout=2.0) as box:
            reply = await raw_hello(ctx, ipc_url, rank_identity(7), rank=7, size=3)
            assert isinstance(reply, Reject), reply
            with pytest.raises(HandshakeTimeout) as info:
                await box.wait()
        nursery.cancel_scope.cancel()
    err = info.value
    assert err.missing == {1: "no HELLO yet", 2: "no HELLO yet"}
    assert "rank 1: no HELLO yet" in str(err) and "rank 2: no HELLO yet" in str(err)
    assert "rank 7 is out of range" in str(err)


class SendFailures(TransportListener):
    """Records the transport's `send_failed` reports."""

    def __init__(self) -> None:
        self.failed: list[tuple[int, str]] = []
        self.reported = trio.Event()

    def send_failed(self, rank: int, cause: str) -> None:
        self.failed.append((rank, cause))
        self.reported.set()


async def test_send_to_a_rank_that_left_is_a_clear_failure(ipc_url: str) -> None:
    listener = SendFailures()
    rank1 = trio.CancelScope()

    async def run_rank1() -> None:
        with rank1:
            await run_engine(ipc_url, 1, 2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_engine, ipc_url, 0, 2)
        nursery.start_soon(run_rank1)
        async with open_group_transport(ipc_url, 2, listener=listener) as transport:
            rank1.cancel()  # rank 1 closes its sockets: its pipes go away
            wake = encode_request(Wake(0))
            while not listener.reported.is_set():  # until the ROUTER has seen it go
                transport.send(1, wake)
                await trio.lowlevel.checkpoint()
            assert listener.failed == [(1, "not connected to the input socket (EHOSTUNREACH)")]
            assert transport.statistics().queued == (0, 0)  # rank 1's queue was dropped
            await round_trip_to(transport, 0)  # the other rank is unaffected
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("mode", [0o777, 0o770])
async def test_insecure_ipc_directory_is_refused(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(PermissionError, match="chmod go-w"):
        async with open_group_transport(f"ipc://{directory}/g", 1, ready_timeout=1):
            pass  # pragma: no cover


async def test_ipc_directory_is_created_private_and_stale_sockets_removed(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "dir"
    url = f"ipc://{directory}/g"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_engine, url, 0, 1)
        async with open_group_transport(url, 1):
            pass
        nursery.cancel_scope.cancel()
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert sorted(os.listdir(directory)) == []  # the group removed its socket files
    # a stale socket file (its process is gone) is removed instead of failing with
    # EADDRINUSE
    stale = directory / "g"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_engine, url, 0, 1)
        async with open_group_transport(url, 1) as transport:
            await round_trip(transport)
        nursery.cancel_scope.cancel()


def test_wildcard_tcp_host_needs_an_advertised_host() -> None:
    with pytest.raises(ValueError, match="advertise_host"):
        GroupTransport("tcp://0.0.0.0:5555", 1)
    transport = GroupTransport("tcp://0.0.0.0:*", 1, advertise_host="127.0.0.1", insecure=True)
    try:
        assert transport.input_address.startswith("tcp://127.0.0.1:")
        assert transport.state.input_address == transport.input_address
    finally:
        transport.close()


@pytest.mark.parametrize("mode", [0o711, 0o701, 0o750])
async def test_an_ipc_directory_others_can_enter_is_refused(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "enterable"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(PermissionError, match="chmod go-wx"):
        async with open_group_transport(f"ipc://{directory}/g", 1, ready_timeout=1):
            pass  # pragma: no cover


async def test_a_url_a_live_group_serves_is_refused_not_taken_over(ipc_url: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_engine, ipc_url, 0, 1)
        async with open_group_transport(ipc_url, 1) as first:
            with pytest.raises(FileExistsError, match="served by a live process"):
                GroupTransport(ipc_url, 1)
            await round_trip(first)  # the first group still has its sockets
        nursery.cancel_scope.cancel()


async def test_an_idle_socket_counts_no_fallbacks(ctx: Any) -> None:
    """The safety timeout firing on a socket with nothing to read is not a missed
    wake-up: only a timeout that finds the socket ready counts."""
    rx = raw(ctx, zmq.PULL)
    rx.safety_timeout = 0.01
    rx.sock.bind("inproc://idle")
    with trio.move_on_after(0.2):
        await rx.receive_batch()
    stats = rx.statistics()
    assert stats.waits >= 2 and stats.fallbacks == 0
    rx.close()


def test_what_one_peer_can_queue_is_bounded_by_max_message_size(ipc_url: str) -> None:
    for limit, output_hwm in [(64 << 20, 64), (8 << 20, 128), (1 << 20, 1000)]:
        transport = GroupTransport(ipc_url, 1, max_message_size=limit)
        try:
            hwms = [zs.sock.getsockopt(zmq.RCVHWM) for zs in (transport.handshake, transport.input)]
            assert hwms == [16, 16]
            assert transport.output.members[0].sock.getsockopt(zmq.RCVHWM) == output_hwm
        finally:
            transport.close()


def test_what_peers_cause_is_logged_ten_times_then_at_powers_of_ten(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limiter = LogLimiter(logging.getLogger("zmqdp.test"))
    with caplog.at_level(logging.WARNING, logger="zmqdp.test"):
        for _ in range(10_000):
            limiter.log(logging.WARNING, "kind", "a peer did %s", "it")
        limiter.log(logging.WARNING, "other", "another kind")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10 + 3 + 1  # 1..10, then 100, 1000, 10000; the other kind
    assert lines[10:13] == [f"a peer did it ({n} times so far)" for n in (100, 1000, 10_000)]


# -- an oversized output (issue 24 #1) -----------------------------------------------------


async def test_an_output_over_max_message_size_ends_its_request_with_the_rank(
    ctx: Any, tmp_path: Path
) -> None:
    """libzmq drops a message over `max_message_size` with its connection, and the
    engine's DEALER reconnects: the request used to stay live forever, and nothing
    counted the loss. The close of the rank's output connection is now its connection
    error."""
    url = f"ipc://{tmp_path}/g"
    limit = 1 << 16
    async with group_in_background(url, 1, max_message_size=limit) as box:
        engine = RawEngine(ctx, url, 0, 1)
        init = await engine.handshake()
        group = await box.wait()
        async with group.submit(Request("big", None)) as stream:
            add = await engine.request()
            first = {"id": add.id, "body": "first", "finish": None}
            await engine.send_batch({"epoch": init.epoch, "outputs": [first]})
            assert (await stream.receive()).body == "first"
            last = {"id": add.id, "body": "x" * (2 * limit), "finish": "stop"}
            await engine.send_batch({"epoch": init.epoch, "outputs": [last]})
            with pytest.raises(EngineDead, match="max_message_size=65536") as caught:
                await stream.receive()
            assert caught.value.rank == 0 and caught.value.request_id == "big"
        assert group.statistics().connections_lost == 1
        engine.close()


# -- what a peer can make the client buffer (issue 24) ----------------


async def test_control_sockets_take_only_small_messages(tmp_path: Path) -> None:
    """libzmq buffers a message being received in full: a peer that sends all of a
    64 MiB HELLO but its last bytes held 64 MiB per connection. The handshake and input
    sockets carry small messages only."""
    async with group_of(tmp_path, 1) as (group, _):
        limits = zmqdp.testing.message_size_limits(group)
        assert limits == {"handshake": (1 << 20,), "input": (1 << 20,), "output": (64 << 20,)}

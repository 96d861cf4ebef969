"""The engine side of docs/protocol.md revision 2: epochs, RESYNC, sizes.

The client here is a fake made of raw ROUTER sockets (`FakeClient`), so these tests
depend on nothing but the codec and `zmqdp.engine`. Socket monitors tell when a
connection was accepted or dropped, so nothing waits on a clock. Every test runs under
the absolute time limit of conftest.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio
import zmq
from hypothesis import given
from hypothesis import strategies as st
from zmq.utils.monitor import parse_monitor_message

from zmqdp._core.codec import decode_batch, decode_handshake, encode_handshake, encode_request
from zmqdp._core.errors import HandshakeRejected, HandshakeTimeout, ProtocolError
from zmqdp._core.handshake import rank_identity
from zmqdp._core.messages import (
    DEFAULT_MAX_MESSAGE_SIZE,
    Add,
    Hello,
    Init,
    Load,
    Output,
    OutputBatch,
    Ready,
    Register,
    Reject,
    Reply,
    RequestMessage,
    Resync,
)
from zmqdp._zmq import ZSocket
from zmqdp.engine import Engine, _split, connect_engine
from zmqdp.mock import MockConfig, RankFaults, run_mock_group

from .helpers import raw, wait_until

ACCEPTED = zmq.EVENT_ACCEPTED
DISCONNECTED = zmq.EVENT_DISCONNECTED


class Monitor:
    """Counts a socket's connection events."""

    def __init__(self, zs: ZSocket) -> None:
        self.sock = ZSocket(zs.sock.get_monitor_socket(ACCEPTED | DISCONNECTED), safety_timeout=30)
        self.counts: Counter[int] = Counter()

    async def wait_for(self, event: int, count: int) -> None:
        while self.counts[event] < count:
            for frames in await self.sock.receive_batch():
                self.counts[parse_monitor_message(frames)["event"]] += 1


class FakeClient:
    """The client's three ROUTERs, bound as §1 says, driven by hand (one rank)."""

    def __init__(self, ctx: Any, tmp_path: Path, size: int = 1) -> None:
        self.url = f"ipc://{tmp_path}/g"
        self.size = size
        self.hs = self._router(ctx, self.url)
        self.inp = self._router(ctx, f"{self.url}.in")
        self.out = self._router(ctx, f"{self.url}.out")
        self.inp_events = Monitor(self.inp)
        self.out_events = Monitor(self.out)
        self.identity = rank_identity(0)
        self.register_body = b""
        self.handed_over: list[list[bytes]] = []

    @staticmethod
    def _router(ctx: Any, address: str) -> ZSocket:
        zs = raw(ctx, zmq.ROUTER)
        zs.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        zs.sock.bind(address)
        return zs

    async def hello(self) -> Hello:
        [[identity, body]] = await self.hs.receive_batch(1)
        msg = decode_handshake(body)
        assert isinstance(msg, Hello) and identity == self.identity, msg
        return msg

    async def init(self, epoch: int | None, **kw: Any) -> None:
        init = Init(f"{self.url}.in", f"{self.url}.out", self.size, epoch=epoch, **kw)
        await self.hs.send([self.identity, encode_handshake(init)])

    async def ready(self) -> Ready:
        [[_, body]] = await self.hs.receive_batch(1)
        msg = decode_handshake(body)
        assert isinstance(msg, Ready), msg
        return msg

    async def register(self) -> Register:
        [[identity, body]] = await self.inp.receive_batch(1)
        msg = decode_handshake(body)
        assert isinstance(msg, Register) and identity == self.identity, msg
        self.register_body = body
        return msg

    async def handshake(self, epoch: int | None, **kw: Any) -> tuple[Hello, Register]:
        hello = await self.hello()
        await self.init(epoch, **kw)
        await self.ready()
        return hello, await self.register()

    async def request(self, msg: RequestMessage) -> None:
        await self.inp.send([self.identity, *encode_request(msg)])

    async def resync(self) -> None:
        await self.hs.send([self.identity, encode_handshake(Resync())])

    async def message(self) -> list[bytes]:
        """The next message from the rank's current output connection. One still queued
        from a connection that a new one took over (ROUTER_HANDOVER) arrives under a
        temporary 5-byte identity: it is kept in `handed_over` and skipped."""
        while True:
            [[identity, *frames]] = await self.out.receive_batch(1)
            if identity == self.identity:
                return frames
            assert len(identity) == 5 and identity[0] == 0, identity
            self.handed_over.append(frames)

    async def body(self) -> bytes:
        frames = await self.message()
        assert len(frames) == 1, frames
        return frames[0]

    async def batch(self) -> OutputBatch:
        return decode_batch(await self.body())


class App:
    """The application: records its inbox; answers every ADD but a "quiet" one with one
    terminal output (echoing the ADD's body, or `pad` bytes if given). It takes what is
    waiting without a checkpoint, as a busy engine would between steps."""

    def __init__(self, url: str, *, pad: int | None = None, gated: bool = False, **kw: Any):
        self.url = url
        self.pad = pad
        self.gate = trio.Event()  # while it is not set, the application reads nothing
        if not gated:
            self.gate.set()
        self.kw = kw
        self.inbox: list[Any] = []
        self.changed = trio.Event()
        self.connected = trio.Event()
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        assert self._engine is not None
        return self._engine

    async def run(self) -> None:
        async with connect_engine(self.url, rank=0, size=1, **self.kw) as eng:
            self._engine = eng
            self.connected.set()
            while True:
                if not self.gate.is_set():  # paused (no checkpoint when it is not)
                    await self.gate.wait()
                try:
                    msg = eng.receive_nowait()
                except trio.WouldBlock:
                    msg = await eng.receive()
                self.inbox.append(msg)
                self.changed.set()
                self.changed = trio.Event()
                if isinstance(msg, Add) and msg.body != "quiet":
                    out = Output(msg.id, msg.body if self.pad is None else "x" * self.pad, "stop")
                    await eng.send(OutputBatch(0, outputs=(out,), load=Load(0, 1, 0.5)))

    async def wait_for(self, predicate: Callable[..., bool], *args: Any) -> None:
        while not predicate(*args):
            await self.changed.wait()


# -- (a) sizes and epochs in HELLO, REGISTER and batches ------------------------------


@pytest.mark.parametrize("epoch", [7, None], ids=["epoch", "revision-1-client"])
async def test_hello_says_the_size_and_register_and_batches_echo_the_epoch(
    ctx: Any, tmp_path: Path, epoch: int | None
) -> None:
    client = FakeClient(ctx, tmp_path)
    app = App(client.url, max_message_size=12345)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.run)
        hello, register = await client.handshake(epoch)
        assert hello == Hello(0, 1, False, max_message_size=12345)
        assert register == Register(epoch=epoch)
        assert ("epoch" in cbor2.loads(client.register_body)) == (epoch is not None)
        await app.connected.wait()
        assert app.engine.epoch == epoch
        for i in range(3):
            await client.request(Add(f"r{i}", i))
        bodies = [await client.body() for _ in range(3)]
        batches = [decode_batch(b) for b in bodies]
        assert [(b.epoch, b.seq) for b in batches] == [(epoch, 0), (epoch, 1), (epoch, 2)]
        assert [b.outputs[0].request_id for b in batches] == ["r0", "r1", "r2"]
        assert all(("epoch" in cbor2.loads(b)) == (epoch is not None) for b in bodies)
        nursery.cancel_scope.cancel()


async def test_hello_says_the_default_size(ctx: Any, tmp_path: Path) -> None:
    client = FakeClient(ctx, tmp_path)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(App(client.url).run)
        hello, _ = await client.handshake(1)
        assert hello.max_message_size == DEFAULT_MAX_MESSAGE_SIZE
        nursery.cancel_scope.cancel()


# -- (b) RESYNC -----------------------------------------------------------------------


async def test_resync_starts_a_new_incarnation_on_new_connections(ctx: Any, tmp_path: Path) -> None:
    client = FakeClient(ctx, tmp_path)
    app = App(client.url, gated=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.run)
        await client.handshake(1)
        await app.connected.wait()
        inbound, handshake = app.engine._in_recv, app.engine._handshake
        start = 0
        for epoch in (1, 2, 3):  # the input task's race with RESYNC, three times
            # The application reads nothing until the inbound queue is full and the
            # input task waits to hand on more ADDs; only then does the engine get
            # a RESYNC. None of those ADDs may reach the application after Resync.
            for i in range(5):
                await client.request(Add(f"early{i}", None))  # answered, old epoch
            for i in range(2000):
                await client.request(Add(f"old{i}", "quiet"))
            await wait_until(lambda: inbound.statistics().current_buffer_used == 1024)
            await client.resync()
            # INIT and RESYNC of each round so far are off the handshake socket
            await wait_until(lambda n: handshake.statistics().received == n, 2 * epoch)
            app.gate.set()
            await client.hello()
            await client.init(epoch + 1)
            await client.ready()
            assert await client.register() == Register(epoch=epoch + 1)
            # both sockets are new connections; the old ones are gone
            for events in (client.inp_events, client.out_events):
                await events.wait_for(ACCEPTED, epoch + 1)
                await events.wait_for(DISCONNECTED, epoch)
            assert app.engine.epoch == epoch + 1
            await client.request(Add(f"new{epoch}", None))
            current: list[OutputBatch] = []
            while not any(o.request_id == f"new{epoch}" for b in current for o in b.outputs):
                batch = await client.batch()
                if batch.epoch == epoch + 1:
                    current.append(batch)
                else:  # sent before the RESYNC; the client drops it
                    assert batch.epoch is not None and batch.epoch <= epoch
            assert [b.seq for b in current] == list(range(len(current)))  # from 0 again
            assert all((decode_batch(b).epoch or 0) <= epoch for [b] in client.handed_over)
            await app.wait_for(lambda m: m in app.inbox, Add(f"new{epoch}", None))
            round_, start = app.inbox[start:], len(app.inbox)
            app.gate = trio.Event()  # pause the application for the next round
            resyncs = [i for i, m in enumerate(round_) if isinstance(m, Resync)]
            assert len(resyncs) == 1
            before, after = round_[: resyncs[0]], round_[resyncs[0] + 1 :]
            assert all(isinstance(m, Add) and m.id[:3] in ("ear", "old") for m in before)
            assert after == [Add(f"new{epoch}", None)]
        stats = app.engine.statistics()
        assert (stats.handshakes, stats.resyncs, stats.fallbacks) == (4, 3, 0)
        nursery.cancel_scope.cancel()


async def test_batches_queued_before_the_new_init_are_dropped(ctx: Any, tmp_path: Path) -> None:
    client = FakeClient(ctx, tmp_path)
    app = App(client.url)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.run)
        await client.handshake(1)
        await app.connected.wait()
        await client.resync()
        await client.hello()
        await app.wait_for(lambda: Resync() in app.inbox)
        # the application answers the Resync before the client has sent INIT
        await app.engine.send(OutputBatch(0, outputs=(Output("stale", None, "stop"),)))
        assert app.engine.epoch == 1
        await client.init(2)
        await client.ready()
        await client.register()
        await app.engine.send(OutputBatch(0, outputs=(Output("fresh", None, "stop"),)))
        batch = await client.batch()  # "stale" went nowhere: "fresh" is the first
        assert (batch.epoch, batch.seq, batch.outputs[0].request_id) == (2, 0, "fresh")
        assert app.engine.statistics().stale_dropped == 1
        nursery.cancel_scope.cancel()


async def test_resync_while_waiting_for_init_is_ignored(ctx: Any, tmp_path: Path) -> None:
    client = FakeClient(ctx, tmp_path)
    app = App(client.url)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.run)
        await client.hello()
        await client.resync()  # the engine is at HELLO already: nothing to redo
        await client.init(1)
        await client.ready()
        await client.register()
        await client.request(Add("a", None))
        batch = await client.batch()
        assert (batch.epoch, batch.outputs[0].request_id) == (1, "a")
        assert app.inbox == [Add("a", None)]
        assert app.engine.statistics().resyncs == 0
        nursery.cancel_scope.cancel()


async def test_an_application_blocked_in_send_still_gets_its_resync(
    ctx: Any, tmp_path: Path
) -> None:
    """The client reads no outputs, so the application ends up blocked in `send()` and
    the inbound queue fills up. A RESYNC must still get through: the output task keeps
    dropping the stale batches, so the application reads on and takes its `Resync`."""
    client = FakeClient(ctx, tmp_path)
    client.out.sock.setsockopt(zmq.RCVHWM, 1)
    app = App(client.url, pad=1000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.run)
        await client.handshake(1)
        await app.connected.wait()
        for i in range(6000):
            await client.request(Add(f"a{i}", None))
        inbound = app.engine._in_recv
        await wait_until(lambda: inbound.statistics().current_buffer_used == 1024)
        await client.resync()
        await client.hello()
        await client.init(2)
        await client.ready()
        assert await client.register() == Register(epoch=2)
        await app.wait_for(lambda: Resync() in app.inbox)
        assert app.engine.statistics().stale_dropped > 0
        nursery.cancel_scope.cancel()


# -- (c) a connection libzmq dropped for an oversized message -------------------------


async def test_oversized_message_drops_the_input_connection_until_a_resync(
    ctx: Any, tmp_path: Path
) -> None:
    client = FakeClient(ctx, tmp_path)
    app = App(client.url, max_message_size=1000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.run)
        await client.handshake(1)
        await client.inp_events.wait_for(ACCEPTED, 1)
        await client.request(Add("huge", "x" * 5000))
        await client.inp_events.wait_for(DISCONNECTED, 1)  # the engine refused it
        await client.request(Add("lost", None))  # no connection: it goes nowhere
        await client.resync()
        await client.hello()
        await client.init(2)
        await client.ready()
        assert await client.register() == Register(epoch=2)
        await client.request(Add("ok", None))
        batch = await client.batch()
        assert (batch.epoch, batch.outputs[0].request_id) == (2, "ok")
        assert app.inbox == [Resync(), Add("ok", None)]
        nursery.cancel_scope.cancel()


# -- (d) splitting --------------------------------------------------------------------


async def test_a_batch_larger_than_the_client_accepts_is_split(ctx: Any, tmp_path: Path) -> None:
    client = FakeClient(ctx, tmp_path)
    app = App(client.url)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.run)
        await client.handshake(3, max_message_size=2000)
        await app.connected.wait()
        outputs = tuple(Output(f"r{i:03}", "t" * 90, None) for i in range(100))
        load = Load(3, 100, 0.25)
        await app.engine.send(
            OutputBatch(0, outputs=outputs, finished=("gone",), load=load, dead="bye")
        )
        bodies: list[bytes] = []
        got: list[OutputBatch] = []
        while not got or got[-1].dead is None:
            bodies.append(await client.body())
            got.append(decode_batch(bodies[-1]))
        assert len(got) > 5 and all(len(b) <= 2000 for b in bodies)
        assert tuple(o for b in got for o in b.outputs) == outputs
        assert [f for b in got for f in b.finished] == ["gone"]
        assert [b.seq for b in got] == list(range(len(got)))
        assert all(b.epoch == 3 for b in got)
        assert [b.load for b in got] == [None] * (len(got) - 1) + [load]
        assert [b.dead for b in got] == [None] * (len(got) - 1) + ["bye"]
        # the next batch carries on the numbering, and a small one is not split
        await app.engine.send(OutputBatch(0, load=load))
        assert (await client.batch()).seq == len(got)
        nursery.cancel_scope.cancel()


async def test_an_output_too_large_for_any_message_is_refused(ctx: Any, tmp_path: Path) -> None:
    client = FakeClient(ctx, tmp_path)
    app = App(client.url)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.run)
        await client.handshake(3, max_message_size=2000)
        await app.connected.wait()
        rid = "big-" + "i" * 1000
        small = Output("small", "s")
        with pytest.raises(ProtocolError, match="does not fit in one message") as info:
            await app.engine.send(OutputBatch(0, outputs=(small, Output(rid, "x" * 3000))))
        assert info.value.request_id == rid and info.value.rank == 0
        assert "2000" in str(info.value) and len(str(info.value)) < 600  # quoted, cut
        with pytest.raises(ProtocolError, match="reply to call 5"):
            await app.engine.send(OutputBatch(0, replies=(Reply(5, result="y" * 3000),)))
        # nothing was queued and no seq consumed
        await app.engine.send(OutputBatch(0, outputs=(small,)))
        batch = await client.batch()
        assert (batch.seq, batch.outputs) == (0, (small,))
        nursery.cancel_scope.cancel()


ENTRY = st.tuples(st.sampled_from(["outputs", "finished", "replies"]), st.integers(0, 400))


@given(
    entries=st.lists(ENTRY, max_size=40),
    limit=st.integers(500, 3000),
    dead=st.sampled_from([None, "d", "r" * 300]),
    seq=st.sampled_from([0, 23, 2**40]),
)
def test_split_keeps_every_entry_in_order_under_the_limit(
    entries: list[tuple[str, int]], limit: int, dead: str | None, seq: int
) -> None:
    outputs = tuple(Output(f"o{i}", "b" * n) for i, (k, n) in enumerate(entries) if k == "outputs")
    finished = tuple(f"f{i}" + "b" * n for i, (k, n) in enumerate(entries) if k == "finished")
    replies = tuple(Reply(i, result="b" * n) for i, (k, n) in enumerate(entries) if k == "replies")
    load = Load(1, 2, 0.5)
    batch = OutputBatch(
        0,
        seq=seq,
        epoch=9,
        outputs=outputs,
        finished=finished,
        replies=replies,
        load=load,
        start_wave=4,
        dead=dead,
    )
    bodies = _split(batch, limit)
    pieces = [decode_batch(b) for b in bodies]
    assert all(len(b) <= limit for b in bodies)
    assert tuple(o for p in pieces for o in p.outputs) == outputs
    assert tuple(f for p in pieces for f in p.finished) == finished
    assert tuple(r for p in pieces for r in p.replies) == replies
    assert [p.seq for p in pieces] == list(range(seq, seq + len(pieces)))
    assert all(p.epoch == 9 for p in pieces)
    *rest, last = pieces
    assert (last.load, last.start_wave, last.dead) == (load, 4, dead)
    assert all(p.load is None and p.start_wave is None and p.dead is None for p in rest)


# -- (e) raw frames -------------------------------------------------------------------


async def test_send_raw_for_testing_sends_frames_verbatim(ctx: Any, tmp_path: Path) -> None:
    client = FakeClient(ctx, tmp_path)
    app = App(client.url)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app.run)
        await client.handshake(1)
        await app.connected.wait()
        await app.engine.send_raw_for_testing([b"\xff not cbor"])
        await app.engine.send_raw_for_testing([b"a", b"", b"c"])
        await app.engine.send(OutputBatch(0))  # in order with send(), seq untouched
        assert await client.message() == [b"\xff not cbor"]
        assert await client.message() == [b"a", b"", b"c"]
        assert (await client.batch()).seq == 0
        nursery.cancel_scope.cancel()


# -- the mock --------------------------------------------------------------------------


async def test_a_mock_rank_comes_back_serving_after_resync(ctx: Any, tmp_path: Path) -> None:
    """A rank that sent garbage and announced `dead` is RESYNCed (as an independent
    client does) and serves the next incarnation; its one-shot faults do not repeat."""
    client = FakeClient(ctx, tmp_path)
    faults = {0: RankFaults(dead_after=2, garbage=1)}
    cfg = MockConfig(engines=1, step_time=0.001, faults=faults)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_mock_group, client.url, cfg)
        await client.handshake(1)
        await client.request(Add("a", {"prompt": [1], "max_tokens": 5}))
        assert await client.message() == [b"\xff not cbor"]  # through the raw hook
        batch = await client.batch()
        while batch.dead is None:
            batch = await client.batch()
        assert batch.epoch == 1
        await client.resync()
        await client.hello()
        await client.init(2)
        await client.ready()
        assert await client.register() == Register(epoch=2)
        await client.request(Add("b", {"prompt": [1], "max_tokens": 3}))
        outputs: list[Output] = []
        while not outputs or outputs[-1].finish is None:
            batch = await client.batch()
            assert batch.epoch == 2 and batch.dead is None
            outputs += batch.outputs
        assert [(o.request_id, o.finish) for o in outputs] == [
            ("b", None),
            ("b", None),
            ("b", "length"),
        ]
        nursery.cancel_scope.cancel()


# -- the first handshake's errors come out of connect_engine ---------------------------


@pytest.mark.parametrize(
    ("answer", "error", "match"),
    [
        (Reject("not today"), HandshakeRejected, "not today"),
        (Init("ipc://x.in", "ipc://x.out", 2, epoch=1), ProtocolError, "group has 2 ranks"),
        (Init("ipc://x.in", "ipc://x.out", 1, version=9), ProtocolError, "version 9"),
        (Init("bogus://x", "ipc://x.out", 1), ProtocolError, "cannot connect"),
    ],
    ids=["reject", "size", "version", "address"],
)
async def test_first_handshake_errors_are_raised_by_connect_engine(
    ctx: Any, tmp_path: Path, answer: Any, error: type[Exception], match: str
) -> None:
    client = FakeClient(ctx, tmp_path)

    async def answer_hello() -> None:
        await client.hello()
        await client.hs.send([client.identity, encode_handshake(answer)])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_hello)
        with pytest.raises(error, match=match):
            async with connect_engine(client.url, rank=0, size=1):
                pytest.fail("connect_engine yielded")  # pragma: no cover


async def test_no_init_is_a_handshake_timeout(tmp_path: Path) -> None:
    with pytest.raises(HandshakeTimeout, match="no INIT"):
        async with connect_engine(
            f"ipc://{tmp_path}/nobody", rank=0, size=1, handshake_timeout=0.2
        ):
            pytest.fail("connect_engine yielded")  # pragma: no cover

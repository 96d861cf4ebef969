"""What the client and transport tests share: small waits, group and transport setups,
raw pyzmq sockets and a rank played by hand on them (`RawEngine`).

Nothing here waits on the clock: `wait_until` checks its predicate at every scheduling
round, and every other wait is on an event. The time limit of each test is the autouse
one in conftest.py.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import cbor2
import trio
import zmq

from tests.fakes.engines import ScriptedEngine, start_engines, wait_ready
from zmqdp import EngineGroup, Output, Request
from zmqdp._core.codec import decode_handshake, decode_request, encode_handshake
from zmqdp._core.handshake import rank_identity
from zmqdp._core.messages import Init, Ready, Register, Reject, Resync
from zmqdp._sockets import GroupTransport, open_group_transport
from zmqdp._zmq import ZSocket
from zmqdp.engine import Wake
from zmqdp.keys import EngineKeys

READY_TIMEOUT = 10
"""`ready_timeout` of the groups the tests connect: a group that does not form fails
with a `HandshakeTimeout` naming the missing ranks, well within the test's time limit."""

T = TypeVar("T")


# -- waiting and reading --------------------------------------------------------------


async def wait_until(predicate: Callable[..., bool], *args: Any) -> None:
    """Check `predicate(*args)` at every scheduling round until it holds (no clock):
    for state that the package, or libzmq's I/O threads, change without telling."""
    while not predicate(*args):
        await trio.lowlevel.checkpoint()


async def collect(group: EngineGroup, request: Request) -> list[Output]:
    """Submit `request` and read its stream to the end."""
    async with group.submit(request) as stream:
        return [out async for out in stream]


def inflight(group: EngineGroup) -> list[int]:
    """The number of requests each rank holds, by rank."""
    return [r.inflight for r in group.statistics().ranks]


def wakes(engine: ScriptedEngine) -> list[int]:
    """The waves of the WAKEs `engine` received, in order."""
    return [m.wave for m in engine.inbox if isinstance(m, Wake)]


# -- groups ---------------------------------------------------------------------------


@asynccontextmanager
async def group_of(
    tmp_path: Path, n: int, *, lockstep: bool = False, **kw: Any
) -> AsyncIterator[tuple[EngineGroup, list[ScriptedEngine]]]:
    """An `EngineGroup` of `n` `ScriptedEngine`s on an ipc URL under `tmp_path`; `kw`
    goes to `EngineGroup.connect`. The engines stop when the group has closed.

    It yields once the group is up and every engine's task has set its handle: the
    group is up as soon as the last REGISTER is read, which can be before an engine's
    task resumes from `connect_engine` (a loaded machine), and a test must never see
    that half-started engine."""
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        engines = await start_engines(nursery, url, n, lockstep=lockstep)
        async with EngineGroup.connect(url, n, ready_timeout=READY_TIMEOUT, **kw) as group:
            await wait_ready(engines)
            yield group, engines
        nursery.cancel_scope.cancel()


@dataclass
class Background(Generic[T]):
    """What a background task connected (see `group_in_background`)."""

    ready: trio.Event = field(default_factory=trio.Event)
    """Set once the connection is made, or has failed."""
    done: trio.Event = field(default_factory=trio.Event)
    value: T | None = None
    error: Exception | None = None

    async def wait(self) -> T:
        """The connected object, once there is one; or the error connecting raised."""
        await self.ready.wait()
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value


@asynccontextmanager
async def _in_background(
    open_: Callable[[], AbstractAsyncContextManager[T]],
) -> AsyncIterator[Background[T]]:
    box: Background[T] = Background()

    async def run() -> None:
        try:
            async with open_() as value:
                box.value = value
                box.ready.set()
                await box.done.wait()
        except Exception as exc:
            box.error = exc
            box.ready.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        yield box
        if box.ready.is_set():
            box.done.set()  # close what was connected, as its `async with` would
        else:
            nursery.cancel_scope.cancel()  # still connecting: give up


def group_in_background(
    url: str, n: int, **kw: Any
) -> AbstractAsyncContextManager[Background[EngineGroup]]:
    """Connect an `EngineGroup` in another task, so that this task can play engines
    by hand while the group waits for them. The group closes when the block ends."""
    return _in_background(lambda: EngineGroup.connect(url, n, ready_timeout=READY_TIMEOUT, **kw))


def client_in_background(
    url: str, n: int, ready_timeout: float = READY_TIMEOUT
) -> AbstractAsyncContextManager[Background[GroupTransport]]:
    """`open_group_transport` in another task (the client side without the group), so
    that this task can play engines; the transport closes when the block ends."""
    return _in_background(lambda: open_group_transport(url, n, ready_timeout=ready_timeout))


# -- raw sockets ----------------------------------------------------------------------


def free_tcp_url() -> str:
    """A loopback tcp URL on a port that was free a moment ago (engines must know the
    port before the client has bound it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def zmq_context() -> Iterator[zmq.Context[Any]]:
    """A private pyzmq context; whatever a failed test left open is closed with it."""
    context: zmq.Context[Any] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


def raw(
    ctx: Any, kind: int, identity: bytes | None = None, options: dict[int, Any] | None = None
) -> ZSocket:
    """A `ZSocket` on a new pyzmq socket of `kind` (LINGER 0, routing id `identity`,
    and any other socket `options`, set before it connects)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    return ZSocket(sock, safety_timeout=30)


def curve_options(keys: EngineKeys) -> dict[int, Any]:
    """The socket options of a CURVE client with an engine's keys."""
    return {
        zmq.CURVE_SERVERKEY: keys.server,
        zmq.CURVE_PUBLICKEY: keys.public,
        zmq.CURVE_SECRETKEY: keys.secret,
    }


class RawEngine:
    """One rank played by hand on raw DEALERs with the rank's identity, so that a test
    can send exactly the bytes it wants. Use it from one task (ZSocket's rule).
    `options` go on every socket (`curve_options(keys)` for a CURVE group)."""

    def __init__(
        self, ctx: Any, url: str, rank: int, size: int, options: dict[int, Any] | None = None
    ) -> None:
        self.ctx = ctx
        self.rank = rank
        self.size = size
        self.options = options
        self.identity = rank_identity(rank)
        self.hs = raw(ctx, zmq.DEALER, self.identity, options)
        self.hs.sock.connect(url)
        self.inp: ZSocket | None = None
        self.out: ZSocket | None = None

    def hello_body(self, **fields: Any) -> bytes:
        hello = {
            "type": "hello",
            "version": 1,
            "rank": self.rank,
            "size": self.size,
            "lockstep": False,
            **fields,
        }
        return cbor2.dumps(hello)

    async def reply(self) -> Init | Reject:
        """The next INIT or REJECT on the handshake socket (RESYNCs are skipped: the
        client sends them to ranks it is waiting for)."""
        while True:
            [[body]] = await self.hs.receive_batch(1)
            msg = decode_handshake(body)
            if isinstance(msg, Init | Reject):
                return msg
            assert isinstance(msg, Resync), msg

    async def hello(self, body: bytes | None = None) -> Init | Reject:
        await self.hs.send([self.hello_body() if body is None else body])
        return await self.reply()

    def open_io(self, init: Init) -> None:
        """Connect input and output DEALERs once, to the addresses of the first INIT."""
        if self.inp is None:
            self.inp = raw(self.ctx, zmq.DEALER, self.identity, self.options)
            self.inp.sock.connect(init.input)
            self.out = raw(self.ctx, zmq.DEALER, self.identity, self.options)
            self.out.sock.connect(init.output)

    async def ready(self, info: Any = None) -> None:
        if info is None:
            await self.hs.send([encode_handshake(Ready({"raw": True}))])
        else:
            await self.hs.send([cbor2.dumps({"type": "ready", "info": info})])

    async def register(self, epoch: int | None) -> None:
        assert self.inp is not None
        await self.inp.send([encode_handshake(Register(epoch=epoch))])

    async def handshake(self) -> Init:
        init = await self.hello()
        assert isinstance(init, Init), init
        self.open_io(init)
        await self.ready()
        await self.register(init.epoch)
        return init

    async def request(self) -> Any:
        assert self.inp is not None
        [[kind, body]] = await self.inp.receive_batch(1)
        return decode_request(kind, body)

    async def send_batch(self, body: dict[str, Any]) -> None:
        assert self.out is not None
        await self.out.send([cbor2.dumps({"rank": self.rank, **body})])

    def close(self) -> None:
        for zs in (self.hs, self.inp, self.out):
            if zs is not None:
                zs.close()

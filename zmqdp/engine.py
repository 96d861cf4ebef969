"""The engine side of PROTOCOL.md, for people who wrap their own engine behind zmqdp.

```python
from zmqdp.engine import connect_engine, Add, Abort, Wake, Call, Resync
from zmqdp.engine import OutputBatch, Output, Load

async with connect_engine("ipc:///run/zmqdp/g1", rank=0, size=2, info={"model": "m"}) as eng:
    async for msg in eng:
        if isinstance(msg, Add):
            await eng.send(OutputBatch(rank=eng.rank, outputs=(Output(msg.id, "hi", "stop"),)))
```

Theory of operation
-------------------
`connect_engine` opens three DEALERs with the rank as routing id (2 bytes, little
endian), does the handshake (HELLO, then INIT or REJECT, then READY on the handshake
socket and REGISTER on the input socket), and runs three tasks, one per socket:

* the handshake task keeps reading the handshake socket: a RESYNC from the client is
  passed on to the application (drop every request you hold, with no outputs) and the
  handshake is then redone at once;
* the input task receives requests (ADD, ABORT, WAKE, CALL), decodes them and passes
  them on in order; it also sends REGISTER when a handshake asks for it; a request of a
  type this version does not know is ignored (§3), an undecodable one is logged and
  counted;
* the output task sends the batches the application gives to `send()`.

`seq` is filled in per incarnation (from 0 at each HELLO, +1 per batch) when a batch
leaves it as None. A REJECT ends the block with `HandshakeRejected` and the client's
reason; an INIT with another version or size ends it with `ProtocolError`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
import zmq

from ._core.codec import decode_handshake, decode_request, encode_batch, encode_handshake
from ._core.errors import HandshakeRejected, HandshakeTimeout, ProtocolError
from ._core.handshake import rank_identity
from ._core.messages import (
    PROTOCOL_VERSION,
    Abort,
    Add,
    Call,
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
    Wake,
)
from ._transport import DEFAULT_MAX_MESSAGE_SIZE
from ._util import single_exception
from ._zmq import ZSocket

__all__ = [
    "Abort",
    "Add",
    "Call",
    "Engine",
    "EngineStatistics",
    "Inbound",
    "Load",
    "Output",
    "OutputBatch",
    "Reply",
    "Resync",
    "Wake",
    "connect_engine",
]

log = logging.getLogger("zmqdp.engine")

Inbound = RequestMessage | Resync


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    handshakes: int
    received: int
    sent: int
    undecodable: int
    unknown_types: int
    fallbacks: int


class Engine:
    """One connected rank. Iterate it for inbound messages; `send()` output batches."""

    def __init__(
        self,
        url: str,
        rank: int,
        size: int,
        lockstep: bool,
        info: Mapping[str, Any],
        wave: int | None,
        handshake_timeout: float,
        max_message_size: int,
    ) -> None:
        self.url = url
        self.rank = rank
        self.size = size
        self.lockstep = lockstep
        self.info = dict(info)
        self.wave = wave
        self.handshake_timeout = handshake_timeout
        self.init: Init | None = None
        self._identity = rank_identity(rank)
        self._max_message_size = max_message_size
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._handshake = self._dealer()
        self._handshake.sock.connect(url)
        self._input: ZSocket | None = None
        self._output: ZSocket | None = None
        self._in_send, self._in_recv = trio.open_memory_channel[Inbound](1024)
        self._out_send, self._out_recv = trio.open_memory_channel[list[bytes]](256)
        self._connected = trio.Event()
        self._seq = 0
        self._handshakes = 0
        self._received = 0
        self._sent = 0
        self._undecodable = 0
        self._unknown = 0

    def _dealer(self) -> ZSocket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self._identity)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
        if self.url.startswith("tcp://[") or self.url.count(":") > 2:
            sock.setsockopt(zmq.IPV6, 1)
        return ZSocket(sock)

    # -- the application's side -------------------------------------------------------

    def __aiter__(self) -> Engine:
        return self

    async def __anext__(self) -> Inbound:
        try:
            return await self._in_recv.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def receive_nowait(self) -> Inbound:
        """The next inbound message if one is waiting; raises `trio.WouldBlock` if not."""
        return self._in_recv.receive_nowait()

    async def receive(self) -> Inbound:
        """The next inbound message, in the order the client sent it.

        Cancellation: if cancelled, no message is lost; the next call returns it.
        """
        return await self._in_recv.receive()

    async def send(self, batch: OutputBatch) -> None:
        """Send one output batch. Fills in `seq` if it is None. Waits only while the
        outgoing queue is full.

        Cancellation: if cancelled, the batch was not queued and `seq` not consumed.
        Raises `ProtocolError` if a body or result has no CBOR form in §7, and
        ValueError if `batch.rank` is not this engine's rank.
        """
        if batch.rank != self.rank:
            raise ValueError(f"batch.rank is {batch.rank}, this engine is rank {self.rank}")
        seq = self._seq if batch.seq is None else batch.seq
        body = encode_batch(batch if batch.seq is not None else dataclasses.replace(batch, seq=seq))
        await self._out_send.send([body])
        if batch.seq is None:
            self._seq += 1

    def statistics(self) -> EngineStatistics:
        sockets = [s for s in (self._handshake, self._input, self._output) if s is not None]
        return EngineStatistics(
            handshakes=self._handshakes,
            received=self._received,
            sent=self._sent,
            undecodable=self._undecodable,
            unknown_types=self._unknown,
            fallbacks=sum(s.statistics().fallbacks for s in sockets),
        )

    # -- handshake --------------------------------------------------------------------

    async def _do_handshake(self) -> None:
        """HELLO -> INIT (or REJECT) -> connect -> READY + REGISTER."""
        hello = Hello(
            rank=self.rank,
            size=self.size,
            lockstep=self.lockstep,
            wave=self.wave if self.lockstep else None,
        )
        self._seq = 0
        await self._handshake.send([encode_handshake(hello)])
        with trio.move_on_after(self.handshake_timeout) as scope:
            reply = await self._next_handshake_reply()
        if scope.cancelled_caught:
            raise HandshakeTimeout(
                {self.rank: f"no INIT from the client at {self.url}"}, [], self.handshake_timeout
            )
        if isinstance(reply, Reject):
            raise HandshakeRejected(self.rank, reply.reason)
        if reply.version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"INIT speaks protocol version {reply.version}, this engine speaks "
                f"{PROTOCOL_VERSION}",
                rank=self.rank,
            )
        if reply.size != self.size:
            raise ProtocolError(
                f"INIT says the group has {reply.size} ranks, this engine was started "
                f"for {self.size}",
                rank=self.rank,
            )
        if self.init is None or (reply.input, reply.output) != (self.init.input, self.init.output):
            self._reconnect(reply)
        self.init = reply
        await self._handshake.send([encode_handshake(Ready(self.info))])
        assert self._input is not None
        self._input.enqueue([encode_handshake(Register())])
        self._handshakes += 1
        self._connected.set()
        log.info("rank %d: handshake %d done", self.rank, self._handshakes)

    def _reconnect(self, init: Init) -> None:
        for zs in (self._input, self._output):
            if zs is not None:
                zs.close()
        self._input = self._dealer()
        self._input.sock.connect(init.input)
        self._output = self._dealer()
        self._output.sock.connect(init.output)

    async def _next_handshake_reply(self) -> Init | Reject:
        while True:
            for frames in await self._handshake.receive_batch(1):
                msg = self._decode_control(frames)
                if isinstance(msg, Init | Reject):
                    return msg
                log.warning("rank %d: ignored %r while waiting for INIT", self.rank, msg)

    def _decode_control(self, frames: list[bytes]) -> object:
        if len(frames) != 1:
            self._undecodable += 1
            return None
        try:
            return decode_handshake(frames[0])
        except ProtocolError as exc:
            self._undecodable += 1
            log.warning("rank %d: undecodable handshake message: %s", self.rank, exc)
            return None

    # -- the tasks --------------------------------------------------------------------

    async def _serve_handshake(self) -> None:
        while True:
            for frames in await self._handshake.receive_batch():
                msg = self._decode_control(frames)
                if isinstance(msg, Resync):
                    log.info("rank %d: RESYNC from the client; redoing the handshake", self.rank)
                    await self._in_send.send(Resync())
                    await self._do_handshake()
                elif msg is not None:
                    log.warning("rank %d: ignored %r on the handshake socket", self.rank, msg)

    async def _serve_input(self) -> None:
        while True:
            zs = self._input
            assert zs is not None
            try:
                while (frames := zs.pop_queued()) is not None:
                    await zs.send(frames)
                for frames in zs.receive_nowait():
                    await self._deliver(frames)
                await zs.wait_readable_or_kicked()
            except trio.ClosedResourceError:
                if zs is self._input:  # closed by us on the way out, not by a reconnect
                    raise
                await trio.lowlevel.checkpoint()

    async def _deliver(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._undecodable += 1
            log.warning("rank %d: dropped a request of %d frames", self.rank, len(frames))
            return
        try:
            msg = decode_request(frames[0], frames[1])
        except ProtocolError as exc:
            self._undecodable += 1
            log.warning("rank %d: undecodable request: %s", self.rank, exc)
            return
        if msg is None:
            self._unknown += 1
            return
        self._received += 1
        await self._in_send.send(msg)

    async def _serve_output(self) -> None:
        async for frames in self._out_recv:
            zs = self._output
            assert zs is not None
            await zs.send(frames)
            self._sent += 1

    def close(self) -> None:
        for zs in (self._handshake, self._input, self._output):
            if zs is not None:
                zs.close()
        self._context.term()


@asynccontextmanager
async def connect_engine(
    url: str,
    *,
    rank: int,
    size: int,
    lockstep: bool = False,
    info: Mapping[str, Any] | None = None,
    wave: int | None = None,
    handshake_timeout: float = 60.0,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
) -> AsyncIterator[Engine]:
    """Connect to the client at group URL `url` as rank `rank` of `size` and handshake.

    Raises `HandshakeRejected` (the client's reason), `HandshakeTimeout` (no answer in
    `handshake_timeout` s) or `ProtocolError` (an INIT this engine cannot follow).

    Cancellation: if cancelled during the handshake, the sockets are closed and the
    client sees a rank that never came up (or a silent one, later).
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is out of range for a group of {size}")
    engine = Engine(
        url, rank, size, lockstep, info or {}, wave, handshake_timeout, max_message_size
    )
    try:
        with single_exception():
            async with trio.open_nursery() as nursery:
                await engine._do_handshake()
                engine._handshake.release()  # from here on the handshake task owns it
                nursery.start_soon(engine._serve_handshake, name=f"zmqdp-engine{rank}-handshake")
                nursery.start_soon(engine._serve_input, name=f"zmqdp-engine{rank}-input")
                nursery.start_soon(engine._serve_output, name=f"zmqdp-engine{rank}-output")
                yield engine
                nursery.cancel_scope.cancel()
    finally:
        engine.close()

"""The engine side of docs/protocol.md, for people who wrap their own engine behind zmqdp.

```python
from zmqdp.engine import connect_engine, Add, Abort, Wake, Call, Resync
from zmqdp.engine import OutputBatch, Output, Load

async with connect_engine("ipc:///tmp/zmqdp-g1/g", rank=0, size=2, info={"model": "m"}) as eng:
    async for msg in eng:
        if isinstance(msg, Add):
            await eng.send(OutputBatch(rank=eng.rank, outputs=(Output(msg.id, "hi", "stop"),)))
        elif isinstance(msg, Resync):
            ...  # drop every request you hold, with no outputs
```

Theory of operation
-------------------
`connect_engine` opens a handshake DEALER with the rank as routing id (2 bytes, little
endian) and starts the *handshake task*, which owns it. That task says HELLO (with this
engine's `max_message_size`), waits for INIT or REJECT, and starts an *incarnation*: a
fresh input DEALER and a fresh output DEALER connected to the addresses INIT names,
READY, and an *input task* that sends REGISTER (echoing INIT's `epoch`) and then
receives requests (ADD, ABORT, WAKE, CALL), decodes them and passes them on in order (a
type this version does not know is ignored, §3; an undecodable request is logged and
counted). The *output task*, one for the engine's life, sends what `send()` queued on
the current output socket. Each socket has one owner task at a time (`_zmq.py`); the
handshake task only creates and closes the input and output sockets.

While an incarnation runs, the handshake task keeps reading the handshake socket. On
RESYNC (§2.5) it, in this order:

1. marks the incarnation over (the output task now drops everything queued for it),
   cancels the input task and waits until it has exited, so that nothing read from the
   old input socket can reach the application any more;
2. closes both sockets (LINGER 0 drops what they still hold, such as ADDs of the dead
   epoch). They are recreated even if the addresses do not change: a connection that
   libzmq dropped because of an oversized message is never retried by libzmq;
3. passes `Resync()` to the application, behind every request of the old incarnation:
   drop everything you hold, with no outputs;
4. says HELLO again and, on INIT, starts the next incarnation.

A RESYNC read while waiting for INIT is ignored: the engine is already at step 1.

`send()` stamps each batch with the current incarnation, the client's `epoch` and `seq`
(from 0 per incarnation, +1 per message, unless the batch sets them). The output task
drops a batch stamped with an older incarnation instead of sending it: it was queued
before the RESYNC's INIT and concerns requests the client has given up (the client
would discard the stale epoch anyway). The output task outlives incarnations so that it
keeps draining the queue during a RESYNC: an application blocked in `send()` on a full
queue could otherwise never take the `Resync()` the handshake task waits to hand over.

Sizes (§1). `send()` encodes a batch once; only if it is larger than the client's
limit (INIT's `max_message_size`, default 64 MiB) is it split into several messages,
each with its own `seq`: `outputs`, then `finished`, then `replies`, in order, packed
greedily. The scalars (`load`, `wave_complete`, `start_wave`, `dead`) go on the last
message only: the client then applies them after the entries they sum up, and a `dead`
after everything else. The pieces are queued as one item, so `send()` stays
all-or-nothing; an entry too large for a message on its own raises `ProtocolError`.

CURVE (`curve=load_engine_keys(DIR, rank)`): every socket is a CURVE client of the
client's public key, with this rank's key pair. A client that does not allow the key
closes the connection during the ZeroMQ handshake, and libzmq never retries it; a
monitor on the handshake socket sees that and ends the block with `HandshakeRejected`
instead of a timeout.

A REJECT ends the block with `HandshakeRejected` and the client's reason; an INIT with
another version or size, or with an address this engine cannot connect to, ends it with
`ProtocolError`; no INIT in `handshake_timeout` ends it with `HandshakeTimeout`. For the
first handshake these are raised by `connect_engine` before it yields.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from ._addresses import is_ipv6
from ._core import cbor
from ._core.codec import decode_handshake, decode_request, encode_batch, encode_handshake
from ._core.errors import HandshakeRejected, HandshakeTimeout, ProtocolError, quote
from ._core.handshake import rank_identity
from ._core.messages import (
    DEFAULT_MAX_MESSAGE_SIZE,
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
from ._util import NoPublicConstructor, open_service_nursery, single_exception
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
"""What iterating an `Engine` yields: a request message (`Add`, `Abort`, `Wake`, `Call`)
or `Resync` (the client asked the engine to start over)."""


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """What an engine's side of the connection has seen: `Engine.statistics()`."""

    handshakes: int
    """Completed handshakes (INIT accepted, READY sent), the first one included."""
    received: int
    """Requests passed on to the application."""
    sent: int
    """Messages sent on the output socket (a split batch counts once per piece)."""
    undecodable: int
    """Requests and handshake messages dropped because they could not be decoded."""
    unknown_types: int
    """Requests of a type this version does not know (ignored, §3)."""
    fallbacks: int
    """Safety-timeout firings of every socket this engine had. Should stay 0."""
    resyncs: int
    """RESYNCs acted on (one ignored while waiting for INIT does not count)."""
    stale_dropped: int
    """Batches dropped because a RESYNC ended their incarnation before they were sent."""


class _Queued(NamedTuple):
    """One `send()`: the messages it became (several if split) and the incarnation
    they belong to."""

    incarnation: int
    messages: list[list[bytes]]


class Engine(metaclass=NoPublicConstructor):
    """One connected rank. Iterate it for inbound messages; `send()` output batches.

    `wave` is what the next HELLO reports (lockstep only): keep it current, so that the
    HELLO after a RESYNC tells a restarted client where the group is (§5).
    """

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
        curve: CurveClient | None = None,
    ) -> None:
        self.url = url
        self._curve = curve
        self.rank = rank
        self.size = size
        self.lockstep = lockstep
        self.info = dict(info)
        self.wave = wave
        self.handshake_timeout = handshake_timeout
        self.init: Init | None = None
        """The INIT of the current incarnation."""
        self._identity = rank_identity(rank)
        self._max_message_size = max_message_size
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._handshake = self._dealer(url)
        self._monitor: ZSocket | None = None
        if curve is not None:  # before connecting, so that no refusal goes unseen
            self._monitor = ZSocket(self._handshake.sock.get_monitor_socket(_HANDSHAKE_EVENTS))
        self._handshake.sock.connect(url)
        self._input: ZSocket | None = None
        self._output: ZSocket | None = None
        self._in_send, self._in_recv = trio.open_memory_channel[Inbound](1024)
        self._out_send, self._out_recv = trio.open_memory_channel[_Queued](256)
        # The current incarnation; send() reads these four without a checkpoint between.
        self._incarnation = 0
        self._epoch: int | None = None
        self._client_max = DEFAULT_MAX_MESSAGE_SIZE
        self._seq = 0
        self._serving = False  # an incarnation is running (INIT seen, no RESYNC since)
        self._handshakes = 0
        self._resyncs = 0
        self._received = 0
        self._sent = 0
        self._stale = 0
        self._undecodable = 0
        self._unknown = 0
        self._retired_fallbacks = 0

    def _dealer(self, address: str) -> ZSocket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self._identity)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
        if is_ipv6(address):
            sock.setsockopt(zmq.IPV6, 1)
        if self._curve is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.server)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.secret)
        return ZSocket(sock)

    @property
    def epoch(self) -> int | None:
        """The client's epoch for the current incarnation (INIT's `epoch`, §2.3); None
        if the client does not send one (revision 1). It changes only after `Resync()`
        has been queued for the application, once the next INIT arrives."""
        return self._epoch

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
        """The next inbound message, in the order the client sent it. After a `Resync()`
        only messages of the next incarnation follow.

        Cancellation: if cancelled, no message is lost; the next call returns it.
        """
        return await self._in_recv.receive()

    async def send(self, batch: OutputBatch) -> None:
        """Queue one output batch for the client. Fills in `seq` and `epoch` where they
        are None, and splits a batch larger than the client accepts (see the module
        docstring). Waits only while the outgoing queue is full.

        Raises `ProtocolError` if a body or result has no CBOR form in §8 or an entry is
        too large for one message, and ValueError if `batch.rank` is not this engine's
        rank; nothing is queued then.

        Cancellation: if cancelled, nothing was queued, and the seq numbers are given
        back unless another task's `send()` has numbered a batch meanwhile (then `seq`
        skips them, which the client tolerates).
        """
        if batch.rank != self.rank:
            raise ValueError(f"batch.rank is {batch.rank}, this engine is rank {self.rank}")
        incarnation, limit = self._incarnation, self._client_max
        auto = batch.seq is None
        first = self._seq if batch.seq is None else batch.seq
        epoch = self._epoch if batch.epoch is None else batch.epoch
        stamped = dataclasses.replace(batch, seq=first, epoch=epoch)
        body = encode_batch(stamped)
        # the common case costs one encoding and one comparison
        fits = len(body) <= limit
        messages = [[body]] if fits else [[piece] for piece in _split(stamped, limit)]
        end = first + len(messages)
        if auto:
            self._seq = end
        try:
            await self._out_send.send(_Queued(incarnation, messages))
        except BaseException:
            if auto and self._incarnation == incarnation and self._seq == end:
                self._seq = first
            raise

    async def send_raw_for_testing(self, frames: Sequence[bytes]) -> None:
        """Tests only: send `frames` as one message on the output socket exactly as
        given (no seq, no epoch, no encoding), in order with `send()`. For invalid
        bodies and wrong frame counts.

        Cancellation: if cancelled, nothing was queued.
        """
        await self._out_send.send(_Queued(self._incarnation, [list(frames)]))

    def statistics(self) -> EngineStatistics:
        """Counters since `connect_engine`, for tests and monitoring."""
        sockets = [s for s in (self._handshake, self._input, self._output) if s is not None]
        return EngineStatistics(
            handshakes=self._handshakes,
            received=self._received,
            sent=self._sent,
            undecodable=self._undecodable,
            unknown_types=self._unknown,
            fallbacks=self._retired_fallbacks + sum(s.statistics().fallbacks for s in sockets),
            resyncs=self._resyncs,
            stale_dropped=self._stale,
        )

    # -- the handshake task -----------------------------------------------------------

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The handshake task: owns the handshake socket, and runs one incarnation after
        the other. `started()` once the first handshake is done, so that its errors
        are raised by `nursery.start`.

        The output task lives as long as the engine, not per incarnation: while the
        handshake task waits for the application to take `Resync()`, the application
        may be waiting for room in the outgoing queue, and only the output task makes
        that room (by dropping what is stale).

        Cancellation: the input and output tasks are cancelled too; `close()` closes
        the sockets.
        """
        with single_exception():  # no user code in here: plain errors for connect_engine
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._serve_output, name=f"zmqdp-engine{self.rank}-output")
                if self._monitor is not None:
                    nursery.start_soon(self._watch_auth, name=f"zmqdp-engine{self.rank}-auth")
                await self._say_hello()
                task_status.started()
                while True:
                    await self._serve_incarnation()
                    self._resyncs += 1
                    await self._in_send.send(Resync())
                    await self._say_hello()

    async def _say_hello(self) -> None:
        """HELLO -> INIT (or REJECT) -> new input and output sockets -> READY. REGISTER
        follows from the input task.

        Cancellation: the handshake is abandoned where it stands; a new incarnation's
        sockets, if made, are closed by `close()`.
        """
        hello = Hello(
            rank=self.rank,
            size=self.size,
            lockstep=self.lockstep,
            wave=self.wave if self.lockstep else None,
            max_message_size=self._max_message_size,
        )
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
        self._begin_incarnation(reply)
        await self._handshake.send([encode_handshake(Ready(self.info))])
        self._handshakes += 1
        log.info("rank %d: handshake %d done (epoch %s)", self.rank, self._handshakes, reply.epoch)

    def _begin_incarnation(self, init: Init) -> None:
        """Fresh input and output sockets, always (§2.5), and the new incarnation's
        numbering. No checkpoint here, so `send()` sees the switch all at once."""
        assert self._input is None and self._output is None
        self._input = self._dealer(init.input)
        self._output = self._dealer(init.output)
        for zs, what, address in (
            (self._input, "input", init.input),
            (self._output, "output", init.output),
        ):
            try:
                zs.sock.connect(address)
            except zmq.ZMQError as exc:
                raise ProtocolError(
                    f"INIT names an {what} address this engine cannot connect to, "
                    f"{quote(address)}: {exc}",
                    rank=self.rank,
                ) from None
        self.init = init
        self._incarnation += 1
        self._epoch = init.epoch
        limit = init.max_message_size
        self._client_max = DEFAULT_MAX_MESSAGE_SIZE if limit is None else limit
        self._seq = 0
        self._serving = True

    async def _next_handshake_reply(self) -> Init | Reject:
        while True:
            for frames in await self._handshake.receive_batch(1):
                msg = self._decode_control(frames)
                if isinstance(msg, Init | Reject):
                    return msg
                if isinstance(msg, Resync):
                    log.debug("rank %d: RESYNC while waiting for INIT, ignored", self.rank)
                else:
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

    async def _serve_incarnation(self) -> None:
        """Run the input task until a RESYNC; return once it has exited and both
        sockets of the incarnation are closed.

        Cancellation: the same, without the RESYNC.
        """
        inp = self._input
        assert inp is not None
        register = encode_handshake(Register(epoch=self._epoch))
        name = f"zmqdp-engine{self.rank}-input-{self._incarnation}"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._serve_input, inp, register, name=name)
                await self._until_resync()
                self._serving = False  # from now on the output task drops what is queued
                nursery.cancel_scope.cancel()
        finally:
            self._serving = False
            for zs in (self._input, self._output):
                if zs is not None:
                    self._retired_fallbacks += zs.statistics().fallbacks
                    zs.close()  # wakes the output task if it is waiting on it
            self._input = self._output = None

    async def _until_resync(self) -> None:
        """Read the handshake socket until a RESYNC; anything else is logged and ignored.

        Cancellation: returns nothing; a message once read is handled first.
        """
        while True:
            for frames in await self._handshake.receive_batch(1):
                msg = self._decode_control(frames)
                if isinstance(msg, Resync):
                    log.info("rank %d: RESYNC from the client; starting over", self.rank)
                    return
                if msg is not None:
                    log.warning("rank %d: ignored %r on the handshake socket", self.rank, msg)

    # -- the input and output tasks ---------------------------------------------------

    async def _serve_input(self, zs: ZSocket, register: bytes) -> None:
        """Owns one incarnation's input socket: REGISTER, then requests in order.

        Cancellation: a request received and not yet handed on is dropped (it belongs
        to an incarnation that is ending).
        """
        await zs.send([register])
        while True:
            for frames in await zs.receive_batch():
                await self._deliver(frames)

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
        """Sends what `send()` queued on the current incarnation's output socket, and
        drops what was queued for an older one (or while none is being served). Owns
        each output socket in turn: the handshake task only creates and closes them.

        Cancellation: the batch being sent, and the rest of a split one, are dropped.
        """
        async for item in self._out_recv:
            current = self._serving and item.incarnation == self._incarnation
            messages = item.messages
            zs = self._output
            if not current or zs is None:
                self._stale += 1
                continue
            try:
                for frames in messages:
                    await zs.send(frames)
                    self._sent += 1
            except trio.ClosedResourceError:  # a RESYNC closed it: the rest is stale
                self._stale += 1

    async def _watch_auth(self) -> None:
        """CURVE: raise `HandshakeRejected` once the client refuses this engine's key
        (libzmq would leave the socket disconnected for good, and the HELLO unanswered),
        or after `_CURVE_FAILURES` failed ZeroMQ handshakes in a row (a wrong client
        public key, or a client without CURVE: libzmq would retry forever)."""
        assert self._monitor is not None and self._curve is not None
        failures = 0
        while True:
            for frames in await self._monitor.receive_batch():
                event = parse_monitor_message(frames)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    failures = 0
                elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    raise HandshakeRejected(
                        self.rank,
                        f"the client at {self.url} refused this engine's CURVE key: is the "
                        f"public key {self._curve.public.decode()} on its allow-list as rank "
                        f"{self.rank}?",
                    )
                else:
                    failures += 1
                    if failures >= _CURVE_FAILURES:
                        raise HandshakeRejected(
                            self.rank,
                            f"the CURVE handshake with the client at {self.url} failed "
                            f"{failures} times in a row: is {self._curve.server.decode()} the "
                            "client's public key, and does the client use CURVE?",
                        )

    def close(self) -> None:
        """Close the sockets at once (linger 0) and the context; `connect_engine`'s block
        does it on leaving."""
        if self._monitor is not None:
            self._handshake.sock.disable_monitor()
            self._monitor.close()
        for zs in (self._handshake, self._input, self._output):
            if zs is not None:
                zs.close()
        self._context.term()


# -- splitting (§1) -----------------------------------------------------------------

_ARRAY_HEAD_MAX = 9  # the longest CBOR head of an array
_SCALARS = ("load", "wave_complete", "start_wave", "dead")


def _entry_size(key: str, item: Any) -> int:
    """The encoded size of one entry of `outputs`, `finished` or `replies`, as
    `encode_batch` writes it (checked: `_split` re-encodes every piece)."""
    if key == "outputs":
        value: Any = {"id": item.request_id, "body": item.body, "finish": item.finish}
    elif key == "replies":
        value = (
            {"call": item.call, "error": item.error}
            if item.error is not None
            else {"call": item.call, "result": item.result}
        )
    else:
        value = item
    return len(cbor.encode(value))


def _too_large(batch: OutputBatch, key: str, item: Any, size: int, limit: int) -> ProtocolError:
    tail = f"{size} bytes; the client accepts at most {limit} per message (§1)"
    if key == "outputs":
        return ProtocolError(
            f"an output does not fit in one message: {tail}",
            rank=batch.rank,
            request_id=item.request_id,
        )
    if key == "finished":
        return ProtocolError(
            f"a `finished` entry does not fit in one message: {tail}",
            rank=batch.rank,
            request_id=item,
        )
    if key == "replies":
        return ProtocolError(
            f"the reply to call {item.call} does not fit in one message: {tail}", rank=batch.rank
        )
    shown = {k: getattr(batch, k) for k in _SCALARS if getattr(batch, k) is not None}
    return ProtocolError(
        f"the batch's scalar fields {quote(shown)} do not fit in one message: {tail}",
        rank=batch.rank,
    )


def _piece(batch: OutputBatch, seq: int, entries: list[tuple[str, Any]], last: bool) -> OutputBatch:
    by_key: dict[str, list[Any]] = {"outputs": [], "finished": [], "replies": []}
    for key, item in entries:
        by_key[key].append(item)
    piece = dataclasses.replace(
        batch,
        seq=seq,
        outputs=tuple(by_key["outputs"]),
        finished=tuple(by_key["finished"]),
        replies=tuple(by_key["replies"]),
    )
    if last:
        return piece
    return dataclasses.replace(piece, load=None, wave_complete=None, start_wave=None, dead=None)


def _split(batch: OutputBatch, limit: int) -> list[bytes]:
    """Encode `batch` (its `seq` and `epoch` filled in) as several bodies of at most
    `limit` bytes, numbered `batch.seq`, `batch.seq + 1`, ...: entries in order, packed
    greedily, scalars on the last body. Raises `ProtocolError` naming an entry (or the
    scalars) that cannot fit alone.

    Packing uses each entry's exact size against a bound on the rest of a body; every
    body is then encoded for real and checked, and that check alone decides whether an
    entry fits on its own."""
    assert batch.seq is not None
    entries: list[tuple[str, Any]] = [("outputs", o) for o in batch.outputs]
    entries += [("finished", f) for f in batch.finished]
    entries += [("replies", r) for r in batch.replies]
    # The most a body spends on anything but its entries: rank, epoch, the highest seq a
    # body can get (there are at most len(entries) + 1 bodies), each array's key and head.
    bare = dataclasses.replace(
        batch,
        seq=batch.seq + len(entries) + 1,
        outputs=(),
        finished=(),
        replies=(),
        load=None,
        wave_complete=None,
        start_wave=None,
        dead=None,
    )
    room = limit - len(encode_batch(bare))
    room -= sum(len(cbor.encode(key)) + _ARRAY_HEAD_MAX for key in {key for key, _ in entries})
    groups: collections.deque[list[tuple[str, Any]]] = collections.deque()
    group: list[tuple[str, Any]] = []
    used = 0
    for key, item in entries:
        size = _entry_size(key, item)
        if group and used + size > room:
            groups.append(group)
            group, used = [], 0
        group.append((key, item))
        used += size
    groups.append(group)
    scalars = any(getattr(batch, key) is not None for key in _SCALARS)
    bodies: list[bytes] = []
    while groups:
        group = groups.popleft()
        last = not groups
        body = encode_batch(_piece(batch, batch.seq + len(bodies), group, last))
        if len(body) <= limit:
            bodies.append(body)
        elif last and scalars and group:  # the scalars get a body of their own
            groups.extend([group, []])
        elif len(group) > 1:  # only if _entry_size disagrees with the codec: halve, retry
            half = len(group) // 2
            groups.extendleft([group[half:], group[:half]])
        elif group:
            raise _too_large(batch, *group[0], len(body), limit)
        else:
            raise _too_large(batch, "scalars", None, len(body), limit)
    return bodies


# -- connecting -----------------------------------------------------------------------


_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_CURVE_FAILURES = 5
"""Failed ZeroMQ handshakes in a row after which a CURVE engine gives up (libzmq retries
every ~0.15 s)."""


class CurveClient(Protocol):
    """An engine's CURVE keys (`zmqdp.keys.EngineKeys`): its key pair and the client's
    public key."""

    @property
    def public(self) -> bytes: ...

    @property
    def secret(self) -> bytes: ...

    @property
    def server(self) -> bytes: ...


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
    curve: CurveClient | None = None,
) -> AsyncIterator[Engine]:
    """Connect to the client at group URL `url` as rank `rank` of `size` and handshake.
    `max_message_size` is the largest message this engine accepts (its MAXMSGSIZE,
    announced in HELLO). The block serves incarnation after incarnation until it ends.
    `curve` (`zmqdp.keys.load_engine_keys(DIR, rank)`) connects with this rank's CURVE
    key pair to a client that uses CURVE; a refused key raises `HandshakeRejected`.

    Raises `HandshakeRejected` (the client's reason), `HandshakeTimeout` (no answer in
    `handshake_timeout` s) or `ProtocolError` (an INIT this engine cannot follow), from
    the first handshake before yielding, or from a later one (after a RESYNC) out of
    the block.

    An exception raised in the block passes out unchanged; errors of the engine's own
    tasks come out as one plain exception.

    Cancellation: if cancelled during the handshake, the sockets are closed and the
    client sees a rank that never came up (or a silent one, later).
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is out of range for a group of {size}")
    if max_message_size <= 0:
        raise ValueError(f"max_message_size must be positive, got {max_message_size}")
    engine = Engine._create(
        url, rank, size, lockstep, info or {}, wave, handshake_timeout, max_message_size, curve
    )
    try:
        async with open_service_nursery() as nursery:
            await nursery.start(engine._run, name=f"zmqdp-engine{rank}-handshake")
            yield engine
    finally:
        engine.close()

"""The client's socket set for one engine group, and the tasks that own it.

Theory of operation
-------------------
The client binds three ROUTERs (docs/protocol.md §1): handshake, input and output. Each has
exactly one owning task:

* `serve_handshake` owns the handshake ROUTER for the life of the group. It answers
  every HELLO with INIT or REJECT (through `HandshakeState`), records READY (an invalid
  one is answered with REJECT), reports a rank that came up and a HELLO that was a
  rejoin, and sends RESYNC about once a second to every rank the group is waiting for
  (docs/protocol.md §2.5; a RESYNC to an identity that is not connected fails with
  EHOSTUNREACH and is ignored). Rejoins can come at any time, so this task never stops
  while the group is open.
* `serve_input` owns the input ROUTER. It sends what other tasks `send()` (ADD, ABORT,
  WAKE, CALL frames go into a queue; the owner is kicked awake) and receives the
  REGISTER messages that complete a rank's handshake, also at any time.
* The output ROUTER is handed to the caller (the dispatcher), which claims it.

Send failures are not raised into the task that queued the message (it has moved on):
`listener.send_failed(rank, cause)` reports an unknown peer (EHOSTUNREACH under
ROUTER_MANDATORY) at once, and a peer whose queue stayed full past `send_timeout`.
Either makes the rank dead (§6); its queued messages are dropped.

`open_group_transport` binds, runs both tasks, and waits until all N ranks are up or
`ready_timeout` passes (`HandshakeTimeout`, naming every missing rank and every
rejected HELLO).

Closing (§9): once the tasks are gone, `aclose` takes over the input socket, pushes
what is still queued (the ABORTs the client sends for its live requests) without
blocking, and closes it with a short LINGER, so those ABORTs reach the engines; the
other sockets close with LINGER 0. The context is then terminated in a worker thread
(bounded by that LINGER), since `term()` blocks.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
import zmq

from ._addresses import (
    GroupAddress,
    parse_group_url,
    prepare_ipc_directory,
    remove_socket_files,
)
from ._core.codec import decode_handshake, encode_handshake
from ._core.errors import HandshakeTimeout, ProtocolError, quote
from ._core.handshake import HandshakeState, identity_rank, rank_identity
from ._core.messages import Hello, Init, Ready, Register, Reject, Resync
from ._core.state import DEFAULT_MAX_MESSAGE_SIZE
from ._util import open_service_nursery
from ._zmq import ZSocket, ZSocketStatistics, is_unreachable

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "GroupTransport",
    "TransportListener",
    "open_group_transport",
]

log = logging.getLogger("zmqdp")

CLOSE_LINGER = 0.5
"""Seconds libzmq may spend delivering the ABORTs queued at close (§9)."""


class TransportListener:
    """What the transport reports, as it happens (a subclass overrides what it needs).
    The calls are synchronous and come from the transport's own tasks."""

    def rank_up(self, rank: int) -> None:
        """`rank` completed a handshake (READY and REGISTER of its current epoch)."""

    def rejoin(self, rank: int) -> None:
        """`rank` said HELLO again (or sent an invalid HELLO): its previous incarnation
        is dead."""

    def send_failed(self, rank: int, cause: str) -> None:
        """A send to `rank` failed or timed out; its queued messages were dropped."""

    def flushed(self) -> None:
        """The input task sent a run of messages."""


@dataclass(frozen=True, slots=True)
class TransportStatistics:
    """Counters of the client's three sockets and of the handshake."""

    handshake: ZSocketStatistics
    input: ZSocketStatistics
    output: ZSocketStatistics
    rejected_hellos: int
    """HELLOs, READYs and untyped handshake messages answered with REJECT."""
    ignored_handshake_messages: int
    """Handshake-socket messages that were neither HELLO nor READY, or came too late."""
    stale_registers: int
    """REGISTERs carrying the epoch of a dead incarnation (§2.3)."""
    resyncs: int
    """RESYNCs sent to ranks the group was waiting for (§2.5)."""
    dropped_answers: int
    """INIT/REJECT answers dropped because the peer's queue was full or it was gone."""


class GroupTransport:
    """Bound client sockets of one group. Use `open_group_transport`."""

    def __init__(
        self,
        url: str,
        size: int,
        *,
        advertise_host: str | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        send_timeout: float = 10.0,
        safety_timeout: float = 1.0,
        resync_interval: float = 1.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        listener: TransportListener | None = None,
    ) -> None:
        self.url = url
        self.size = size
        self.address: GroupAddress = parse_group_url(url, advertise_host)
        self.send_timeout = send_timeout
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._sockets: list[ZSocket] = []
        self._bound = False  # only the socket files we bound are ours to remove
        try:
            prepare_ipc_directory(self.address)
            self.handshake = self._router(self.address.handshake, max_message_size, safety_timeout)
            self.input = self._router(self.address.input, max_message_size, safety_timeout)
            self.output = self._router(self.address.output, max_message_size, safety_timeout)
            self._bound = True
        except BaseException:
            self._close_sockets()
            raise
        self.handshake_address = self.address.advertised(self._endpoint(self.handshake))
        """Where engines connect (for tcp://H:* the port the OS chose)."""
        self.input_address = self.address.advertised(self._endpoint(self.input))
        self.output_address = self.address.advertised(self._endpoint(self.output))
        self.state = HandshakeState(
            size,
            self.input_address,
            self.output_address,
            # Random, so a restarted client never reuses its predecessor's epochs (§2.3).
            first_epoch=secrets.randbelow(2**32) + 1,
            max_message_size=max_message_size,
            resync_interval=resync_interval,
        )
        self._resyncs = 0
        self._dropped_answers = 0
        self.ranks_changed = trio.Event()  # set (and replaced) whenever a rank comes up
        self.listener = listener or TransportListener()
        self._blocked_since: float | None = None
        self.nursery: trio.Nursery | None = None  # set by open_group_transport

    def _router(self, address: str, max_message_size: int, safety: float) -> ZSocket:
        sock = self.context.socket(zmq.ROUTER)
        self._sockets.append(ZSocket(sock, safety_timeout=safety))  # closed on failure
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        if self.address.ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(address)
        return self._sockets[-1]

    @staticmethod
    def _endpoint(zs: ZSocket) -> str:
        endpoint = zs.sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        return endpoint.decode()

    # -- sending (any task) -----------------------------------------------------------

    def send(self, rank: int, frames: Sequence[bytes]) -> None:
        """Queue a message for `rank` on the input socket; never blocks. Failures come
        back through `listener.send_failed`."""
        self.input.enqueue([rank_identity(rank), *frames])

    # -- the owning tasks -------------------------------------------------------------

    def forget(self, rank: int, *, resync: bool = True) -> None:
        """The rank is dead: it must handshake again. With `resync`, it is sent RESYNC
        at once and then about once a second until it says HELLO (§2.5)."""
        self.state.forget(rank, resync=resync)
        if resync:
            self.handshake.kick()

    async def serve_handshake(self) -> None:
        """Own the handshake ROUTER: answer HELLOs, record READYs, send RESYNCs, forever.

        Cancellation: it stops between messages; a message it took off the socket is
        answered first (the answer may be lost with the socket)."""
        zs = self.handshake
        resync = encode_handshake(Resync())
        while True:
            for rank in self.state.resync_due(trio.current_time()):
                try:
                    if zs.send_nowait([rank_identity(rank), resync]):
                        self._resyncs += 1
                except zmq.ZMQError:
                    pass  # not connected (yet): the next RESYNC may find it
            batch = zs.receive_nowait()
            for frames in batch:
                self._on_handshake_message(frames)
            if batch:
                await trio.lowlevel.checkpoint()  # a flood of HELLOs yields per batch
            with trio.move_on_at(self.state.next_resync()):
                await zs.wait_readable_or_kicked()

    def _on_handshake_message(self, frames: list[bytes]) -> None:
        """One message on the handshake socket. HELLO and READY are answered (an invalid
        one with REJECT naming it, §7); a body that claims no type is rejected without
        touching any rank; anything else (a malformed REGISTER, an unknown type) is
        counted and ignored: only an invalid HELLO is a rejoin."""
        if len(frames) != 2:
            self.state.ignored += 1
            log.warning(
                "handshake: dropped a message of %d frames from identity %s",
                len(frames),
                frames[0].hex(),
            )
            return
        identity, body = frames
        try:
            msg: object = decode_handshake(body)
        except ProtocolError as exc:
            msg = exc
        if isinstance(msg, Hello) or (isinstance(msg, ProtocolError) and msg.message == "hello"):
            self._answer_hello(identity, msg)
        elif isinstance(msg, Ready):
            self._answer_ready(identity, dict(msg.info))
        elif isinstance(msg, ProtocolError) and msg.message == "ready":
            self._answer_ready(identity, msg)
        elif isinstance(msg, ProtocolError) and msg.message is None:
            reject = self.state.on_invalid(identity, msg)
            log.warning("handshake: rejected a message: %s", reject.reason)
            self._answer(identity, reject)
        else:
            self.state.ignored += 1
            log.warning("handshake: ignored %s from identity %s", quote(msg), identity.hex())

    def _answer_hello(self, identity: bytes, hello: Hello | ProtocolError) -> None:
        verdict = self.state.on_hello(identity, hello)
        if verdict.rejoin and verdict.rank is not None:
            log.warning(
                "rank %d: HELLO again (rejoin #%d): its previous incarnation is dead",
                verdict.rank,
                self.state.rejoins[verdict.rank],
            )
            self.listener.rejoin(verdict.rank)
        elif isinstance(hello, Hello) and verdict.rank is not None and verdict.rank < self.size:
            log.info("rank %d: HELLO accepted", verdict.rank)
        if isinstance(verdict.reply, Reject):
            log.warning("handshake: rejected a HELLO: %s", verdict.reply.reason)
        self._answer(identity, verdict.reply)

    def _answer_ready(self, identity: bytes, ready: dict[str, object] | ProtocolError) -> None:
        verdict = self.state.on_ready(identity, ready)
        if verdict is True:
            self._rank_up(identity)
        elif isinstance(verdict, Reject):
            log.warning("handshake: rejected a READY: %s", verdict.reason)
            self._answer(identity, verdict)

    def _answer(self, identity: bytes, reply: Init | Reject) -> None:
        """Answer without waiting: one peer that does not read must not hold up the
        handshake of the others, so an answer that would block is dropped and counted
        (that peer's HELLO times out on its side and it says HELLO again)."""
        try:
            if self.handshake.send_nowait([identity, encode_handshake(reply)]):
                return
            cause = "its queue is full"
        except zmq.ZMQError as exc:  # the engine vanished between its message and ours
            cause = str(exc)
        self._dropped_answers += 1
        log.warning("handshake: could not answer identity %s: %s", identity.hex(), cause)

    def _rank_up(self, identity: bytes) -> None:
        rank = identity_rank(identity)
        assert rank is not None
        log.info("rank %d: up (info %r)", rank, self.state.info(rank))
        self.listener.rank_up(rank)
        self.ranks_changed.set()
        self.ranks_changed = trio.Event()

    async def serve_input(self) -> None:
        """Own the input ROUTER: send queued messages, receive REGISTERs, forever."""
        zs = self.input
        while True:
            sent_any = self._flush_input()
            for frames in zs.receive_nowait():
                self._on_input_message(frames)
            if sent_any:
                self.listener.flushed()
                await trio.lowlevel.checkpoint()
            elif zs.queued and self._blocked_since is not None:
                # The head message's peer is at its HWM: poll gently until the send
                # timeout, then give up on that rank.
                if trio.current_time() - self._blocked_since > self.send_timeout:
                    self._give_up_on_head("its input queue stayed full")
                with trio.move_on_after(0.005):
                    await zs.wait_readable_or_kicked()
            else:
                await zs.wait_readable_or_kicked()

    def _flush_input(self) -> bool:
        zs = self.input
        sent = False
        while True:
            frames = zs.pop_queued()
            if frames is None:
                self._blocked_since = None
                return sent
            try:
                if not zs.send_nowait(frames):
                    zs.unpop_queued(frames)
                    if self._blocked_since is None:
                        self._blocked_since = trio.current_time()
                    return sent
            except zmq.ZMQError as exc:
                rank = identity_rank(bytes(frames[0]))
                cause = (
                    "not connected to the input socket (EHOSTUNREACH)"
                    if is_unreachable(exc)
                    else f"send failed: {exc}"
                )
                self._fail_rank_sends(rank, cause)
                continue
            self._blocked_since = None
            sent = True

    def _give_up_on_head(self, why: str) -> None:
        frames = self.input.pop_queued()
        if frames is None:
            return
        self._blocked_since = None
        rank = identity_rank(bytes(frames[0]))
        self._fail_rank_sends(rank, f"{why} for {self.send_timeout:g} s (send timeout)")

    def _fail_rank_sends(self, rank: int | None, cause: str) -> None:
        """Drop every queued message for `rank` and report the failure once."""
        if rank is None:
            return
        zs = self.input
        identity = rank_identity(rank)
        kept = []
        while (frames := zs.pop_queued()) is not None:
            if bytes(frames[0]) != identity:
                kept.append(frames)
        for frames in reversed(kept):
            zs.unpop_queued(frames)
        log.warning("rank %d: %s", rank, cause)
        self.listener.send_failed(rank, cause)

    def _on_input_message(self, frames: list[bytes]) -> None:
        if len(frames) == 2:
            try:
                msg = decode_handshake(frames[1])
            except ProtocolError as exc:
                log.warning("input: undecodable message from %s: %s", frames[0].hex(), exc)
                return
            if isinstance(msg, Register):
                if self.state.on_register(frames[0], msg.epoch):
                    self._rank_up(frames[0])
                return
        self.state.ignored += 1
        log.warning("input: ignored a message from identity %s", frames[0].hex())

    # -- waiting and closing ----------------------------------------------------------

    async def wait_ready(self) -> None:
        """Wait until every rank is up.

        Cancellation: nothing changes; wrap it in a deadline and raise
        `self.timeout_error(...)` when it expires."""
        while not self.state.ready():
            await self.ranks_changed.wait()

    def timeout_error(self, timeout: float) -> HandshakeTimeout:
        return HandshakeTimeout(self.state.missing(), list(self.state.rejected), timeout)

    def statistics(self) -> TransportStatistics:
        return TransportStatistics(
            handshake=self.handshake.statistics(),
            input=self.input.statistics(),
            output=self.output.statistics(),
            rejected_hellos=self.state.rejections,
            ignored_handshake_messages=self.state.ignored,
            stale_registers=self.state.stale_registers,
            resyncs=self._resyncs,
            dropped_answers=self._dropped_answers,
        )

    def _close_sockets(self) -> None:
        for zs in self._sockets:
            zs.close()
        if self._own_context:
            self.context.term()

    def close(self) -> None:
        """Close every socket (unsent messages are dropped) and the context."""
        self._close_sockets()
        self._sockets = []
        if self._bound:
            remove_socket_files(self.address)

    async def aclose(self) -> None:
        """Close after the owning tasks have ended, delivering what is still queued on
        the input socket, such as ABORTs (§9): the input socket closes with a LINGER
        of `CLOSE_LINGER`, the others with none, and the context is terminated in a
        worker thread (`term()` blocks until the LINGER is over or all is delivered).

        Cancellation: shielded; it takes at most `CLOSE_LINGER` seconds."""
        zs = self.input
        if not zs.closed:
            zs.release()  # its owner, the input task, has ended
            while (frames := zs.pop_queued()) is not None:
                try:
                    if not zs.send_nowait(frames):
                        break  # that engine's queue is full: the rest is dropped
                except zmq.ZMQError:
                    continue  # that engine is gone; its requests are over anyway
        zs.close(linger=CLOSE_LINGER)
        for other in self._sockets:
            other.close()
        self._sockets = []
        if self._own_context:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.context.term)
        if self._bound:
            remove_socket_files(self.address)


@asynccontextmanager
async def open_group_transport(
    url: str,
    engines: int,
    *,
    ready_timeout: float = 60.0,
    advertise_host: str | None = None,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    send_timeout: float = 10.0,
    listener: TransportListener | None = None,
) -> AsyncIterator[GroupTransport]:
    """Bind the group's sockets, wait for all `engines` ranks, yield the transport.

    The handshake and input tasks keep running inside the block (rejoins), in the
    nursery `transport.nursery`, where callers may start their own tasks (the client's
    dispatcher). Leaving the block cancels them and closes everything.

    `listener` is told of ranks coming up, rejoins, failed sends and flushes, from
    the start (during the initial handshake too).

    Cancellation: if cancelled while waiting for the ranks, the sockets are closed and
    nothing is left running.
    """
    transport = GroupTransport(
        url,
        engines,
        advertise_host=advertise_host,
        max_message_size=max_message_size,
        send_timeout=send_timeout,
        listener=listener,
    )
    try:
        async with open_service_nursery() as nursery:
            transport.nursery = nursery
            nursery.start_soon(transport.serve_handshake, name="zmqdp-handshake")
            nursery.start_soon(transport.serve_input, name="zmqdp-input")
            with trio.move_on_after(ready_timeout) as waiting:
                await transport.wait_ready()
            if waiting.cancelled_caught:
                raise transport.timeout_error(ready_timeout)
            yield transport
    finally:
        await transport.aclose()

"""The client's socket set for one engine group, and the tasks that own it.

Theory of operation
-------------------
The client binds three ROUTERs (PROTOCOL.md §1): handshake, input and output. Each has
exactly one owning task:

* `serve_handshake` owns the handshake ROUTER for the life of the group. It answers
  every HELLO with INIT or REJECT (through `HandshakeState`), records READY, and
  reports a rank that came up and a HELLO that was a rejoin. Rejoins can come at any
  time, so this task never stops while the group is open.
* `serve_input` owns the input ROUTER. It sends what other tasks `send()` (ADD, ABORT,
  WAKE, CALL frames go into a queue; the owner is kicked awake) and receives the
  REGISTER messages that complete a rank's handshake, also at any time.
* The output ROUTER is handed to the caller (the dispatcher), which claims it.

Send failures are not raised into the task that queued the message (it has moved on):
`on_send_failure(rank, cause)` reports an unknown peer (EHOSTUNREACH under
ROUTER_MANDATORY) at once, and a peer whose queue stayed full past `send_timeout`.
Either makes the rank dead (§6); its queued messages are dropped.

`open_group_transport` binds, runs both tasks, and waits until all N ranks are up or
`ready_timeout` passes (`HandshakeTimeout`, naming every missing rank and every
rejected HELLO).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
import zmq

from ._addresses import GroupAddress, parse_group_url, prepare_ipc_directory
from ._core.codec import decode_handshake, encode_handshake
from ._core.errors import HandshakeTimeout, ProtocolError
from ._core.handshake import HandshakeState, identity_rank, rank_identity
from ._core.messages import Hello, Ready, Register, Reject, Resync
from ._util import single_exception
from ._zmq import ZSocket, ZSocketStatistics, is_unreachable

__all__ = ["DEFAULT_MAX_MESSAGE_SIZE", "GroupTransport", "open_group_transport"]

log = logging.getLogger("zmqdp")

DEFAULT_MAX_MESSAGE_SIZE = 64 * 1024 * 1024


def _noop(*_: object) -> None:
    pass


@dataclass(frozen=True, slots=True)
class TransportStatistics:
    handshake: ZSocketStatistics
    input: ZSocketStatistics
    output: ZSocketStatistics
    rejected_hellos: int
    ignored_handshake_messages: int


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
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.url = url
        self.size = size
        self.address: GroupAddress = parse_group_url(url, advertise_host)
        self.send_timeout = send_timeout
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._sockets: list[ZSocket] = []
        try:
            prepare_ipc_directory(self.address)
            self.handshake = self._router(self.address.handshake, max_message_size, safety_timeout)
            self.input = self._router(self.address.input, max_message_size, safety_timeout)
            self.output = self._router(self.address.output, max_message_size, safety_timeout)
        except BaseException:
            self._close_sockets()
            raise
        self.handshake_address = self.address.advertised(self._endpoint(self.handshake))
        """Where engines connect (for tcp://H:* the port the OS chose)."""
        self.input_address = self.address.advertised(self._endpoint(self.input))
        self.output_address = self.address.advertised(self._endpoint(self.output))
        self.state = HandshakeState(size, self.input_address, self.output_address)
        self.ranks_changed = trio.Event()  # set (and replaced) whenever a rank comes up
        self.on_rank_up: Callable[[int], None] = _noop
        self.on_rejoin: Callable[[int], None] = _noop
        self.on_send_failure: Callable[[int, str], None] = _noop
        self.on_flushed: Callable[[], None] = _noop  # after the input task sent a run
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
        back through `on_send_failure`."""
        self.input.enqueue([rank_identity(rank), *frames])

    # -- the owning tasks -------------------------------------------------------------

    def resync(self, rank: int) -> None:
        """Ask `rank` to drop its requests and redo the handshake (§2 RESYNC). Lost if
        the rank is not connected; its HELLO (a rejoin) tells when it took effect."""
        self.handshake.enqueue([rank_identity(rank), encode_handshake(Resync())])

    async def serve_handshake(self) -> None:
        """Own the handshake ROUTER: answer HELLOs, record READYs, send RESYNCs, forever."""
        zs = self.handshake
        while True:
            while (frames := zs.pop_queued()) is not None:
                try:
                    with trio.move_on_after(self.send_timeout):
                        await zs.send(frames)
                except zmq.ZMQError as exc:
                    log.warning("handshake: could not send to %s: %s", frames[0].hex(), exc)
            for frames in zs.receive_nowait():
                await self._on_handshake_message(frames)
            await zs.wait_readable_or_kicked()

    async def _on_handshake_message(self, frames: list[bytes]) -> None:
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
        if isinstance(msg, Hello | ProtocolError):
            await self._answer_hello(identity, msg)
        elif isinstance(msg, Ready):
            if self.state.on_ready(identity, dict(msg.info)):
                self._rank_up(identity)
        else:
            self.state.ignored += 1
            log.warning(
                "handshake: ignored %s from identity %s", type(msg).__name__, identity.hex()
            )

    async def _answer_hello(self, identity: bytes, hello: Hello | ProtocolError) -> None:
        verdict = self.state.on_hello(identity, hello)
        if verdict.rejoin and verdict.rank is not None:
            log.warning(
                "rank %d: HELLO again (rejoin #%d): its previous incarnation is dead",
                verdict.rank,
                self.state.rejoins[verdict.rank],
            )
            self.on_rejoin(verdict.rank)
        elif isinstance(hello, Hello) and verdict.rank is not None and verdict.rank < self.size:
            log.info("rank %d: HELLO accepted", verdict.rank)
        if isinstance(verdict.reply, Reject):
            log.warning("handshake: rejected a HELLO: %s", verdict.reply.reason)
        try:
            with trio.move_on_after(self.send_timeout):
                await self.handshake.send([identity, encode_handshake(verdict.reply)])
        except zmq.ZMQError as exc:  # the engine vanished between HELLO and our answer
            log.warning("handshake: could not answer identity %s: %s", identity.hex(), exc)

    def _rank_up(self, identity: bytes) -> None:
        rank = identity_rank(identity)
        assert rank is not None
        log.info("rank %d: up (info %r)", rank, self.state.info(rank))
        self.on_rank_up(rank)
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
                self.on_flushed()
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
        self.on_send_failure(rank, cause)

    def _on_input_message(self, frames: list[bytes]) -> None:
        if len(frames) == 2:
            try:
                msg = decode_handshake(frames[1])
            except ProtocolError as exc:
                log.warning("input: undecodable message from %s: %s", frames[0].hex(), exc)
                return
            if isinstance(msg, Register):
                if self.state.on_register(frames[0]):
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
        return HandshakeTimeout(self.state.missing(), self.state.rejected, timeout)

    def statistics(self) -> TransportStatistics:
        return TransportStatistics(
            handshake=self.handshake.statistics(),
            input=self.input.statistics(),
            output=self.output.statistics(),
            rejected_hellos=len(self.state.rejected),
            ignored_handshake_messages=self.state.ignored,
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


@asynccontextmanager
async def open_group_transport(
    url: str,
    engines: int,
    *,
    ready_timeout: float = 60.0,
    advertise_host: str | None = None,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    send_timeout: float = 10.0,
) -> AsyncIterator[GroupTransport]:
    """Bind the group's sockets, wait for all `engines` ranks, yield the transport.

    The handshake and input tasks keep running inside the block (rejoins), in the
    nursery `transport.nursery`, where callers may start their own tasks (the client's
    dispatcher). Leaving the block cancels them and closes everything.

    Cancellation: if cancelled while waiting for the ranks, the sockets are closed and
    nothing is left running.
    """
    transport = GroupTransport(
        url,
        engines,
        advertise_host=advertise_host,
        max_message_size=max_message_size,
        send_timeout=send_timeout,
    )
    try:
        with single_exception():
            async with trio.open_nursery() as nursery:
                transport.nursery = nursery
                nursery.start_soon(transport.serve_handshake, name="zmqdp-handshake")
                nursery.start_soon(transport.serve_input, name="zmqdp-input")
                with trio.move_on_after(ready_timeout) as waiting:
                    await transport.wait_ready()
                if waiting.cancelled_caught:
                    raise transport.timeout_error(ready_timeout)
                yield transport
                nursery.cancel_scope.cancel()
    finally:
        transport.close()

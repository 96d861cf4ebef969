"""A small trio adapter for pyzmq sockets.

Theory of operation
-------------------
pyzmq has no trio support, and `ZMQ_FD` is not a normal file descriptor: it is the
socket's *mailbox*, readable when libzmq has unprocessed commands, and **any** zmq call
on the socket (send, recv, even reading `EVENTS`) may consume that edge while messages
stay queued (docs/design.md, "The ZeroMQ fd rules"). The rules that make it safe, all enforced here:

1. **One task per socket.** The first task that uses a `ZSocket` owns it; any other
   task gets `trio.BusyResourceError`. Ownership can be handed over explicitly
   (`release()`), for example from `connect()` to the dispatcher task. Nobody steals
   anybody's edge, so no cross-task wake-up protocol is needed.
2. **EVENTS before every wait.** `_wait()` reads `EVENTS` and only parks on the fd if
   the wanted flag is clear, and it reads `EVENTS` again after every wake-up.
3. **Drain in batches.** `receive_batch()` takes up to `limit` messages with `NOBLOCK`
   and does one checkpoint per batch, not per message (a checkpoint costs ~5 µs, a
   zmq recv ~1 µs).
4. **A safety net.** Every fd wait has a timeout (1 s by default); when it fires, the
   wait re-reads `EVENTS`. A correct adapter never needs it: `statistics().fallbacks`
   counts the firings and the tests assert it stays 0.
5. **Cancellation never loses a message.** A receive checks for cancellation *before*
   it touches the socket and, once it holds messages, only a cancel-shielded
   checkpoint follows, so a message taken off the socket is always returned.
6. **Nothing blocks.** Every zmq call is made with `NOBLOCK`.
7. **Close in order.** `close()` calls `trio.lowlevel.notify_closing(fd)` (waking any
   waiter with `ClosedResourceError`), then closes the socket with `linger=0`, so
   closing never waits for unsent messages.

A socket that is both sent on by request and read from (the input ROUTER: ADDs go out,
REGISTERs come in) still has a single owner: other tasks queue their messages elsewhere
(the transport's per-rank `Outbox`) and `kick()` the owner, whose
`wait_readable_or_kicked()` is woken by a cancel-scope kick, or returns at once if a
kick came while it was busy. A kick costs one cancellation (~60 µs) and only happens
when the owner is parked; under load the owner is busy draining and nobody kicks.

8. **Memory is bounded by configuration.** One drain takes at most `limit` messages and
   stops once it holds `max_bytes` (it always takes at least one message), so a peer
   sending the largest messages `MAXMSGSIZE` allows cannot make one drain hold 256 of
   them.

With `peer_check` (CURVE groups), each message is received with its metadata and only
kept if the check accepts its routing id and the `User-Id` the ZAP handler gave the
authenticated peer; the others are dropped and counted (`refused`).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import trio
import zmq

__all__ = ["POLLIN", "POLLOUT", "ZSocket", "ZSocketStatistics"]

POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
_EVENTS = zmq.EVENTS
_NOBLOCK = int(zmq.NOBLOCK)
_SEND_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)

Frames = Sequence[bytes]

PeerCheck = Callable[[bytes, str | None], bool]
"""`(routing id, User-Id metadata) -> keep the message?`"""

DEFAULT_DRAIN_BYTES = 16 * 1024 * 1024
"""What one drain may hold, in bytes (it always takes at least one message)."""


@dataclass(frozen=True, slots=True)
class ZSocketStatistics:
    """Counters of one socket."""

    received: int
    """Messages received."""
    sent: int
    """Messages sent."""
    batches: int
    """Non-empty batches returned by `receive_batch`."""
    waits: int
    """Times the owner parked on the fd."""
    fallbacks: int
    """Times the safety timeout ended a wait and found the socket ready: a wake-up the
    fd missed. Should stay 0 (a timeout on an idle socket does not count)."""
    kicks: int
    """Times another task woke the parked owner."""
    refused: int
    """Messages dropped because `peer_check` refused their sender (CURVE groups: a
    routing id that is not the rank bound to the peer's key)."""


class ZSocket:
    """A pyzmq socket used from trio by exactly one task at a time."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        *,
        safety_timeout: float = 1.0,
        max_bytes: int = DEFAULT_DRAIN_BYTES,
        peer_check: PeerCheck | None = None,
    ) -> None:
        self.sock = sock
        self.max_bytes = max_bytes
        self.peer_check = peer_check
        # getsockopt is typed `int | bytes`; EVENTS and FD are ints. Bind once, typed.
        self._getsockopt = cast(Callable[[int], int], sock.getsockopt)
        self.fd: int = self._getsockopt(zmq.FD)
        self.safety_timeout = safety_timeout
        self.closed = False
        self._owner: trio.lowlevel.Task | None = None
        self._park: trio.CancelScope | None = None
        self._kicked = False
        self._received = 0
        self._sent = 0
        self._batches = 0
        self._waits = 0
        self._fallbacks = 0
        self._kicks = 0
        self._refused = 0

    # -- ownership --------------------------------------------------------------------

    def _claim(self) -> None:
        task = trio.lowlevel.current_task()
        if self._owner is None:
            self._owner = task
        elif self._owner is not task:
            raise trio.BusyResourceError(
                f"zmq socket {self.sock.type!r} is owned by task {self._owner.name!r}; "
                f"task {task.name!r} may not touch it"
            )
        if self.closed:
            raise trio.ClosedResourceError("the zmq socket is closed")

    def release(self) -> None:
        """Give up ownership so another task can claim the socket."""
        self._owner = None

    # -- waiting ----------------------------------------------------------------------

    async def _wait(self, flag: int) -> None:
        """Park until `EVENTS & flag`. Re-reads EVENTS after every wake-up."""
        getsockopt = self._getsockopt
        while not getsockopt(_EVENTS) & flag:
            self._waits += 1
            with trio.move_on_after(self.safety_timeout) as scope:
                await trio.lowlevel.wait_readable(self.fd)
            if scope.cancelled_caught and getsockopt(_EVENTS) & flag:
                self._fallbacks += 1  # ready, yet the fd never said so: a missed wake-up

    # -- receiving --------------------------------------------------------------------

    def receive_nowait(self, limit: int = 256) -> list[list[bytes]]:
        """Up to `limit` queued messages (and about `max_bytes`), without waiting
        (possibly none)."""
        self._claim()
        return self._drain(limit)

    def _drain(self, limit: int) -> list[list[bytes]]:
        out: list[list[bytes]] = []
        if not self._getsockopt(_EVENTS) & POLLIN:  # avoids a costly zmq.Again
            return out
        if self.peer_check is not None:
            return self._drain_checked(limit)
        recv = self.sock.recv_multipart
        budget = self.max_bytes
        try:
            while len(out) < limit and budget > 0:
                frames = recv(_NOBLOCK)
                out.append(frames)
                for frame in frames:
                    budget -= len(frame)
        except zmq.Again:
            pass
        self._received += len(out)
        return out

    def _drain_checked(self, limit: int) -> list[list[bytes]]:
        """`_drain` for a socket whose peers are authenticated: read each message with
        its metadata and keep it only if `peer_check` accepts its sender."""
        check = self.peer_check
        assert check is not None
        recv = self.sock.recv_multipart
        out: list[list[bytes]] = []
        budget = self.max_bytes
        taken = 0
        try:
            while taken < limit and budget > 0:
                frames = recv(_NOBLOCK, copy=False)
                taken += 1
                data = [f.bytes for f in frames]
                for frame in data:
                    budget -= len(frame)
                # The metadata travels on the frames that came over the wire, not on the
                # routing-id frame the ROUTER prepends.
                user_id = frames[1].get("User-Id") if len(frames) > 1 else None
                if check(data[0], user_id if isinstance(user_id, str) else None):
                    out.append(data)
                else:
                    self._refused += 1
        except zmq.Again:
            pass
        self._received += taken
        return out

    async def receive_batch(self, limit: int = 256) -> list[list[bytes]]:
        """Wait for at least one message and return up to `limit` of them.

        Cancellation: either returns messages or raises `Cancelled` having taken none
        off the socket; a message once received is never lost.
        """
        self._claim()
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            batch = self._drain(limit)
            if batch:
                self._batches += 1
                await trio.lowlevel.cancel_shielded_checkpoint()
                return batch
            await self._wait(POLLIN)

    # -- sending ----------------------------------------------------------------------

    def send_nowait(self, frames: Frames) -> bool:
        """Send one message now. Returns False if it would block (HWM reached).

        Raises `zmq.ZMQError` with `errno.EHOSTUNREACH` for an unknown ROUTER peer.
        """
        self._claim()
        # One `send` per frame with plain int flags: pyzmq's send_multipart costs three
        # times as much (enum flag arithmetic per frame). On a ROUTER (the only socket
        # zmqdp sends multipart messages on) only the first frame can fail (HWM, unknown
        # peer): once it is queued, ZeroMQ takes the rest of the message.
        send = self.sock.send
        last = len(frames) - 1
        try:
            send(frames[0], _SEND_MORE if last else _NOBLOCK)
        except zmq.Again:
            return False
        for i in range(1, last):
            send(frames[i], _SEND_MORE)
        if last:
            send(frames[last], _NOBLOCK)
        self._sent += 1
        return True

    async def send(self, frames: Frames) -> None:
        """Send one message, waiting while it would block.

        Cancellation: if cancelled, the message was not sent.
        """
        self._claim()
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self.send_nowait(frames):
            await self._wait(POLLOUT)
            # ROUTER POLLOUT means "some peer has room", not ours: do not spin.
            await trio.sleep(0.001)
        await trio.lowlevel.cancel_shielded_checkpoint()

    # -- other tasks: kick -----------------------------------------------------------

    def kick(self) -> None:
        """Wake the owner if it is parked in `wait_readable_or_kicked`, or make its next
        call return at once (any task may call this)."""
        self._kicked = True
        if self._park is not None:
            self._kicks += 1
            self._park.cancel()
            self._park = None

    async def wait_readable_or_kicked(self) -> None:
        """Owner only: park until a message can be received or another task kicks.
        Returns at once if a kick came since the last call returned."""
        self._claim()
        if self._kicked:
            self._kicked = False
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope() as scope:
            self._park = scope
            try:
                await self._wait(POLLIN)
            finally:
                self._park = None
                self._kicked = False

    # -- closing ----------------------------------------------------------------------

    def close(self, linger: float = 0.0) -> None:
        """Close now: wake any waiter with `ClosedResourceError`. Messages already handed
        to libzmq are dropped, unless `linger`
        (seconds) gives libzmq that long to deliver them; `close` never waits, but a
        later `Context.term()` does, for at most `linger`. Safe to call more than once,
        from any task of this trio run."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(RuntimeError):  # outside trio nobody can be waiting
            trio.lowlevel.notify_closing(self.fd)
        self.sock.close(linger=int(linger * 1000))

    def statistics(self) -> ZSocketStatistics:
        return ZSocketStatistics(
            received=self._received,
            sent=self._sent,
            batches=self._batches,
            waits=self._waits,
            fallbacks=self._fallbacks,
            kicks=self._kicks,
            refused=self._refused,
        )


def is_unreachable(exc: zmq.ZMQError) -> bool:
    """True if a ROUTER_MANDATORY send failed because the peer is not connected."""
    return exc.errno == errno.EHOSTUNREACH

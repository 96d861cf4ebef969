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
   zmq recv ~1 µs). After the first message `EVENTS` says whether another is queued:
   a lone message, the common case of an idle group, then costs no `zmq.Again` (an
   exception, about twice a read of `EVENTS`).
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

9. **One task, several sockets.** A task that owns more than one socket (the handshake
   task and its connection monitors; the dispatcher and vLLM's per-rank output sockets,
   `ZSocketSet`) parks on all their fds at once through one `select.epoll` object,
   whose own fd trio waits on: rule 2 still holds, since `EVENTS` of every socket is
   read before each wait and after each wake-up.

`Monitor` reads libzmq's socket monitor (connection accepted, connection closed, with
the connection's fd): how the client learns at once that an engine's connection is
gone, by exit, kill, or a ZMTP heartbeat timeout (`heartbeat`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "POLLIN",
    "POLLOUT",
    "Monitor",
    "ZSocket",
    "ZSocketSet",
    "ZSocketStatistics",
    "handshake_deadline",
    "heartbeat",
    "shutdown_connection",
]

POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
_EVENTS = zmq.EVENTS
_NOBLOCK = int(zmq.NOBLOCK)
_SEND_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_SRCFD = 2  # ZMQ_SRCFD: deprecated in libzmq's docs, still answered by 4.3
_HAS_EPOLL = hasattr(select, "epoll")

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
        self._fds: _Fds | None = None  # the epoll object of `wait_readable_or_kicked(also)`

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

    async def _wait(self, flag: int) -> bool:
        """Park until `EVENTS & flag`. Re-reads EVENTS after every wake-up. Returns
        whether it parked (a schedule point), not if `flag` was set at once."""
        getsockopt = self._getsockopt
        parked = False
        while not getsockopt(_EVENTS) & flag:
            parked = True
            self._waits += 1
            with trio.move_on_after(self.safety_timeout) as scope:
                await trio.lowlevel.wait_readable(self.fd)
            if scope.cancelled_caught and getsockopt(_EVENTS) & flag:
                self._fallbacks += 1  # ready, yet the fd never said so: a missed wake-up
        return parked

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
                if len(out) == 1 and not self._getsockopt(_EVENTS) & POLLIN:
                    break  # a lone message (the common case when idle): no zmq.Again
        except zmq.Again:
            pass
        self._received += len(out)
        return out

    def _drain_checked(self, limit: int) -> list[list[bytes]]:
        """`_drain` for a socket whose peers are authenticated: read each message with
        its metadata and keep it only if `peer_check` accepts its sender."""
        return [data for data, _ in self._drain_sourced(limit, with_fd=False)]

    def receive_nowait_sourced(self, limit: int = 256) -> list[tuple[list[bytes], int]]:
        """`receive_nowait`, each message with the fd of the connection it came on
        (libzmq's `ZMQ_SRCFD`; -1 if unknown), to tie a peer's messages to the
        connection `Monitor` reports on. Slower than `receive_nowait`: for sockets that
        carry a few messages per connection (the handshake)."""
        self._claim()
        if not self._getsockopt(_EVENTS) & POLLIN:
            return []
        return self._drain_sourced(limit, with_fd=True)

    def _drain_sourced(self, limit: int, *, with_fd: bool) -> list[tuple[list[bytes], int]]:
        """Read each message with its metadata (`copy=False`); with `peer_check`, keep
        only those whose sender it accepts."""
        check = self.peer_check
        recv = self.sock.recv_multipart
        out: list[tuple[list[bytes], int]] = []
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
                # routing-id frame a ROUTER prepends.
                wire = frames[1] if len(frames) > 1 else frames[0]
                if check is not None:
                    user_id = wire.get("User-Id") if len(frames) > 1 else None
                    if not check(data[0], user_id if isinstance(user_id, str) else None):
                        self._refused += 1
                        continue
                fd = -1
                if with_fd:
                    with contextlib.suppress(zmq.ZMQError):
                        fd = int(wire.get(_SRCFD))
                out.append((data, fd))
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
        waited = False
        while True:
            batch = self._drain(limit)
            if batch:
                self._batches += 1
                if not waited:  # (a wait was the schedule point; another adds latency)
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return batch
            waited = await self._wait(POLLIN) or waited

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

    async def wait_readable_or_kicked(self, also: Sequence[ZSocket] = ()) -> None:
        """Owner only: park until a message can be received (here or on one of `also`,
        sockets the same task owns) or another task kicks. Returns at once if a kick
        came since the last call returned."""
        self._claim()
        if self._kicked:
            self._kicked = False
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope() as scope:
            self._park = scope
            try:
                if also:
                    await wait_any((self, *also), self._epoll_for(also))
                else:
                    await self._wait(POLLIN)
            finally:
                self._park = None
                self._kicked = False

    def _epoll_for(self, also: Sequence[ZSocket]) -> _Fds:
        fds = self._fds
        if fds is None or fds.members != (self, *also):
            if fds is not None:
                fds.close()
            fds = self._fds = _Fds((self, *also))
        return fds

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
        if self._fds is not None:
            self._fds.close()
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


class _Fds:
    """The fds of several sockets behind one fd trio can wait on (an epoll object: it
    is readable while any of them is). Without epoll (not Linux), only the first
    socket's fd is waited on and the others are looked at every `POLL_FALLBACK` s."""

    def __init__(self, members: tuple[ZSocket, ...]) -> None:
        self.members = members
        self._epoll = select.epoll() if _HAS_EPOLL else None
        if self._epoll is not None:
            for zs in members:
                self._epoll.register(zs.fd, select.EPOLLIN)

    @property
    def fd(self) -> int:
        return self.members[0].fd if self._epoll is None else self._epoll.fileno()

    @property
    def timeout(self) -> float:
        return min(z.safety_timeout for z in self.members) if self._epoll else POLL_FALLBACK

    def close(self) -> None:
        if self._epoll is not None and not self._epoll.closed:
            with contextlib.suppress(RuntimeError):
                trio.lowlevel.notify_closing(self._epoll.fileno())
            self._epoll.close()


POLL_FALLBACK = 0.05
"""Seconds between looks at the other sockets of a several-socket wait without epoll."""


async def wait_any(members: Sequence[ZSocket], fds: _Fds) -> bool:
    """Park until one of `members` (owned by the calling task) can receive: `EVENTS`
    of each is read before every wait and after every wake-up (rule 2). Returns
    whether it parked (a schedule point)."""
    getters = [zs._getsockopt for zs in members]
    parked = False
    while not any(get(_EVENTS) & POLLIN for get in getters):
        parked = True
        first = members[0]
        first._waits += 1
        with trio.move_on_after(fds.timeout) as scope:
            await trio.lowlevel.wait_readable(fds.fd)
        if (
            scope.cancelled_caught
            and fds.timeout != POLL_FALLBACK
            and any(get(_EVENTS) & POLLIN for get in getters)
        ):
            first._fallbacks += 1
    return parked


Gate = Callable[[int], Callable[[int, list[bytes]], bool] | None]
"""`gate(i)`, called before each drain of member `i`: does what must come first (read
the member's connection monitor) and returns None (take every message) or a predicate
on the fd each message came on and its frames (keep it?)."""


class ZSocketSet:
    """Several receiving sockets read as one by a single task (vLLM's per-rank output
    sockets, read by the dispatcher): the interface of `ZSocket` that the dispatcher
    uses. Each drain takes from the members in turn, starting one further each time,
    so a chatty member cannot starve the others. `mark(i, frames)` may rewrite a
    message of member `i` (vLLM: tag a death sentinel with the rank that sent it).

    `gate` (module `Gate`) runs before each member's drain, and `extra` sockets (its
    connection monitors, which the same task reads in `gate`) wake a parked receive
    too: a connection that closes while the task is parked is seen at once. A member
    whose gate returns a predicate is read with each message's source fd (slower) and
    a message it refuses is dropped and counted (`dropped`)."""

    def __init__(
        self,
        members: Sequence[ZSocket],
        mark: Callable[[int, list[bytes]], list[bytes]] | None = None,
        *,
        gate: Gate | None = None,
        extra: Sequence[ZSocket] = (),
    ) -> None:
        self.members = tuple(members)
        self._mark = mark
        self._gate = gate
        self._extra = tuple(extra)
        self._start = 0
        self._fds: _Fds | None = None
        self._park: trio.CancelScope | None = None
        self._kicked = False
        self.dropped = 0
        """Messages a gate refused (a previous incarnation's connection)."""

    @property
    def closed(self) -> bool:
        return all(zs.closed for zs in self.members)

    def release(self) -> None:
        for zs in self.members:
            zs.release()

    def receive_nowait(self, limit: int = 256) -> list[list[bytes]]:
        """Up to `limit` queued messages of all members, without waiting."""
        members = self.members
        n = len(members)
        start = self._start
        self._start = (start + 1) % n
        out: list[list[bytes]] = []
        mark = self._mark
        gate = self._gate
        for k in range(n):
            i = (start + k) % n
            keep = None if gate is None else gate(i)
            if keep is None:
                got = members[i].receive_nowait(limit - len(out))
            else:
                sourced = members[i].receive_nowait_sourced(limit - len(out))
                got = [frames for frames, fd in sourced if keep(fd, frames)]
                self.dropped += len(sourced) - len(got)
            if got:
                if mark is not None:
                    got = [mark(i, frames) for frames in got]
                out += got
                if len(out) >= limit:
                    break
        return out

    async def receive_batch(self, limit: int = 256) -> list[list[bytes]]:
        """Wait for at least one message of any member; cancellation as
        `ZSocket.receive_batch` (a message once received is never lost)."""
        waited = (*self.members, *self._extra)
        for zs in waited:
            zs._claim()
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            self._kicked = False
            batch = self.receive_nowait(limit)
            if batch:
                self.members[0]._batches += 1
                if not parked:  # (parking was the schedule point; another adds latency)
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return batch
            if self._kicked:
                continue  # a gate has something to do now
            if self._fds is None:
                self._fds = _Fds(waited)
            with trio.CancelScope() as scope:
                self._park = scope
                try:
                    parked = await wait_any(waited, self._fds) or parked
                finally:
                    self._park = None

    def kick(self) -> None:
        """Make the owner run its gates now (any task may call this): a parked
        `receive_batch` wakes, a busy one looks again before it parks."""
        self._kicked = True
        if self._park is not None:
            self._park.cancel()

    def close(self) -> None:
        if self._fds is not None:
            self._fds.close()
        for zs in self.members:
            zs.close()

    def statistics(self) -> ZSocketStatistics:
        each = [zs.statistics() for zs in self.members]
        return ZSocketStatistics(
            *(sum(getattr(s, f) for s in each) for f in ZSocketStatistics.__slots__)
        )


MONITORED = int(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
ACCEPTED = int(zmq.EVENT_ACCEPTED)
DISCONNECTED = int(zmq.EVENT_DISCONNECTED)


class Monitor:
    """libzmq's monitor of one bound socket: each connection accepted and each one
    closed (by the peer's exit, or by libzmq after a heartbeat timeout), with its fd.
    Owned by the task that owns the monitored socket; read it to the end before that
    socket's messages (and again before a message is taken as a rank's), so that a
    connection's accept and close are seen before any message read after them (libzmq
    emits the accept before the connection can deliver, and the close before it closes
    the fd, so an fd number reused by a new connection is always seen closed first)."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._target = sock
        self.zs = ZSocket(sock.get_monitor_socket(MONITORED))

    def events(self) -> list[tuple[int, int]]:
        """Up to 1024 of what happened since the last call, in order: `(ACCEPTED or
        DISCONNECTED, fd)` (call again until it returns none). While about a thousand
        events wait unread, libzmq blocks the I/O thread that emits them, and with it
        every socket that thread serves, heartbeat answers included: the owner reads
        them before every wait, and a flood of connections during a long stall of the
        owner's loop could hold up the whole group (second adversarial campaign)."""
        out = []
        for frames in self.zs.receive_nowait(1024):
            if len(frames) != 2 or len(frames[0]) != 6:
                continue
            ev = parse_monitor_message(frames)
            if ev["event"] in (ACCEPTED, DISCONNECTED):
                out.append((int(ev["event"]), int(ev["value"])))
        return out

    def close(self) -> None:
        if not self.zs.closed:
            with contextlib.suppress(zmq.ZMQError):
                if not self._target.closed:
                    self._target.disable_monitor()
            self.zs.close()


def heartbeat(sock: zmq.Socket[bytes], interval: float | None, timeout: float) -> None:
    """ZMTP heartbeats on every connection of `sock` (libzmq answers a PING in its I/O
    thread, whatever the engine's own code is doing): a peer that sends nothing, not
    even a PONG, for `timeout` s after a PING is disconnected, which its `Monitor`
    reports. No TTL is sent: it would ask every engine to drop us when *we* are late
    (a gateway starved of CPU for 3 s on an overloaded host lost every rank of an MoE
    group at once that way), and an engine gains nothing from it (its sockets reconnect).
    `interval` None: no heartbeats. Only for a socket whose receive queue does not
    fill: libzmq stops reading a peer whose queue is full, its PONGs with it, and would
    drop a live connection (and what it had queued)."""
    handshake_deadline(sock, timeout)
    if interval is None:
        return
    ms = max(1, round(timeout * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(interval * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)


def handshake_deadline(sock: zmq.Socket[bytes], timeout: float) -> None:
    """Drop a connection whose ZMTP handshake (CURVE included) has not completed after
    `timeout` s (`HANDSHAKE_IVL`, 30 s by default): heartbeats start only after the
    handshake, so an engine stopped in the middle of one would be seen 30 s late, and
    a stalled stranger would hold a connection that long."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, round(timeout * 1000)))


def is_unreachable(exc: zmq.ZMQError) -> bool:
    """True if a ROUTER_MANDATORY send failed because the peer is not connected."""
    return exc.errno == errno.EHOSTUNREACH


def shutdown_connection(fd: int) -> bool:
    """End the connection libzmq serves on `fd` (from a monitor event or `ZMQ_SRCFD`):
    `shutdown(2)` on a duplicate of it, so libzmq reads end-of-stream and closes the
    connection the usual way (a DISCONNECTED event follows), while libzmq alone closes
    the fd itself. For a connection `ROUTER_HANDOVER` displaced: libzmq keeps it open
    with no route, so the peer never notices and never reconnects. Returns False if the
    fd was not a socket any more. The caller has read the monitor to its end first, so
    `fd` is not a number libzmq closed and reused."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        with socket.socket(fileno=dup) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    return True


_GONE = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


def peer_closed(fd: int) -> bool:
    """Whether the peer of the connection libzmq serves on `fd` has closed it (or `fd`
    is closed already), by `poll(2)` with nothing read: the engine process exited or
    was killed, rather than a single message being dropped with one connection."""
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)
    return any(events & _GONE for _, events in poller.poll(0))

"""What the client asks of a transport on any wire, and what every transport shares.

`Transport` is what the client uses of one (sends, forgets, statistics, the output
socket for the dispatcher); `TransportListener` is what a transport reports; a
`GroupDialect` pairs a wire with the opener of its sockets. `TransportBase` holds what
every dialect's transport shares; the socket layouts are elsewhere: natively
`_sockets.py` (`GroupTransport`, `NATIVE`, `open_group_transport`), on vLLM's wire
`vllm/sockets.py`.

Theory of operation
-------------------
Each socket has exactly one owning task:

* `serve_handshake` owns the handshake ROUTER for the life of the group: it hands each
  message to the dialect (`_on_handshake_message`) and runs the dialect's timed work
  (`_resync`, natively RESYNC about once a second to every rank the group is waiting
  for, docs/protocol.md §2.5). Rejoins can come at any time, so this task never stops
  while the group is open.
* `serve_input` owns the input ROUTER. It sends what other tasks `send()` (ADD, ABORT,
  WAKE, CALL frames go into a per-rank queue, `_core/outbox.py`; the owner is kicked
  awake) and receives the messages that complete a rank's handshake (REGISTER
  natively), also at any time. A rank whose pipe is full is skipped and retried on a
  backing-off timer, so it delays only its own messages and the task never spins.
* One socket per dialect carries the ranks' lives (the **watched socket**: natively the
  handshake ROUTER, on vLLM's wire the input ROUTER). Its owner reads its connection
  monitor (`_zmq.Monitor`) before every batch of its messages: each message the client
  accepts from a new incarnation ties its connection (the fd libzmq gives the message)
  to the rank (`_core/liveness.ConnectionWatch`, `_claim`), and when that connection
  closes, because the engine exited, was killed, or missed ZMTP heartbeats
  (`heartbeat_interval`, `heartbeat_timeout`: a stopped process), that is reported at
  once, idle or not, naming the incarnation whose connection it was
  (`listener.connection_lost`). The group's core judges it
  (`GroupCore.on_connection_lost`) and orders the forget of that incarnation: the
  transport decides nothing itself once a group exists (at start-up, before one
  does, that handshake starts over).
* The output socket(s) are handed to the caller (the dispatcher), which claims them;
  the close of a rank's output connection is judged by `_output_lost` (`OUTPUT_LOST`,
  `ENGINE_GONE`).

Every client ROUTER bounds what libzmq may queue per peer (RCVHWM, from
`max_message_size`: `output_hwm`, `CONTROL_HWM`), and every owning task checkpoints
after each non-empty batch it drains, so a peer that floods a socket slows down nobody
else. What peers cause is logged through a `LogLimiter`.

Send failures are not raised into the task that queued the message (it has moved on):
`listener.send_failed(rank, cause)` reports an unknown peer (EHOSTUNREACH under
ROUTER_MANDATORY) at once, and a peer whose pipe stayed full past `send_timeout`.
Either makes the rank dead (§6); its queued messages are dropped. So are the messages
queued for a rank the client declares dead for any other reason (`drop_queued`): they
belong to an incarnation that is gone.

Closing (§9): once the tasks are gone, `aclose` takes over the input socket, pushes
what is still queued for each rank (the ABORTs the client sends for its live requests) without
blocking, and closes it with a short LINGER, so those ABORTs reach the engines; the
other sockets close with LINGER 0. The context is then terminated in a worker thread
(bounded by that LINGER), since `term()` blocks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import trio
import zmq

from ._core.errors import HandshakeTimeout
from ._core.handshake import RankUp
from ._core.liveness import ConnectionWatch
from ._core.messages import DEFAULT_MAX_MESSAGE_SIZE
from ._core.outbox import Outbox
from ._core.wire import Wire
from ._util import LogLimiter
from ._zmq import (
    ACCEPTED,
    Monitor,
    ZSocket,
    ZSocketSet,
    ZSocketStatistics,
    is_unreachable,
    peer_closed,
)
from .values import ConnectOptions

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "GroupDialect",
    "Transport",
    "TransportBase",
    "TransportListener",
    "TransportStatistics",
]

R = TypeVar("R")

log = logging.getLogger("zmqdp")

PEER_QUEUE_BYTES = 1 << 30
"""About what libzmq may queue for one peer on the output socket: its RCVHWM is this many
bytes' worth of the largest messages allowed, but at least 64 messages (fewer cut the
dispatcher's batches, and its throughput by a third, measured) and at most 1000."""

CONTROL_HWM = 16
"""RCVHWM of the handshake and input sockets, which carry a few messages per
incarnation: one peer can make them hold at most this many messages."""

CONTROL_MAX_MESSAGE = 1 << 20
"""MAXMSGSIZE of the handshake and input sockets (at most `max_message_size`): HELLO,
READY and REGISTER are small, and libzmq buffers a message being received in full, so
a peer that sends all of a large one but its last bytes holds that much per
connection."""


def output_hwm(max_message_size: int) -> int:
    """The output ROUTER's RCVHWM (messages per peer) for this `max_message_size`:
    memory a peer can fill is bounded by configuration, not by how fast it sends."""
    return max(64, min(1000, PEER_QUEUE_BYTES // max(1, max_message_size)))


CLOSE_LINGER = 0.5
"""Seconds libzmq may spend delivering the ABORTs queued at close (§9)."""


class TransportListener:
    """What the transport reports, as it happens (a subclass overrides what it needs).
    The calls are synchronous and come from the transport's own tasks."""

    def rank_up(self, up: RankUp) -> None:
        """`up.rank` completed a handshake (natively READY and REGISTER of its current
        epoch); `up` is what its handshake said."""

    def rejoin(self, rank: int) -> None:
        """`rank` said HELLO again (or sent an invalid HELLO): its previous incarnation
        is dead."""

    def send_failed(self, rank: int, cause: str) -> None:
        """A send to `rank` failed or timed out; its queued messages were dropped."""

    def connection_lost(
        self, rank: int, incarnation: int | None, cause: str, grace: float = 0.0
    ) -> bool:
        """The connection of `rank`'s incarnation `incarnation` closed (it exited, was
        killed, or missed heartbeats). Return True if the group judges it (`grace`:
        that much later, so that a report of its other connections closing may come
        meanwhile and name the plain cause): the transport then does nothing more.
        False (no group yet, at start-up): the transport starts that handshake over."""
        return False

    def flushed(self) -> None:
        """The input task sent a run of messages."""

    def output_stray_closed(self) -> None:
        """An output connection that no rank had claimed, opened after an INIT, closed:
        if a rank's first message came on it and was over max_message_size, libzmq
        dropped it with the connection (the core's `seq` rule judges)."""

    def displaced(self, rank: int, cause: str) -> None:
        """CURVE: a peer with another rank's key took `rank`'s identity on the input or
        output socket (ROUTER_HANDOVER): `rank`'s connection there is gone."""


@dataclass(frozen=True, slots=True)
class TransportStatistics:
    """Counters of the client's three sockets and of the handshake."""

    handshake: ZSocketStatistics
    input: ZSocketStatistics
    output: ZSocketStatistics
    rejected_hellos: int
    """HELLOs, READYs and untyped handshake messages answered with REJECT."""
    ignored_handshake_messages: int
    """Handshake-socket messages that were neither HELLO nor READY, or came too late,
    and input-socket messages that were not a valid REGISTER."""
    stale_registers: int
    """REGISTERs carrying the epoch of a dead incarnation (§2.3)."""
    resyncs: int
    """RESYNCs sent to ranks the group was waiting for (§2.5)."""
    dropped_answers: int
    """INIT/REJECT answers dropped because the peer's queue was full or it was gone."""
    identity_conflicts: int
    """Rejoins soon after the rank's previous HELLO (two processes claiming one rank)."""
    queued: tuple[int, ...]
    """Per rank: messages waiting for the input task (a blocked rank's grow)."""
    input_rounds: int
    """Times the input task woke up and looked for work: it grows with traffic, and by
    a few dozen a second per rank whose pipe is full; a spinning task would show here."""
    refused_connections: int
    """CURVE: connections refused by the ZAP handler (a key not on the allow-list)."""
    impersonations: int
    """CURVE: messages dropped because their routing id was not their key's rank."""
    connections_lost: int
    """Ranks declared dead because their connection closed (exit, kill, or missed
    heartbeats)."""
    stale_messages: int
    """vLLM: output messages dropped because they came on a connection of a previous
    incarnation of their rank (a lingering engine the rank's new one replaced)."""
    routes_restored: int = 0
    """Natively: times the client ended connections of a displaced engine of a rank
    (`ROUTER_HANDOVER` had cut it off) so that it reconnects and hears its RESYNC."""


class Transport(Protocol):
    """What the client uses of a transport, on any wire. (Not its handshake state: what
    a rank's handshake said comes in `TransportListener.rank_up`'s record.)"""

    output: ZSocket | ZSocketSet
    """The output socket (vLLM: one per rank), the dispatcher's alone."""
    nursery: trio.Nursery | None

    @property
    def lockstep(self) -> bool:
        """The ranks run in lockstep (their HELLOs said so, or the dialect: MoE)."""
        ...

    def send(self, rank: int, frames: Sequence[bytes]) -> None: ...

    def publish(self, frames: list[bytes]) -> None: ...

    def drop_queued(self, rank: int) -> None: ...

    def forget(self, rank: int, *, resync: bool = True, epoch: int | None = None) -> None: ...

    def statistics(self) -> TransportStatistics: ...


OpenTransport = Callable[
    [str, int, ConnectOptions, "TransportListener"], AbstractAsyncContextManager[Transport]
]


@dataclass(frozen=True, slots=True)
class GroupDialect(Generic[R]):
    """A wire and the sockets it runs on: what `EngineGroup.open` takes to speak to
    engines of one kind (`NATIVE`, `zmqdp.vllm.dialect(...)`). The variation is passed
    in, never made by subclassing the group, its core or its transport."""

    wire: Wire[R]
    """The codec and its capability flags (sans-IO, `_core/wire.py`)."""
    open_transport: OpenTransport
    """Bind the sockets, run the handshake until every rank is up, yield the transport."""


OUTPUT_LOST = (
    "its output connection closed while the engine lives, so outputs it sent may be "
    "lost: it sent a message over max_message_size={} bytes (libzmq drops the message "
    "with the connection, and the engine reconnects), or restarted its output socket"
)
"""The cause of a rank whose output connection closed (a template of the size)."""

ENGINE_GONE = (
    "its connection closed, and its other connections too: the engine process exited or "
    "was killed (see its log)"
)
"""The cause of a rank whose output connection closed along with the rest."""

OUTPUT_GRACE = 0.1
"""Seconds the close of a rank's output connection alone waits to be judged: a killed
engine's other connections close within microseconds of it, and name the plain cause."""


def handshake_next_step(url: str, up: int, rejected: bool, timeout: float, start: str) -> str:
    """What a `HandshakeTimeout` tells its reader to do next, from what was seen: `up`
    ranks came up, some handshakes were `rejected` or not, after `timeout` s."""
    slow = f"if the engines are still starting, raise ready_timeout (it was {timeout:g} s)"
    if rejected:
        return (
            "the rejected handshakes above say how the engines differ from this client: "
            f"restart them to match ({start}); {slow}"
        )
    if up:
        return (
            f"start the missing ranks (each connecting to {url}), or look in their logs "
            f"for why they stopped; {slow}"
        )
    return (
        f"no engine completed the handshake: is an engine group running and connecting to "
        f"{url}? Start one with {start} (or check your engines' logs and the URL they "
        f"were given); {slow}"
    )


class TransportBase:
    """What every transport shares, whatever its wire: the input ROUTER and its owner
    task, sends, the handshake loop, handshake answers, waiting for the ranks, the
    statistics and closing. A dialect's transport (`GroupTransport` natively,
    `zmqdp.vllm.sockets.VllmTransport`) adds only its socket layout and how it reads
    its handshake messages (`_on_handshake_message`, `_on_input_message`, `_resync`).

    The input task sends what other tasks queued in the per-rank `outbox` (until a
    rank's pipe is full; that rank is retried on the outbox's timer and dropped after
    `send_timeout`), and hands what arrives to `_on_input_message`. It parks until a
    message arrives, another task queues one for a rank that is not blocked, or a
    blocked rank's retry is due; it never spins on a full rank, and a peer that floods
    the socket makes it yield once per batch."""

    size: int
    handshake: ZSocket
    input: ZSocket
    output: ZSocket | ZSocketSet
    outbox: Outbox[list[bytes]]
    listener: TransportListener
    send_timeout: float
    state: Any
    context: zmq.Context[zmq.Socket[bytes]]
    nursery: trio.Nursery | None
    _logs: LogLimiter
    _sockets: list[ZSocket]
    _own_context: bool
    _monitors: list[Monitor]
    """Every connection monitor, to close first."""
    _watched: ZSocket | None = None
    _monitor: Monitor | None = None
    heartbeat_interval: float | None
    heartbeat_timeout: float

    def _init_base(
        self, identities: list[bytes], listener: TransportListener | None, send_timeout: float
    ) -> None:
        """After the sockets are bound: the state every transport keeps."""
        self.listener = listener or TransportListener()
        self.send_timeout = send_timeout
        self.outbox = Outbox(self.size, send_timeout=send_timeout)
        self._identities = identities
        self._input_rounds = 0
        self._dropped_answers = 0
        self.ranks_changed = trio.Event()  # set (and replaced) whenever a rank comes up
        self.nursery = None  # set by the opener
        self._connections_lost = 0
        self._watch = ConnectionWatch()
        self._history: dict[int, set[int]] = {}
        """Rank -> open connections of the watched socket it ever claimed (a displaced
        one may be a live engine that `ROUTER_HANDOVER` cut off: `_restore_route`)."""
        self._claimed: dict[int, int | None] = {}
        """Rank -> the incarnation whose connection of the watched socket it claimed
        (its close is reported as that incarnation's)."""
        self._lost_counted: dict[int, int | None] = {}
        """Rank -> the incarnation whose loss `connections_lost` counted last."""
        self._lost_logged: dict[int, int | None] = {}
        """Rank -> the incarnation whose loss was logged last (once each)."""
        self._output_epochs: dict[int, int | None] = {}
        """Rank -> the incarnation its output connections belong to (set as each new
        incarnation begins on the output socket)."""
        self._duplicates = 0

    # -- sending (any task) -----------------------------------------------------------

    def send(self, rank: int, frames: Sequence[bytes]) -> None:
        """Queue a message for `rank` on the input socket; never blocks. Failures come
        back through `listener.send_failed`. Raises `trio.ClosedResourceError` once the
        transport is closed."""
        if self.input.closed:
            raise trio.ClosedResourceError("the engine group's sockets are closed")
        if self.outbox.put(rank, [self._identities[rank], *frames]):
            self.input.kick()

    def drop_queued(self, rank: int) -> None:
        """Forget what is queued for `rank`: it was declared dead, and a next
        incarnation on the same identity must not get the old one's messages."""
        self.outbox.drop(rank)

    # -- the handshake task -----------------------------------------------------------

    def _on_handshake_message(self, frames: list[bytes], fd: int) -> None:
        """One handshake message, `fd` the connection it came on (-1: unknown)."""
        raise NotImplementedError

    # -- liveness: the watched socket --------------------------------------------------
    #
    # One socket per dialect carries the ranks' lives (`_watched`: natively the
    # handshake ROUTER, on vLLM's wire the input ROUTER). Its owner task reads its
    # connection monitor to the end before it reads its messages, and again right
    # before a message claims its connection for a rank (`_claim`), so that every close
    # and accept that happened before the message is known first (`_core/liveness.py`).

    def _watch_connections(self) -> None:
        """(The watched socket's owner.) Read its monitor to the end; report each rank
        whose current incarnation's connection closed."""
        monitor = self._monitor
        if monitor is None:
            return
        while events := monitor.events():
            for event, fd in events:
                if event == ACCEPTED:
                    self._watch.accepted(fd)
                    continue
                for fds in self._history.values():
                    fds.discard(fd)
                if (rank := self._watch.disconnected(fd)) is not None:
                    self._connection_lost(rank, self._claimed.get(rank))

    def _claim(self, fd: int, rank: int) -> None:
        """(The watched socket's owner.) A message of `rank`'s new incarnation came on
        connection `fd`: the rank lives as long as this connection does (if that one
        closed already, the rank is dead now)."""
        if fd >= 0:
            self._watch_connections()
            if self._watch.connections(rank) - {fd}:
                self._duplicates += 1
                # (heartbeats off: nothing can judge the incumbent, the newest wins)
                log.error(
                    "rank %d: a new engine process said HELLO while the connection of the "
                    "current one is still open: a second process runs as rank %d (a copied "
                    "key pair or a replayed one, or a mistake in deployment), or the previous "
                    "one is stopped or hung; the newcomer takes the rank, and the other is "
                    "RESYNCed once it is needed again (statistics().identity_conflicts)",
                    rank,
                    rank,
                )
            self._claimed[rank] = epoch = self.state.epoch(rank)
            if not self._watch.claim(fd, rank):
                self._connection_lost(rank, epoch)
            else:
                self._history.setdefault(rank, set()).add(fd)

    def _take(self, zs: ZSocket) -> list[tuple[list[bytes], int]]:
        """What `zs`'s owner has to read now, each message with its connection's fd
        (-1 where nobody asks: a socket that is not the watched one)."""
        if zs is self._watched:
            self._watch_connections()
            return zs.receive_nowait_sourced()
        return [(frames, -1) for frames in zs.receive_nowait()]

    def _also(self, zs: ZSocket) -> list[ZSocket]:
        """What else `zs`'s owner parks on: the watched socket's monitor."""
        return [self._monitor.zs] if zs is self._watched and self._monitor is not None else []

    def _watch_socket(self, zs: ZSocket) -> None:
        """Make `zs` the watched socket: its monitor. (Its ZMTP heartbeats are set
        before it binds: libzmq copies a socket's options into each listener. Only
        there: on a socket whose queue can fill, libzmq stops reading a back-pressured
        peer, its PONGs with it, and would drop a live connection.)"""
        self._watched = zs
        self._monitor = Monitor(zs.sock)
        self._monitors.append(self._monitor)

    def _connection_lost(
        self, rank: int, incarnation: int | None, cause: str | None = None, grace: float = 0.0
    ) -> None:
        """A connection of `rank`'s incarnation `incarnation` closed: report it. Once a
        group exists, it judges (`GroupCore.on_connection_lost`) and this changes
        nothing here; before, at start-up, that handshake starts over."""
        if self._lost_counted.get(rank, -1) != incarnation:  # its other connections' too
            self._lost_counted[rank] = incarnation
            self._connections_lost += 1
        if cause is None:
            cause = (
                "its connection closed: the engine exited, was killed or restarted, or sent "
                "nothing, not even a heartbeat, for "
                f"heartbeat_timeout={self.heartbeat_timeout:g} s"
            )
        self._lost(rank, incarnation)
        judged = self.listener.connection_lost(rank, incarnation, cause, grace)
        # A group judges the death and logs it once ("rank N: dead: <cause>"). Here,
        # one line per incarnation, of a plain report: one with a grace may be
        # superseded (an engine killed: the output's close can come first, when the
        # engine still seems alive), and a repeat is its other connections'.
        plain = not grace and self._lost_logged.get(rank, -1) != incarnation
        if plain:
            self._lost_logged[rank] = incarnation
        level = logging.WARNING if plain or not judged else logging.DEBUG
        log.log(level, "rank %d: %s", rank, cause)
        if not judged:
            self.forget(rank, epoch=incarnation)

    def _lost(self, rank: int, incarnation: int | None) -> None:
        """A dialect's note that `rank`'s connection closed (for `HandshakeTimeout`)."""

    def _output_lost(self, rank: int, max_message_size: int) -> None:
        """(Dispatcher.) `rank`'s output connection closed. If the connection its life
        is tied to is closed by its peer too, the process is gone: say so plainly;
        otherwise outputs were dropped with the one connection (`OUTPUT_LOST`)."""
        life = self._watch.connections(rank)
        incarnation = self._output_epochs.get(rank)
        if life and all(peer_closed(fd) for fd in life):
            self._connection_lost(rank, incarnation, ENGINE_GONE)
        else:  # judged a little later: the close of the others may be on its way
            cause = OUTPUT_LOST.format(max_message_size)
            self._connection_lost(rank, incarnation, cause, OUTPUT_GRACE)

    def forget(self, rank: int, *, resync: bool = True, epoch: int | None = None) -> None:
        """The incarnation `epoch` of `rank` is dead (None: whichever is current): its
        handshake starts over, unless a newer one began since (the state machine's
        `superseded`)."""
        raise NotImplementedError

    def _close_monitors(self) -> None:
        """Before the sockets they watch close (libzmq: monitors first)."""
        for monitor in self._monitors:
            monitor.close()
        self._monitors = []

    def _on_input_message(self, frames: list[bytes], fd: int) -> None:
        raise NotImplementedError

    def _resync(self, now: float) -> float:
        """Send what is due to ranks the group waits for; return when to look again."""
        return math.inf

    async def serve_handshake(self) -> None:
        """Own the handshake ROUTER: answer HELLOs, record READYs (and, natively, send
        RESYNCs), forever: rejoins can come at any time.

        Cancellation: it stops between messages; a message it took off the socket is
        answered first (the answer may be lost with the socket)."""
        zs = self.handshake
        also = self._also(zs)
        while True:
            next_at = self._resync(trio.current_time())
            batch = self._take(zs)
            for frames, fd in batch:
                self._on_handshake_message(frames, fd)
            if batch:
                await trio.lowlevel.checkpoint()  # a flood of HELLOs yields per batch
            with trio.move_on_at(next_at):
                await zs.wait_readable_or_kicked(also=also)

    def _answer_bytes(self, identity: bytes, body: bytes) -> None:
        """Answer without waiting: one peer that does not read must not hold up the
        handshake of the others, so an answer that would block is dropped and counted
        (that peer's HELLO times out on its side and it says HELLO again)."""
        try:
            if self.handshake.send_nowait([identity, body]):
                return
            cause = "its queue is full"
        except zmq.ZMQError as exc:  # the engine vanished between its message and ours
            cause = str(exc)
        self._dropped_answers += 1
        self._logs.log(
            logging.WARNING,
            "answer-dropped",
            "handshake: could not answer identity %s: %s",
            identity.hex(),
            cause,
        )

    def _rank_is_up(self, rank: int, detail: str) -> None:
        log.info("rank %d: up (%s)", rank, detail)
        self.listener.rank_up(self.state.rank_up(rank))
        self.ranks_changed.set()
        self.ranks_changed = trio.Event()

    # -- the input task ---------------------------------------------------------------

    async def serve_input(self) -> None:
        """Own the input ROUTER (class docstring), forever."""
        zs = self.input
        outbox = self.outbox
        also = self._also(zs)
        while True:
            self._input_rounds += 1
            now = trio.current_time()
            sent_any = self._flush_input(now)
            received = self._take(zs)
            for frames, fd in received:
                self._on_input_message(frames, fd)
            for rank in outbox.overdue(now):
                outbox.drop(rank)
                self._send_failed(
                    rank, f"its input pipe stayed full for {self.send_timeout:g} s (send timeout)"
                )
            probe_at = self._input_round(now)
            if sent_any:
                self.listener.flushed()
            if sent_any or received:
                await trio.lowlevel.checkpoint()
                continue
            with trio.move_on_at(min(outbox.next_retry(), probe_at)):
                await zs.wait_readable_or_kicked(also=also)

    def _input_round(self, now: float) -> float:
        """(The input task, each round.) A dialect's own input work; returns when it
        next has some (vLLM: probe dormant ranks)."""
        return math.inf

    def _flush_input(self, now: float) -> bool:
        """Send what each rank that is not blocked has queued, in order, until its pipe
        is full. Returns whether anything was sent."""
        zs = self.input
        outbox = self.outbox
        sent = False
        for rank in outbox.sendable(now):
            while (frames := outbox.head(rank)) is not None:
                try:
                    if not zs.send_nowait(frames):
                        outbox.blocked(rank, now)
                        break
                except zmq.ZMQError as exc:
                    outbox.drop(rank)
                    self._send_failed(
                        rank,
                        "not connected to the input socket (EHOSTUNREACH)"
                        if is_unreachable(exc)
                        else f"send failed: {exc}",
                    )
                    break
                outbox.sent(rank)
                sent = True
        return sent

    def _send_failed(self, rank: int, cause: str) -> None:
        log.warning("rank %d: %s", rank, cause)
        self.listener.send_failed(rank, cause)

    # -- waiting, statistics and closing ----------------------------------------------

    async def wait_ready(self) -> None:
        """Wait until every rank is up.

        Cancellation: nothing changes; wrap it in a deadline and raise
        `self.timeout_error(...)` when it expires."""
        while not self.state.ready():
            await self.ranks_changed.wait()

    def timeout_error(self, timeout: float, url: str, start: str) -> HandshakeTimeout:
        """The `HandshakeTimeout` of a group bound at `url` that waited `timeout` s for
        its ranks. `start`: how to start an engine group for it (the dialect's command,
        in backticks), for the message's next step."""
        missing = self.state.missing()
        for rank, why in missing.items():
            explained = self._explain_missing(rank)
            if explained is not None:
                missing[rank] = f"{why}; {explained}"
        rejected = list(self.state.rejected)
        up = self.size - len(missing)
        return HandshakeTimeout(
            missing,
            rejected,
            timeout,
            url=url,
            size=self.size,
            next_step=handshake_next_step(url, up, bool(rejected), timeout, start),
        )

    def _explain_missing(self, rank: int) -> str | None:
        """What the dialect saw that may explain why `rank` never joined."""
        return None

    def _counters(self) -> dict[str, int]:
        """The dialect's own counters of `TransportStatistics` (0 where it has none)."""
        return {}

    def statistics(self) -> TransportStatistics:
        extra = self._counters()
        return TransportStatistics(
            handshake=self.handshake.statistics(),
            input=self.input.statistics(),
            output=self.output.statistics(),
            rejected_hellos=self.state.rejections,
            ignored_handshake_messages=self.state.ignored,
            stale_registers=extra.get("stale_registers", 0),
            resyncs=extra.get("resyncs", 0),
            dropped_answers=self._dropped_answers,
            identity_conflicts=extra.get("identity_conflicts", 0),
            queued=tuple(self.outbox.queued(r) for r in range(self.size)),
            input_rounds=self._input_rounds,
            refused_connections=extra.get("refused_connections", 0),
            impersonations=extra.get("impersonations", 0),
            connections_lost=self._connections_lost,
            stale_messages=self.output.dropped if isinstance(self.output, ZSocketSet) else 0,
            routes_restored=extra.get("routes_restored", 0),
        )

    def _close_sockets(self) -> None:
        """Close every socket at once (a constructor that failed half-way, `close`)."""
        self._close_monitors()
        if isinstance(getattr(self, "output", None), ZSocketSet):
            self.output.close()  # its members are in `_sockets`; this closes its epoll
        for zs in self._sockets:
            zs.close()
        self._sockets = []
        if self._own_context:
            self.context.term()

    def _closed(self) -> None:
        """After every socket closed (natively: remove the ipc socket files bound)."""

    async def aclose(self) -> None:
        """Close after the owning tasks have ended, delivering what is still queued on
        the input socket, such as ABORTs (§9): the input socket closes with a LINGER
        of `CLOSE_LINGER`, the others with none, and the context is terminated in a
        worker thread (`term()` blocks until the LINGER is over or all is delivered).

        Cancellation: shielded; it takes at most `CLOSE_LINGER` seconds."""
        self._close_monitors()
        zs = self.input
        if not zs.closed:
            zs.release()  # its owner, the input task, has ended
            for rank in range(self.size):
                for frames in self.outbox.take_all(rank):
                    try:
                        if not zs.send_nowait(frames):
                            break  # that engine's pipe is full: the rest is dropped
                    except zmq.ZMQError:
                        break  # that engine is gone; its requests are over anyway
        zs.close(linger=CLOSE_LINGER)
        if isinstance(self.output, ZSocketSet):
            self.output.close()
        for other in self._sockets:
            other.close()
        self._sockets = []
        if self._own_context:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.context.term)
        self._closed()

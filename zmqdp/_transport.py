"""The client's socket set for one engine group, and the tasks that own it.

Theory of operation
-------------------
The client binds three ROUTERs (docs/protocol.md §1): handshake, input and output. Each has
exactly one owning task:

* `serve_handshake` owns the handshake ROUTER for the life of the group. It answers
  every HELLO with INIT or REJECT (through `HandshakeState`), records READY (an invalid
  one is answered with REJECT), reports a rank that came up and a HELLO that was a
  rejoin, and sends RESYNC about once a second to every rank the group is waiting for
  (docs/protocol.md §2.5). Rejoins can come at any time, so this task never stops
  while the group is open. Every ROUTER hands a rank's identity to its newest
  connection (`ROUTER_HANDOVER`, so that a restart works), which leaves the displaced
  one open with no route. So a HELLO for a rank whose connection is still open is held
  while the heartbeats judge that connection (`_contests`, `_settle`): admitted if it
  closes, refused if it stays (a second process). A RESYNC that finds no route (or
  three that get no HELLO) makes the task end the rank's earlier, displaced
  connections (`_restore_route`, `_zmq.shutdown_connection`): the engine reconnects
  and hears the next one.
* `serve_input` owns the input ROUTER. It sends what other tasks `send()` (ADD, ABORT,
  WAKE, CALL frames go into a per-rank queue, `_core/outbox.py`; the owner is kicked
  awake) and receives the REGISTER messages that complete a rank's handshake, also at
  any time. A rank whose pipe is full is skipped and retried on a backing-off timer, so
  it delays only its own messages and the task never spins.
  The handshake task also owns the **connection monitor** of the handshake ROUTER
  (`_zmq.Monitor`) and reads it before every batch of handshake messages: each HELLO
  the client accepts ties its connection (the fd libzmq gives the message) to the
  rank (`_core/liveness.ConnectionWatch`), and when that connection closes, because
  the engine exited, was killed, or missed ZMTP heartbeats (`heartbeat_interval`,
  `heartbeat_timeout`: a stopped process), the rank is reported dead at once
  (`listener.connection_lost`), idle or not. Engines keep their handshake connection
  for their whole life (they must hear RESYNC on it, §2.5).
* The output ROUTER is handed to the caller (the dispatcher), which claims it, as a
  `ZSocketSet` with its connection monitor: before each drain the dispatcher reads the
  monitor (`_output_gate`), ties each rank to the connection that delivered its
  messages since its HELLO (`_output_claim`), and the close of that connection, or a
  second connection delivering for the rank, is the rank's connection error: outputs
  were lost (a message over `max_message_size` is dropped with its connection).
* With CURVE keys (`curve=`), `serve_zap` owns a ZAP socket bound in the transport's
  own context before any ROUTER binds, and answers libzmq's question about every new
  connection from the allow-list (`_core/auth.py`). Every ROUTER then also checks each
  message: one whose routing id is not the rank of its peer's key is dropped and
  counted, and if it came on the input or output socket the rank whose identity was
  taken is reported (`listener.displaced`): its connection there is gone.

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

`open_group_transport` binds, runs both tasks, and waits until all N ranks are up or
`ready_timeout` passes (`HandshakeTimeout`, naming every missing rank and every
rejected HELLO).

Closing (§9): once the tasks are gone, `aclose` takes over the input socket, pushes
what is still queued for each rank (the ABORTs the client sends for its live requests) without
blocking, and closes it with a short LINGER, so those ABORTs reach the engines; the
other sockets close with LINGER 0. The context is then terminated in a worker thread
(bounded by that LINGER), since `term()` blocks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import trio
import zmq

from ._addresses import (
    GroupAddress,
    parse_group_url,
    prepare_ipc_directory,
    remove_socket_files,
)
from ._core.auth import ZAP_DOMAIN, PeerBinding, ZapPolicy
from ._core.codec import decode_handshake, encode_handshake
from ._core.errors import HandshakeTimeout, ProtocolError, quote
from ._core.handshake import Handshake, HandshakeState, identity_rank, rank_identity
from ._core.liveness import ConnectionWatch
from ._core.messages import Hello, Init, Ready, Register, Reject, Resync
from ._core.outbox import Outbox
from ._core.state import DEFAULT_MAX_MESSAGE_SIZE
from ._core.wire import NativeWire, Wire
from ._util import LogLimiter, open_service_nursery
from ._zmq import (
    ACCEPTED,
    Monitor,
    ZSocket,
    ZSocketSet,
    ZSocketStatistics,
    handshake_deadline,
    heartbeat,
    is_unreachable,
    peer_closed,
    shutdown_connection,
)
from .values import ConnectOptions, Request

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "NATIVE",
    "GroupDialect",
    "GroupTransport",
    "Transport",
    "TransportListener",
    "open_group_transport",
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


ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq looks for the ZAP handler of a context (RFC 27)."""


class CurveServer(Protocol):
    """The client's CURVE keys (`zmqdp.keys.ClientKeys`): its key pair and the
    allow-list of engine keys."""

    @property
    def public(self) -> bytes: ...

    @property
    def secret(self) -> bytes: ...

    def rank_of(self, key: bytes) -> int | None: ...


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

    def connection_lost(self, rank: int, cause: str, grace: float = 0.0) -> None:
        """The connection of `rank`'s current incarnation closed (it exited, was
        killed, or missed heartbeats): it is dead. `grace`: judge it that much later
        (a report of its other connections closing may come meanwhile and name the
        plain cause)."""

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
    """What the client uses of a transport, on any wire."""

    output: ZSocket | ZSocketSet
    """The output socket (vLLM: one per rank), the dispatcher's alone."""
    nursery: trio.Nursery | None

    @property
    def lockstep(self) -> bool:
        """The ranks run in lockstep (their HELLOs said so, or the dialect: MoE)."""
        ...

    @property
    def state(self) -> Handshake: ...

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


@asynccontextmanager
async def _open_native(
    url: str, engines: int, options: ConnectOptions, listener: TransportListener
) -> AsyncIterator[Transport]:
    async with open_group_transport(
        url,
        engines,
        ready_timeout=options.ready_timeout or NativeWire.default_ready_timeout,
        advertise_host=options.advertise_host,
        max_message_size=options.max_message_size,
        send_timeout=options.send_timeout,
        listener=listener,
        curve=options.curve,
        insecure=options.insecure,
        heartbeat_interval=options.heartbeat_interval,
        heartbeat_timeout=options.heartbeat_timeout,
    ) as transport:
        yield transport


NATIVE: GroupDialect[Request] = GroupDialect(NativeWire(), _open_native)
"""zmqdp's own protocol (docs/protocol.md): `EngineGroup.connect`'s dialect."""


UNANSWERED_RESYNCS = 3
"""RESYNCs that reach a rank's identity without a HELLO in answer before the client ends
the displaced connections of earlier engines of the rank (`_restore_route`)."""

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

OUTPUT_TAKEN = (
    "another connection took its identity on the output socket while its own was open "
    "(ROUTER_HANDOVER: a second process runs as this rank, or its key was replayed), so "
    "what the engine sends is dropped"
)


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
        self._unanswered: dict[int, int] = {}
        """Rank -> routable RESYNCs since its last HELLO."""
        self._duplicates = 0
        self._routes_restored = 0

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
                    self._connection_lost(rank)

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
            self._unanswered.pop(rank, None)
            if not self._watch.claim(fd, rank):
                self._connection_lost(rank)
            else:
                self._history.setdefault(rank, set()).add(fd)

    def _restore_route(self, rank: int, why: str, *, unroutable: bool) -> None:
        """(The watched socket's owner.) A RESYNC for `rank` found no route, or no
        answer: an engine of the rank that `ROUTER_HANDOVER` displaced (a duplicate or
        a replayed key took its identity, and then left or sits idle) keeps a connection
        libzmq will neither close nor route to, so it never hears anything again. End
        those connections: its DEALER reconnects, takes the identity back (the newest
        connection wins) and the next RESYNC reaches it. `unroutable`: no connection
        holds the identity, so every one of the rank's that is still open is displaced
        (even one still claimed: an intruder's invalid HELLO is a rejoin that leaves the
        real engine's claimed); otherwise only those nobody claims (the rank's own
        engine may just be slow to answer)."""
        self._watch_connections()
        ended = [
            fd
            for fd in sorted(self._history.get(rank, ()))
            if fd in self._watch
            and (unroutable or self._watch.owner(fd) is None)
            and shutdown_connection(fd)
        ]
        if ended:
            self._routes_restored += 1
            self._logs.log(
                logging.WARNING,
                "route",
                "rank %d: %s; ended %d displaced connection(s) of an earlier engine of the "
                "rank (ROUTER_HANDOVER had cut it off), so that it reconnects",
                rank,
                why,
                len(ended),
            )

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

    def _connection_lost(self, rank: int, cause: str | None = None, grace: float = 0.0) -> None:
        self._connections_lost += 1
        if cause is None:
            cause = (
                "its connection closed: the engine exited, was killed or restarted, or sent "
                "nothing, not even a heartbeat, for "
                f"heartbeat_timeout={self.heartbeat_timeout:g} s"
            )
        log.warning("rank %d: %s", rank, cause)
        self.listener.connection_lost(rank, cause, grace)
        self.forget(rank)  # at start-up there is no group yet: its handshake starts over
        self._lost(rank)

    def _lost(self, rank: int) -> None:
        """A dialect's note that `rank`'s connection closed (for `HandshakeTimeout`)."""

    def _output_lost(self, rank: int, max_message_size: int) -> None:
        """(Dispatcher.) `rank`'s output connection closed. If the connection its life
        is tied to is closed by its peer too, the process is gone: say so plainly;
        otherwise outputs were dropped with the one connection (`OUTPUT_LOST`)."""
        life = self._watch.connections(rank)
        if life and all(peer_closed(fd) for fd in life):
            self._connection_lost(rank, ENGINE_GONE)
        else:  # judged a little later: the close of the others may be on its way
            self._connection_lost(rank, OUTPUT_LOST.format(max_message_size), OUTPUT_GRACE)

    def forget(self, rank: int, *, resync: bool = True, epoch: int | None = None) -> None:
        """The incarnation `epoch` of `rank` is dead (None: whichever is current): its
        handshake starts over, unless a newer HELLO was accepted since (`_superseded`)."""
        raise NotImplementedError

    def _superseded(self, rank: int, epoch: int | None) -> bool:
        """A forget of incarnation `epoch` comes after a newer HELLO of `rank` was
        accepted: that handshake stands (forgetting it would drop its INIT, or RESYNC an
        engine that is starting the new incarnation)."""
        current = self.state.epoch(rank)
        return epoch is not None and current is not None and current != epoch

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
        self.listener.rank_up(rank)
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


@dataclass(frozen=True, slots=True)
class _HeldHello:
    identity: bytes
    hello: Hello
    fd: int
    deadline: float


class GroupTransport(TransportBase):
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
        curve: CurveServer | None = None,
        insecure: bool = False,
        heartbeat_interval: float | None = 0.5,
        heartbeat_timeout: float = 3.0,
    ) -> None:
        self.url = url
        self.size = size
        self._max_message_size = max_message_size
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self._monitors = []
        self.address: GroupAddress = parse_group_url(url, advertise_host)
        if self.address.transport == "tcp" and curve is None and not insecure:
            reach = "other machines" if not self.address.loopback else "every local user"
            raise ValueError(
                f"group URL {url!r} can be reached by {reach}, and without "
                "authentication anyone who connects can claim a rank, read its requests "
                "and inject outputs. Give the client CURVE keys (curve=load_client_keys"
                "(DIR), keys made by `python -m zmqdp keys DIR --engines N`), use an ipc:// "
                "URL (its directory admits only this user), or pass insecure=True if "
                "everyone who can reach it is trusted"
            )
        self.curve = curve
        self.zap: ZapPolicy | None = None if curve is None else ZapPolicy(curve.rank_of)
        self.binding: PeerBinding | None = None if curve is None else PeerBinding(size)
        self._logs = LogLimiter(log)
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._sockets: list[ZSocket] = []
        self._bound = False  # only the socket files we bound are ours to remove
        self._zap: ZSocket | None = None
        try:
            prepare_ipc_directory(self.address)
            if curve is not None:  # bound first: no connection is ever accepted unasked
                sock = self.context.socket(zmq.ROUTER)
                self._zap = ZSocket(sock, safety_timeout=safety_timeout)
                self._sockets.append(self._zap)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(ZAP_ENDPOINT)
            self.handshake = self._router(
                "handshake", self.address.handshake, max_message_size, safety_timeout
            )
            self.input = self._router("input", self.address.input, max_message_size, safety_timeout)
            output = self._router("output", self.address.output, max_message_size, safety_timeout)
            self._bound = True
        except BaseException:
            self._close_sockets()
            raise
        self.handshake_address = self.address.advertised(self._endpoint(self.handshake))
        """Where engines connect (for tcp://H:* the port the OS chose)."""
        self.input_address = self.address.advertised(self._endpoint(self.input))
        self.output_address = self.address.advertised(self._endpoint(output))
        # The dispatcher reads the output socket with its monitor (`_output_gate`).
        self._output_watch = ConnectionWatch()
        self._output_before: dict[int, set[int]] = {}
        self._claiming: set[int] = set()
        """Ranks between their INIT and their death: only they may claim a connection
        (a dead incarnation's engine may go on sending, and must not claim the rank
        back before its successor's INIT)."""
        self.output = ZSocketSet([output], gate=self._output_gate, extra=[self._output_monitor.zs])
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
        self._hello_due: dict[int, tuple[bytes, bytes]] = {}
        """Rank -> (identity, INIT) of an accepted HELLO whose INIT waits for the
        dispatcher to read the output monitor (`_output_gate`)."""
        self._deferred: list[tuple[bytes, bytes]] = []
        """INITs the dispatcher released, for the handshake task to send."""
        self._gating = False  # the dispatcher reads the output socket (`_output_gate`)
        self._held: dict[int, _HeldHello] = {}
        """Rank -> a HELLO held while its current engine's connection is open."""
        self._resync_body = encode_handshake(Resync())
        self._init_base([rank_identity(r) for r in range(size)], listener, send_timeout)

    def _router(self, name: str, address: str, max_message_size: int, safety: float) -> ZSocket:
        sock = self.context.socket(zmq.ROUTER)
        check = None if self.binding is None else partial(self._admit, name)
        self._sockets.append(ZSocket(sock, safety_timeout=safety, peer_check=check))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if name == "output":
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        else:
            sock.setsockopt(zmq.MAXMSGSIZE, min(max_message_size, CONTROL_MAX_MESSAGE))
        hwm = output_hwm(max_message_size) if name == "output" else CONTROL_HWM
        sock.setsockopt(zmq.RCVHWM, hwm)
        if name == "handshake":  # the watched socket (its queue holds a few messages)
            heartbeat(sock, self.heartbeat_interval, self.heartbeat_timeout)
            # Engines keep it for life (RESYNC comes on it). Its monitor starts before
            # it binds, so that no connection (an engine started first) goes unreported.
            self._watch_socket(self._sockets[-1])
        else:
            handshake_deadline(sock, self.heartbeat_timeout)
        if name == "output":  # read by the dispatcher (`_output_gate`), also from before bind
            self._output_monitor = Monitor(sock)
            self._monitors.append(self._output_monitor)
        if self.address.ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        if self.curve is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.secret)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.bind(address)
        return self._sockets[-1]

    def _explain_missing(self, rank: int) -> str | None:
        return None if self.binding is None else self.binding.explain(rank)

    def _admit(self, socket: str, identity: bytes, user_id: str | None) -> bool:
        """CURVE: keep a message only if its routing id is its key's rank."""
        assert self.binding is not None
        keep, displaced, line = self.binding.admit(socket, identity, user_id)
        if line is not None:
            self._logs.log(logging.ERROR, "impersonation", "%s", line)
        if displaced is not None:
            self.listener.displaced(
                displaced,
                f"a peer with another rank's key took its identity on the {socket} socket",
            )
        return keep

    async def serve_zap(self) -> None:
        """Own the ZAP socket: answer libzmq's question about each new connection.

        Cancellation: stops between requests; a connection still waiting for its
        answer is refused when the sockets close."""
        zs = self._zap
        assert zs is not None and self.zap is not None
        while True:
            for frames in await zs.receive_batch():
                reply, line = self.zap.answer(frames)
                if line is not None:
                    self._logs.log(logging.ERROR, "zap", "%s", line)
                if reply is not None:
                    with contextlib.suppress(zmq.ZMQError):  # that connection is gone
                        zs.send_nowait(reply)

    @staticmethod
    def _endpoint(zs: ZSocket) -> str:
        endpoint = zs.sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        return endpoint.decode()

    @property
    def lockstep(self) -> bool:
        """The admitted ranks' HELLOs say lockstep (§5)."""
        return bool(self.state.lockstep)

    def publish(self, frames: list[bytes]) -> None:
        """The native wire has no publication socket: WAKEs go to each rank."""
        raise RuntimeError("the native wire publishes nothing (Wire.wake_published is False)")

    # -- the owning tasks -------------------------------------------------------------

    def forget(self, rank: int, *, resync: bool = True, epoch: int | None = None) -> None:
        """The rank is dead: it must handshake again. With `resync`, it is sent RESYNC
        at once and then about once a second until it says HELLO (§2.5)."""
        if self._superseded(rank, epoch):
            return
        self.state.forget(rank, resync=resync)
        self._watch.release(rank)
        self._output_watch.release(rank)
        self._claiming.discard(rank)
        self._hello_due.pop(rank, None)
        identity = rank_identity(rank)
        self._deferred = [due for due in self._deferred if due[0] != identity]
        if resync:
            self.handshake.kick()

    # -- liveness: the output socket (the dispatcher reads it) -------------------------
    #
    # A rank's output connection is the newest one that delivered a message with the
    # rank's identity since its INIT was sent (connections open before are a
    # predecessor's: an engine connects its output socket once it has its INIT, §2).
    # The INIT of a HELLO accepted while the dispatcher runs is therefore sent only
    # once the dispatcher has read the output monitor to its end (`_output_gate`,
    # `_hello_due`): a connection the monitor had reported but nobody had read yet (a
    # previous incarnation's, reconnecting to a restarted client under CPU load) was
    # missed by a snapshot taken at the HELLO, and its stale batch claimed the rank, so
    # the new incarnation's own connection was then judged a second process
    # (OUTPUT_TAKEN) and its first request failed. When it closes, outputs may have been
    # lost with it: libzmq drops the connection of a message over max_message_size, and
    # the engine's DEALER
    # reconnects as if nothing happened. So its close is a connection error of the rank
    # (§8.5), and nothing waits for an output that will never come. Messages are read
    # with their source fd only while some open connection is nobody's (until each
    # rank's first message after its HELLO): the common case stays on the fast path.

    def _output_begin(self, rank: int) -> None:
        """(Handshake task.) A new incarnation of `rank`: the output connections open now
        are its predecessors', never its own."""
        self._output_watch.release(rank)
        self._output_before[rank] = self._output_watch.open_fds()
        self._claiming.add(rank)

    def _output_gate(self, _member: int) -> Callable[[int, list[bytes]], bool] | None:
        """(Dispatcher, before each drain of the output socket.) Read its monitor; a
        rank whose output connection closed is lost. Then begin the incarnations whose
        INIT waits (`_hello_due`): every connection open now is a predecessor's, and
        the handshake task may send the INIT."""
        self._gating = True
        watch = self._output_watch
        self._read_output_monitor()
        if self._hello_due:
            for rank, due in self._hello_due.items():
                self._output_begin(rank)
                self._deferred.append(due)
            self._hello_due.clear()
            self.handshake.kick()
        return self._output_claim if watch.strays() else None

    def _read_output_monitor(self) -> None:
        """Read the output socket's monitor to its end (the dispatcher; before it
        exists, the handshake task): a rank whose output connection closed is lost."""
        watch = self._output_watch
        while events := self._output_monitor.events():
            for event, fd in events:
                if event == ACCEPTED:
                    watch.accepted(fd)
                    continue
                predecessor = False
                for before in self._output_before.values():
                    predecessor = fd in before or predecessor
                    before.discard(fd)
                if (rank := watch.disconnected(fd)) is not None:
                    self._output_lost(rank, self._max_message_size)
                elif not predecessor:
                    # nobody's, opened after an INIT: an engine's first message over
                    # max_message_size is dropped with such a connection (`seq` tells)
                    self.listener.output_stray_closed()

    def _output_claim(self, fd: int, frames: list[bytes]) -> bool:
        """Keep every message (the core judges it); claim its connection for the rank
        its identity names, unless that connection predates the rank's HELLO. A second
        connection delivering for a rank whose claimed one is still open took the
        rank's identity (`ROUTER_HANDOVER`: a second process, a replayed key): what the
        engine sends on the first is dropped by libzmq from now on, so that is a
        connection error of the rank too, and its RESYNC makes the engine reconnect."""
        rank = identity_rank(frames[0])
        watch = self._output_watch
        if (
            rank not in self._claiming
            or watch.owner(fd) == rank
            or fd not in watch
            or fd in self._output_before.get(rank, ())
        ):
            return True
        if watch.connections(rank):
            self._connection_lost(rank, OUTPUT_TAKEN)
        else:
            watch.claim(fd, rank)
        return True

    def _resync(self, now: float) -> float:
        """RESYNC every rank the group waits for that is due (§2.5). One that finds no
        route (EHOSTUNREACH), or the third in a row that gets no HELLO, ends the rank's
        displaced connections (`_restore_route`); the next one may reach the engine.
        Also decides the held HELLOs (`_settle`)."""
        # Held HELLOs first: one decided now makes its rank no longer due, and a RESYNC
        # to a rank with a HELLO held would reach the newcomer (it holds the route) and
        # make it start over right after its INIT.
        while self._deferred:
            self._answer_bytes(*self._deferred.pop(0))
        settle_at = self._settle(now)
        zs = self.handshake
        for rank in self.state.resync_due(now):
            if rank in self._held:
                continue
            try:
                if zs.send_nowait([rank_identity(rank), self._resync_body]):
                    self._resyncs += 1
                    unanswered = self._unanswered[rank] = self._unanswered.get(rank, 0) + 1
                    if unanswered >= UNANSWERED_RESYNCS:
                        # Routable, yet nobody answers: whoever holds the rank's identity
                        # is not a live engine of ours (an idle intruder, a zombie)
                        self._unanswered[rank] = 0
                        why = f"{unanswered} RESYNCs got no HELLO"
                        self._restore_route(rank, why, unroutable=False)
            except zmq.ZMQError:
                # Not connected (yet): the next RESYNC may find it. Or displaced.
                self._restore_route(rank, "its RESYNC found no route", unroutable=True)
        next_at: float = min(self.state.next_resync(), settle_at)
        return next_at

    def _on_handshake_message(self, frames: list[bytes], fd: int) -> None:
        """One message on the handshake socket (`fd`: the connection it came on). HELLO
        and READY are answered (an invalid one with REJECT naming it, §7); a body that
        claims no type is rejected without touching any rank; anything else (a malformed
        REGISTER, an unknown type) is counted and ignored: only an invalid HELLO is a
        rejoin."""
        if len(frames) != 2:
            self.state.ignored += 1
            self._logs.log(
                logging.WARNING,
                "handshake-frames",
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
            self._answer_hello(identity, msg, fd)
        elif isinstance(msg, Ready):
            self._answer_ready(identity, dict(msg.info))
        elif isinstance(msg, ProtocolError) and msg.message == "ready":
            self._answer_ready(identity, msg)
        elif isinstance(msg, ProtocolError) and msg.message is None:
            reject = self.state.on_invalid(identity, msg)
            self._logs.log(
                logging.WARNING,
                "handshake-reject",
                "handshake: rejected a message: %s",
                reject.reason,
            )
            self._answer(identity, reject)
        else:
            self.state.ignored += 1
            self._logs.log(
                logging.WARNING,
                "handshake-ignored",
                "handshake: ignored %s from identity %s",
                quote(msg),
                identity.hex(),
            )

    def _contests(self, identity: bytes, hello: Hello | ProtocolError, fd: int) -> bool:
        """A valid HELLO of a rank whose current handshake connection is still open,
        on another connection: a second process for the rank, or a restart while the
        old process is stopped or its close is not seen yet. Hold it (`_settle`) while
        the heartbeats judge the incumbent: the incumbent keeps the rank if it lives."""
        rank = identity_rank(identity)
        if (
            not isinstance(hello, Hello)
            or fd < 0
            or rank is None
            or rank >= self.size
            or self.heartbeat_interval is None  # nothing would ever judge the incumbent
            or self.state.hello_problem(identity, hello) is not None  # REJECT, a rejoin
        ):
            return False
        self._watch_connections()
        current = self._watch.connections(rank)
        if not current or fd in current:
            return False
        if rank not in self._held:
            log.warning(
                "rank %d: HELLO from a second connection while the current engine's is "
                "open: held until that one closes, or refused after %.1f s if it stays",
                rank,
                self.heartbeat_interval + self.heartbeat_timeout,
            )
        deadline = trio.current_time() + self.heartbeat_interval + self.heartbeat_timeout
        self._held[rank] = _HeldHello(identity, hello, fd, deadline)
        self.handshake.kick()  # the task's next wait must end by the deadline
        return True

    def _settle(self, now: float) -> float:
        """(Handshake task.) Decide the held HELLOs that can be decided; return when to
        look again. The incumbent's connection closed: the newcomer is a restart and is
        admitted. It stayed open past the heartbeat timeout: the newcomer is a second
        process and is refused (REJECT goes to it: it holds the identity's route now)."""
        next_at = math.inf
        if self._held:
            self._watch_connections()  # a close that decides it may have just come
        for rank, held in list(self._held.items()):
            if held.fd not in self._watch:  # the newcomer left
                del self._held[rank]
            elif not self._watch.connections(rank):
                del self._held[rank]
                self._answer_hello(held.identity, held.hello, held.fd)
            elif now >= held.deadline:
                del self._held[rank]
                self._duplicates += 1
                reason = (
                    f"rank {rank} is served by another engine process, which is alive "
                    "(its connection stays open and answers heartbeats); exactly one "
                    "engine may run as a rank"
                )
                log.error(
                    "rank %d: refused a second engine process for the rank: the current "
                    "one lives (statistics().identity_conflicts)",
                    rank,
                )
                self.state.rejections += 1
                self._answer(held.identity, Reject(reason))
            else:
                next_at = min(next_at, held.deadline)
        return next_at

    def _answer_hello(self, identity: bytes, hello: Hello | ProtocolError, fd: int) -> None:
        if self._contests(identity, hello, fd):
            return
        verdict = self.state.on_hello(identity, hello, trio.current_time())
        if verdict.conflict is not None:
            log.error(
                "rank %s: said HELLO three times in %.1f s: two processes may "
                "be claiming rank %s (each new connection takes the rank's identity from the "
                "other, which is left orphaned), or the engine is restarting in a loop; make "
                "sure exactly one engine runs as rank %s (reported once per episode; "
                "statistics().identity_conflicts counts them)",
                verdict.rank,
                verdict.conflict,
                verdict.rank,
                verdict.rank,
            )
        if verdict.rejoin and verdict.rank is not None:
            log.warning(
                "rank %d: HELLO again (rejoin #%d): its previous incarnation is dead",
                verdict.rank,
                self.state.rejoins[verdict.rank],
            )
            self.listener.rejoin(verdict.rank)
        elif isinstance(hello, Hello) and verdict.rank is not None and verdict.rank < self.size:
            log.info("rank %d: HELLO accepted", verdict.rank)
        if isinstance(verdict.reply, Init) and verdict.rank is not None:
            self._claim(fd, verdict.rank)  # its life is this connection's
            if self._gating:  # INIT once the dispatcher has read the output monitor
                self._hello_due[verdict.rank] = (identity, encode_handshake(verdict.reply))
                self.output.kick()
                return
            # The initial handshake: no dispatcher yet, and the handshake task reads the
            # output monitor (a restarted client's predecessors reconnect meanwhile).
            self._read_output_monitor()
            self._output_monitor.zs.release()  # the dispatcher's, once it runs
            self._output_begin(verdict.rank)
        if isinstance(verdict.reply, Reject):
            self._logs.log(
                logging.WARNING,
                "hello-reject",
                "handshake: rejected a HELLO: %s",
                verdict.reply.reason,
            )
        self._answer(identity, verdict.reply)

    def _answer_ready(self, identity: bytes, ready: dict[str, object] | ProtocolError) -> None:
        verdict = self.state.on_ready(identity, ready)
        if verdict is True:
            self._rank_up(identity)
        elif isinstance(verdict, Reject):
            self._logs.log(
                logging.WARNING, "ready-reject", "handshake: rejected a READY: %s", verdict.reason
            )
            self._answer(identity, verdict)

    def _answer(self, identity: bytes, reply: Init | Reject) -> None:
        self._answer_bytes(identity, encode_handshake(reply))

    def _rank_up(self, identity: bytes) -> None:
        rank = identity_rank(identity)
        assert rank is not None
        self._rank_is_up(rank, f"epoch {self.state.epoch(rank)}, info {self.state.info(rank)!r}")

    def _on_input_message(self, frames: list[bytes], fd: int) -> None:
        if len(frames) == 2:
            try:
                msg = decode_handshake(frames[1])
            except ProtocolError as exc:
                self.state.ignored += 1
                self._logs.log(
                    logging.WARNING,
                    "input-undecodable",
                    "input: undecodable message from %s: %s",
                    frames[0].hex(),
                    exc,
                )
                return
            if isinstance(msg, Register):
                if self.state.on_register(frames[0], msg.epoch):
                    self._rank_up(frames[0])
                return
        self.state.ignored += 1
        self._logs.log(
            logging.WARNING,
            "input-ignored",
            "input: ignored a message from identity %s",
            frames[0].hex(),
        )

    # -- statistics and closing -------------------------------------------------------

    def _counters(self) -> dict[str, int]:
        return {
            "stale_registers": self.state.stale_registers,
            "resyncs": self._resyncs,
            "identity_conflicts": self.state.identity_conflicts + self._duplicates,
            "routes_restored": self._routes_restored,
            "refused_connections": 0 if self.zap is None else self.zap.refused,
            "impersonations": 0 if self.binding is None else self.binding.impersonations,
        }

    def close(self) -> None:
        """Close every socket (unsent messages are dropped) and the context."""
        self._close_sockets()
        if self._bound:
            remove_socket_files(self.address)

    def _closed(self) -> None:
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
    curve: CurveServer | None = None,
    insecure: bool = False,
    heartbeat_interval: float | None = 0.5,
    heartbeat_timeout: float = 3.0,
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
        curve=curve,
        insecure=insecure,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
    )
    try:
        async with open_service_nursery() as nursery:
            transport.nursery = nursery
            if transport.zap is not None:
                nursery.start_soon(transport.serve_zap, name="zmqdp-zap")
            nursery.start_soon(transport.serve_handshake, name="zmqdp-handshake")
            nursery.start_soon(transport.serve_input, name="zmqdp-input")
            with trio.move_on_after(ready_timeout) as waiting:
                await transport.wait_ready()
            if waiting.cancelled_caught:
                at = transport.handshake_address if url.endswith(":*") else url
                keys = " --keys DIR" if curve is not None else ""
                start = f"`python -m zmqdp mock --url {at} --engines {engines}{keys}`"
                raise transport.timeout_error(ready_timeout, at, start)
            yield transport
    finally:
        await transport.aclose()

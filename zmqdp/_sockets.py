"""The native socket layout (docs/protocol.md §1): the client's three ROUTERs of one
engine group, CURVE, and `NATIVE`. The twin of `vllm/sockets.py`; what every transport
shares (the input task, sends, the watched socket, closing) is `TransportBase` in
`_transport.py`.

Theory of operation
-------------------
The client binds three ROUTERs: handshake, input and output. Each has exactly one
owning task:

* `serve_handshake` owns the handshake ROUTER (the watched socket: engines keep their
  handshake connection for their whole life, they must hear RESYNC on it, §2.5). It
  answers every HELLO with INIT or REJECT (through `HandshakeState`), records READY (an
  invalid one is answered with REJECT), reports a rank that came up and a HELLO that
  was a rejoin, and sends RESYNC about once a second to every rank the group is waiting
  for. Every ROUTER hands a rank's identity to its newest connection
  (`ROUTER_HANDOVER`, so that a restart works), which leaves the displaced one open
  with no route. So a HELLO for a rank whose connection is still open is held while the
  heartbeats judge that connection (`_contests`, `_settle`): admitted if it closes,
  refused if it stays (a second process). A RESYNC that finds no route (or three that
  get no HELLO) makes the task end the rank's earlier, displaced connections
  (`_restore_route`, `_zmq.shutdown_connection`): the engine reconnects and hears the
  next one.
* `serve_input` owns the input ROUTER and receives the REGISTER messages that complete
  a rank's handshake.
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

`open_group_transport` binds, runs the tasks, and waits until all N ranks are up or
`ready_timeout` passes (`HandshakeTimeout`, naming every missing rank and every
rejected HELLO). It takes the group's `ConnectOptions` as they are.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Protocol

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
from ._core.errors import ProtocolError, quote
from ._core.handshake import (
    UNANSWERED_RESYNCS,
    HandshakeState,
    identity_rank,
    rank_identity,
)
from ._core.liveness import ConnectionWatch
from ._core.messages import Hello, Init, Ready, Register, Reject, Resync
from ._core.wire import NativeWire
from ._transport import (
    CONTROL_HWM,
    CONTROL_MAX_MESSAGE,
    GroupDialect,
    TransportBase,
    TransportListener,
    output_hwm,
)
from ._util import LogLimiter, open_service_nursery
from ._zmq import (
    ACCEPTED,
    Monitor,
    ZSocket,
    ZSocketSet,
    handshake_deadline,
    heartbeat,
    shutdown_connection,
)
from .values import ConnectOptions, Request, connect_options

__all__ = ["NATIVE", "CurveServer", "GroupTransport", "open_group_transport"]

log = logging.getLogger("zmqdp")


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


OUTPUT_TAKEN = (
    "another connection took its identity on the output socket while its own was open "
    "(ROUTER_HANDOVER: a second process runs as this rank, or its key was replayed), so "
    "what the engine sends is dropped"
)


class GroupTransport(TransportBase):
    """Bound client sockets of one group. Use `open_group_transport`."""

    def __init__(
        self,
        url: str,
        size: int,
        options: ConnectOptions | None = None,
        *,
        listener: TransportListener | None = None,
        safety_timeout: float = 1.0,
        resync_interval: float = 1.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        **kwargs: Any,
    ) -> None:
        """`options` (or keywords building one, `ConnectOptions`'s): only the transport's
        fields are read (`advertise_host`, `max_message_size`, `send_timeout`, `curve`,
        `insecure`, `heartbeat_interval`, `heartbeat_timeout`)."""
        options = connect_options(options, kwargs)
        advertise_host = options.advertise_host
        max_message_size = options.max_message_size
        send_timeout = options.send_timeout
        curve: CurveServer | None = options.curve
        insecure = options.insecure
        heartbeat_interval = options.heartbeat_interval
        heartbeat_timeout = options.heartbeat_timeout
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
        self._resync_body = encode_handshake(Resync())
        self._routes_restored = 0
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
        if not self.state.forget(rank, resync=resync, epoch=epoch):
            return  # a newer HELLO was accepted since: that handshake stands
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
        self._output_epochs[rank] = self.state.epoch(rank)
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
            self._connection_lost(rank, self._output_epochs.get(rank), OUTPUT_TAKEN)
        else:
            watch.claim(fd, rank)
        return True

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
        watch = self._watch
        displaced = self.state.displaced(
            self._history.get(rank, ()), watch.__contains__, watch.owner, unroutable=unroutable
        )
        ended = [fd for fd in displaced if shutdown_connection(fd)]
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
            if self.state.holds(rank):
                continue
            try:
                if zs.send_nowait([rank_identity(rank), self._resync_body]):
                    self._resyncs += 1
                    if self.state.resync_sent(rank):  # routable, yet nobody answers
                        why = f"{UNANSWERED_RESYNCS} RESYNCs got no HELLO"
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
            self.state.on_ignored()
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
            self.state.on_ignored()
            self._logs.log(
                logging.WARNING,
                "handshake-ignored",
                "handshake: ignored %s from identity %s",
                quote(msg),
                identity.hex(),
            )

    def _contests(self, identity: bytes, hello: Hello | ProtocolError, fd: int) -> bool:
        """Whether the handshake holds this HELLO while the heartbeats judge the rank's
        current connection (`HandshakeState.contest`: the incumbent keeps the rank if
        it lives)."""
        rank = identity_rank(identity)
        if fd < 0 or rank is None or rank >= self.size:
            return False
        self._watch_connections()
        judge_after = (
            None
            if self.heartbeat_interval is None  # nothing would ever judge the incumbent
            else self.heartbeat_interval + self.heartbeat_timeout
        )
        first = not self.state.holds(rank)
        now = trio.current_time()
        incumbent = self._watch.connections(rank)
        if not self.state.contest(identity, hello, fd, now, incumbent, judge_after):
            return False
        if first:
            log.warning(
                "rank %d: HELLO from a second connection while the current engine's is "
                "open: held until that one closes, or refused after %.1f s if it stays",
                rank,
                judge_after,
            )
        self.handshake.kick()  # the task's next wait must end by the deadline
        return True

    def _settle(self, now: float) -> float:
        """(Handshake task.) Carry out what the handshake decided about the held HELLOs
        (`HandshakeState.settle`); return when to look again. The incumbent's connection
        closed: the newcomer is a restart and is admitted. It stayed open past the
        heartbeat timeout: the newcomer is a second process and is refused (REJECT goes
        to it: it holds the identity's route now)."""
        if self.state.holding():
            self._watch_connections()  # a close that decides one may have just come
        watch = self._watch
        settled = self.state.settle(now, watch.__contains__, watch.connections)
        for held in settled.admit:
            self._answer_hello(held.identity, held.hello, held.fd)
        for held, reply in settled.refuse:
            log.error(
                "rank %d: refused a second engine process for the rank: the current "
                "one lives (statistics().identity_conflicts)",
                held.hello.rank,
            )
            self._answer_bytes(held.identity, reply)
        next_at: float = settled.next_at
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
        assert verdict.reply is not None  # natively every HELLO is answered
        if verdict.admitted and verdict.rank is not None:
            self._claim(fd, verdict.rank)  # its life is this connection's
            if self._gating:  # INIT once the dispatcher has read the output monitor
                self._hello_due[verdict.rank] = (identity, verdict.reply)
                self.output.kick()
                return
            # The initial handshake: no dispatcher yet, and the handshake task reads the
            # output monitor (a restarted client's predecessors reconnect meanwhile).
            self._read_output_monitor()
            self._output_monitor.zs.release()  # the dispatcher's, once it runs
            self._output_begin(verdict.rank)
        if verdict.refused is not None:
            self._logs.log(
                logging.WARNING, "hello-reject", "handshake: rejected a HELLO: %s", verdict.refused
            )
        self._answer_bytes(identity, verdict.reply)

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
                self.state.on_ignored()
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
        self.state.on_ignored()
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
    options: ConnectOptions | None = None,
    listener: TransportListener | None = None,
    **kwargs: Any,
) -> AsyncIterator[GroupTransport]:
    """Bind the group's sockets, wait for all `engines` ranks, yield the transport.
    `options`: the group's `ConnectOptions` (or keywords building one);
    `ready_timeout` None waits the native wire's default (60 s).

    The handshake and input tasks keep running inside the block (rejoins), in the
    nursery `transport.nursery`, where callers may start their own tasks (the client's
    dispatcher). Leaving the block cancels them and closes everything.

    `listener` is told of ranks coming up, rejoins, failed sends and flushes, from
    the start (during the initial handshake too).

    Cancellation: if cancelled while waiting for the ranks, the sockets are closed and
    nothing is left running.
    """
    options = connect_options(options, kwargs)
    ready_timeout = options.ready_timeout or NativeWire.default_ready_timeout
    transport = GroupTransport(url, engines, options, listener=listener)
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
                keys = " --keys DIR" if options.curve is not None else ""
                start = f"`python -m zmqdp mock --url {at} --engines {engines}{keys}`"
                raise transport.timeout_error(ready_timeout, at, start)
            yield transport
    finally:
        await transport.aclose()


NATIVE: GroupDialect[Request] = GroupDialect(NativeWire(), open_group_transport)
"""zmqdp's own protocol (docs/protocol.md): `EngineGroup.connect`'s dialect."""

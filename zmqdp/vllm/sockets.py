"""The frontend's sockets for a group of vLLM engines, and the tasks that own them.

Theory of operation
-------------------
vLLM's socket map (`vllm/v1/engine/core_client.py`, `core.py`, `coordinator.py`):

* handshake ROUTER, bound at the address engines were started with
  (``--data-parallel-address HOST --data-parallel-rpc-port PORT``): owned by
  `serve_handshake`, which answers every HELLO with the rank's init and records READYs,
  for the life of the group (a restarted engine says HELLO again: a rejoin);
* input ROUTER (requests; engines connect DEALERs, identity = rank): owned by
  `serve_input`, which sends what other tasks queue with `send` (a per-rank `Outbox`,
  the owner is kicked awake) and receives the engines' ready responses;
* output PULLs, **one per rank** (each rank's init names its own; engines connect
  PUSH): handed to the dispatcher, their only user, as one `ZSocketSet`. vLLM's
  output messages carry an `engine_index` anyone can write, and its death sentinel
  ``ENGINE_CORE_DEAD`` and a closed connection name no rank: a socket per rank does.
  The set puts its socket's rank tag in front of every message (`VllmWire.source_tag`),
  so a message is always its socket's rank's; a monitor per socket, read by the
  dispatcher, reports the close of
  the connection accepted after the rank's latest HELLO (`_core/liveness.py`): the
  engine exited, was killed, or missed ZMTP heartbeats (a stopped process);
* MoE groups only, the coordinator role: an XPUB that engines subscribe to (their
  coordinator input), owned by `serve_coordinator`, which publishes ``READY`` once all
  ranks subscribed (and again on every later subscription, which engines ignore once
  started) and the START_DP_WAVEs the client queues with `publish`. Each engine's
  coordinator output (stats, ``wave_complete``, ``start_wave``) is its own output
  PULL: those messages reach the one dispatcher, in the stream it already reads.

* with ``routing="prefix"`` and ``kv_events=True``, per rank whose ready response
  enables KV events, a SUB and a replay DEALER, owned by that rank incarnation's task
  in `kv_events.py` (started when the rank is up, after the group took the new
  incarnation; cancelled when it is forgotten). The group attaches its prefix index
  (`attach_prefix`) once its core exists; a wildcard endpoint host is replaced by the
  peer address of the input connection the rank's ready response came on.

**Dormant ranks** (dense groups). A vLLM engine does its handshake once per process,
so a rank declared dead while its process lives (a stall longer than the heartbeat
timeout: the client drops its input connection; or the silence rule) used to be lost
until someone restarted it, although its sockets reconnect by themselves. Such a rank
is *dormant* while the output connections of its last incarnation stay open (a process
that exited closes them): its requests ended as for any death and no new work goes to
it, but the input task probes it about once a second (`PROBE_INTERVAL`) with a UTILITY
call (`PROBE_METHOD`) on its identity. A probe can only be sent once an engine has
reconnected its input DEALER with that identity, and the answer counts only if it comes
on one of those same output connections, so the process that answers is the one whose
incarnation died: a restarted engine, a new process, would say HELLO first (and a HELLO
ends the dormancy). Then the rank is up again as a new incarnation of the same process
(`VllmHandshake.resume`), its life tied to its newest input connection, and the core
ABORTs the requests that ended with its death (`Wire.resumes`). Lockstep (MoE) groups
fail as a whole and are never resumed this way. docs/protocol.md has the rule.

Every ROUTER sets ROUTER_MANDATORY (a send to an engine that is gone fails with
EHOSTUNREACH and is reported through `listener.send_failed`), every socket LINGER 0,
except the input socket at close, which is given `CLOSE_LINGER` to deliver the ABORTs
queued for live requests. Every zmq call is non-blocking (`ZSocket`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import secrets
import socket as _socket
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
import zmq

from .._addresses import is_loopback
from .._core.errors import ProtocolError
from .._core.kv_events import KvEventCounters
from .._core.liveness import ConnectionWatch
from .._transport import CONTROL_MAX_MESSAGE, TransportBase, TransportListener
from .._util import LogLimiter, open_service_nursery
from .._zmq import ACCEPTED, Monitor, ZSocket, ZSocketSet, handshake_deadline, heartbeat
from ..values import ConnectOptions
from .codec import (
    COORDINATOR_READY,
    ENGINE_CORE_DEAD,
    decode_hello,
    decode_outputs,
    decode_ready_response,
    encode_init,
    encode_utility,
    rank_identity,
)
from .handshake import VllmHandshake
from .kv_events import ExactIndex, KvEvents, peer_host

__all__ = ["MASTER_PORTS", "VllmTransport", "moe_parallel_config", "open_vllm_transport"]

log = logging.getLogger("zmqdp.vllm")

PROBE_INTERVAL = 1.0
"""Seconds between the probes of a dormant rank (module docstring)."""
PROBE_METHOD = "is_sleeping"
"""The UTILITY a dormant rank is probed with: cheap, harmless, in vLLM 0.32 and 0.33."""


@dataclass(slots=True)
class _Dormant:
    """A dense rank declared dead whose process may live (module docstring)."""

    outputs: set[int]
    """The open output connections of its last incarnation (it is gone once none is)."""
    call: int
    """The call id of its probes."""
    next_probe: float = -math.inf
    answered: bool = False


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low(path: str = EPHEMERAL_RANGE) -> int:
    """The lowest port the OS hands out to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_tcp_ports(host: str, n: int) -> list[int]:
    """`n` distinct ports free now on `host`, for the MoE parallel_config, taken below
    the OS's ephemeral range: an engine binds them only once its model has loaded (a
    minute or more later, or at its restart hours later), and a port of the ephemeral
    range is meanwhile taken by any outgoing connection (the engines' own store clients
    took one here: the worker died of EADDRINUSE, measured). Falls back to ports the
    OS picks if that range has none free."""
    low = _ephemeral_low()
    first = max(1024, low // 2)
    socks: list[_socket.socket] = []
    try:
        if low - first >= 4 * n:
            for port in secrets.SystemRandom().sample(range(first, low), min(low - first, 64 * n)):
                if len(socks) == n:
                    break
                s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
                try:
                    s.bind((host, port))
                except OSError:
                    s.close()
                    continue
                socks.append(s)
        while len(socks) < n:
            s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


MASTER_PORTS = 5
"""Pre-allocated DP master ports in a MoE init, as vLLM's frontend sends for all-remote
engines (`ParallelConfig.__post_init__`: `get_open_ports_list(5)`): each DP process
group an engine sets up, and each retry after EADDRINUSE, pops one."""


def moe_parallel_config(size: int, advertise_host: str | None = None) -> dict[str, Any]:
    """The `parallel_config` of a MoE init, as vLLM's frontend sends it when it runs no
    engine itself: a master address, pre-allocated master ports, and
    ``_coord_store_port: 0``. A non-zero coordination TCPStore port would make every
    engine try to connect to a store nobody runs (2 x 300 s of retries, then
    `DistNetworkError`), and the client would see only "no READY"."""
    host = advertise_host or "127.0.0.1"
    ports = _free_tcp_ports("0.0.0.0" if advertise_host else host, MASTER_PORTS + 1)
    return {
        "data_parallel_master_ip": host,
        "data_parallel_master_port": ports[0],
        "_data_parallel_master_port_list": ports[1:],
        "_coord_store_port": 0,
        "data_parallel_size": size,
    }


def _sibling(url: str, name: str) -> str:
    """Where to bind the input/output/coordinator sockets next to the handshake URL:
    ``tcp://HOST:*`` (the OS picks the port), or ``ipc://PATH-name``."""
    if url.startswith("tcp://"):
        host = url[len("tcp://") :].rsplit(":", 1)[0]
        return f"tcp://{host}:*"
    if url.startswith("ipc://"):
        return f"{url}-{name}"
    raise ValueError(f"a vLLM handshake URL is tcp://HOST:PORT or ipc://PATH, got {url!r}")


class VllmTransport(TransportBase):
    """Bound frontend sockets for one vLLM engine group. Use `open_vllm_transport`."""

    def __init__(
        self,
        url: str,
        size: int,
        options: ConnectOptions,
        *,
        lockstep: bool,
        parallel_config: Mapping[str, Any] | None = None,
        parallel_config_hash: str | None = None,
        listener: TransportListener | None = None,
        vllm_version: str | None = None,
        source_tag: Callable[[int], bytes] | None = None,
    ) -> None:
        """`options`: the group's; only the transport's fields are read."""
        advertise_host = options.advertise_host
        send_timeout = options.send_timeout
        max_message_size = options.max_message_size
        insecure = options.insecure
        heartbeat_interval = options.heartbeat_interval
        heartbeat_timeout = options.heartbeat_timeout
        if url.startswith("tcp://") and not insecure:
            host = url[len("tcp://") :].rpartition(":")[0]
            reach = "every local user" if is_loopback(host) else "other machines"
            raise ValueError(
                f"group URL {url!r} can be reached by {reach}, and vLLM's engine-core "
                "protocol has no authentication: anyone who connects can claim a rank, "
                "read its requests and inject outputs. Use an ipc:// URL for engines on "
                "this machine that accept one, or pass insecure=True if everyone who can "
                "reach it is trusted (as vLLM assumes; headless engines speak only tcp)"
            )
        self.max_message_size = max_message_size
        self.size = size
        self.lockstep = lockstep
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self._logs = LogLimiter(log)
        self._own_context = True
        self.context = zmq.Context()
        self._sockets: list[ZSocket] = []
        self._monitors = []
        self._announced: set[int] = set()  # ranks whose engine sent ENGINE_CORE_DEAD
        self.coordinator: ZSocket | None = None
        try:
            self.handshake = self._bind(zmq.ROUTER, url)
            # The watched socket: each rank's ready response comes on it, and claims it.
            self.input = self._bind(zmq.ROUTER, _sibling(url, "input"), watched=True)
            self._output_watches: list[tuple[Monitor, ConnectionWatch]] = []
            self.outputs = [self._bind(zmq.PULL, _sibling(url, f"output{r}")) for r in range(size)]
            if lockstep:
                self.coordinator = self._bind(zmq.XPUB, _sibling(url, "coordinator"))
        except BaseException:
            self._close_sockets()
            raise
        mark = None
        if source_tag is not None:
            tags = [source_tag(r) for r in range(size)]
            announced = self._announced

            def mark(rank: int, frames: list[bytes]) -> list[bytes]:
                if len(frames) == 1 and frames[0] == ENGINE_CORE_DEAD:
                    announced.add(rank)  # a dying engine: never resumed
                return [tags[rank], *frames]

        self.output = ZSocketSet(
            self.outputs, mark, gate=self._gate, extra=[m.zs for m, _ in self._output_watches]
        )
        self.input_address = self._advertised(self.input, advertise_host)
        self.output_addresses = [self._advertised(zs, advertise_host) for zs in self.outputs]
        self.coordinator_address = (
            None if self.coordinator is None else self._advertised(self.coordinator, advertise_host)
        )
        if lockstep and parallel_config is None:
            parallel_config = moe_parallel_config(size, advertise_host)
        self.parallel_config = dict(parallel_config or {})
        self.init_bodies = [
            encode_init(
                [self.input_address],
                [output],
                self.coordinator_address,
                output if lockstep else None,  # the coordinator's PULL: the rank's own
                None,
                self.parallel_config if lockstep else {},
            )
            for output in self.output_addresses
        ]
        self._hello_seen = [False] * size  # a connection to rank r's output is r's
        self._hello_due: dict[int, tuple[bytes, bytes]] = {}  # HELLOs the gate answers
        self._deferred: list[tuple[bytes, bytes]] = []  # answers for the handshake task
        self._gating = False  # the dispatcher runs `_gate`
        self.state = VllmHandshake(
            size,
            lambda rank: self.init_bodies[rank],
            lockstep=lockstep,
            expected_hash=parallel_config_hash,
            version_override=vllm_version,
            on_warning=lambda rank, why: log.warning("rank %d: %s", rank, why),
        )
        self._init_base([rank_identity(r) for r in range(size)], listener, send_timeout)
        self._published: collections.deque[list[bytes]] = collections.deque()
        self.subscriptions = 0
        self._dormant: dict[int, _Dormant] = {}
        self._resume_due: set[int] = set()  # answered probes, for the input task
        self.probes = 0
        """Probes sent to dormant ranks."""
        self.resumptions = 0
        """Dormant ranks that came back (the same process answered)."""
        self.kv = KvEvents(
            self.context,
            enabled=options.routing == "prefix" and options.kv_events,
        )
        """The ranks' KV-event tasks (exact prefix affinity: `kv_events.py`)."""
        self._hosts: dict[int, str | None] = {}  # each rank's engine address, as seen here
        self._url_host = (
            url[len("tcp://") :].rpartition(":")[0].strip("[]")
            if url.startswith("tcp://")
            else None
        )

    def _bind(self, kind: int, address: str, *, watched: bool = False) -> ZSocket:
        sock = self.context.socket(kind)
        zs = ZSocket(sock)
        self._sockets.append(zs)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted engine takes its identity
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, duplicates too
        if watched:  # its queue is unbounded: a busy engine's PONGs are always read
            heartbeat(sock, self.heartbeat_interval, self.heartbeat_timeout)
        else:
            handshake_deadline(sock, self.heartbeat_timeout)
        if kind in (zmq.PULL, zmq.ROUTER):
            sock.setsockopt(zmq.RCVHWM, 0)  # as vLLM: engines never block on us
            # A frame past it drops the peer's connection (libzmq): one engine cannot
            # make the client hold an arbitrarily large message.
            limit = self.max_message_size
            if kind == zmq.ROUTER:  # handshake and input: small messages (ready, HELLO)
                limit = min(limit, CONTROL_MAX_MESSAGE)
            sock.setsockopt(zmq.MAXMSGSIZE, limit)
        if watched:
            self._watch_socket(zs)  # before it binds: no connection goes unreported
        if kind == zmq.PULL:  # a rank's output socket: the dispatcher reads its monitor
            self._output_watches.append((Monitor(sock), ConnectionWatch()))
            self._monitors.append(self._output_watches[-1][0])
        sock.bind(address)
        return zs

    @staticmethod
    def _advertised(zs: ZSocket, host: str | None) -> str:
        endpoint = zs.sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        address = endpoint.decode()
        if host is not None and address.startswith("tcp://"):
            address = f"tcp://{host}:{address.rsplit(':', 1)[1]}"
        return address

    # -- sending (any task) -------------------------------------------------------------

    def publish(self, frames: list[bytes]) -> None:
        """Queue a message for every engine on the coordinator XPUB (MoE groups)."""
        assert self.coordinator is not None
        if self.coordinator.closed:
            raise trio.ClosedResourceError("the engine group's sockets are closed")
        self._published.append(frames)
        self.coordinator.kick()

    def forget(self, rank: int, *, resync: bool = True, epoch: int | None = None) -> None:
        """The rank is dead: it is up again after a new HELLO (vLLM has no RESYNC: a
        vLLM engine does its handshake once, so only a restarted one comes back)."""
        if self.state.superseded(rank, epoch):
            return  # a newer incarnation began since: it stands
        announced = rank in self._announced
        self._announced.discard(rank)
        if (
            not (self.lockstep or announced)
            and self.state.is_up(rank)
            and rank not in self._dormant
        ):
            outputs = set(self._output_watches[rank][1].connections(rank))
            if outputs:  # its process may live: probe it (module docstring)
                self._dormant[rank] = _Dormant(outputs, secrets.randbits(64))
                self.input.kick()
        self.state.forget(rank, epoch=epoch)
        self.kv.rank_down(rank)
        self._hello_seen[rank] = False
        self._hello_due.pop(rank, None)
        self._watch.release(rank)
        self._output_watches[rank][1].release(rank)

    def _lost(self, rank: int, incarnation: int | None) -> None:
        self.state.note_lost(
            rank, incarnation, "its connection closed after its HELLO (the engine died)"
        )

    def _begin(self, rank: int) -> None:
        """A new incarnation of `rank`: the connections its output socket has now are
        its predecessors'; the ones accepted from now on are its own."""
        self._output_watches[rank][1].release(rank)
        self._output_epochs[rank] = self.state.epoch(rank)
        self._hello_seen[rank] = True

    def _resync(self, now: float) -> float:
        """(The handshake task, each round.) Send the init answers the gate released."""
        while self._deferred:
            identity, body = self._deferred.pop(0)
            self._answer_bytes(identity, body)
        return math.inf

    def _gate(self, rank: int) -> Callable[[int, list[bytes]], bool] | None:
        """Before the dispatcher drains `rank`'s output socket: read its monitor (a
        connection accepted after the rank's HELLO is its current incarnation's), then
        say which messages to keep. (Its death is judged by its input connection, which
        its ready response claims: any peer can open and close a connection here.) While a
        connection of a previous incarnation is still open (a lingering engine the
        rank's restart replaced), messages are read with their source and only the
        current incarnation's are kept: nothing of a dead incarnation reaches the new
        one. Called by the dispatcher task, which owns the sockets and their monitors."""
        self._gating = True
        monitor, watch = self._output_watches[rank]
        rejoining = rank in self._hello_due  # a close read now is a predecessor's
        while events := monitor.events():
            for event, fd in events:
                if event == ACCEPTED:
                    watch.accepted(fd, rank if self._hello_seen[rank] else None)
                    continue
                if (dormant := self._dormant.get(rank)) is not None and fd in dormant.outputs:
                    dormant.outputs.discard(fd)
                    if not dormant.outputs:  # its process is gone: it will not answer
                        del self._dormant[rank]
                        self._resume_due.discard(rank)
                if watch.disconnected(fd) is not None and not rejoining:
                    # The engine's own output connection closed (the last one, a MoE
                    # engine has two). An engine that exited closes its input too;
                    # one that lives had a message over max_message_size dropped with
                    # the connection, and reconnected: either way outputs were lost.
                    self._output_lost(rank, self.max_message_size)
        if (due := self._hello_due.pop(rank, None)) is not None:
            # Every connection accepted until now is a predecessor's (the monitor was
            # read just above); the new incarnation connects once it has its init.
            self._begin(rank)
            self._deferred.append(due)
            self.handshake.kick()
        dormant = self._dormant.get(rank)
        if dormant is not None and not dormant.answered:
            return self._probe_gate(rank, dormant, watch.connections(rank))
        if watch.strays():
            current = watch.connections(rank)
            return lambda fd, _frames: fd in current
        return None

    def _probe_gate(
        self, rank: int, dormant: _Dormant, current: frozenset[int]
    ) -> Callable[[int, list[bytes]], bool]:
        """Keep what `_gate` keeps; take the answer to a dormant rank's probe, if it came
        on one of its last incarnation's output connections, and tell the input task."""

        def keep(fd: int, frames: list[bytes]) -> bool:
            if fd in dormant.outputs and not dormant.answered:
                try:
                    batch = decode_outputs(frames)
                except ProtocolError:
                    return fd in current
                if any(reply.call == dormant.call for reply in batch.replies):
                    dormant.answered = True
                    self._resume_due.add(rank)
                    self.input.kick()
                    return False  # our own probe's answer
            return fd in current

        return keep

    def _input_round(self, now: float) -> float:
        """(The input task.) Bring back the dormant ranks that answered; probe the
        others that are due (a send finds no route until the engine's input DEALER has
        reconnected: EHOSTUNREACH, tried again later)."""
        for rank in sorted(self._resume_due):
            self._resume(rank)
        next_at = math.inf
        for rank, dormant in self._dormant.items():
            if dormant.answered:
                continue
            if now >= dormant.next_probe:
                dormant.next_probe = now + PROBE_INTERVAL
                probe = encode_utility(dormant.call, PROBE_METHOD, ())
                with contextlib.suppress(zmq.ZMQError):  # not reconnected (yet)
                    if self.input.send_nowait([self._identities[rank], *probe]):
                        self.probes += 1
            next_at = min(next_at, dormant.next_probe)
        return next_at

    def _resume(self, rank: int) -> None:
        """(The input task.) A dormant rank's process answered its probe: up again, its
        life tied to its newest input connection (the one the probe went through)."""
        self._resume_due.discard(rank)
        dormant = self._dormant.pop(rank, None)
        if dormant is None or not self.state.resumable(rank):
            return
        self._watch_connections()
        fd = self._watch.newest_stray()
        if fd is None:  # that connection closed again: probe on
            dormant.answered, dormant.next_probe = False, -math.inf
            self._dormant[rank] = dormant
            return
        self.state.resume(rank)  # a new incarnation: its connections are claimed for it
        self._claimed[rank] = self._output_epochs[rank] = self.state.epoch(rank)
        self._watch.claim(fd, rank)
        outputs = self._output_watches[rank][1]
        for out in dormant.outputs:
            if out in outputs:
                outputs.accepted(out, rank)
        self._hello_seen[rank] = True
        self.resumptions += 1
        log.warning(
            "rank %d: the engine process declared dead answers again on its connections "
            "(it had stalled): up again (resumption #%d)",
            rank,
            self.resumptions,
        )
        self._rank_up(rank)

    # -- the owning tasks ---------------------------------------------------------------

    def _on_handshake_message(self, frames: list[bytes], fd: int) -> None:
        """HELLO (answered with the rank's init) or READY on the handshake socket
        (`TransportBase.serve_handshake` reads them)."""
        if len(frames) != 2:
            self.state.on_ignored()
            return
        identity, body = frames
        try:
            msg = decode_hello(body)
        except ProtocolError as exc:
            self.state.on_ignored()
            self._logs.log(logging.WARNING, "hs", "handshake: from %s: %s", identity.hex(), exc)
            return
        status = msg["status"]
        if status == "HELLO":
            verdict = self.state.on_hello(identity, msg)
            if not verdict.admitted or verdict.reply is None or verdict.rank is None:
                log.warning("handshake: refused a HELLO: %s", verdict.refused)
                return
            self._dormant.pop(verdict.rank, None)  # a new process: the old one is gone
            self._resume_due.discard(verdict.rank)
            if verdict.rejoin:
                log.warning("rank %d: HELLO again: its previous incarnation is dead", verdict.rank)
                self.listener.rejoin(verdict.rank)
            # Its life is the input connection its ready response will claim: the
            # predecessor's closing (it may, any time now) is no longer this rank's death.
            self._watch.release(verdict.rank)
            if self._gating:
                # The dispatcher answers, once it has read the rank's connection
                # monitor: connections accepted before that are a previous
                # incarnation's; this one connects once it has read the init.
                self._hello_due[verdict.rank] = (identity, verdict.reply)
                self.output.kick()
            else:  # the initial handshake: no dispatcher yet, no predecessor
                self._begin(verdict.rank)
                self._answer_bytes(identity, verdict.reply)
        elif status == "READY":
            if (rank := self.state.on_ready(identity, msg)) is not None:
                self._rank_up(rank)
        else:
            self.state.on_ignored()

    def _rank_up(self, rank: int) -> None:
        self._rank_is_up(rank, f"vLLM {self.state.version(rank)}")
        if self.nursery is not None:  # (after the group took the new incarnation)
            host = self._hosts.get(rank) or self._url_host
            if host in (None, "", "*", "0.0.0.0", "::"):
                host = "127.0.0.1"
            self.kv.rank_up(self.nursery, rank, self.state.info(rank), host)

    def attach_prefix(self, index: ExactIndex | None, totals: dict[str, int]) -> None:
        """The group's prefix index, once its core exists (None: no prefix routing):
        the KV-event tasks apply what the engines publish to it, and keep their
        counters, summed, in `totals`."""
        self.kv.attach(index, totals)

    def kv_event_counters(self) -> KvEventCounters:
        """What the KV-event feeds of every rank incarnation have seen, summed."""
        return self.kv.counters()

    def _on_input_message(self, frames: list[bytes], fd: int) -> None:
        """The engines' ready responses (`TransportBase.serve_input` reads them, with
        the connection each came on: the rank's life is that connection's)."""
        if len(frames) == 2:
            try:
                info = decode_ready_response(frames[1])
            except ProtocolError as exc:
                self.state.on_ignored()
                self._logs.log(logging.WARNING, "in", "input: from %s: %s", frames[0].hex(), exc)
                return
            awaiting = self.state.awaits_response(frames[0])
            if awaiting is not None:
                self._hosts[awaiting] = peer_host(fd)  # where its KV events are
            if (rank := self.state.on_ready_response(frames[0], info)) is not None:
                self._rank_up(rank)
            if awaiting is not None:
                self._claim(fd, awaiting)
            return
        self.state.on_ignored()

    async def serve_coordinator(self) -> None:
        """Own the coordinator XPUB (MoE): count subscriptions, publish READY once all
        ranks subscribed (and on every later one), publish queued START_DP_WAVEs."""
        zs = self.coordinator
        assert zs is not None
        while True:
            for frames in zs.receive_nowait():
                if frames and frames[0][:1] == b"\x01":
                    self.subscriptions += 1
                    if self.subscriptions >= self.size:
                        self._published.append([COORDINATOR_READY])
            while self._published:
                # XPUB never blocks: a slow subscriber drops (at HWM, unbounded here).
                zs.send_nowait(self._published.popleft())
            await zs.wait_readable_or_kicked()


def _start_command(url: str, engines: int) -> str:
    """How to start the headless vLLM engines of a group at `url` (one per rank R), for
    `HandshakeTimeout`'s next step."""
    host, port = "HOST", "PORT"
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://") :].rpartition(":")
    return (
        f"`vllm serve MODEL --headless --data-parallel-size {engines} "
        "--data-parallel-size-local 1 --data-parallel-start-rank R "
        f"--data-parallel-address {host} --data-parallel-rpc-port {port}`, one process "
        "per rank R"
    )


@asynccontextmanager
async def open_vllm_transport(
    url: str,
    engines: int,
    options: ConnectOptions,
    listener: TransportListener | None = None,
    *,
    lockstep: bool,
    ready_timeout: float,
    parallel_config: Mapping[str, Any] | None = None,
    parallel_config_hash: str | None = None,
    vllm_version: str | None = None,
    source_tag: Callable[[int], bytes] | None = None,
) -> AsyncIterator[VllmTransport]:
    """Bind, serve the handshake, wait for all `engines` ranks (`HandshakeTimeout`
    naming each missing rank and why), yield; leaving closes everything. `options`:
    the group's (`ready_timeout`: its own or the wire's default, resolved)."""
    transport = VllmTransport(
        url,
        engines,
        options,
        lockstep=lockstep,
        parallel_config=parallel_config,
        parallel_config_hash=parallel_config_hash,
        listener=listener,
        vllm_version=vllm_version,
        source_tag=source_tag,
    )
    try:
        async with open_service_nursery() as nursery:
            transport.nursery = nursery
            nursery.start_soon(transport.serve_handshake, name="zmqdp-vllm-handshake")
            nursery.start_soon(transport.serve_input, name="zmqdp-vllm-input")
            if transport.coordinator is not None:
                nursery.start_soon(transport.serve_coordinator, name="zmqdp-vllm-coordinator")
            with trio.move_on_after(ready_timeout) as waiting:
                await transport.wait_ready()
            if waiting.cancelled_caught:
                raise transport.timeout_error(ready_timeout, url, _start_command(url, engines))
            yield transport
    finally:
        with contextlib.suppress(trio.ClosedResourceError):
            await transport.aclose()

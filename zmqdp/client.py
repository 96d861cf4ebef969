"""`EngineGroup`: one trio client for a data-parallel group of N engines.

Theory of operation
-------------------
Tasks. `EngineGroup.connect` opens a nursery with the handshake task (it answers HELLOs
for the life of the group, so rejoins work), the input task (the only one that sends
on the input ROUTER; it also reads REGISTERs) and **one dispatcher task**, which owns
the output ROUTER and the watchdog deadline. The sans-IO `GroupCore` (`_core/state.py`)
decides what a submit, a message or a timeout does; this module carries that out and
applies the group-level policy (a lockstep group fails whole, an independent one RESYNCs
its dead rank, one WAKE after a run of ADDs).

The submit path, `EngineGroup.submit`, is synchronous and never blocks:

1. check that the group is open;
2. `GroupCore.submit` validates the id and pinned rank, gives the request a fresh wire
   id (docs/protocol.md §3), encodes the ADD (any failure: `InvalidRequest`, nothing
   kept), registers it (a live duplicate id raises `DuplicateRequestId` before any
   reservation), selects and reserves a rank (pinned: `InvalidRank` if out of range or
   down), and refuses an ADD larger than that rank accepts (§1: `InvalidRequest`,
   the reservation rolled back);
3. queue the ADD for the input task, which sends it;
4. lockstep groups: after the input task has sent a run of ADDs it sends **one**
   WAKE(c) to every rank (docs/protocol.md §5); a send failure there kills the rank, and in
   a lockstep group that fails the group, so no request is left stranded;
5. hand out the `RequestStream`.

A send that fails later (unknown peer, or a full queue past `send_timeout`) is reported
by the input task and declares the rank dead (§6), which ends its requests with
`EngineDead`; nothing is ever silently dropped.

Messages from engines. `GroupCore.on_message` decides; the dispatcher carries it out.
A message that is not a valid batch kills its rank at once (§7 connection error); a
malformed entry ends only the request it names, with `ProtocolError`; a batch of a dead
incarnation (another `epoch`, §2.3) is counted and dropped. A long batch comes back in
slices (`BatchResult.rest`): the dispatcher applies one slice per round and reads the
other ranks' messages in between, so one rank's long batch holds up nobody else; that
rank's own later messages wait behind it, in order.

Streams (`stream.py`). The dispatcher `deliver`s outputs to a per-request buffer and
`notify`s each consumer at most once per drained batch of messages, not once per output.
A slow consumer only grows its own buffer; the dispatcher never waits for it. Leaving a
stream's `async with` early (or being cancelled inside it) calls back into the group,
which aborts the request on its own rank with a synchronous queue operation.

Failure policy (§6). A dead rank's requests fail with `EngineDead(rank, cause)`. In an
independent group the rank leaves selection and comes back after a fresh handshake; the
client sends it RESYNC about once a second until it says HELLO (§2.5), so that an
engine that is alive but was silent or sent garbage does that handshake without a
restart. In a lockstep group its peers cannot progress without it: the whole group
fails, every live stream raises, and every later submit raises `GroupClosed`.

Closing (§9). Leaving `connect`'s block, or a lockstep group failing, sends ABORT for
every live request to its rank (if that rank is up) before the sockets close, so
engines stop generating for a client that is gone.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, cast

import trio
from trio_util import AsyncValue

from ._admission import WaitQueue
from ._calls import PendingCalls
from ._core.codec import encode_request
from ._core.errors import (
    CallTimeout,
    EngineDead,
    GroupClosed,
    GroupDraining,
    InvalidRank,
    InvalidRequest,
    ProtocolError,
    RequestAborted,
    StreamOverflow,
    quote,
)
from ._core.handshake import identity_rank
from ._core.messages import Call, Load, Wake
from ._core.metrics import HistogramSnapshot
from ._core.requests import Outcome
from ._core.state import (
    DEFAULT_MAX_MESSAGE_SIZE,
    BatchRest,
    BatchResult,
    Failure,
    GroupCore,
    check_timeout,
)
from ._transport import GroupTransport, TransportListener, open_group_transport
from ._util import LogLimiter, NoPublicConstructor
from .keys import ClientKeys
from .stream import RequestStream

__all__ = [
    "EngineGroup",
    "EngineInfo",
    "GroupHealth",
    "GroupStatistics",
    "RankState",
    "RankStatistics",
    "Request",
    "RequestStream",
]

log = logging.getLogger("zmqdp")

_HELD_UP = 0.05
"""Seconds: a dispatcher that wakes this late was held up (see `_dispatch`)."""
_DRAIN_BEFORE_JUDGING = 8
"""Batches of 256 messages read before a silence is judged inside a busy round."""


class RankState(enum.Enum):
    """Whether a rank takes requests."""

    UP = "up"
    """Handshake complete: selectable, pinnable."""
    DOWN = "down"
    """Dead, rejoining or not yet back: submits pinned to it raise `InvalidRank`."""


T = TypeVar("T")


class WatchedValue(Protocol[T]):
    """A value that tasks can wait on (trio-util's `AsyncValue`, read-only here)."""

    @property
    def value(self) -> T: ...

    async def wait_value(
        self, value_or_predicate: T | Callable[[T], bool], *, held_for: float = 0
    ) -> T:
        """Wait until the value equals `value_or_predicate` (or the predicate holds)."""
        ...

    async def wait_transition(
        self, value_or_predicate: T | Callable[[T, T], bool] | None = None
    ) -> tuple[T, T]:
        """Wait for the next change (matching it, if given); returns (new, old)."""
        ...


@dataclass(frozen=True, slots=True)
class Request:
    """One request: `id` unique among live requests (a non-empty str of at most 512
    characters; reusable once the request ends), `body` any CBOR-able value
    (docs/protocol.md §8) whose ADD fits the engine's `max_message_size`, `rank` an int to
    pin it (None: least-loaded), `timeout` its deadline in seconds from submit (None:
    the group's `request_timeout`): past it the request is aborted on its rank and its
    stream raises `RequestTimeout`."""

    id: str
    body: Any = None
    rank: int | None = None
    timeout: float | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """One rank as the client sees it."""

    rank: int
    info: Mapping[str, Any]
    """The free-form metadata of its READY (model, `max_num_seqs`, ...), as sent."""
    state: RankState


@dataclass(frozen=True, slots=True)
class RankStatistics:
    """One rank in `GroupStatistics`."""

    rank: int
    state: RankState
    inflight: int
    """Requests this client has live on the rank."""
    load: Load
    """The rank's latest load report (queue counts zeroed while it holds nothing)."""
    batches: int
    """Valid batches received from its current incarnation."""
    protocol_errors: int
    """Its invalid messages and malformed entries, this incarnation."""
    queued: int
    """Messages waiting to be sent to it (they pile up while its input pipe is full)."""
    cap: int | None
    """Its in-flight cap (`max_inflight`); None: no cap."""
    ttft: HistogramSnapshot
    """Seconds from submit to the first output, of requests sent to it."""
    latency: HistogramSnapshot
    """Seconds from submit to the terminal output, of its requests that finished."""


@dataclass(frozen=True, slots=True)
class GroupStatistics:
    """A snapshot of `EngineGroup.statistics()`: per rank, then counters since connect."""

    ranks: tuple[RankStatistics, ...]
    lockstep: bool
    wave: int | None
    """The wave clock (lockstep groups), else None."""
    submitted: int
    """Requests accepted by `submit` (their ADD was queued)."""
    finished: int
    """Requests that ended with their terminal output."""
    truncated: int
    """Requests the engine listed in `finished` without a terminal output."""
    aborted: int
    """Requests ended by `abort()` or by leaving their stream early."""
    failed: int
    """Requests ended because their rank died or the group closed."""
    rolled_back: int
    """Submits refused with `InvalidRequest` because the body could not be encoded or
    the ADD was too large; nothing was sent or kept."""
    protocol_failed: int
    """Requests ended with `ProtocolError` by a malformed entry naming them (§7)."""
    overflowed: int
    """Streams whose consumer fell `max_buffered` outputs behind: their request was
    aborted (or, if its terminal output came in the same batch, counted as finished
    too, and its outputs past the bound dropped)."""
    timed_out: int
    """Requests aborted because their deadline passed (`RequestTimeout`)."""
    overloaded: int
    """Submits refused by admission control (`Overloaded`); nothing was kept."""
    waiting: int
    """Tasks in `wait_submit` waiting for room now."""
    protocol_errors: int
    """Messages that were not valid batches (each killed its rank), or came from an
    identity that is no rank."""
    malformed_entries: int
    """Malformed entries of otherwise valid batches."""
    stale_messages: int
    """Messages of a dead incarnation (another epoch, or from a rank that is down)."""
    late_outputs: int
    """Entries for requests that had already ended (e.g. outputs racing an abort)."""
    unknown_outputs: int
    """Entries naming a wire id the client never issued, or one live on another rank."""
    wakes: int
    """WAKE rounds sent to the whole group: after a run of ADDs, and at the end of a
    dispatcher pass that took `start_wave`s (one round answers all of them)."""
    stall_wakes: int
    """Extra WAKEs for a stalled lockstep rank; a correct group needs none."""
    fallbacks: int
    """Safety-timeout firings of the socket adapter; 0 in a healthy process."""
    rejected_hellos: int
    """Handshake messages answered with REJECT (invalid or mismatched HELLO, READY)."""
    ignored_handshake_messages: int
    """Handshake messages that were neither HELLO nor READY, or came out of turn, and
    input-socket messages that were not a valid REGISTER."""
    stale_registers: int
    """REGISTERs of a dead incarnation (another epoch), ignored."""
    resyncs: int
    """RESYNCs sent to ranks the group waited for (start-up, after a death)."""
    dropped_answers: int
    """Handshake answers dropped because that peer did not read them."""
    identity_conflicts: int
    """Times a rank said HELLO again soon after its previous HELLO: two processes
    claiming one rank, or an engine restarting in a loop (logged once, loudly)."""
    refused_connections: int
    """CURVE: connections refused because their key is not on the allow-list."""
    impersonations: int
    """CURVE: messages dropped because their routing id was not their key's rank."""


@dataclass(frozen=True, slots=True)
class GroupHealth:
    """`EngineGroup.health()`: what a liveness and a readiness probe ask."""

    live: bool
    """The group serves (not closed, not failed): restart the process if False."""
    ready: bool
    """Live, not draining, and at least one rank up: send it traffic."""
    draining: bool
    ranks_up: int
    size: int
    inflight: int
    """Live requests."""
    room: int | None
    """Requests the up ranks can still take before admission refuses (None: no cap)."""


class _GroupListener(TransportListener):
    """Passes the transport's events to the group once it exists. Before that (the
    initial handshake) there is nothing to tell: the group starts from the ready
    handshake state."""

    group: EngineGroup | None = None

    def rank_up(self, rank: int) -> None:
        if self.group is not None:
            self.group._on_rank_up(rank)

    def rejoin(self, rank: int) -> None:
        if self.group is not None:
            self.group._rank_dead(
                rank, "said HELLO again (rejoin): its previous incarnation is dead", rejoin=True
            )

    def send_failed(self, rank: int, cause: str) -> None:
        if self.group is not None:
            self.group._rank_dead(rank, cause)

    def flushed(self) -> None:
        if self.group is not None:
            self.group._after_flush()

    def displaced(self, rank: int, cause: str) -> None:
        if self.group is not None:
            self.group._rank_dead(rank, cause)


class EngineGroup(metaclass=NoPublicConstructor):
    """The client of one engine group. Create it with `EngineGroup.connect`."""

    _for_testing_stream_class: type[RequestStream] = RequestStream
    """Tests and benchmarks only: the stream class `submit` makes (unless the group's
    `_stream_class` is set)."""

    def __init__(
        self,
        transport: GroupTransport,
        core: GroupCore[RequestStream],
        max_buffered: int | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_inflight: int | Literal["info"] | None = None,
        request_timeout: float | None = None,
    ) -> None:
        self._transport = transport
        self._core = core
        self._max_buffered = max_buffered
        self._max_inflight = max_inflight
        self._request_timeout = request_timeout
        self._waiters = WaitQueue()
        self._idle: trio.Event | None = None  # set when draining and nothing is live
        self._timer: trio.CancelScope | None = None  # the dispatcher's wait, if parked
        self.lockstep = core.lockstep
        self.size = core.size
        # trio-util is untyped: these are AsyncValues, shown to users as WatchedValues
        self._states: list[Any] = [AsyncValue(RankState.UP) for _ in range(core.size)]
        self._wave: Any = AsyncValue(core.clock.wave if core.clock is not None else None)
        self._calls = PendingCalls()
        self._logs = LogLimiter(log)
        # the dispatcher's long batches in hand, and the messages held behind them
        self._long: dict[int, BatchRest] = {}
        self._held: dict[int, collections.deque[list[bytes]]] = {}
        self._held_bytes: dict[int, int] = {}
        self._held_limit = 4 * max_message_size
        self._wake_due = False  # a start_wave of this dispatcher pass awaits its WAKE
        self._wake_rounds = 0
        self._firsts: list[RequestStream] = []  # streams given their first output
        # The stream class of this group's `submit` (`zmqdp.aio` sets its own); None:
        # `_for_testing_stream_class`, read at each submit (benchmarks switch it).
        self._stream_class: type[RequestStream] | None = None

    # -- connecting -------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        url: str,
        engines: int,
        *,
        ready_timeout: float = 60.0,
        silence_timeout: float = 30.0,
        send_timeout: float = 10.0,
        stall_timeout: float = 5.0,
        advertise_host: str | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_buffered: int | None = None,
        max_inflight: int | Literal["info"] | None = None,
        request_timeout: float | None = None,
        curve: ClientKeys | None = None,
        insecure: bool = False,
    ) -> AsyncIterator[EngineGroup]:
        """Bind the group URL, wait for all `engines` ranks, and serve them.

        Engines that kept running after an earlier client went away are picked up: the
        client sends RESYNC to every rank it is waiting for (docs/protocol.md §2.5).
        `max_message_size` bounds what the client receives and is announced in INIT;
        each engine announces its own in HELLO, and `submit` refuses larger ADDs.
        `max_buffered` bounds each stream's unread outputs: a request whose consumer
        falls that far behind is aborted on its rank and its stream raises
        `StreamOverflow` after those outputs (None: unbounded).

        Admission control: `max_inflight` caps the requests in flight on each rank (an
        int; "info": each rank's `max_num_seqs` from its READY info, uncapped if it
        sends none; None: no cap). A submit that finds no room raises `Overloaded`;
        `wait_submit` waits for room instead. `request_timeout` is the deadline of
        every request without its own `Request.timeout` (None: none).

        `curve` (`zmqdp.keys.load_client_keys(DIR)`) makes the client a CURVE server
        that admits only engines whose key is on its allow-list, each as the one rank its
        key is bound to. A tcp URL that other machines can reach is refused without it,
        unless `insecure=True` (a trusted network).

        Raises `HandshakeTimeout` if the group is not ready in `ready_timeout` s.
        Leaving the block sends ABORT for every live request, then closes every socket;
        live streams end with `GroupClosed`. An exception raised in the block passes
        out unchanged (an `ExceptionGroup` stays one); errors of zmqdp's own tasks come
        out as one plain exception.

        Cancellation: cancelled while waiting for the engines, it closes everything
        and leaves nothing running.
        """
        if max_buffered is not None and (type(max_buffered) is not int or max_buffered < 1):
            raise ValueError(f"max_buffered must be a positive int or None, got {max_buffered!r}")
        if max_inflight not in (None, "info") and (
            type(max_inflight) is not int or max_inflight < 1
        ):
            raise ValueError(
                f"max_inflight must be a positive int, 'info' or None, got {max_inflight!r}"
            )
        if request_timeout is not None:
            check_timeout("request_timeout", request_timeout)
        listener = _GroupListener()
        async with open_group_transport(
            url,
            engines,
            ready_timeout=ready_timeout,
            advertise_host=advertise_host,
            max_message_size=max_message_size,
            send_timeout=send_timeout,
            listener=listener,
            curve=curve,
            insecure=insecure,
        ) as transport:
            core: GroupCore[RequestStream] = GroupCore(
                engines,
                lockstep=bool(transport.state.lockstep),
                silence_timeout=silence_timeout,
                stall_timeout=stall_timeout,
                wave=transport.state.hello_wave(),
            )
            group = cls._create(
                transport, core, max_buffered, max_message_size, max_inflight, request_timeout
            )
            for rank in range(engines):
                group._on_rank_up(rank)
            listener.group = group
            assert transport.nursery is not None
            transport.nursery.start_soon(group._dispatch, name="zmqdp-dispatcher")
            try:
                yield group
            finally:
                group._close()

    # -- public API -------------------------------------------------------------------

    @property
    def engines(self) -> tuple[EngineInfo, ...]:
        """Per rank: READY info and state."""
        return tuple(
            EngineInfo(r, self._transport.state.info(r), self._states[r].value)
            for r in range(self.size)
        )

    def rank_state(self, rank: int) -> WatchedValue[RankState]:
        """The rank's state, to wait on: `await group.rank_state(1).wait_value(RankState.UP)`.
        Raises `InvalidRank` for a rank outside the group."""
        if type(rank) is not int or not 0 <= rank < self.size:
            raise InvalidRank(rank, self.size, None, f"out of range for a group of {self.size}")
        return cast(WatchedValue[RankState], self._states[rank])

    @property
    def wave(self) -> WatchedValue[int | None]:
        """Lockstep groups: the wave clock as a trio-util `AsyncValue[int]` (None for
        independent groups). It moves when a rank reports `wave_complete` (the group
        parked) or `start_wave`: `await group.wave.wait_value(lambda w: w > seen)`."""
        return cast(WatchedValue[int | None], self._wave)

    def submit(self, request: Request) -> RequestStream:
        """Send a request; return its stream (use it with `async with` at once).

        Never blocks. Raises `Overloaded` (admission control: no room, see
        `wait_submit`), `GroupDraining`, `GroupClosed`, `DuplicateRequestId`,
        `InvalidRank`, `NoEngineAvailable` or `InvalidRequest` (a bad id, timeout or
        pinned rank, a body with no CBOR form, or an ADD larger than the engine
        accepts), each before anything is sent or reserved.
        """
        stream = (self._stream_class or self._for_testing_stream_class)._create(
            request.id, self._close_stream, self._max_buffered
        )
        timeout = request.timeout if request.timeout is not None else self._request_timeout
        now = trio.current_time()
        sub = self._core.submit(request.id, request.body, stream, request.rank, now, timeout)
        stream.rank = sub.rank
        stream.wire_id = sub.wire_id
        stream.submitted_at = now
        self._transport.send(sub.rank, sub.frames)
        if timeout is not None:
            timer = self._timer
            if timer is not None and now + timeout < timer.deadline:
                timer.deadline = now + timeout  # the parked dispatcher wakes in time
        return stream

    async def wait_submit(self, request: Request) -> RequestStream:
        """`submit`, waiting for room while admission control refuses it: waiters are
        admitted first come, first served (a plain `submit` that finds room takes it).
        Raises what `submit` raises, except `Overloaded`; `GroupDraining` if the group
        starts draining meanwhile.

        Cancellation: if cancelled while waiting, nothing was submitted. Once admitted
        the request is live and the stream is returned; enter its `async with` at once.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._waiters and self._room_for(request.rank):  # nobody queued ahead
            stream = self.submit(request)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return stream
        return await self._waiters.wait(request)

    @property
    def draining(self) -> bool:
        """`drain()` was called: no new requests are taken."""
        return self._core.draining

    async def drain(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Stop taking requests (`submit` raises `GroupDraining`, waiters too), wait until
        every live request has ended, then close the group (as leaving `connect`'s
        block does). After `timeout` seconds, the requests still live are aborted on
        their ranks and their streams raise `GroupClosed`.

        Cancellation: the group stays draining and its live requests go on; leaving
        `connect`'s block closes it.
        """
        core = self._core
        if core.closed is None and not core.draining:
            core.draining = True
            log.info("draining: %d live request(s)", len(core.book))
            self._waiters.fail_all(lambda r: GroupDraining(r.id))
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while len(core.book) and core.closed is None:
                self._idle = trio.Event()
                await self._idle.wait()
        self._idle = None
        left = len(core.book)
        self._close(
            f"the engine group was drained; {left} request(s) were still live after "
            f"{timeout or 0:g} s"
            if left
            else "the engine group was drained"
        )

    def health(self) -> GroupHealth:
        """A snapshot for liveness and readiness probes."""
        core = self._core
        up = [r for r in range(self.size) if core.is_up(r)]
        live = core.closed is None
        caps = [core.routing.cap(r) for r in up]
        room = (
            None
            if any(c is None for c in caps)
            else sum(
                max(0, cast(int, cap) - core.routing.inflight_count(r))
                for r, cap in zip(up, caps, strict=True)
            )
        )
        return GroupHealth(
            live=live,
            ready=live and not core.draining and bool(up),
            draining=core.draining,
            ranks_up=len(up),
            size=self.size,
            inflight=len(core.book),
            room=room,
        )

    async def abort(self, request_id: str) -> None:
        """Abort a live request; a no-op for unknown or ended ids (idempotent).

        Cancellation: the abort is queued synchronously before the checkpoint, so it
        happens even if this call is cancelled.
        """
        self._abort(request_id, None)
        await trio.lowlevel.checkpoint()

    def _encode_call(
        self, rank: int, call_id: int, method: str, args: tuple[Any, ...]
    ) -> Sequence[bytes]:
        """The CALL's frames (a wire dialect overrides this); `InvalidRequest` if it
        has no wire form or is larger than the rank accepts."""
        try:
            frames = encode_request(Call(call_id, method, args))
        except ProtocolError as exc:
            raise InvalidRequest(f"CALL {method}", exc.cause) from None
        limit = self._core.health[rank].max_message_size
        if len(frames[0]) + len(frames[1]) > limit:
            raise InvalidRequest(
                f"CALL {method}", f"larger than rank {rank} accepts ({limit} bytes)"
            )
        return frames

    async def call(self, rank: int, method: str, *args: Any, timeout: float = 10.0) -> Any:  # noqa: ASYNC109
        """Run a utility method on one rank and return its result.

        Raises `CallTimeout` if no reply comes within `timeout` s, `CallFailed` with the
        engine's error string (or what was wrong with its reply), `EngineDead` if the
        rank dies first or is not up, `GroupClosed`, and `InvalidRequest` if the
        arguments have no CBOR form or the CALL is larger than the rank accepts.

        Cancellation: the reply, if it comes later, is dropped.
        """
        if type(rank) is not int or not 0 <= rank < self.size:
            raise InvalidRank(rank, self.size, None, "CALL needs an int rank of the group")
        if type(method) is not str:
            raise InvalidRequest(quote(method), "the CALL method must be a str")
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        if self._core.closed is not None:
            raise GroupClosed(self._core.closed.cause)
        if not self._core.is_up(rank):
            raise EngineDead(rank, f"CALL {method!r}: the rank is not up")
        call_id, pending = self._calls.open(rank, method)
        try:
            frames = self._encode_call(rank, call_id, method, args)
            self._transport.send(rank, frames)
            with trio.move_on_after(timeout):
                await pending.done.wait()
        finally:
            self._calls.forget(call_id)
        if not pending.done.is_set():
            raise CallTimeout(rank, method, timeout)
        return pending.result()

    def statistics(self) -> GroupStatistics:
        """A frozen snapshot of per-rank state and the group's counters."""
        core = self._core
        c = core.counters
        t = self._transport.statistics()
        return GroupStatistics(
            ranks=tuple(
                RankStatistics(
                    rank=r,
                    state=self._states[r].value,
                    inflight=core.routing.inflight_count(r),
                    load=core.routing.load(r),
                    batches=core.health[r].batches,
                    protocol_errors=core.health[r].protocol_errors,
                    queued=t.queued[r],
                    cap=core.routing.cap(r),
                    ttft=core.ttft[r].snapshot(),
                    latency=core.latency[r].snapshot(),
                )
                for r in range(self.size)
            ),
            lockstep=self.lockstep,
            wave=core.clock.wave if core.clock is not None else None,
            submitted=c.submitted,
            finished=c.finished,
            truncated=c.truncated,
            aborted=c.aborted,
            failed=c.failed,
            rolled_back=c.rolled_back,
            protocol_failed=c.protocol_failed,
            overflowed=c.overflowed,
            timed_out=c.timed_out,
            overloaded=c.overloaded,
            waiting=len(self._waiters),
            protocol_errors=c.protocol_errors,
            malformed_entries=c.malformed_entries,
            stale_messages=c.stale_messages,
            late_outputs=c.late_outputs,
            unknown_outputs=c.unknown_outputs,
            wakes=self._wake_rounds,
            stall_wakes=c.stall_wakes,
            fallbacks=t.handshake.fallbacks + t.input.fallbacks + t.output.fallbacks,
            rejected_hellos=t.rejected_hellos,
            ignored_handshake_messages=t.ignored_handshake_messages,
            stale_registers=t.stale_registers,
            resyncs=t.resyncs,
            dropped_answers=t.dropped_answers,
            identity_conflicts=t.identity_conflicts,
            refused_connections=t.refused_connections,
            impersonations=t.impersonations,
        )

    @property
    def closed(self) -> GroupClosed | None:
        """Why the group is closed or failed, or None while it serves."""
        return self._core.closed

    # -- internals: streams -----------------------------------------------------------

    def _close_stream(self, stream: RequestStream) -> None:
        """A stream's `async with` ended before its request did: abort it, once."""
        self._abort(stream.request_id, stream)

    def _abort(self, request_id: str, stream: RequestStream | None) -> None:
        """The one abort path: end the request (only that `stream`'s submission, if
        given) and send ABORT of its wire id to its rank. A user's `abort()` makes a
        reader see `RequestAborted`; closing the stream leaves nobody to tell."""
        ended = self._core.abort(request_id, stream)
        if ended is not None:
            error = RequestAborted(ended.rank, request_id) if stream is None else None
            ended.handle.finish(Outcome.ABORTED, error)
            self._transport.send(ended.rank, self._core.encode_abort((ended.wire_id,)))
            self._after_endings()

    def _after_endings(self) -> None:
        """Requests ended (or a rank came up): admit waiters, wake a drain."""
        if self._waiters:
            self._waiters.admit(self.submit, self._room_for)
        idle = self._idle
        if idle is not None and not len(self._core.book):
            idle.set()

    def _room_for(self, rank: int | None) -> bool:
        """Whether a request pinned to `rank` (None: unpinned) is worth trying now: a
        pinned rank that is up and full is not; anything else is (it fits, or its
        submit raises the error the waiter should get)."""
        routing = self._core.routing
        if rank is None:
            return any(routing.has_room(r) for r in range(self.size)) or not any(
                routing.is_up(r) for r in range(self.size)
            )
        return not (type(rank) is int and routing.is_up(rank) and not routing.has_room(rank))

    # -- internals: the dispatcher ----------------------------------------------------

    async def _dispatch(self) -> None:
        """The dispatcher: owns the output socket and the watchdog deadline (module
        docstring, and docs/design.md "Nobody blocks anybody").

        A long batch comes back from the core with a `rest`: it is applied one slice per
        round, and in each round this task also takes what the other ranks sent, so one
        rank's long batch does not hold up everybody else's outputs; messages of that
        same rank wait behind its long batch (`_held`), to keep its order.

        Cancellation: only at checkpoints (the group is closing); what was applied
        stays applied."""
        zs = self._transport.output
        core = self._core
        while True:
            if self._long:  # work in hand: take what is queued, without waiting
                messages = zs.receive_nowait(256)
            else:
                # Re-evaluate at least once a second: a submit can give an idle rank a
                # deadline while this task is parked.
                deadline = min(core.next_deadline(), trio.current_time() + 1.0)
                with trio.move_on_at(deadline) as timer:
                    self._timer = timer  # a submit with an earlier deadline moves it
                    try:
                        messages = await zs.receive_batch(256)
                    finally:
                        self._timer = None
                if timer.cancelled_caught:
                    deadline = timer.deadline
                    # Read what is queued before judging silence: if this task was held
                    # up past the deadline, the heartbeats that arrived meanwhile are
                    # waiting. If it woke late, libzmq's I/O thread may have been held
                    # up too: give it a moment to hand over what the kernel holds.
                    messages = zs.receive_nowait(256)
                    if not messages and trio.current_time() - deadline > _HELD_UP:
                        with trio.move_on_after(_HELD_UP):
                            messages = await zs.receive_batch(256)
                    if not messages:
                        self._on_timeout(trio.current_time())
                        continue
            dirty: set[RequestStream] = set()
            in_hand = list(self._long)  # a batch started in this round waits for the next
            for frames in messages:
                self._take(frames, dirty)
            if in_hand:
                self._advance_long(in_hand, dirty)
            if trio.current_time() >= core.next_deadline():
                # Also judged when other ranks keep this task busy and the timer above
                # never fires (a silent rank must not hide behind a chatty one).
                self._judge_silence(dirty)
            for stream in dirty:
                stream.notify()
            self._after_endings()
            clock = core.clock
            if clock is not None:
                if self._wake_due:
                    # One WAKE(c) answers every start_wave of this pass (docs/protocol.md
                    # §5; the wave model checks this, `coalesce`): a pass that took the
                    # start_waves of 8 ranks sent 8 rounds of 8 WAKEs before.
                    self._wake_due = False
                    self._wake_all(clock.wave)
                if clock.wave != self._wave.value:
                    self._wave.value = clock.wave
            if self._long:
                await trio.lowlevel.checkpoint()  # consumers and other tasks run

    def _judge_silence(self, dirty: set[RequestStream]) -> None:
        """A deadline passed while this task was busy: first read what is queued (the
        heartbeats that arrived meanwhile, as the timer path does), up to
        `_DRAIN_BEFORE_JUDGING` batches so a flood cannot postpone the judgement, then
        judge at the time of judging."""
        zs = self._transport.output
        for _ in range(_DRAIN_BEFORE_JUDGING):
            messages = zs.receive_nowait(256)
            for frames in messages:
                self._take(frames, dirty)
            if len(messages) < 256:
                break
        self._on_timeout(trio.current_time())

    def _take(self, frames: list[bytes], dirty: set[RequestStream]) -> None:
        """One message from the output socket: applied now, or held behind its rank's
        long batch."""
        rank = identity_rank(frames[0]) if frames else None
        if rank is not None and rank in self._long:
            self._held.setdefault(rank, collections.deque()).append(frames)
            held = self._held_bytes.get(rank, 0) + sum(map(len, frames))
            self._held_bytes[rank] = held
            if held > self._held_limit:
                self._rank_dead(
                    rank,
                    f"it sent {held} bytes faster than its batches could be applied "
                    f"(over {self._held_limit}, 4 x max_message_size)",
                )
            return
        rank, result = self._core.on_message(frames, trio.current_time())
        if rank is None:
            self._logs.log(logging.WARNING, "output-identity", "%s", result.error)
            return
        self._carry_out_batch(rank, result, dirty)
        if result.rest is not None:
            self._long[rank] = result.rest

    def _drop_held(self, rank: int) -> None:
        """`rank` died: the rest of its long batch and what was held behind it belong to
        the incarnation that is gone (counted as stale, never applied)."""
        self._long.pop(rank, None)
        self._held_bytes.pop(rank, None)
        held = self._held.pop(rank, None)
        if held:
            self._core.counters.stale_messages += len(held)

    def _advance_long(self, ranks: list[int], dirty: set[RequestStream]) -> None:
        """One slice of the long batch of each of `ranks`; a rank whose batch is done gets
        the messages held behind it applied, in order (until one is long again)."""
        for rank in ranks:
            if rank not in self._long:
                continue  # it died meanwhile
            result = self._core.continue_batch(self._long[rank], trio.current_time())
            self._carry_out_batch(rank, result, dirty)
            if result.rest is not None:
                self._long[rank] = result.rest
                continue
            self._long.pop(rank, None)  # (gone already if the rank died in that slice)
            held = self._held.pop(rank, None)
            self._held_bytes.pop(rank, None)
            while held:
                self._take(held.popleft(), dirty)
                if rank in self._long and held:
                    self._held[rank] = held
                    self._held_bytes[rank] = sum(sum(map(len, f)) for f in held)
                    break

    def _carry_out_batch(
        self, rank: int, result: BatchResult[RequestStream], dirty: set[RequestStream]
    ) -> None:
        core = self._core
        fx = result.effects
        if fx is not None:
            firsts = self._firsts
            for stream in RequestStream.deliver_all(fx.deliveries, dirty, firsts):
                self._overflow(stream)
            now = trio.current_time() if firsts or fx.ended else 0.0
            if firsts:
                for stream in firsts:
                    if stream.first_output_at is None:
                        stream.first_output_at = now
                        core.observe_first_output(stream.rank, now - stream.submitted_at)
                firsts.clear()
            for ended in fx.ended:
                stream = ended.handle
                stream.finish(ended.outcome, core.ending_error(ended))
                if ended.outcome is Outcome.FINISHED:
                    core.observe_finished(stream.rank, now - stream.submitted_at)
        if result.wake is not None:
            self._wake_due = True  # answered at the end of this dispatcher pass
        for reply in result.replies:
            if reply.error is not None:
                self._calls.fail(reply.call, rank, reply.error)
            else:
                self._calls.settle(reply.call, rank, reply.result)
        for call_id, cause in result.bad_replies:
            self._calls.fail(call_id, rank, cause)
        if result.error is not None:
            log.warning("%s", result.error)
        if result.dead is not None:
            self._rank_dead(rank, result.dead)

    def _overflow(self, stream: RequestStream) -> None:
        """A stream's buffer is at `max_buffered`: its consumer does not keep up. The
        request is aborted on its rank and the stream fails with `StreamOverflow`
        after the outputs it holds."""
        if stream.outcome is not None:
            return
        ended = self._core.overflow(stream.request_id, stream)
        if ended is not None:
            self._transport.send(ended.rank, self._core.encode_abort((ended.wire_id,)))
        error = StreamOverflow(
            stream.rank, stream.request_id, self._max_buffered or 0, aborted=ended is not None
        )
        self._logs.log(logging.WARNING, "overflow", "%s", error)
        stream.finish(Outcome.OVERFLOWED, error)

    def _on_timeout(self, now: float) -> None:
        for ended, error in self._core.expire(now):
            ended.handle.finish(ended.outcome, error)
            self._transport.send(ended.rank, self._core.encode_abort((ended.wire_id,)))
            log.info("%s", error)
        dead, wake = self._core.on_timeout(now)
        if wake is not None:
            log.warning(
                "lockstep group: a rank has waiting work and no progress; WAKE(%d) again", wake
            )
            self._wake_all(wake, stall=True)
        for rank, cause in dead:
            self._rank_dead(rank, cause)

    def _wake_all(self, wave: int, *, stall: bool = False) -> None:
        if not stall:  # stall WAKEs are counted by the core (`stall_wakes`)
            self._wake_rounds += 1
        frames = encode_request(Wake(wave))
        for rank in range(self.size):
            if self._core.is_up(rank):
                self._transport.send(rank, frames)

    def _after_flush(self) -> None:
        """Called by the input task after it sent a run of messages."""
        wave = self._core.after_flush()
        if wave is not None:
            self._wake_all(wave)

    # -- internals: rank lifecycle ----------------------------------------------------

    def _on_rank_up(self, rank: int) -> None:
        if self._core.closed is not None:
            return
        state = self._transport.state
        self._core.rank_up(
            rank,
            trio.current_time(),
            epoch=state.epoch(rank),
            hello_wave=state.wave(rank),
            max_message_size=state.engine_max_message_size(rank),
        )
        self._core.routing.set_cap(rank, self._cap_of(rank))
        self._states[rank].value = RankState.UP
        log.info("rank %d: up (epoch %s)", rank, state.epoch(rank))
        self._after_endings()  # room for waiters

    def _cap_of(self, rank: int) -> int | None:
        cap = self._max_inflight
        if cap != "info":
            return cap
        seqs = self._transport.state.info(rank).get("max_num_seqs")
        if type(seqs) is int and seqs > 0:
            return seqs
        log.warning(
            "rank %d: max_inflight='info' but its READY info has no positive int "
            "'max_num_seqs' (%s): no in-flight cap for it",
            rank,
            quote(seqs),
        )
        return None

    def _rank_dead(self, rank: int, cause: str, *, rejoin: bool = False) -> None:
        failure = self._core.rank_down(rank, cause, rejoin=rejoin)
        if failure is not None:
            log.error("rank %d: dead: %s", rank, cause)
            self._carry_out(failure)

    def _close(self, cause: str = "the engine group was closed") -> None:
        failure = self._core.close(cause)
        if failure is not None:
            self._carry_out(failure)

    def _carry_out(self, failure: Failure[RequestStream]) -> None:
        """Do what `GroupCore.rank_down` or `close` decided, in its order."""
        for ended, error in failure.ended:
            ended.handle.finish(ended.outcome, error)
        if failure.rank is not None:
            self._transport.drop_queued(failure.rank)  # for an incarnation that is gone
            self._drop_held(failure.rank)
        for rank, frames in failure.aborts:
            self._transport.send(rank, frames)
        if failure.forget is not None:
            self._transport.forget(failure.forget, resync=failure.resync)
        if failure.rank is not None:
            self._calls.fail_all(EngineDead(failure.rank, failure.cause), failure.rank)
        if failure.closed is not None:
            self._calls.fail_all(failure.closed)
            closed = failure.closed
            self._waiters.fail_all(lambda r: GroupClosed(closed.cause, r.id))
        for rank in range(self.size):
            if not self._core.is_up(rank):
                self._states[rank].value = RankState.DOWN
        self._after_endings()

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
   id (PROTOCOL.md §8.1), encodes the ADD (any failure: `InvalidRequest`, nothing
   kept), registers it (a live duplicate id raises `DuplicateRequestId` before any
   reservation), selects and reserves a rank (pinned: `InvalidRank` if out of range or
   down), and refuses an ADD larger than that rank accepts (§8.4: `InvalidRequest`,
   the reservation rolled back);
3. queue the ADD for the input task, which sends it;
4. lockstep groups: after the input task has sent a run of ADDs it sends **one**
   WAKE(c) to every rank (PROTOCOL.md §5); a send failure there kills the rank, and in
   a lockstep group that fails the group, so no request is left stranded;
5. hand out the `RequestStream`.

A send that fails later (unknown peer, or a full queue past `send_timeout`) is reported
by the input task and declares the rank dead (§6), which ends its requests with
`EngineDead`; nothing is ever silently dropped.

Messages from engines. `GroupCore.on_message` decides; the dispatcher carries it out.
A message that is not a valid batch kills its rank at once (§8.5 connection error); a
malformed entry ends only the request it names, with `ProtocolError`; a batch of a dead
incarnation (another `epoch`, §8.2) is counted and dropped.

Streams (`stream.py`). The dispatcher `deliver`s outputs to a per-request buffer and
`notify`s each consumer at most once per drained batch of messages, not once per output.
A slow consumer only grows its own buffer; the dispatcher never waits for it. Leaving a
stream's `async with` early (or being cancelled inside it) calls back into the group,
which aborts the request on its own rank with a synchronous queue operation.

Failure policy (§6). A dead rank's requests fail with `EngineDead(rank, cause)`. In an
independent group the rank leaves selection and comes back after a fresh handshake; the
client sends it RESYNC about once a second until it says HELLO (§8.3), so that an
engine that is alive but was silent or sent garbage does that handshake without a
restart. In a lockstep group its peers cannot progress without it: the whole group
fails, every live stream raises, and every later submit raises `GroupClosed`.

Closing (§8.7). Leaving `connect`'s block, or a lockstep group failing, sends ABORT for
every live request to its rank (if that rank is up) before the sockets close, so
engines stop generating for a client that is gone.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from trio_util import AsyncValue

from ._calls import PendingCalls
from ._core.codec import encode_request
from ._core.errors import (
    CallTimeout,
    EngineDead,
    GroupClosed,
    InvalidRequest,
    ProtocolError,
    RequestAborted,
    StreamTruncated,
)
from ._core.messages import Abort, Call, Load, Wake
from ._core.requests import Ended, Outcome
from ._core.state import DEFAULT_MAX_MESSAGE_SIZE, GroupCore
from ._transport import GroupTransport, open_group_transport
from ._util import NoPublicConstructor
from .stream import RequestStream

__all__ = [
    "EngineGroup",
    "EngineInfo",
    "GroupStatistics",
    "RankState",
    "RankStatistics",
    "Request",
    "RequestStream",
]

log = logging.getLogger("zmqdp")

_ABORT_BUDGET = 64 * 1024  # bytes per ABORT at close: keeps each message small


class RankState(enum.Enum):
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class Request:
    """One request: `id` unique among live requests (a non-empty str of at most 512
    characters; reusable once the request ends), `body` any CBOR-able value
    (PROTOCOL.md §7) whose ADD fits the engine's `max_message_size`, `rank` an int to
    pin it (None: least-loaded)."""

    id: str
    body: Any = None
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    rank: int
    info: Mapping[str, Any]
    state: RankState


@dataclass(frozen=True, slots=True)
class RankStatistics:
    rank: int
    state: RankState
    inflight: int
    load: Load
    batches: int
    protocol_errors: int


@dataclass(frozen=True, slots=True)
class GroupStatistics:
    ranks: tuple[RankStatistics, ...]
    lockstep: bool
    wave: int | None
    submitted: int
    finished: int
    truncated: int
    aborted: int
    failed: int
    rolled_back: int
    """Submits refused with `InvalidRequest` because the body could not be encoded or
    the ADD was too large; nothing was sent or kept."""
    protocol_failed: int
    """Requests ended with `ProtocolError` by a malformed entry naming them (§8.5)."""
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
    stall_wakes: int
    fallbacks: int
    """Safety-timeout firings of the socket adapter; 0 in a healthy process."""


class EngineGroup(metaclass=NoPublicConstructor):
    """The client of one engine group. Create it with `EngineGroup.connect`."""

    _for_testing_stream_class: type[RequestStream] = RequestStream
    """Tests and benchmarks only: the stream class `submit` makes."""

    def __init__(self, transport: GroupTransport, core: GroupCore[RequestStream]) -> None:
        self._transport = transport
        self._core = core
        self.lockstep = core.lockstep
        self.size = core.size
        self._closed: GroupClosed | None = None
        self._states = [AsyncValue(RankState.UP) for _ in range(core.size)]
        self._wave = AsyncValue(core.clock.wave if core.clock is not None else None)
        self._adds_since_wake = False
        self._calls = PendingCalls()

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
    ) -> AsyncIterator[EngineGroup]:
        """Bind the group URL, wait for all `engines` ranks, and serve them.

        Engines that kept running after an earlier client went away are picked up: the
        client sends RESYNC to every rank it is waiting for (PROTOCOL.md §8.3).
        `max_message_size` bounds what the client receives and is announced in INIT;
        each engine announces its own in HELLO, and `submit` refuses larger ADDs.

        Raises `HandshakeTimeout` if the group is not ready in `ready_timeout` s.
        Leaving the block sends ABORT for every live request, then closes every socket;
        live streams end with `GroupClosed`. An exception raised in the block passes
        out unchanged (an `ExceptionGroup` stays one); errors of zmqdp's own tasks come
        out as one plain exception.

        Cancellation: cancelled while waiting for the engines, it closes everything
        and leaves nothing running.
        """
        async with open_group_transport(
            url,
            engines,
            ready_timeout=ready_timeout,
            advertise_host=advertise_host,
            max_message_size=max_message_size,
            send_timeout=send_timeout,
        ) as transport:
            core: GroupCore[RequestStream] = GroupCore(
                engines,
                lockstep=bool(transport.state.lockstep),
                silence_timeout=silence_timeout,
                stall_timeout=stall_timeout,
                wave=transport.state.hello_wave(),
            )
            group = cls._create(transport, core)
            for rank in range(engines):
                group._on_rank_up(rank)
            transport.on_rank_up = group._on_rank_up
            transport.on_rejoin = group._on_rejoin
            transport.on_send_failure = group._on_send_failure
            transport.on_flushed = group._after_flush
            assert transport.nursery is not None
            transport.nursery.start_soon(group._dispatch, name="zmqdp-dispatcher")
            try:
                yield group
            finally:
                group._close(GroupClosed("the engine group was closed"))

    # -- public API -------------------------------------------------------------------

    @property
    def engines(self) -> tuple[EngineInfo, ...]:
        """Per rank: READY info and state."""
        return tuple(
            EngineInfo(r, self._transport.state.info(r), self._states[r].value)
            for r in range(self.size)
        )

    def rank_state(self, rank: int) -> Any:
        """The rank's state as a trio-util `AsyncValue[RankState]`, to wait on:
        `await group.rank_state(1).wait_value(RankState.UP)`."""
        return self._states[rank]

    @property
    def wave(self) -> Any:
        """Lockstep groups: the wave clock as a trio-util `AsyncValue[int]` (None for
        independent groups). It moves when a rank reports `wave_complete` (the group
        parked) or `start_wave`: `await group.wave.wait_value(lambda w: w > seen)`."""
        return self._wave

    def submit(self, request: Request) -> RequestStream:
        """Send a request; return its stream (use it with `async with`).

        Never blocks. Raises `GroupClosed`, `DuplicateRequestId`, `InvalidRank`,
        `NoEngineAvailable` or `InvalidRequest` (a bad id, a pinned rank that is not an
        int, a body with no CBOR form, or an ADD larger than the engine accepts), each
        before anything is sent or reserved.
        """
        if self._closed is not None:
            raise GroupClosed(self._closed.cause, request_id=str(request.id))
        stream = self._for_testing_stream_class._create(request.id, self._close_stream)
        sub = self._core.submit(request.id, request.body, stream, request.rank, trio.current_time())
        stream.rank = sub.rank
        stream.wire_id = sub.wire_id
        self._transport.send(sub.rank, sub.frames)
        self._adds_since_wake = self.lockstep
        return stream

    async def abort(self, request_id: str) -> None:
        """Abort a live request; a no-op for unknown or ended ids (idempotent).

        Cancellation: the abort is queued synchronously before the checkpoint, so it
        happens even if this call is cancelled.
        """
        ended = self._core.abort(request_id)
        if ended is not None:
            self._transport.send(ended.rank, encode_request(Abort((ended.wire_id,))))
            ended.handle.finish(Outcome.ABORTED, RequestAborted(ended.rank, request_id))
        await trio.lowlevel.checkpoint()

    async def call(self, rank: int, method: str, *args: Any, timeout: float = 10.0) -> Any:  # noqa: ASYNC109
        """Run a utility method on one rank and return its result.

        Raises `CallTimeout` if no reply comes within `timeout` s, `CallFailed` with the
        engine's error string (or what was wrong with its reply), `EngineDead` if the
        rank dies first or is not up, `GroupClosed`, and `InvalidRequest` if the
        arguments have no CBOR form or the CALL is larger than the rank accepts.

        Cancellation: the reply, if it comes later, is dropped.
        """
        if self._closed is not None:
            raise GroupClosed(self._closed.cause)
        if not self._core.is_up(rank):
            raise EngineDead(rank, f"CALL {method!r}: the rank is not up")
        call_id, pending = self._calls.open(rank, method)
        try:
            try:
                frames = encode_request(Call(call_id, method, tuple(args)))
            except ProtocolError as exc:
                raise InvalidRequest(f"CALL {method}", exc.cause) from None
            limit = self._core.health[rank].max_message_size
            if len(frames[0]) + len(frames[1]) > limit:
                raise InvalidRequest(
                    f"CALL {method}", f"larger than rank {rank} accepts ({limit} bytes)"
                )
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
            protocol_errors=c.protocol_errors,
            malformed_entries=c.malformed_entries,
            stale_messages=c.stale_messages,
            late_outputs=c.late_outputs,
            unknown_outputs=c.unknown_outputs,
            wakes=c.wakes,
            stall_wakes=c.stall_wakes,
            fallbacks=t.handshake.fallbacks + t.input.fallbacks + t.output.fallbacks,
        )

    @property
    def closed(self) -> GroupClosed | None:
        """Why the group is closed or failed, or None while it serves."""
        return self._closed

    # -- internals: streams -----------------------------------------------------------

    def _close_stream(self, stream: RequestStream) -> None:
        """A stream's `async with` ended before its request did: abort it, once."""
        ended = self._core.abort(stream.request_id, stream)
        if ended is not None:
            stream.finish(Outcome.ABORTED)
            if self._closed is None:
                self._transport.send(ended.rank, encode_request(Abort((ended.wire_id,))))

    def _end_stream(self, ended: Ended[RequestStream]) -> None:
        stream = ended.handle
        if ended.outcome is Outcome.FINISHED:
            stream.finish(Outcome.FINISHED)
        elif ended.outcome is Outcome.TRUNCATED:
            stream.finish(Outcome.TRUNCATED, StreamTruncated(ended.rank, ended.request_id))
        elif ended.outcome is Outcome.PROTOCOL_ERROR:
            stream.finish(
                ended.outcome,
                ProtocolError(
                    ended.cause or "malformed entry", rank=ended.rank, request_id=ended.request_id
                ),
            )
        else:  # FAILED: the rank died
            stream.finish(
                ended.outcome, EngineDead(ended.rank, ended.cause or "dead", ended.request_id)
            )

    # -- internals: the dispatcher ----------------------------------------------------

    async def _dispatch(self) -> None:
        zs = self._transport.output
        core = self._core
        while True:
            # Re-evaluate at least once a second: a submit can give an idle rank a
            # deadline while this task is parked.
            deadline = min(core.next_deadline(), trio.current_time() + 1.0)
            with trio.move_on_at(deadline) as timer:
                messages = await zs.receive_batch(256)
            if timer.cancelled_caught:
                self._on_timeout(trio.current_time())
                continue
            self._on_messages(messages, trio.current_time())

    def _on_messages(self, messages: list[list[bytes]], now: float) -> None:
        core = self._core
        dirty: set[RequestStream] = set()
        for frames in messages:
            rank, result = core.on_message(frames, now)
            if rank is None:
                log.warning("%s", result.error)
                continue
            fx = result.effects
            if fx is not None:
                for stream, out in fx.deliveries:
                    stream.deliver(out)
                    dirty.add(stream)
                for ended in fx.ended:
                    self._end_stream(ended)
            if result.wake is not None:
                self._wake_all(result.wake)
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
        for stream in dirty:
            stream.notify()
        clock = core.clock
        if clock is not None and clock.wave != self._wave.value:
            self._wave.value = clock.wave

    def _on_timeout(self, now: float) -> None:
        dead, wake = self._core.on_timeout(now)
        if wake is not None:
            log.warning(
                "lockstep group: a rank has waiting work and no progress; WAKE(%d) again", wake
            )
            self._wake_all(wake)
        for rank, cause in dead:
            self._rank_dead(rank, cause)

    def _wake_all(self, wave: int) -> None:
        frames = encode_request(Wake(wave))
        for rank in range(self.size):
            if self._core.health[rank].up:
                self._transport.send(rank, frames)

    def _after_flush(self) -> None:
        """Called by the input task after it sent a run of messages."""
        if self._adds_since_wake:
            self._adds_since_wake = False
            wave = self._core.wake_after_adds()
            if wave is not None:
                self._wake_all(wave)

    # -- internals: rank lifecycle ----------------------------------------------------

    def _on_rank_up(self, rank: int) -> None:
        if self._closed is not None:
            return
        state = self._transport.state
        self._core.rank_up(
            rank,
            trio.current_time(),
            epoch=state.epoch(rank),
            hello_wave=state.wave(rank),
            max_message_size=state.engine_max_message_size(rank),
        )
        self._states[rank].value = RankState.UP
        log.info("rank %d: up (epoch %s)", rank, state.epoch(rank))

    def _on_rejoin(self, rank: int) -> None:
        self._rank_dead(
            rank, "said HELLO again (rejoin): its previous incarnation is dead", rejoin=True
        )

    def _on_send_failure(self, rank: int, cause: str) -> None:
        self._rank_dead(rank, cause)

    def _rank_dead(self, rank: int, cause: str, *, rejoin: bool = False) -> None:
        if not self._core.is_up(rank):
            return
        log.error("rank %d: dead: %s", rank, cause)
        self._states[rank].value = RankState.DOWN
        if not rejoin:
            # The engine may still be alive (silent, or sending garbage): in an
            # independent group, RESYNC it until it handshakes again (§8.3), so the
            # rank can come back. Harmless if its process is gone.
            self._transport.forget(rank, resync=not self.lockstep)
        self._calls.fail_all(EngineDead(rank, cause), rank)
        if self.lockstep:
            dead = EngineDead(rank, cause)
            self._close(
                GroupClosed(f"the lockstep group failed: {dead}"), dead_rank=rank, dead_cause=cause
            )
            return
        for ended in self._core.rank_dead(rank, cause):
            self._end_stream(ended)

    def _close(
        self, reason: GroupClosed, *, dead_rank: int | None = None, dead_cause: str = ""
    ) -> None:
        if self._closed is not None:
            return
        self._closed = reason
        core = self._core
        up = [core.is_up(r) and r != dead_rank for r in range(self.size)]
        all_ended = core.fail_all(reason.cause)
        self._abort_on_engines(all_ended, up)
        for ended in all_ended:
            if ended.rank == dead_rank:
                error: BaseException = EngineDead(ended.rank, dead_cause, ended.request_id)
            else:
                error = GroupClosed(reason.cause, request_id=ended.request_id)
            ended.handle.finish(Outcome.FAILED, error)
        for rank in range(self.size):
            self._states[rank].value = RankState.DOWN
        self._calls.fail_all(GroupClosed(reason.cause))

    def _abort_on_engines(self, ended: list[Ended[RequestStream]], up: list[bool]) -> None:
        """§8.7: tell each engine that is still up to drop what it was running for us."""
        by_rank: dict[int, list[str]] = {}
        for e in ended:
            if up[e.rank]:
                by_rank.setdefault(e.rank, []).append(e.wire_id)
        for rank, wire_ids in by_rank.items():
            # Each ABORT must fit what the engine accepts (§8.4), or it drops it.
            budget = min(self._core.health[rank].max_message_size, _ABORT_BUDGET) - 16
            chunk: list[str] = []
            size = 0
            for wid in wire_ids:
                cost = len(wid.encode()) + 9  # the string and its longest CBOR head
                if chunk and size + cost > budget:
                    self._transport.send(rank, encode_request(Abort(tuple(chunk))))
                    chunk, size = [], 0
                chunk.append(wid)
                size += cost
            if chunk:
                self._transport.send(rank, encode_request(Abort(tuple(chunk))))

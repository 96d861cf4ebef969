"""`EngineGroup`: one trio client for a data-parallel group of N engines, on any wire.

Theory of operation
-------------------
Who decides, who carries out. The sans-IO `GroupCore` (`_core/state.py`) decides
everything: what a submit, an abort, an output message, a deadline, a failed send or a
rank coming up does, including a rank's death and the group's failure policy. Facts go
in; what they call for comes out as one `Effects` record (`_core/effects.py`), which
this module carries out in one place, `_apply`. The wire (native or vLLM's) is an
object the core and the transport take (`GroupDialect`): this class never asks which.

Tasks. `connect` opens the dialect's transport (natively `_sockets.py`), whose nursery runs the
handshake task (it answers HELLOs for the life of the group, so rejoins work) and the
input task (the only one that sends on the input socket), and starts **one dispatcher
task** (`_dispatch.py`), which owns the output socket and the watchdog deadline. The
transport reports what happens (a rank up, a rejoin, a failed send, a flush) as facts.

The submit path, `submit`, is synchronous and never blocks:

1. check that the group is open; the wire prepares the request (`Wire.prepare`);
2. `GroupCore.submit` validates the id and pinned rank, gives the request a fresh wire
   id (docs/protocol.md §3), encodes the ADD (any failure: `InvalidRequest`, nothing
   kept), registers it (a live duplicate id raises `DuplicateRequestId` before any
   reservation), selects and reserves a rank (pinned: `InvalidRank` if out of range or
   down), and refuses an ADD larger than that rank accepts (§1);
3. queue the ADD for the input task, which sends it; its one effect comes back from
   `GroupCore.submit` directly (the hot path);
4. lockstep groups: after the input task has sent a run of ADDs it reports a flush,
   and the core sends **one** WAKE(c) to every rank (docs/protocol.md §5);
5. hand out the `RequestStream`.

A send that fails later is reported by the input task and declares the rank dead (§6),
which ends its requests with `EngineDead`; nothing is ever silently dropped.

Streams (`stream.py`). The dispatcher delivers outputs to a per-request buffer and wakes
each consumer at most once per pass (with a stream interval, once per k outputs:
`ConnectOptions.stream_interval`, or `Request.stream_interval` for one request). A slow
consumer only grows its own buffer. Leaving a stream's `async with` early aborts the
request on its own rank, synchronously.

Failure policy (§6, decided in the core). A dead rank's requests fail with
`EngineDead(rank, cause)`. In an independent group the rank leaves selection and comes
back after a fresh handshake (RESYNCed about once a second until it says HELLO, §2.5).
In a lockstep group the whole group fails. Closing (§9) sends ABORT for every live
request to its rank (if up) before the sockets close.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar, Unpack, cast

import trio
from trio_util import AsyncValue

from ._admission import WaitQueue
from ._calls import PendingCalls
from ._carry import Carrier
from ._core.errors import (
    CallTimeout,
    GroupClosed,
    GroupDraining,
    InvalidRank,
    InvalidRequest,
)
from ._core.handshake import RankUp
from ._core.state import GroupCore
from ._core.wire import Wire
from ._dispatch import Dispatcher
from ._probes import group_health, group_statistics
from ._sockets import NATIVE
from ._transport import GroupDialect, Transport, TransportListener
from ._util import NoPublicConstructor
from .fdlimit import raise_open_files_limit
from .stream import RequestStream
from .values import (
    ConnectKeywords,
    ConnectOptions,
    EngineInfo,
    GroupHealth,
    GroupStatistics,
    RankState,
    RankStatistics,
    Request,
    WatchedValue,
    check_engines,
    connect_options,
    with_connect_options,
)

__all__ = [  # the value types too: their old home, so old imports keep working
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

R = TypeVar("R")
S = TypeVar("S")


class EngineGroup(Generic[R], metaclass=NoPublicConstructor):
    """The client of one engine group. Get one from `connect`, never by calling the
    class::

        async with EngineGroup.connect("ipc:///tmp/zmqdp-g1/g", engines=2) as group:
            async with group.submit(Request("r1", body)) as stream:
                async for out in stream:
                    ...

    `connect` binds the URL and waits (`ready_timeout`, 60 s) until every rank has
    connected and done the handshake; to try it without engines of your own, run
    ``python -m zmqdp mock --url ipc:///tmp/zmqdp-g1/g --engines 2`` in another shell.
    vLLM engine cores: `zmqdp.vllm.connect`; asyncio code: `zmqdp.aio`.

    `R` is the request type of its wire (`Request` natively, `zmqdp.vllm.VllmRequest`
    on vLLM's). What it raises: `help(zmqdp.ZmqdpError)`."""

    stream_class: type[RequestStream] = RequestStream
    """The stream class `submit` makes (`zmqdp.aio` makes its own; benchmarks switch
    it on the class)."""

    def __init__(
        self,
        transport: Transport,
        core: GroupCore[RequestStream],
        wire: Wire[R],
        options: ConnectOptions,
        stream_class: type[RequestStream] | None,
    ) -> None:
        """Private: zmqdp builds the group once its engines are connected. Use
        `EngineGroup.connect(url, engines)` (or `zmqdp.vllm.connect`); calling the class
        raises `TypeError`."""
        self._transport = transport
        self._core = core
        self._thread = threading.get_ident()
        self._token = trio.lowlevel.current_trio_token()
        self._wire = wire
        self._max_buffered = options.max_buffered
        self._max_inflight = options.max_inflight
        self._request_timeout = options.request_timeout
        if stream_class is not None:
            self.stream_class = stream_class
        self._waiters: WaitQueue[R] = WaitQueue()
        self._idle: trio.Event | None = None  # set when draining and nothing is live
        self.lockstep = core.lockstep
        self.size = core.size
        # trio-util is untyped: these are AsyncValues, shown to users as WatchedValues
        self._states: list[Any] = [AsyncValue(RankState.DOWN) for _ in range(core.size)]
        self._wave: Any = AsyncValue(core.clock.wave if core.clock is not None else None)
        self._infos: list[Mapping[str, Any]] = [{} for _ in range(core.size)]
        self._ups: list[RankUp | None] = [None] * core.size
        """Per rank: what its latest incarnation that came up said in its handshake."""
        self._calls = PendingCalls(wire.new_call_id)
        self._stream_interval = options.stream_interval
        carrier = Carrier(
            core,
            transport,
            self._calls,
            self._states,
            self._wave,
            self._waiters,
            self._after_endings,
            options.max_buffered,
            options.stream_interval,
            options.stream_max_delay,
        )
        self._carrier = carrier
        self._apply = carrier.apply
        self._dispatcher = Dispatcher(core, transport.output, self._apply, carrier.holding)

    # -- connecting -------------------------------------------------------------------

    @classmethod
    @with_connect_options
    @asynccontextmanager
    async def connect(
        cls,
        url: str,
        engines: int,
        *,
        options: ConnectOptions | None = None,
        **kwargs: Unpack[ConnectKeywords],
    ) -> AsyncIterator[EngineGroup[Request]]:
        """Bind the group URL, wait for all `engines` native engines, and serve them.

        The keyword arguments are `zmqdp.ConnectOptions`'s, each explained there (or
        pass one record as `options`); type checkers know them (`ConnectKeywords`).
        Engines that kept running after an earlier client went away are picked up
        (RESYNC, docs/protocol.md §2.5).

        Raises `HandshakeTimeout` after `ready_timeout` (60 s) without every rank: it
        names the URL, the ranks that came up, each missing one and what to do next.
        `ValueError` for options no group could use. Leaving the block sends ABORT for
        every live request, then closes every socket; live streams end with
        `GroupClosed`. An exception raised in the block passes out unchanged; errors of
        zmqdp's own tasks come out as one plain exception.

        Cancellation: cancelled while waiting for the engines, it closes everything
        and leaves nothing running.
        """
        async with EngineGroup.open(url, engines, NATIVE, options, **kwargs) as group:
            yield group

    @classmethod
    @with_connect_options
    @asynccontextmanager
    async def open(
        cls,
        url: str,
        engines: int,
        dialect: GroupDialect[S],
        options: ConnectOptions | None = None,
        *,
        stream_class: type[RequestStream] | None = None,
        **kwargs: Unpack[ConnectKeywords],
    ) -> AsyncIterator[EngineGroup[S]]:
        """`connect` on any wire: `dialect` is `zmqdp.NATIVE` or `zmqdp.vllm.dialect(...)`
        (what `zmqdp.vllm.connect` calls). `stream_class`: the streams `submit` makes.
        Cancellation as `connect`."""
        engines = check_engines(engines)
        options = connect_options(options, kwargs)
        if options.raise_fd_limit:
            raise_open_files_limit()
        listener = _Listener()
        async with dialect.open_transport(url, engines, options, listener) as transport:
            core: GroupCore[RequestStream] = GroupCore(
                engines,
                lockstep=transport.lockstep,
                silence_timeout=options.silence_timeout,
                stall_timeout=options.stall_timeout,
                wave=max((up.hello_wave or 0 for up in listener.ups.values()), default=0),
                wire=dialect.wire,
                held_limit=4 * options.max_message_size,
                recover=options.recover,
                recover_timeout=options.recover_timeout
                or options.ready_timeout
                or dialect.wire.default_ready_timeout,
                speed=options.routing == "speed",
                prefix=options.routing == "prefix",
            )
            group = cast(
                EngineGroup[S],
                EngineGroup._create(transport, core, dialect.wire, options, stream_class),
            )
            for rank in range(engines):
                group._rank_up(listener.ups[rank])
            listener.group = group
            attach = getattr(transport, "attach_prefix", None)
            if attach is not None:  # vLLM: the KV-event tasks apply to the index
                attach(core.prefix, core.kv_events)
            assert transport.nursery is not None
            transport.nursery.start_soon(group._dispatcher.run, name="zmqdp-dispatcher")
            try:
                yield group
            finally:
                group._close()

    def _check_thread(self) -> None:
        """The group's state is its thread's: a call from another thread would change it
        without waking the tasks that act on it (trio's primitives are not thread-safe)."""
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "an EngineGroup is used from another thread than the one it runs in; "
                "call it from there (e.g. with trio.from_thread.run_sync)"
            )

    # -- state ------------------------------------------------------------------------

    @property
    def engines(self) -> tuple[EngineInfo, ...]:
        """Per rank: handshake info (READY, or vLLM's ready response) and state."""
        return tuple(EngineInfo(r, self._info(r), self._states[r].value) for r in range(self.size))

    def wire_version(self, rank: int) -> str | None:
        """The protocol version spoken with the rank: on vLLM's wire ``"0.32"`` or
        ``"0.33"`` (the `vllm_version` given to connect, else its ready response's);
        natively the revision of its HELLO. That of its latest incarnation that came
        up; None while none has."""
        up = self._ups[rank]
        return None if up is None else up.version

    def _info(self, rank: int) -> dict[str, Any]:
        """The handshake info of the rank's current incarnation ({} while it is down)."""
        up = self._ups[rank]
        if up is None or self._states[rank].value is not RankState.UP:
            return {}
        return dict(up.info)

    def rank_state(self, rank: int) -> WatchedValue[RankState]:
        """The rank's state, to wait on: `await group.rank_state(1).wait_value(RankState.UP)`.
        Raises `InvalidRank` for a rank outside the group."""
        if type(rank) is not int or not 0 <= rank < self.size:
            raise InvalidRank(rank, self.size, None, f"out of range for a group of {self.size}")
        return cast(WatchedValue[RankState], self._states[rank])

    @property
    def wave(self) -> WatchedValue[int | None]:
        """Lockstep groups: the wave clock as a trio-util `AsyncValue[int]` (None for
        independent groups): `await group.wave.wait_value(lambda w: w > seen)`."""
        return cast(WatchedValue[int | None], self._wave)

    @property
    def draining(self) -> bool:
        """`drain()` was called: no new requests are taken."""
        return self._core.draining

    @property
    def closed(self) -> GroupClosed | None:
        """Why the group is closed or failed, or None while it serves. A
        `GroupRecovering` (`ConnectOptions.recover`) while a failed group waits for its
        ranks to come back: it serves again afterwards."""
        return self._core.closed

    # -- requests ---------------------------------------------------------------------

    def submit(self, request: R) -> RequestStream:
        """Send a request; return its stream (use it with `async with` at once).

        Never blocks. Raises a `SubmitRefused` or a `GroupClosed`, each before anything
        is sent or reserved: `Overloaded` (admission control: no room, see
        `wait_submit`), `GroupDraining`, `GroupClosed`, `DuplicateRequestId` (an
        `InvalidRequest`), `InvalidRank`, `NoEngineAvailable` or `InvalidRequest` (a
        bad id, timeout or pinned rank, a body with no wire form, or an ADD larger than
        the engine accepts).
        """
        self._check_thread()
        prepared = self._wire.prepare(request, self._infos, time.time())
        interval = getattr(request, "stream_interval", None)
        if interval is None:
            interval = self._stream_interval
        elif type(interval) is not int or interval < 1:
            raise InvalidRequest(
                str(prepared.id), f"stream_interval must be a positive int, got {interval!r}"
            )
        elif interval > 1:
            self._carrier.interval = interval  # (the carrier holds from now on)
        stream = self.stream_class._create(prepared.id, self._close_stream, self._max_buffered)
        timeout = prepared.timeout if prepared.timeout is not None else self._request_timeout
        now = trio.current_time()
        sub = self._core.submit(
            prepared.id, prepared.body, stream, prepared.rank, now, timeout, prepared.prefix
        )
        stream.rank = sub.rank
        stream.wire_id = sub.wire_id
        stream._interval = interval
        stream.submitted_at = now
        self._transport.send(sub.rank, sub.frames)
        if timeout is not None:
            self._dispatcher.move_deadline(now + timeout)
        return stream

    def would_admit(self, rank: int | None) -> bool:
        """Whether `submit` of a request pinned to `rank` (None: unpinned) would find
        room now with nobody waiting ahead (`wait_submit` would not wait)."""
        return not self._waiters and self._core.room_for(rank)

    async def wait_submit(self, request: R) -> RequestStream:
        """`submit`, waiting for room while admission control refuses it: waiters are
        admitted first come, first served (a plain `submit` that finds room takes it).
        Raises what `submit` raises, except `Overloaded`; `GroupDraining` if the group
        starts draining meanwhile.

        Cancellation: if cancelled while waiting, nothing was submitted. Once admitted
        the request is live and the stream is returned; enter its `async with` at once.
        """
        self._check_thread()
        await trio.lowlevel.checkpoint_if_cancelled()
        rank = getattr(request, "rank", None)
        if self.would_admit(rank):
            stream = self.submit(request)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return stream
        return await self._waiters.wait(request, rank)

    def abort_nowait(self, request_id: str) -> None:
        """`abort` without the checkpoint (synchronous code, `zmqdp.aio`)."""
        self._check_thread()
        self._core.on_abort(request_id, None)
        self._apply(self._core.take_effects())

    async def abort(self, request_id: str) -> None:
        """Abort a live request; a no-op for unknown or ended ids (idempotent). A reader
        of its stream gets `RequestAborted`.

        Cancellation: the abort is queued synchronously before the checkpoint, so it
        happens even if this call is cancelled.
        """
        self.abort_nowait(request_id)
        await trio.lowlevel.checkpoint()

    async def call(self, rank: int, method: str, *args: Any, timeout: float = 10.0) -> Any:  # noqa: ASYNC109
        """Run a utility method on one rank and return its result.

        Raises `CallTimeout` if no reply comes within `timeout` s, `CallFailed` with the
        engine's error string (or what was wrong with its reply), `EngineDead` if the
        rank is down when called (dead, rejoining, not yet back: nothing is sent) or
        dies before it answers, `InvalidRank` for a rank outside the group,
        `GroupClosed`, and `InvalidRequest` if the arguments have no wire form or the
        call is larger than the rank accepts.

        Cancellation: the reply, if it comes later, is dropped.
        """
        self._check_thread()
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        self._core.check_call(rank, method)
        call_id, pending = self._calls.open(rank, method)
        try:
            self._transport.send(rank, self._core.call_frames(rank, call_id, method, args))
            with trio.move_on_after(timeout):
                await pending.done.wait()
        finally:
            self._calls.forget(call_id)
        if not pending.done.is_set():
            raise CallTimeout(rank, method, timeout)
        return pending.result()

    async def drain(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Stop taking requests (`submit` raises `GroupDraining`, waiters too), wait until
        every live request has ended, then close the group (as leaving `connect`'s
        block does). After `timeout` seconds, the requests still live are aborted on
        their ranks and their streams raise `GroupClosed`.

        Cancellation: the group stays draining and its live requests go on; leaving
        `connect`'s block closes it.
        """
        self._check_thread()
        core = self._core
        if core.on_drain():
            log.info("draining: %d live request(s)", len(core.book))
            self._waiters.fail_all(lambda r: GroupDraining(str(getattr(r, "id", r))))
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

    # -- probes -----------------------------------------------------------------------

    def health(self) -> GroupHealth:
        """A snapshot for liveness and readiness probes."""
        return group_health(self._core)

    def statistics(self) -> GroupStatistics:
        """A frozen snapshot of per-rank state and the group's counters."""
        states = tuple(v.value for v in self._states)
        return group_statistics(
            self._core, self._transport.statistics(), states, len(self._waiters)
        )

    # -- carrying out -----------------------------------------------------------------

    def _after_endings(self) -> None:
        """Requests ended (or a rank came up): admit waiters, wake a drain."""
        if self._waiters:
            self._waiters.admit(self.submit, self._core.room_for)
        idle = self._idle
        if idle is not None and not len(self._core.book):
            idle.set()

    def _close_stream(self, stream: RequestStream) -> None:
        """A stream's `async with` ended before its request did: abort it, once."""
        if threading.get_ident() != self._thread:  # hand it to the group's thread
            # (RunFinishedError: the group's run is over, and every request with it)
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._close_stream, stream)
            return
        self._core.on_abort(stream.request_id, stream)
        self._apply(self._core.take_effects())

    def _close(self, cause: str = "the engine group was closed") -> None:
        self._core.on_close(cause)
        self._apply(self._core.take_effects())

    # -- the transport's facts --------------------------------------------------------

    def _rank_up(self, up: RankUp) -> None:
        self._ups[up.rank] = up
        self._infos[up.rank] = up.info
        self._core.on_rank_up(up, trio.current_time(), cap=self._max_inflight)
        self._apply(self._core.take_effects())

    def _connection_lost(
        self, rank: int, incarnation: int | None, cause: str, grace: float
    ) -> None:
        """Judged by the core once what is queued before it has been read (`Dispatcher`)."""
        now = trio.current_time()
        self._core.on_connection_lost(rank, incarnation, cause, now, grace)
        self._dispatcher.move_deadline(now + grace)

    def _rank_dead(self, rank: int, cause: str, *, rejoin: bool = False) -> None:
        self._core.on_rank_dead(rank, cause, rejoin=rejoin)
        self._apply(self._core.take_effects())

    def _flushed(self) -> None:
        self._core.on_flushed()
        self._apply(self._core.take_effects())


class _Listener(TransportListener):
    """Passes the transport's reports to the group once it exists (before that, during
    the initial handshake, there is nothing to tell: the group starts from the ready
    handshake state)."""

    group: EngineGroup[Any] | None = None

    def __init__(self) -> None:
        self.ups: dict[int, RankUp] = {}
        """Each rank's latest rank-up of the initial handshake (the group starts there)."""

    def rank_up(self, up: RankUp) -> None:
        if self.group is not None:
            self.group._rank_up(up)
        else:
            self.ups[up.rank] = up

    def rejoin(self, rank: int) -> None:
        if self.group is not None:
            self.group._rank_dead(
                rank, "said HELLO again (rejoin): its previous incarnation is dead", rejoin=True
            )

    def send_failed(self, rank: int, cause: str) -> None:
        if self.group is not None:
            self.group._rank_dead(rank, cause)

    def connection_lost(
        self, rank: int, incarnation: int | None, cause: str, grace: float = 0.0
    ) -> bool:
        if self.group is None:
            return False  # the transport's handshake starts over
        self.group._connection_lost(rank, incarnation, cause, grace)
        return True

    def flushed(self) -> None:
        if self.group is not None:
            self.group._flushed()

    def output_stray_closed(self) -> None:
        if self.group is not None:
            self.group._core.on_output_stray_closed()

    def displaced(self, rank: int, cause: str) -> None:
        if self.group is not None:
            self.group._rank_dead(rank, cause)

"""The exact mode of prefix affinity on vLLM's wire: each rank's KV events, read and
applied to the group's prefix index (issue 36; the facts in docs/kv-events.md).

Theory of operation
-------------------
A vLLM engine started with ``--kv-events-config`` names, in its ready response's
``kv_events_config``, a PUB socket (and optionally a replay ROUTER) where it publishes
the blocks its prefix cache stores and evicts. With ``routing="prefix"`` and
``kv_events=True``, `KvEvents` (one per group, owned by the vLLM transport) follows
every rank whose ready response enables them: one task per rank incarnation, which
alone owns that rank's SUB (subscribed to the config's topic) and replay DEALER, and a
`zmqdp._core.kv_events.KvEventFeed` that turns frames into `Stored` / `Removed` /
`Dropped` / `AskReplay`. The task applies them to the group's `PrefixIndex` with the
incarnation it read when it started (`store`, `remove`, `drop`, and `hold` while a
replay is under way), so that anything a dead incarnation's task still applies is
ignored by the index. It marks the rank `set_exact` (its approximate inserts become
short-lived predictions: an engine reports blocks only after their prefill).

Where to connect: the config's endpoints are the engine's own, already offset by its
rank; a wildcard host (``tcp://*:P``) is replaced by the engine's address as this
client sees it, the peer address of the input connection its ready response came on
(``tcp://*:0`` with ``VLLM_HOST_IP`` on the engine gives a concrete address anyway).
Only ``tcp://`` and ``ipc://`` endpoints are followed.

A rank's death or replacement cancels its task (sockets closed, LINGER 0): the core
forgets the rank's index, and the next incarnation's ready response starts a new task
with a new feed (a restarted engine counts seq from 0 with an empty cache). A feed that
starts late (the PUB drops what was published before the SUB joined) replays from seq
0 when the engine has a replay socket, and otherwise starts from what it gets.

Nothing an engine sends can crash the group or grow memory without bound: a message
over `MAX_MESSAGE` bytes ends the SUB's connection (libzmq's MAXMSGSIZE; it reconnects,
and the gap is replayed or the rank's index dropped), each socket queues at most
`RCVHWM` messages, the feed counts junk and caps what one batch and its map can hold,
the index caps a rank's blocks and the group's, and an unexpected error ends only that
rank's task (logged; the rank's index dropped). A task yields after `BATCH` messages
or `YIELD_BLOCKS` blocks, so an engine that floods its events holds the group's event
loop for one message's blocks at a time at most (a batch is capped at 4096). Logs of
what engines cause are rate-limited.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket as _socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

import trio
import zmq

from .._core.kv_events import (
    AskReplay,
    Dropped,
    KvEvent,
    KvEventCounters,
    KvEventFeed,
    Removed,
    Stored,
    event_endpoints,
    replay_request,
)
from .._util import LogLimiter
from .._zmq import ZSocket

__all__ = [
    "BATCH",
    "MAX_MESSAGE",
    "RCVHWM",
    "YIELD_BLOCKS",
    "ExactIndex",
    "KvEvents",
    "peer_host",
]

log = logging.getLogger("zmqdp.vllm.kv_events")

MAX_MESSAGE = 1 << 20
"""The SUB's and DEALER's MAXMSGSIZE. A real batch is a few KB to a few hundred (one
engine step's blocks); libzmq ends the connection of a peer that sends more (the SUB
reconnects: a gap)."""
RCVHWM = 1000
"""Messages a rank's SUB (and DEALER) queues while its task is busy (libzmq drops past
it: a gap): with `MAX_MESSAGE`, at most about 1 GiB per socket whatever an engine
sends, as the output socket's bound (`_transport.output_hwm`)."""
BATCH = 64
"""Messages a task reads before it yields to the rest of the group."""
YIELD_BLOCKS = 1024
"""Blocks (about 4 ms of hashing) a task applies before it yields."""
MAX_KNOWN_BLOCKS = 1 << 20
"""The most engine block hashes one feed remembers (at most twice the rank's
``num_gpu_blocks`` too)."""


class ExactIndex(Protocol):
    """What the KV tasks use of `zmqdp._core.prefix.PrefixIndex` (its exact mode)."""

    def incarnation(self, rank: int) -> int:
        """The rank's current incarnation (calls naming another are ignored)."""
        ...

    def store(self, rank: int, keys: list[int], incarnation: int) -> None:
        """The engine holds these blocks (BlockStored, our keys)."""
        ...

    def remove(self, rank: int, keys: list[int], incarnation: int) -> None:
        """The engine evicted these blocks (BlockRemoved)."""
        ...

    def drop(self, rank: int, incarnation: int) -> None:
        """Forget every block of the rank (AllBlocksCleared, or the feed lost track)."""
        ...

    def hold(self, rank: int, held: bool, incarnation: int) -> None:
        """While held (a replay under way), the rank counts as caching nothing."""
        ...

    def set_exact(self, rank: int, on: bool, incarnation: int) -> None:
        """The rank's events are live (or no longer are)."""
        ...


def peer_host(fd: int) -> str | None:
    """The IP address of the TCP peer on `fd` (None: not a TCP socket, or closed)."""
    try:
        sock = _socket.socket(fileno=_socket.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (_socket.AF_INET, _socket.AF_INET6):
            return None
        host = sock.getpeername()[0]
        return host if isinstance(host, str) and host else None
    except OSError:
        return None
    finally:
        sock.close()


def _followable(endpoint: str) -> bool:
    return endpoint.startswith(("tcp://", "ipc://")) and len(endpoint) < 1024


@dataclass
class _Follow:
    """One rank incarnation's task."""

    scope: trio.CancelScope
    feed: KvEventFeed | None = None


class KvEvents:
    """The KV-event tasks of one vLLM group (module docstring). The transport calls
    `rank_up` and `rank_down`; the group calls `attach` once its core exists (the
    tasks wait for it: what they read meanwhile stays queued in libzmq)."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        *,
        enabled: bool,
        replay_timeout: float = 2.0,
    ) -> None:
        self.context = context
        self.enabled = enabled
        self.replay_timeout = replay_timeout
        """Seconds a replay may take before the rank's index is dropped instead."""
        """routing="prefix" and kv_events=True: follow the ranks that publish."""
        self.index: ExactIndex | None = None
        self._attached = trio.Event()
        self._follows: dict[int, _Follow] = {}
        self._done = KvEventCounters()  # the feeds that ended
        self._logs = LogLimiter(log)
        self.followed = 0
        """Rank incarnations whose events were followed."""
        self.applied = 0
        """Feed results applied to the index."""
        self._changed = trio.Event()
        self._totals: dict[str, int] | None = None
        self._held: dict[int, bool] = {}  # per rank: `hold` in force

    def attach(self, index: ExactIndex | None, totals: dict[str, int] | None = None) -> None:
        """The group's prefix index (None: the group does not route by prefix, and no
        task ever starts), and where to keep the feeds' counters, summed
        (`GroupCore.kv_events`)."""
        self.index = index
        self._totals = totals
        if index is None:
            self.enabled = False
            for rank in list(self._follows):
                self.rank_down(rank)
        self._attached.set()

    def following(self, rank: int) -> bool:
        """A task follows `rank`'s events."""
        return rank in self._follows

    def live(self, rank: int) -> bool:
        """`rank`'s events are followed and applied as they come (no replay under way)."""
        follow = self._follows.get(rank)
        return follow is not None and follow.feed is not None and not follow.feed.replaying

    def rank_up(
        self, nursery: trio.Nursery, rank: int, info: Mapping[str, Any], host: str | None
    ) -> bool:
        """A new incarnation of `rank` is up with ready response `info`: follow its events
        if it publishes them (returns whether a task started). `host`: the engine's
        address as this client sees it, for a wildcard endpoint."""
        self.rank_down(rank)
        if not self.enabled:
            return False
        ends = event_endpoints(info.get("kv_events_config"), host or "127.0.0.1")
        if ends is None:
            return False
        pub, replay = ends
        if not _followable(pub) or (replay is not None and not _followable(replay)):
            self._logs.log(
                logging.WARNING,
                "endpoint",
                "rank %d: KV events at %.200r (replay %.200r): not a tcp:// or ipc:// "
                "endpoint, not followed",
                rank,
                pub,
                replay,
            )
            return False
        config = info["kv_events_config"]
        topic = config.get("topic", "")
        block = info.get("block_size")
        blocks = info.get("num_gpu_blocks")
        known = MAX_KNOWN_BLOCKS
        if type(blocks) is int and blocks > 0:
            known = max(1024, min(known, 2 * blocks))
        dp_rank = info.get("data_parallel_rank")
        follow = _Follow(trio.CancelScope())
        self._follows[rank] = follow
        self.followed += 1
        nursery.start_soon(
            self._follow,
            follow,
            rank,
            pub,
            replay,
            topic.encode() if isinstance(topic, str) else b"",
            dict(
                block_size=block if type(block) is int and block > 0 else None,
                dp_rank=dp_rank if type(dp_rank) is int else rank,
                replay=replay is not None,
                max_known_blocks=known,
                replay_timeout=self.replay_timeout,
            ),
            name=f"zmqdp-vllm-kv-events-{rank}",
        )
        return True

    def rank_down(self, rank: int) -> None:
        """`rank`'s incarnation is dead (or replaced): its task ends, its sockets close."""
        follow = self._follows.pop(rank, None)
        if follow is not None:
            follow.scope.cancel()

    def close(self) -> None:
        """End every task (their sockets close as they end)."""
        for rank in list(self._follows):
            self.rank_down(rank)

    def counters(self) -> KvEventCounters:
        """Every feed's counters, summed (`last_junk`: the latest feed's that has one)."""
        total = KvEventCounters(**{f.name: getattr(self._done, f.name) for f in fields(self._done)})
        for follow in self._follows.values():
            if follow.feed is not None:
                _add(total, follow.feed.counters)
        return total

    def _publish_counters(self) -> None:
        totals = self._totals
        if totals is not None:
            counters = self.counters()
            for f in fields(counters):
                value = getattr(counters, f.name)
                if type(value) is int:
                    totals[f.name] = value

    async def wait(self, predicate: Callable[[], bool]) -> None:
        """Until `predicate()` holds, checked after every round a task applied something
        (tests)."""
        while not predicate():
            self._changed = trio.Event()
            await self._changed.wait()

    # -- one rank incarnation ----------------------------------------------------------

    async def _follow(
        self,
        follow: _Follow,
        rank: int,
        pub: str,
        replay: str | None,
        topic: bytes,
        settings: dict[str, Any],
    ) -> None:
        sockets: list[ZSocket] = []
        incarnation: int | None = None
        index: ExactIndex | None = None
        with follow.scope:
            try:
                sub = self._socket(zmq.SUB, pub, sockets)
                sub.sock.setsockopt(zmq.SUBSCRIBE, topic)
                dealer = None if replay is None else self._socket(zmq.DEALER, replay, sockets)
                await self._attached.wait()
                index = self.index
                if index is None:
                    return
                incarnation = index.incarnation(rank)
                feed = follow.feed = KvEventFeed(rank, **settings)
                index.set_exact(rank, True, incarnation)
                if dealer is not None:  # what was published before the SUB joined
                    for event in feed.start(trio.current_time()):
                        self._apply(rank, event, index, incarnation, dealer)
                    index.hold(rank, feed.replaying, incarnation)
                log.info("rank %d: following its KV events at %s (replay %s)", rank, pub, replay)
                await self._serve(rank, feed, index, incarnation, sub, dealer)
            except (zmq.ZMQError, ValueError) as exc:
                self._logs.log(
                    logging.WARNING,
                    "socket",
                    "rank %d: KV events at %.200s: %s; the rank is routed without them",
                    rank,
                    pub,
                    exc,
                )
            except Exception:  # nothing a rank sends may end the group
                log.exception("rank %d: the KV-event task failed; its index is dropped", rank)
            finally:
                for zs in reversed(sockets):
                    zs.close()
                if follow.feed is not None:
                    _add(self._done, follow.feed.counters)
                    follow.feed = None
                    self._publish_counters()
                if index is not None and incarnation is not None:
                    index.hold(rank, False, incarnation)
                    index.drop(rank, incarnation)
                    index.set_exact(rank, False, incarnation)
                if self._follows.get(rank) is follow:
                    del self._follows[rank]

    def _socket(self, kind: int, address: str, sockets: list[ZSocket]) -> ZSocket:
        sock = self.context.socket(kind)
        zs = ZSocket(sock)
        sockets.append(zs)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        if address.startswith("tcp://[") or address.count(":") > 2:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(address)
        return zs

    async def _serve(
        self,
        rank: int,
        feed: KvEventFeed,
        index: ExactIndex,
        incarnation: int,
        sub: ZSocket,
        dealer: ZSocket | None,
    ) -> None:
        """Read the rank's SUB (and replay DEALER) forever, applying what they say,
        yielding after every `YIELD_BLOCKS` blocks and every `BATCH` messages."""
        also = [] if dealer is None else [dealer]
        self._held[rank] = feed.replaying
        while True:
            deadline = feed.deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await sub.wait_readable_or_kicked(also)
            self._round(rank, feed, index, incarnation, dealer, feed.tick(trio.current_time()))
            blocks = 0
            messages = [(True, frames) for frames in sub.receive_nowait(BATCH)]
            if dealer is not None:
                messages += [(False, frames) for frames in dealer.receive_nowait(BATCH)]
            for live, frames in messages:
                now = trio.current_time()
                if live:
                    events = feed.feed(frames, now)
                elif frames and frames[0] == b"":
                    events = feed.replayed(frames[1:], now)
                else:
                    feed.counters.junk += 1
                    continue
                blocks += self._round(rank, feed, index, incarnation, dealer, events)
                if blocks >= YIELD_BLOCKS:
                    blocks = 0
                    await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()  # a flood yields once per batch at least

    def _round(
        self,
        rank: int,
        feed: KvEventFeed,
        index: ExactIndex,
        incarnation: int,
        dealer: ZSocket | None,
        events: list[KvEvent],
    ) -> int:
        """Apply `events` and the feed's replay state (a replaying rank is held at once:
        its index may hold blocks evicted in the missing range). Returns the blocks
        they named."""
        blocks = 0
        for event in events:
            self._apply(rank, event, index, incarnation, dealer)
            if isinstance(event, Stored | Removed):
                blocks += len(event.keys)
        changed = bool(events)
        if feed.replaying != self._held.get(rank, False):
            self._held[rank] = feed.replaying
            index.hold(rank, feed.replaying, incarnation)
            changed = True
        if changed:
            self.applied += len(events)
            self._publish_counters()
            self._changed.set()
        return blocks

    def _apply(
        self,
        rank: int,
        event: KvEvent,
        index: ExactIndex,
        incarnation: int,
        dealer: ZSocket | None,
    ) -> None:
        if isinstance(event, Stored):
            index.store(rank, event.keys, incarnation)
        elif isinstance(event, Removed):
            index.remove(rank, event.keys, incarnation)
        elif isinstance(event, Dropped):
            index.drop(rank, incarnation)
            self._logs.log(
                logging.WARNING, "dropped", "%s: the rank's prefix index is dropped", event.reason
            )
        elif isinstance(event, AskReplay) and dealer is not None:
            # A full queue (or a peer not yet connected) loses it: the feed's replay
            # timeout then drops the rank's index, which is always safe.
            with contextlib.suppress(zmq.ZMQError):
                dealer.send_nowait(replay_request(event.start_seq))


def _add(total: KvEventCounters, more: KvEventCounters) -> None:
    for f in fields(total):
        if f.name == "last_junk":
            if more.last_junk:
                total.last_junk = more.last_junk
        else:
            setattr(total, f.name, getattr(total, f.name) + getattr(more, f.name))

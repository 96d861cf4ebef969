"""The snapshots of `EngineGroup.health()` and `EngineGroup.statistics()`, read off the
core and the transport: plain reads, no decisions, no I/O."""

from __future__ import annotations

from typing import Any, cast

from ._core.state import GroupCore
from ._transport import TransportStatistics
from .values import GroupHealth, GroupStatistics, PrefixStatistics, RankState, RankStatistics

__all__ = ["group_health", "group_statistics"]


def group_health(core: GroupCore[Any]) -> GroupHealth:
    """What a liveness and a readiness probe ask."""
    up = [r for r in range(core.size) if core.is_up(r)]
    live = core.closed is None or core.recovering  # recovering: do not restart the host
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
        ready=core.closed is None and not core.draining and bool(up),
        draining=core.draining,
        ranks_up=len(up),
        size=core.size,
        inflight=len(core.book),
        room=room,
        recovering=core.recovering,
    )


def group_statistics(
    core: GroupCore[Any],
    t: TransportStatistics,
    states: tuple[RankState, ...],
    waiting: int,
) -> GroupStatistics:
    """Per-rank state and the group's counters since connect."""
    c = core.counters
    return GroupStatistics(
        ranks=tuple(
            RankStatistics(
                rank=r,
                state=states[r],
                inflight=core.routing.inflight_count(r),
                load=core.routing.load(r),
                batches=core.health[r].batches,
                protocol_errors=core.health[r].protocol_errors,
                queued=t.queued[r],
                cap=core.routing.cap(r),
                ttft=core.ttft[r].snapshot(),
                latency=core.latency[r].snapshot(),
            )
            for r in range(core.size)
        ),
        lockstep=core.lockstep,
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
        waiting=waiting,
        protocol_errors=c.protocol_errors,
        malformed_entries=c.malformed_entries,
        stale_messages=c.stale_messages + t.stale_messages,
        late_outputs=c.late_outputs,
        unknown_outputs=c.unknown_outputs,
        wakes=core.wake_rounds,
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
        connections_lost=t.connections_lost,
        routes_restored=t.routes_restored,
        prefix=prefix_statistics(core),
    )


def prefix_statistics(core: GroupCore[Any]) -> PrefixStatistics | None:
    """Prefix affinity's counters and the index's size (None: ``routing`` is not
    "prefix")."""
    index = core.prefix
    if index is None:
        return None
    routing = core.routing
    return PrefixStatistics(
        routed=routing.prefix_routed,
        hits=routing.prefix_hits,
        cached_tokens=routing.prefix_cached_tokens,
        prompt_tokens=routing.prefix_prompt_tokens,
        blocks=index.total,
        rank_blocks=tuple(index.blocks(r) for r in range(core.size)),
        exact_ranks=tuple(r for r in range(core.size) if index.is_exact(r)),
        kv_events=dict(core.kv_events),
    )

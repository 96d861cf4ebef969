"""The wiped-replacement replay of issue 33 (part 2), on real transports without their
tasks: an engine is restarted while the old one is stopped, and the core's judgement of
the old incarnation's death must not wipe the handshake of the replacement already under
way. (On 362b651 the core's forget named no incarnation, and wiped it.)

The replay drives only calls that exist since 362b651 (the handshake state machines'
events, the transport's `forget`, the core's facts), through `_up` and `_apply_forgets`,
so that it runs on that commit too."""

from __future__ import annotations

import inspect
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zmqdp._core.handshake import RankPhase, rank_identity
from zmqdp._core.messages import Hello
from zmqdp._core.state import GroupCore
from zmqdp._transport import TransportListener
from zmqdp.values import ConnectOptions
from zmqdp.vllm.sockets import VllmTransport

try:
    from zmqdp._sockets import GroupTransport
except ImportError:  # before the split of _transport.py (362b651, e109aa5)
    from zmqdp._transport import GroupTransport  # type: ignore[attr-defined,no-redef]

ME = rank_identity(0)


@pytest.fixture
def where() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="zmqdp-replay-") as d:
        yield f"ipc://{Path(d) / 'g'}"


def _up(core: GroupCore[Any], transport: Any, rank: int) -> None:
    """The client's `_rank_up`, on any commit."""
    params = inspect.signature(core.on_rank_up).parameters
    if "up" in params:  # the rank-up record
        core.on_rank_up(transport.state.rank_up(rank), 0.0, cap=None)
    else:
        core.on_rank_up(rank, 0.0, epoch=transport.state.epoch(rank))


def _apply_forgets(core: GroupCore[Any], transport: Any) -> int:
    """Carry out the core's forget effects as the client does; return how many."""
    forgets = core.take_effects().forgets
    for rank, resync, *epoch in forgets:
        if epoch:
            transport.forget(rank, resync=resync, epoch=epoch[0])
        else:
            transport.forget(rank, resync=resync)
    return len(forgets)


def test_vllm_a_judged_death_keeps_the_replacements_handshake(where: str) -> None:
    if "options" in inspect.signature(VllmTransport).parameters:  # since the split
        transport = VllmTransport(where, 1, ConnectOptions(), lockstep=False)
    else:
        transport = VllmTransport(where, 1, lockstep=False)
    try:
        hs = transport.state
        core: GroupCore[Any] = GroupCore(1, lockstep=False)
        hs.on_hello(ME, {"status": "HELLO"})
        hs.on_ready_response(ME, {"vllm_version": "0.33.0"})
        assert hs.on_ready(ME, {"status": "READY"}) == 0  # first up
        _up(core, transport, 0)
        assert hs.on_hello(ME, {"status": "HELLO"}).rejoin  # the replacement: its INIT
        # The old incarnation's death, reported before that HELLO, is judged now.
        core.on_rank_dead(0, "its connection closed")
        assert _apply_forgets(core, transport) == 1  # the core says forget
        assert hs.awaits_response(ME) == 0, "the core's forget wiped the replacement"
        hs.on_ready_response(ME, {"vllm_version": "0.33.0"})
        assert hs.on_ready(ME, {"status": "READY"}) == 0  # its READY makes it up
    finally:
        transport.close() if hasattr(transport, "close") else transport._close_sockets()


def test_native_a_judged_death_keeps_the_replacements_handshake(where: str) -> None:
    transport = GroupTransport(where, 1)
    try:
        hs = transport.state
        core: GroupCore[Any] = GroupCore(1, lockstep=False)
        hello = Hello(rank=0, size=1, lockstep=False)
        hs.on_hello(ME, hello)
        hs.on_ready(ME, {})
        assert hs.on_register(ME, hs.epoch(0))  # first up
        _up(core, transport, 0)
        first = hs.epoch(0)
        verdict = hs.on_hello(ME, hello)  # the replacement: its INIT
        assert verdict.rejoin and hs.epoch(0) != first
        core.on_rank_dead(0, "its connection closed")
        assert _apply_forgets(core, transport) == 1  # the core says forget
        assert hs.phase(0) is RankPhase.INIT_SENT, "the core's forget wiped the replacement"
        assert hs.resync_due(1.0) == []  # no RESYNC to make it start over
        hs.on_ready(ME, {})
        assert hs.on_register(ME, hs.epoch(0))  # it comes up
    finally:
        transport.close()


class Judge(TransportListener):
    """A group that judges: records what the transport reports."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, int | None, str, float]] = []

    def connection_lost(
        self, rank: int, incarnation: int | None, cause: str, grace: float = 0.0
    ) -> bool:
        self.reports.append((rank, incarnation, cause, grace))
        return True


@pytest.mark.parametrize("judged", [True, False], ids=["a-group-judges", "at-start-up"])
def test_the_transport_reports_a_closed_connection_and_decides_nothing(
    where: str, judged: bool
) -> None:
    judge = Judge()
    transport = GroupTransport(where, 1, listener=judge if judged else None)
    try:
        hs = transport.state
        hs.on_hello(ME, Hello(rank=0, size=1, lockstep=False))
        epoch = hs.epoch(0)
        transport._connection_lost(0, epoch)  # its claimed connection closed
        if judged:
            [(rank, incarnation, cause, grace)] = judge.reports
            assert (rank, incarnation, grace) == (0, epoch, 0.0) and "closed" in cause
            assert hs.phase(0) is RankPhase.INIT_SENT  # the core will judge, not this
        else:  # no group yet: that handshake starts over
            assert hs.phase(0) is RankPhase.MISSING
    finally:
        transport.close()

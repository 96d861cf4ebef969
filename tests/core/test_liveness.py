"""`_core/liveness.ConnectionWatch`: examples, then the state machine of
tests/models/liveness.py."""

from __future__ import annotations

from hypothesis import settings

from tests.models.liveness import ConnectionMachine
from zmqdp._core.liveness import ConnectionWatch

TestConnections = ConnectionMachine.TestCase
TestConnections.settings = settings(settings.default, stateful_step_count=60)


def test_the_close_of_a_claimed_connection_is_its_ranks_death() -> None:
    watch = ConnectionWatch()
    watch.accepted(7)
    watch.claim(7, 1)
    assert watch.connections(1) == {7}
    assert watch.disconnected(7) == 1
    assert watch.connections(1) == set() and len(watch) == 0


def test_a_predecessors_late_close_kills_nobody() -> None:
    """A restarted engine's HELLO claims its new connection while its predecessor's
    lingers; the predecessor's close, when it comes, is not the new one's death."""
    watch = ConnectionWatch()
    watch.accepted(7)
    watch.claim(7, 0)
    watch.accepted(8)
    watch.claim(8, 0)
    assert watch.disconnected(7) is None
    assert watch.disconnected(8) == 0


def test_strangers_and_released_ranks_are_no_deaths() -> None:
    watch = ConnectionWatch()
    watch.accepted(5)  # a port scanner: never claimed
    assert watch.disconnected(5) is None
    watch.accepted(6, rank=2)  # vLLM: the rank's own socket, after its HELLO
    watch.release(2)  # declared dead for another reason (ENGINE_CORE_DEAD)
    assert watch.disconnected(6) is None


def test_a_reused_fd_is_the_new_connections() -> None:
    watch = ConnectionWatch()
    watch.accepted(9, rank=0)
    assert watch.disconnected(9) == 0
    watch.accepted(9)  # the OS reuses the number for a stranger
    assert watch.disconnected(9) is None


def test_a_rank_dies_with_its_last_connection_not_a_strays() -> None:
    """vLLM: a MoE engine opens two connections to its output socket; a port probe may
    open a third. Only when all the rank's connections are gone is the engine."""
    watch = ConnectionWatch()
    for fd in (4, 5, 6):
        watch.accepted(fd, rank=0)
    assert watch.disconnected(6) is None  # the probe
    assert watch.disconnected(4) is None
    assert watch.disconnected(5) == 0

"""Deaths by closed connections on both wires (tests/models/deaths.py): the real
handshake state machines and core hold the machine's invariants, and a forget that
ignores the incarnation it names (it wipes a replacement's handshake) is caught."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from tests.core.test_mutants import HUNT
from tests.models.deaths import ForgetsAnyIncarnation, VllmForgetsAnyIncarnation, machine
from zmqdp._core.handshake import RankUp
from zmqdp._core.state import GroupCore


@pytest.mark.parametrize("wire", ["native", "vllm"])
def test_deaths_are_decided_once_and_never_wipe_a_replacement(wire: str) -> None:
    run_state_machine_as_test(
        machine(wire), settings=settings(max_examples=300, stateful_step_count=40, deadline=None)
    )


@pytest.mark.parametrize(
    ("wire", "mutant"),
    [("native", ForgetsAnyIncarnation), ("vllm", VllmForgetsAnyIncarnation)],
)
def test_a_forget_that_wipes_a_replacement_is_caught(wire: str, mutant: type) -> None:
    with pytest.raises(AssertionError, match="wiped"):
        run_state_machine_as_test(machine(wire, mutant), settings=HUNT)


# -- the core's judgement of a reported loss, rule by rule -------------------------------


def up_core(epoch: int = 7) -> GroupCore[Any]:
    core: GroupCore[Any] = GroupCore(2, lockstep=False)
    core.on_rank_up(RankUp(0, epoch), 0.0)
    core.on_rank_up(RankUp(1, 40), 0.0)
    core.take_effects()
    return core


def test_a_loss_is_judged_at_its_deadline_once() -> None:
    core = up_core()
    core.on_connection_lost(0, 7, "its connection closed", 1.0, grace=0.1)
    assert core.next_deadline() == 1.1 and core.is_up(0)  # nothing decided on report
    core.on_connection_lost(0, 7, "its output connection closed", 1.05)  # no grace
    core.on_deadline(1.05)
    fx = core.take_effects()
    assert not core.is_up(0) and fx.forgets == [(0, True, 7)]
    assert [m for _, _, m in fx.logs] == ["rank 0: dead: its output connection closed"]
    core.on_deadline(1.1)  # the first report: that incarnation's death is judged
    fx = core.take_effects()
    assert not fx.forgets and not fx.logs and core.next_deadline() == math.inf


def test_a_loss_of_an_incarnation_that_never_came_up_forgets_it_by_name() -> None:
    core = up_core()
    core.on_connection_lost(0, 8, "its connection closed", 1.0)  # a handshake under way
    core.on_deadline(1.0)
    fx = core.take_effects()
    assert core.is_up(0) and fx.forgets == [(0, True, 8)]  # 7 lives; 8 starts over


def test_a_new_incarnation_up_before_the_judgement_ends_the_old_with_its_cause() -> None:
    core = up_core()
    core.on_connection_lost(0, 7, "the engine process exited", 1.0, grace=0.1)
    core.on_rank_up(RankUp(0, 8), 1.05)
    fx = core.take_effects()
    assert core.is_up(0) and core.health[0].epoch == 8 and not fx.forgets
    assert "rank 0: dead: the engine process exited" in [m for _, _, m in fx.logs]
    core.on_deadline(1.1)  # the report names 7: the transport keeps 8's handshake
    assert core.is_up(0) and core.take_effects().forgets == [(0, True, 7)]


def test_an_incarnation_whose_connection_closed_before_its_ready_never_comes_up() -> None:
    """Its close is read before its READY (the monitor first): it must not serve, take
    waiters or end a recovery for one pass (review of issue 33)."""
    core = up_core()
    core.on_rank_dead(0, "killed")
    core.take_effects()
    core.on_connection_lost(0, 8, "its connection closed", 1.0)
    core.on_rank_up(RankUp(0, 8), 1.0)
    fx = core.take_effects()
    assert not core.is_up(0) and not fx.ranks
    core.on_deadline(1.0)
    assert not core.is_up(0) and core.take_effects().forgets == [(0, True, 8)]


def test_a_closed_group_does_not_resync_a_restarted_engine() -> None:
    core = up_core()
    core.on_close("closed by the user")
    core.take_effects()
    core.on_connection_lost(0, 9, "its connection closed", 1.0)  # a restart said HELLO
    core.on_deadline(1.0)
    assert core.take_effects().forgets == [(0, False, 9)]

"""Each deliberately broken variant of the core (tests/models/mutants.py) must be caught.

This proves the property tests can fail: a state machine or search that passes for the
real core and for a broken one checks nothing. Runs are derandomized so the verdict does
not depend on the seed; the counterexample is printed by Hypothesis or in the message.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from tests.models import mutants
from tests.models.lifecycle import RetirementMachine
from tests.models.liveness import ConnectionMachine
from tests.models.long_batches import check_long_batches
from tests.models.outbox import OutboxMachine
from tests.models.waves import Config, WaveMachine, search

HUNT = settings(
    max_examples=2000,
    derandomize=True,
    database=None,
    deadline=None,
    report_multiple_bugs=False,
    # Catching is the point, not the smallest counterexample: shrinking a state machine
    # run costs minutes. `HYPOTHESIS_SHRINK_MUTANTS=1` shrinks, to study a failure.
    phases=(
        (Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink)
        if os.environ.get("HYPOTHESIS_SHRINK_MUTANTS")
        else (Phase.explicit, Phase.reuse, Phase.generate)
    ),
)


def _caught_by_machine(base: type[RuleBasedStateMachine], **swap: Any) -> str:
    machine = type(f"{base.__name__}With{next(iter(swap.values())).__name__}", (base,), swap)
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(machine, settings=HUNT)
    return str(info.value)


LIFECYCLE_MUTANTS = {
    # a batch of a dead incarnation is applied to the new one (its load, or its `dead`)
    mutants.IgnoresEpoch: ("stale batch", "a batch of a dead incarnation"),
    # a late output of an aborted request reaches its successor with the same id, or
    # the engine gets an ADD for an id it still holds
    mutants.ReusesWireIds: ("expected", "reused wire id"),
    # one bad entry kills the rank instead of ending only the request it names
    mutants.DropsBatchOnBadEntry: ("with only entry errors",),
    # an ADD larger than the rank accepts is sent
    mutants.NoSizeCheck: ("which accepts",),
    # a rank takes a request past its in-flight cap
    mutants.IgnoresCaps: ("in-flight cap",),
    # a request whose deadline passed stays live
    mutants.IgnoresDeadlines: ("due",),
}


@pytest.mark.parametrize("core", LIFECYCLE_MUTANTS, ids=lambda c: c.__name__)
def test_retirement_machine_catches(core: type[Any]) -> None:
    message = _caught_by_machine(RetirementMachine, core_cls=core)
    assert any(expected in message for expected in LIFECYCLE_MUTANTS[core]), message


SLICE_MUTANTS = {
    # the rest of a long batch is applied after its incarnation died
    mutants.ContinuesStaleBatch: ("its rank died", "a dead incarnation's `dead` applied"),
    # an entry at a slice boundary of a long batch is lost
    mutants.LosesSliceBoundaries: ("expected",),
    # a message that came behind a long batch is applied before the batch's end
    mutants.AppliesHeldAtOnce: ("expected",),
    # the bytes held behind a long batch are never counted against held_limit
    mutants.UncountedHeld: ("past held_limit",),
}


@pytest.mark.parametrize("core", SLICE_MUTANTS, ids=lambda c: c.__name__)
def test_long_batch_property_catches(core: type[Any]) -> None:
    with pytest.raises(AssertionError) as info:
        check_long_batches(core, HUNT)()
    message = str(info.value)
    assert any(expected in message for expected in SLICE_MUTANTS[core]), message


def test_outbox_machine_catches_head_of_line_blocking() -> None:
    message = _caught_by_machine(OutboxMachine, outbox_cls=mutants.HeadOfLineOutbox)
    assert "held back by another rank" in message


@pytest.mark.parametrize(
    "watch",
    [mutants.StaleCloseKills, mutants.AnyCloseKills, mutants.ReleaseForgotten],
    ids=lambda c: c.__name__,
)
def test_connection_machine_catches(watch: type[Any]) -> None:
    message = _caught_by_machine(ConnectionMachine, watch_cls=watch)
    assert "the close of fd" in message


WAVE_MUTANTS = [mutants.BumpingClock, mutants.IgnoresStartWave, mutants.BelievedParkedClock]


@pytest.mark.parametrize("clock", WAVE_MUTANTS, ids=lambda c: c.__name__)
def test_wave_machine_catches(clock: type[Any]) -> None:
    message = _caught_by_machine(WaveMachine, clock_cls=clock)
    assert "never finish" in message or "parked" in message


@pytest.mark.parametrize("clock", WAVE_MUTANTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("self_wake", [False, True], ids=["waits-for-wake", "self-wake"])
@pytest.mark.parametrize("coalesce", [False, True], ids=["each-answer", "one-per-pass"])
def test_exhaustive_search_catches(clock: type[Any], self_wake: bool, coalesce: bool) -> None:
    result = search(Config(ranks=2, requests=2, self_wake=self_wake, coalesce=coalesce), clock)
    assert result.problem is not None, f"{clock.__name__} survived {result.states} states"
    assert result.counterexample


def test_bumping_clock_strands_a_rank_running_alone() -> None:
    """The failure docs/protocol.md §5 describes: the group parks split across two waves, and
    the lower rank later accepts a WAKE the higher one ignores."""
    result = search(Config(ranks=2, requests=2, self_wake=False), mutants.BumpingClock)
    assert result.problem is not None and "run while their peers are parked" in result.problem

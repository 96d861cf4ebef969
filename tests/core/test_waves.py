"""The wave clock: unit rules, a Hypothesis-driven model of a lockstep group, and an
exhaustive breadth-first search of every interleaving for small groups."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from tests.models.waves import Config, WaveMachine, search
from zmqdp._core.waves import WaveClock


def test_clock_follows_and_never_leads() -> None:
    clock = WaveClock()
    assert clock.wake_after_adds() == 0
    clock.wave_complete(0)
    assert clock.wave == 1  # completion folds to w + 1 ...
    clock.wave_complete(0)
    assert clock.wave == 1  # ... idempotently
    assert clock.start_wave(1) == 1  # start_wave answers with the clock, never c + 1
    assert clock.start_wave(0) == 1  # a stale start_wave still gets an answer
    assert clock.start_wave(5) == 5  # a rank that is ahead pulls the clock forward
    clock.observe_hello(3)
    assert clock.wave == 5
    clock.observe_hello(9)
    assert clock.wake_after_adds() == 9


def test_smg_wave_tests_ported() -> None:
    """SMG's wave tests (the SMG connector's tests #14, #15, #17, #18) under zmqdp's rules."""
    # #14 first submit wakes the parked group: with zmqdp the wake names the wave the
    # group is parked at (0), not 1.
    clock = WaveClock()
    assert clock.wake_after_adds() == 0
    # #15 every wake names a wave the ranks will accept: after WaveComplete(w) the next
    # wake is w + 1, the wave every rank parked at, and every rank gets the same one.
    clock.wave_complete(7)
    assert clock.wake_after_adds() == 8
    # #17 a rank's start_wave wakes the whole group with a wave >= the one it named.
    assert clock.start_wave(11) == 11
    # #18 wave_complete updates the clock without waking (it returns nothing to send).
    assert clock.wave_complete(12) is None  # type: ignore[func-returns-value]
    assert clock.wave == 13


TestWaveMachine = WaveMachine.TestCase
TestWaveMachine.settings = settings(settings.default, stateful_step_count=40)

# Every configuration below is searched exhaustively on each CI run (about a minute in
# all on 2 cores). ZMQDP_WAVE_SEARCH=full adds the larger ones (minutes each).
SMALL = [
    Config(ranks, requests, steps, sync, self_wake, after_adds)
    for ranks, requests, steps, sync in [
        (2, 2, 1, 1),
        (2, 2, 2, 2),
        (2, 2, 1, 3),
        (3, 2, 1, 1),
        (2, 3, 1, 2),
    ]
    for self_wake in (False, True)
    for after_adds in (False, True)
] + [Config(3, 3, 1, 1, self_wake, False) for self_wake in (False, True)]
# The dispatcher answers the start_waves of one pass with one WAKE(c) (coalesce).
SMALL += [
    Config(ranks, requests, steps, sync, self_wake, after_adds, coalesce=True)
    for ranks, requests, steps, sync in [(2, 2, 1, 1), (2, 2, 2, 2), (3, 2, 1, 1), (2, 3, 1, 2)]
    for self_wake in (False, True)
    for after_adds in (False, True)
]
LARGE = [Config(3, 3, 1, 1, self_wake, True) for self_wake in (False, True)] + [
    Config(2, 4, 1, 2, self_wake, after) for self_wake in (False, True) for after in (False, True)
]


@pytest.mark.parametrize(
    "cfg", SMALL + (LARGE if os.environ.get("ZMQDP_WAVE_SEARCH") == "full" else []), ids=repr
)
def test_exhaustive_search_finds_no_stuck_state(cfg: Config) -> None:
    result = search(cfg)
    assert result.problem is None, (result.problem, result.counterexample)
    assert result.states > 20  # the search really explored something


def test_the_clock_never_goes_past_what_the_wire_carries() -> None:
    """A start_wave or wave_complete past 2**63-1 (a hostile peer) never makes the clock,
    and so no WAKE, carry a wave the wire cannot encode (docs/protocol.md §1)."""
    clock = WaveClock()
    assert clock.start_wave(2**64 - 1) == 2**63 - 1
    clock.wave_complete(2**64)
    assert clock.wake_after_adds() == 2**63 - 1

"""`zmqdp.vllm.connect`'s group's wave translation against vLLM 0.33's engine rules
(tests/models/vllm_waves.py): every interleaving of small groups, a Hypothesis-driven
machine, and the broken translations shown caught."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from tests.core.test_mutants import HUNT
from tests.models.vllm_waves import (
    BROKEN_DIALECTS,
    BumpingDialect,
    ExcludesReporterDialect,
    VConfig,
    VllmCoordinatorDialect,
    VllmWaveMachine,
    ZmqdpDialect,
    vsearch,
)
from zmqdp._core.waves import WaveClock
from zmqdp.vllm.wire import request_wave, start_dp_wave


def test_the_translation_is_the_clock_and_no_exclusion() -> None:
    clock = WaveClock()
    clock.wave_complete(4)
    assert request_wave(clock) == 5 and request_wave(None) == 0
    assert start_dp_wave(clock.start_wave(3)) == (5, None)


# The real dialect: zmqdp's clock, one START_DP_WAVE(c, None) per dispatcher pass that
# took start_waves (coalesce), post-ADD START_DP_WAVE on or off. Sync intervals matter
# only with requests longer than one step (vLLM also decides at step 1).
SMALL = [
    VConfig(2, 2, steps, sync, after_adds, coalesce)
    for steps, sync in [(1, 1), (2, 2), (2, 3)]
    for after_adds in (False, True)
    for coalesce in (True, False)
    if (coalesce or steps == 1) and not (after_adds and sync == 3)
]
LARGE = [
    VConfig(2, 2, 2, 3, True, True),
    VConfig(3, 2, 1, 1, True, True),
    VConfig(3, 2, 2, 2, True, True),
    VConfig(2, 3, 1, 2, True, True),
    VConfig(2, 3, 2, 2, False, True),
]


@pytest.mark.parametrize(
    "cfg", SMALL + (LARGE if os.environ.get("ZMQDP_WAVE_SEARCH") == "full" else []), ids=repr
)
def test_exhaustive_search_finds_no_stuck_state(cfg: VConfig) -> None:
    result = vsearch(cfg, ZmqdpDialect)
    assert result.problem is None, (result.problem, result.counterexample)
    assert result.states > 100


@pytest.mark.parametrize(
    "cfg", [VConfig(2, 2, 1, 1), VConfig(2, 2, 2, 2), VConfig(3, 2, 1, 1)], ids=repr
)
def test_vllms_own_coordinator_passes_too(cfg: VConfig) -> None:
    """vLLM 0.33's coordinator rules (exclude the reporter, answer only newer or parked
    waves, no front-end wake) against the same engines: the model is not just tuned to
    zmqdp's choices."""
    result = vsearch(cfg, VllmCoordinatorDialect)
    assert result.problem is None, (result.problem, result.counterexample)


@pytest.mark.parametrize(
    "cfg", [VConfig(2, 2, 1, 1), VConfig(2, 2, 2, 2), VConfig(3, 2, 1, 1)], ids=repr
)
def test_zmqdps_rules_serve_vllm_032_engines(cfg: VConfig) -> None:
    """vLLM 0.32 engines (and 0.11-0.31) report no start_wave for an ADD at their own
    wave (vLLM 0.32's front end woke the peers with FIRST_REQ): zmqdp's unchanged rules,
    with the post-ADD START_DP_WAVE, leave no stuck state against them either."""
    result = vsearch(dataclasses.replace(cfg, engine="0.32"))
    assert result.problem is None, (result.problem, result.counterexample)


def test_vllm_032_engines_need_the_post_add_wake() -> None:
    """...and it is the post-ADD wake that does it: without it a 0.32 group strands the
    rank that got the request, where a 0.33 group (which reports start_wave) does not."""
    assert vsearch(VConfig(2, 2, 1, 1, False, engine="0.33")).problem is None
    result = vsearch(VConfig(2, 2, 1, 1, False, engine="0.32"))
    assert result.problem is not None and "run while their peers are parked" in result.problem


TestVllmWaveMachine = VllmWaveMachine.TestCase
TestVllmWaveMachine.settings = settings(settings.default, stateful_step_count=40)


@pytest.mark.parametrize("dialect", BROKEN_DIALECTS, ids=lambda d: d.__name__)
@pytest.mark.parametrize("after_adds", [False, True], ids=["no-post-add-wake", "post-add-wake"])
def test_exhaustive_search_catches(dialect: type[Any], after_adds: bool) -> None:
    result = vsearch(VConfig(2, 2, 1, 1, after_adds), dialect)
    assert result.problem is not None, f"{dialect.__name__} survived {result.states} states"
    assert result.counterexample


@pytest.mark.parametrize("dialect", BROKEN_DIALECTS, ids=lambda d: d.__name__)
def test_wave_machine_catches(dialect: type[Any]) -> None:
    machine = type(
        f"VllmWaveMachineWith{dialect.__name__}", (VllmWaveMachine,), {"dialect_cls": dialect}
    )
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(machine, settings=HUNT)
    assert "never finish" in str(info.value) or "parked" in str(info.value)


def test_excluding_the_reporter_strands_a_rank() -> None:
    """Why `start_dp_wave` names no excluded engine: the answer to a late start_wave(w)
    is START_DP_WAVE(c) with c = w + 1 once the wave completed; the reporter is parked at
    c too, and excluding it wakes its peers without it."""
    result = vsearch(VConfig(2, 2, 1, 1, False, coalesce=False), ExcludesReporterDialect)
    assert result.problem is not None and "run while their peers are parked" in result.problem
    assert result.counterexample is not None
    assert result.counterexample[-2:] == [("deliver_start", 0), ("deliver_start", 1)]


def test_bumping_splits_the_group_across_waves() -> None:
    result = vsearch(VConfig(2, 2, 1, 1, False), BumpingDialect)
    assert result.problem is not None and "run while their peers are parked" in result.problem

"""Deaths by closed connections on both wires (tests/models/deaths.py): the real
handshake state machines and core hold the machine's invariants, and a forget that
ignores the incarnation it names (it wipes a replacement's handshake) is caught."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from tests.core.test_mutants import HUNT
from tests.models.deaths import ForgetsAnyIncarnation, VllmForgetsAnyIncarnation, machine


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

"""The settings under which a property test hunts a deliberately broken variant
(tests/models/mutants.py): derandomized, no database, no shrinking (catching is enough),
stopping at the first failure. A variant ends the search as soon as it is caught, so a
large `max_examples` costs the correct machine nothing and a variant a few seconds."""

from __future__ import annotations

from hypothesis import Phase, settings


def hunt(max_examples: int, steps: int | None = None) -> settings:
    """`max_examples` derandomized examples (of `steps` rules each for a state machine)."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps if steps is not None else 50,
        derandomize=True,
        database=None,
        deadline=None,
        report_multiple_bugs=False,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),  # catching, not shrinking
    )

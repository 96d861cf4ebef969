"""Shared test configuration: Hypothesis profiles.

* ``dev`` (default): quick local runs.
* ``ci`` (selected when ``CI=true``): at least 500 examples per property and state machine.
* ``fuzz``: a long local fuzz, ``HYPOTHESIS_PROFILE=fuzz python3 dev.py check``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=150, deadline=None)
settings.register_profile(
    "ci", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "fuzz",
    max_examples=20_000,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") == "true" else "dev")
)

"""Shared test configuration: Hypothesis profiles, a time limit on every async test,
and the `ctx` fixture.

Hypothesis profiles:

* ``dev`` (default): quick local runs.
* ``ci`` (selected when ``CI=true``): at least 500 examples per property and state machine.
* ``fuzz``: a long local fuzz, ``HYPOTHESIS_PROFILE=fuzz python3 dev.py check``.

Time limit: every async (trio) test runs under an absolute ``trio.fail_after`` of
`DEFAULT_TIMEOUT_S` seconds, or of ``N`` with ``@pytest.mark.timeout_s(N)``, so a hang
fails with `trio.TooSlowError` instead of stalling the run. pytest-trio runs fixtures
in tasks of their own, so a cancel scope opened by a fixture would not cover the test:
the limit is put around the test function itself, at collection time (the wrapper
replaces `item.obj` before pytest-trio wraps that in its runner). It covers the test's
body, not the setup and teardown of its async fixtures.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import trio
import zmq
from hypothesis import HealthCheck, settings

from .helpers import zmq_context

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

DEFAULT_TIMEOUT_S = 20.0
"""The time limit of an async test without a `timeout_s` marker, in seconds."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "timeout_s(seconds): the absolute time limit of an async test, enforced with "
        f"trio.fail_after (default {DEFAULT_TIMEOUT_S:g} s)",
    )


def _under_time_limit(
    test: Callable[..., Awaitable[None]], seconds: float
) -> Callable[..., Awaitable[None]]:
    @functools.wraps(test)  # keeps the name and, through __wrapped__, the signature
    async def limited(*args: Any, **kwargs: Any) -> None:
        with trio.fail_after(seconds):
            await test(*args, **kwargs)

    return limited


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        marker = item.get_closest_marker("timeout_s")
        if not inspect.iscoroutinefunction(item.obj):
            if marker is not None:
                raise pytest.UsageError(f"{item.nodeid}: timeout_s applies to async tests only")
            continue
        seconds = DEFAULT_TIMEOUT_S if marker is None else float(marker.args[0])
        item.obj = _under_time_limit(item.obj, seconds)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    """A private pyzmq context, destroyed with LINGER 0 after the test."""
    with zmq_context() as context:
        yield context

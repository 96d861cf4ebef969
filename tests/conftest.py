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

Parallel runs: ``python3 dev.py check`` runs the suite on pytest-xdist workers (one a
core, ``--dist loadfile``: each file in one worker, in its order). Tests are isolated
by construction: ipc URLs under ``tmp_path`` (per test, per worker), TCP ports picked
by the OS (port 0), no shared files. A test that must have the machine to itself (it
starts many processes, or lowers its own descriptor limit and floods it) is marked
``@pytest.mark.serial``: under xdist it waits until every running test has ended, and
no test starts while it runs (`_MachineShare`, a reader-writer lock on a file that the
workers share). Without xdist the marker does nothing.

Optional extras: a test module that cannot be imported because a package of one of
zmqdp's extras (pyproject.toml's ``[project.optional-dependencies]``: ``gateway``,
``vllm``, ``demo``, ``bench``) is not installed is *skipped*, with a reason naming the
extra and the ``pip install`` that brings it, instead of failing the collection (so
``pip install -e .[test]`` then ``pytest`` works). Any other import error still fails.
``python3 dev.py check`` installs every extra, so nothing is skipped there. A test that
needs an extra only at run time says so itself: ``pytest.importorskip`` in a sync test,
``@pytest.mark.skipif(find_spec(...) is None, ...)`` on an async one (a skip raised
inside trio loses its reason).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import tomllib
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

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
    config.addinivalue_line(
        "markers",
        "serial: under pytest-xdist, the test runs while no other test does (it needs the "
        "machine to itself)",
    )


class _MachineShare:
    """A reader-writer lock over the xdist workers of one run: every test holds it
    shared, a `serial` test exclusively. A second lock, the gate, gives the exclusive
    side priority: a waiting `serial` test holds the gate, so that no test starts
    before it has run (the other worker would otherwise keep the lock shared, one test
    after another). Both are `flock`s on files in the run's shared temporary root,
    which pytest removes with the rest of its old temporary directories."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self._gate: IO[bytes] = open(root / "zmqdp-serial-gate.lock", "ab")  # noqa: SIM115
        self._machine: IO[bytes] = open(root / "zmqdp-machine.lock", "ab")  # noqa: SIM115

    @contextlib.contextmanager
    def hold(self, alone: bool) -> Iterator[None]:
        import fcntl

        if alone:
            fcntl.flock(self._gate, fcntl.LOCK_EX)
            fcntl.flock(self._machine, fcntl.LOCK_EX)
        else:
            fcntl.flock(self._gate, fcntl.LOCK_SH)
            fcntl.flock(self._machine, fcntl.LOCK_SH)
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._machine, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self._gate, fcntl.LOCK_UN)


_share: _MachineShare | None = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    """Under xdist (a worker's basetemp is `<the run's root>/popen-gwN`), set-up, call
    and teardown of each test hold `_MachineShare`: exclusively for a `serial` test."""
    global _share
    basetemp = item.config.option.basetemp
    if not os.environ.get("PYTEST_XDIST_WORKER") or not basetemp or os.name != "posix":
        return (yield)
    if _share is None:
        _share = _MachineShare(Path(basetemp).parent)
    with _share.hold(alone=item.get_closest_marker("serial") is not None):
        return (yield)


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


def _extras_by_module() -> dict[str, str]:
    """Top-level module name -> the extra(s) of pyproject.toml that install it.

    A distribution's module is taken to be its normalized name (`prometheus-client` ->
    `prometheus_client`, `Jinja2` -> `jinja2`), which holds for every extra zmqdp has.
    """
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
    found: dict[str, list[str]] = {}
    for extra, requirements in extras.items():
        for requirement in requirements:
            name = re.match(r"[A-Za-z0-9._-]+", requirement)
            if name is not None:
                module = name.group().lower().replace("-", "_")
                found.setdefault(module, []).append(extra)
    return {module: ",".join(names) for module, names in found.items()}


EXTRA_OF = _extras_by_module()


class _ModuleNeedingExtras(pytest.Module):
    """A test module whose import fails for want of an extra is skipped, saying which."""

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        try:
            self.obj  # noqa: B018 - imports the module (pytest caches it)
        except pytest.Collector.CollectError as exc:
            cause = exc.__cause__
            if isinstance(cause, ModuleNotFoundError) and cause.name:
                top = cause.name.partition(".")[0]
                extra = EXTRA_OF.get(top)
                if extra is not None:
                    pytest.skip(
                        f"{self.nodeid} needs the {extra} extra ({top} is not installed): "
                        f"pip install -e '.[{extra}]'"
                    )
            raise
        return super().collect()


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module:
    return _ModuleNeedingExtras.from_parent(parent, path=module_path)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    """A private pyzmq context, destroyed with LINGER 0 after the test."""
    with zmq_context() as context:
        yield context

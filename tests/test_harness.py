"""The test harness itself (tests/helpers.py, tests/fakes/engines.py): what every client
test relies on without saying so.

`group_of` must never hand a test an engine whose handshake is done but whose task has
not set its handle yet: `test_start_wave_wakes_the_whole_group` once failed on a loaded
machine with ``assert self.engine is not None`` for that reason. The tests below make
that window as wide as it can be, deterministically: each engine's task resumes from
`connect_engine` only after the group is up.

Under pytest-xdist, a test marked `serial` holds conftest.py's machine lock alone, and
every other test holds it shared (checked in a small suite run on two workers).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

import tests.helpers
from tests.fakes import engines as fake_engines
from tests.fakes.engines import start_engines, wait_ready
from zmqdp import EngineGroup

from .helpers import READY_TIMEOUT, group_of, wait_until, wakes


def engines_resume_after_the_group(monkeypatch: pytest.MonkeyPatch) -> trio.Event:
    """Make every `ScriptedEngine`'s `connect_engine` return only once the returned
    event is set (its handshake done, the rank up on the client), and make `group_of`'s
    group set it as soon as it is connected: the slowest an engine task can be."""
    group_up = trio.Event()
    real_connect_engine = fake_engines.connect_engine

    @asynccontextmanager
    async def late_engine(*args: Any, **kw: Any) -> AsyncIterator[Any]:
        async with real_connect_engine(*args, **kw) as engine:
            await group_up.wait()
            yield engine

    class SignallingGroup:
        @staticmethod
        @asynccontextmanager
        async def connect(*args: Any, **kw: Any) -> AsyncIterator[EngineGroup]:
            async with EngineGroup.connect(*args, **kw) as group:
                group_up.set()
                yield group

    monkeypatch.setattr(fake_engines, "connect_engine", late_engine)
    monkeypatch.setattr(tests.helpers, "EngineGroup", SignallingGroup)
    return group_up


async def test_group_of_yields_only_engines_whose_handle_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every engine's handle is set when `group_of` yields, however late its task
    resumes; the scenario that failed (a wave started at once) then works."""
    group_up = engines_resume_after_the_group(monkeypatch)
    async with group_of(tmp_path, 3, lockstep=True) as (_group, engines):
        assert group_up.is_set()
        assert all(e.engine is not None and e.ready.is_set() for e in engines)
        await engines[0].emit(start_wave=7)
        for e in engines:
            await e.wait_for(lambda e=e: wakes(e) == [7])


async def test_emit_waits_for_the_handle_of_an_engine_started_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test that connects its own group over `start_engines` may emit at once: `emit`
    waits for the handle instead of failing (`wait_ready` is there to wait first)."""
    group_up = engines_resume_after_the_group(monkeypatch)
    url = f"ipc://{tmp_path}/g"
    async with trio.open_nursery() as nursery:
        engines = await start_engines(nursery, url, 2, lockstep=True)
        async with EngineGroup.connect(url, 2, ready_timeout=READY_TIMEOUT) as group:
            assert engines[1].engine is None  # the group is up, the engine's task is not
            nursery.start_soon(partial(engines[1].emit, wave_complete=3))
            group_up.set()
            await wait_until(lambda: group.statistics().wave == 4)
            await wait_ready(engines)
            assert all(e.engine is not None for e in engines)
        nursery.cancel_scope.cancel()


_LOCK_PROBE = """
import fcntl
from pathlib import Path

import pytest


def taken(request, mode):
    \"\"\"Whether the machine lock cannot be taken in `mode` from a new descriptor.\"\"\"
    root = Path(request.config.option.basetemp).parent
    with open(root / "zmqdp-machine.lock", "ab") as f:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


@pytest.mark.serial
def test_serial(request):
    assert taken(request, fcntl.LOCK_SH), "a serial test must hold the lock alone"


def test_ordinary(request):
    assert taken(request, fcntl.LOCK_EX), "an ordinary test must hold the lock shared"
    assert not taken(request, fcntl.LOCK_SH), "... and let the others share it"
"""


@pytest.mark.skipif(
    importlib.util.find_spec("xdist") is None or os.name != "posix",
    reason="pytest-xdist (the test extra) on a POSIX system",
)
def test_a_serial_test_holds_the_machine_alone_under_xdist(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(root)!r})\n"
        "from tests.conftest import pytest_configure, pytest_runtest_protocol  # noqa: F401\n"
    )
    (tmp_path / "test_probe.py").write_text(_LOCK_PROBE)
    xdist = ["-n", "2", "--basetemp", str(tmp_path / "base")]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist, "test_probe.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 passed" in run.stdout, run.stdout[-3000:]

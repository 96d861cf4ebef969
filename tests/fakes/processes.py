"""Engines in processes of their own, one per rank, on either wire: for faults that need
a real process (SIGKILL closes its connections; SIGSTOP keeps them open and stops
libzmq's I/O thread, which answers heartbeats). Used by tests/test_liveness.py and
benchmarks/bench_liveness.py.

Natively each rank is `python -m zmqdp mock --ranks R`; on vLLM's wire,
`tests/fakes/vllm_process.py` (one `FakeVllmEngine`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

import zmqdp.vllm
from zmqdp import EngineGroup, Request
from zmqdp.mock import mock_process
from zmqdp.vllm import SamplingParams, VllmRequest

__all__ = ["WIRES", "Wire", "ranks", "resume"]

ROOT = Path(__file__).resolve().parent.parent.parent
STEP_TIME = 0.005
"""Seconds per output of the engines here."""


@dataclass(frozen=True)
class Wire:
    """How to run, connect to and ask a group of one wire ("native" or "vllm")."""

    name: str

    def url(self, tmp: Path) -> str:
        return f"ipc://{tmp}/g"

    def engine(self, url: str, size: int, rank: int) -> AbstractAsyncContextManager[Any]:
        if self.name == "native":
            return mock_process(url, size, "--ranks", str(rank), "--step-time", str(STEP_TIME))
        return _vllm_process(url, size, rank)

    def connect(self, url: str, size: int, **kw: Any) -> AbstractAsyncContextManager[Any]:
        kw.setdefault("ready_timeout", 30.0)
        if self.name == "native":
            return EngineGroup.connect(url, size, **kw)
        return zmqdp.vllm.connect(url, size, **kw)

    def request(self, rid: str, tokens: int, rank: int | None = None) -> Any:
        if self.name == "native":
            return Request(rid, {"prompt": [1, 2, 3], "max_tokens": tokens}, rank=rank)
        sampling = SamplingParams(temperature=0.0, max_tokens=tokens)
        return VllmRequest(rid, [10, 20], sampling, rank=rank)


WIRES = [pytest.param(Wire("native"), id="native"), pytest.param(Wire("vllm"), id="vllm")]


@asynccontextmanager
async def _vllm_process(url: str, size: int, rank: int) -> AsyncIterator[trio.Process]:
    cmd = [
        sys.executable,
        "-m",
        "tests.fakes.vllm_process",
        url,
        str(size),
        str(rank),
        str(STEP_TIME),
    ]
    proc = await trio.lowlevel.open_process(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield proc
    finally:
        with trio.CancelScope(shield=True):
            proc.kill()
            await proc.wait()


@asynccontextmanager
async def ranks(wire: Wire, url: str, size: int) -> AsyncIterator[list[trio.Process]]:
    """One engine process per rank for the block; each is resumed and killed after."""
    procs: list[trio.Process] = []
    try:
        async with trio.open_nursery() as nursery:
            stop = trio.Event()

            async def run(rank: int, task_status: trio.TaskStatus[None]) -> None:
                async with wire.engine(url, size, rank) as proc:
                    procs.append(proc)
                    task_status.started()
                    await stop.wait()
                    resume(proc)

            for rank in range(size):
                await nursery.start(run, rank)
            try:
                yield procs
            finally:
                stop.set()
    finally:
        for proc in procs:
            resume(proc)


def resume(proc: trio.Process) -> None:
    """SIGCONT a stopped process (so SIGTERM and SIGKILL can end it)."""
    if proc.returncode is None:
        with suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)

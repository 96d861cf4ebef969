"""`zmqdp.aio` driving vLLM engines: an asyncio (and uvloop) host on vLLM's wire, with the
fake vLLM engines of tests/fakes/vllm.py in a trio run of their own thread.

The same `AsyncioEngineGroup` as natively, given `zmqdp.vllm.dialect(...)`: this is what
the one-core structure buys (the group is generic over its wire, not subclassed).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import pytest
import trio

import zmqdp.vllm
from tests.fakes.threaded import TIME_LIMIT, Run, loop_runner, wait_until
from tests.fakes.vllm import FakeVllmGroup
from zmqdp import GroupClosed, RankState
from zmqdp.aio import AsyncioEngineGroup
from zmqdp.vllm import SamplingParams, VllmOutput, VllmRequest

run = pytest.fixture(params=["asyncio", "uvloop"], name="run")(loop_runner)


class VllmEngineThread:
    """`FakeVllmGroup` engines in a trio run of their own thread (`with` starts and
    stops them). The test reads their `received` lists only through `wait_until`."""

    def __init__(self, size: int, *, moe: bool = False, **fake_kw: Any) -> None:
        self._dir = tempfile.mkdtemp(prefix="zva", dir="/tmp")
        self.fake = FakeVllmGroup(f"ipc://{self._dir}/hs", size, moe=moe, **fake_kw)
        self.url = self.fake.url
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        with trio.move_on_after(TIME_LIMIT):
            async with trio.open_nursery() as nursery:
                self.fake.nursery = nursery
                for engine in self.fake.engines:
                    nursery.start_soon(engine.run)
                self._started.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()

    def __enter__(self) -> VllmEngineThread:
        self._thread.start()
        assert self._started.wait(TIME_LIMIT)
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._token is not None and self._stop is not None
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(TIME_LIMIT)
        self.fake.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def got(self, rank: int, kind: str) -> Callable[[], list[Any]]:
        return lambda: self.fake.engines[rank].got(kind)


def req(rid: str, max_tokens: int = 4, **kw: Any) -> VllmRequest:
    return VllmRequest(rid, [10, 20], SamplingParams(temperature=0.0, max_tokens=max_tokens), **kw)


async def collect(group: AsyncioEngineGroup[VllmRequest], r: VllmRequest) -> list[Any]:
    async with group.submit(r) as stream:
        return [out async for out in stream]


def test_an_asyncio_host_drives_a_dense_vllm_group(run: Run) -> None:
    """Streams on vLLM's wire from asyncio: every token, vLLM's finish reason, the two
    ranks both used (least-loaded), a pinned request on its rank, and leaving a stream
    early sends vLLM's ABORT of its wire id, exactly once."""
    with VllmEngineThread(2) as engines:

        async def main() -> None:
            async with AsyncioEngineGroup.connect(
                engines.url, 2, dialect=zmqdp.vllm.dialect(), ready_timeout=5.0
            ) as group:
                assert [e.state for e in group.engines] == [RankState.UP, RankState.UP]
                results = await asyncio.gather(*(collect(group, req(f"r{i}")) for i in range(6)))
                for outs in results:
                    assert isinstance(outs[-1].body, VllmOutput)
                    assert outs[-1].finish == "length"
                    assert sum(len(o.body.token_ids) for o in outs) == 4
                ranks = {r.rank: r for r in group.statistics().ranks}
                assert all(ranks[r].latency.count > 0 for r in (0, 1)), ranks
                pinned = await collect(group, req("pinned", rank=1))
                assert pinned[-1].finish == "length"
                async with group.submit(req("long", max_tokens=10_000, rank=0)) as stream:
                    await stream.receive()
                await wait_until(lambda: len(engines.got(0, "abort")()) == 1)
                assert engines.got(0, "abort")() == [[stream.wire_id]]
                assert group.statistics().aborted == 1

        run(main)


def test_an_asyncio_host_drives_a_moe_vllm_group(run: Run) -> None:
    """A lockstep (MoE) group on vLLM's wire from asyncio: the client plays the DP
    coordinator (its WAKEs are published START_DP_WAVEs), requests complete wave after
    wave, and leaving the block closes the group."""
    with VllmEngineThread(2, moe=True) as engines:

        async def main() -> None:
            async with AsyncioEngineGroup.connect(
                engines.url, 2, dialect=zmqdp.vllm.dialect(moe=True), ready_timeout=5.0
            ) as group:
                assert group.lockstep
                for wave in range(3):
                    outs = await asyncio.gather(
                        *(collect(group, req(f"w{wave}-{i}", max_tokens=3)) for i in range(3))
                    )
                    assert all(o[-1].finish == "length" for o in outs)
                assert group.statistics().wakes > 0
            assert isinstance(group.closed, GroupClosed)

        run(main)

"""Faults on real vLLM engine cores, dense DP=2, one rank per process: SIGKILL of one
engine core, a restarted engine, and an engine-side fatal error (ENGINE_CORE_DEAD).
The outcome of every request is checked. The tests run in file order on one group:
each leaves it as the next expects (the last one closes it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from zmqdp import EngineDead, GroupClosed, RankState
from zmqdp.vllm import VllmGroup

from .engines import EngineProcs, GroupHost, running_group
from .helpers import VOCAB, Result, collect, request

SILENCE = 3.0


@pytest.fixture(scope="module")
def faulty(vllm_venv: Path, models: Path, engine_logs: Path) -> Iterator[GroupHost]:
    engines = EngineProcs(vllm_venv, models / "dense", 2, engine_logs / "faults")
    with running_group(engines, ready_timeout=300, silence_timeout=SILENCE) as host:
        yield host


async def _run_both(
    group: VllmGroup, prefix: str, n: int, max_tokens: int, started: trio.Event | None = None
) -> list[Result]:
    """`n` long requests pinned to each rank, concurrently; `started` is set once each
    has its first output."""
    results: list[Result] = []
    first = trio.Semaphore(0)

    async def one(i: int, rank: int) -> None:
        r = Result(rank)
        results.append(r)
        try:
            r_ = request(f"{prefix}-{rank}-{i}", max_tokens, rank=rank, eos=None)
            async with group.submit(r_) as s:
                async for out in s:
                    if not r.outputs:
                        first.release()
                    r.outputs.append(out)
                    r.tokens += out.body.token_ids
                    r.finish = out.finish
        except Exception as exc:
            r.error = exc
            if not r.outputs:
                first.release()

    async with trio.open_nursery() as nursery:
        for rank in (0, 1):
            for i in range(n):
                nursery.start_soon(one, i, rank)
        for _ in range(2 * n):
            await first.acquire()
        if started is not None:
            started.set()
    return results


def test_sigkill_of_one_engine_core_fails_only_its_requests(faulty: GroupHost) -> None:
    started = trio.Event()
    outcome: dict[str, list[Result]] = {}

    async def run(group: VllmGroup) -> None:
        async with trio.open_nursery() as nursery:

            async def load() -> None:
                outcome["results"] = await _run_both(group, "kill", 4, 300, started)

            nursery.start_soon(load)
            await started.wait()
            await trio.to_thread.run_sync(faulty.engines.kill_engine_core, 1)
        await group.rank_state(1).wait_value(RankState.DOWN)
        outcome["after"] = [await collect(group, request(f"after-kill-{i}", 4)) for i in range(4)]

    faulty.run(run, timeout=120)
    results = outcome["results"]
    for r in results:
        if r.rank == 0:
            assert r.error is None and r.finish == "length" and len(r.tokens) == 300, r
        else:
            assert isinstance(r.error, EngineDead), r
            assert "rank 1" in str(r.error)
    assert all(r.error is None and r.rank == 0 for r in outcome["after"]), outcome["after"]
    group = faulty.group
    assert group is not None
    health = group.health()
    assert health.ranks_up == 1 and health.live


def test_a_restarted_engine_rejoins_without_a_new_client(faulty: GroupHost) -> None:
    engines = faulty.engines
    engines.stop(1)  # the killed core's parent process, if it is still there
    engines.start(1)

    async def run(group: VllmGroup) -> list[Result]:
        await group.rank_state(1).wait_value(RankState.UP)
        return [await collect(group, request(f"rejoined-{r}", 6, rank=r, eos=None)) for r in (1, 0)]

    results = faulty.run(run, timeout=300)
    assert [(r.rank, r.error, len(r.tokens)) for r in results] == [(1, None, 6), (0, None, 6)]


def test_an_engine_side_fatal_error_ends_every_request(faulty: GroupHost) -> None:
    """A prompt token outside the vocabulary, pinned to rank 1, kills that engine core
    (vLLM: "EngineCore encountered a fatal error", then ENGINE_CORE_DEAD on its output
    socket). vLLM's sentinel names no rank, so zmqdp (like vLLM's frontend) fails the
    whole group: every live request ends with `GroupClosed` naming the sentinel, and
    new submits are refused. (Per-rank attribution is the liveness issue's work.)"""

    async def run(group: VllmGroup) -> tuple[list[Result], Result, BaseException | None]:
        results: list[Result] = []
        bad = Result(1)
        started = trio.Event()
        async with trio.open_nursery() as nursery:

            async def load() -> None:
                results.extend(await _run_both(group, "fatal", 2, 400, started))

            nursery.start_soon(load)
            await started.wait()
            bad = await collect(group, request("out-of-vocab", 4, prompt=[5, VOCAB + 7], rank=1))
        try:
            group.submit(request("after-dead", 2))
        except GroupClosed as exc:
            return results, bad, exc
        return results, bad, None

    results, bad, refused = faulty.run(run, timeout=120)
    assert isinstance(bad.error, GroupClosed) and "ENGINE_CORE_DEAD" in str(bad.error), bad
    for r in results:
        assert r.finish == "length" or isinstance(r.error, GroupClosed), r
    assert any(isinstance(r.error, GroupClosed) for r in results)
    assert isinstance(refused, GroupClosed)

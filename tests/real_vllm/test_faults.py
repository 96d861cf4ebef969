"""Faults on real vLLM engine cores, dense DP=2, one rank per process (each rank gets
an output socket of its own from zmqdp): SIGKILL of a busy and of an idle engine core,
SIGSTOP of one, a restarted engine, and an engine-side fatal error (ENGINE_CORE_DEAD)
while the other rank streams. The outcome of every request is checked. The group runs
with the default silence timeout (30 s), so every death here is seen by its
connection's close or a heartbeat, not by silence. The tests run in file order on one
group: each leaves it as the next expects."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from zmqdp import EngineDead, RankState
from zmqdp.vllm import VllmGroup

from .engines import EngineProcs, GroupHost, running_group
from .helpers import VOCAB, Result, collect, request

DETECTION = 10.0
"""Seconds a death must be seen within here (heartbeat_timeout 3 s + interval 0.5 s at
most for a stopped engine; at once for a killed one): far below the 30 s silence."""


@pytest.fixture(scope="module")
def faulty(vllm_venv: Path, models: Path, engine_logs: Path) -> Iterator[GroupHost]:
    # Eager engines: this group starts 6 engine processes (4 restarts of rank 1), and
    # torch.compile's warm-up took 20-40 s of each start here; what these tests check
    # (fault detection, rejoining) does not depend on it. test_dense runs compiled.
    engines = EngineProcs(
        vllm_venv, models / "dense", 2, engine_logs / "faults", extra=("--enforce-eager",)
    )
    with running_group(engines, ready_timeout=300) as host:
        yield host


def _restart(host: GroupHost, rank: int) -> None:
    """A fresh engine process for `rank`; it rejoins the same client."""
    host.engines.stop(rank)
    host.engines.start(rank)

    async def up(group: VllmGroup) -> None:
        await group.rank_state(rank).wait_value(RankState.UP)

    host.run(up, timeout=300)


async def _down_within(group: VllmGroup, rank: int) -> None:
    with trio.fail_after(DETECTION):
        await group.rank_state(rank).wait_value(RankState.DOWN)


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


LONG = 480
"""Tokens of the long requests: as many as the engines' max_model_len (512) leaves. An
eager engine on a quiet machine makes 300 in well under a second, and the kill has to
land while they run."""


def test_sigkill_of_one_engine_core_fails_only_its_requests(faulty: GroupHost) -> None:
    started = trio.Event()
    outcome: dict[str, list[Result]] = {}
    pid = faulty.engines.engine_core_pid(1)  # looked up before the load starts

    async def run(group: VllmGroup) -> None:
        async with trio.open_nursery() as nursery:

            async def load() -> None:
                outcome["results"] = await _run_both(group, "kill", 4, LONG, started)

            nursery.start_soon(load)
            await started.wait()
            os.kill(pid, signal.SIGKILL)
            await _down_within(group, 1)
        outcome["after"] = [await collect(group, request(f"after-kill-{i}", 4)) for i in range(4)]

    faulty.run(run, timeout=120)
    results = outcome["results"]
    for r in results:
        if r.rank == 0:
            assert r.error is None and r.finish == "length" and len(r.tokens) == LONG, r
        elif r.error is None:  # it finished before the kill landed (a fast engine)
            assert r.finish == "length" and len(r.tokens) == LONG, r
        else:
            assert isinstance(r.error, EngineDead), r
            assert "rank 1" in str(r.error) and "silent" not in str(r.error), r
    assert any(isinstance(r.error, EngineDead) for r in results if r.rank == 1), results
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


def test_sigstop_of_an_engine_core_is_seen_by_heartbeats_and_the_same_process_returns(
    faulty: GroupHost,
) -> None:
    """The stopped process keeps its sockets: only the heartbeats can tell, and its
    request ends. A vLLM engine does its handshake once per process, so it used to stay
    out until a new process replaced it. After SIGCONT its sockets reconnect, it
    answers the client's probe, and it is up again as the same process (issue 32)."""
    pid = faulty.engines.engine_core_pid(1)
    group = faulty.group
    assert group is not None

    async def stop_while_busy(group: VllmGroup) -> BaseException | None:
        async with group.submit(request("held-stop", 300, rank=1, eos=None)) as s:
            await s.receive()
            os.kill(pid, signal.SIGSTOP)
            try:
                with trio.fail_after(DETECTION):
                    async for _ in s:
                        pass
            except EngineDead as exc:
                return exc
        return None

    try:
        error = faulty.run(stop_while_busy, timeout=60)
        assert isinstance(error, EngineDead) and "heartbeat" in str(error), error
        assert group.rank_state(1).value is RankState.DOWN
        after = faulty.run(collect, request("after-stop", 4), timeout=60)
        assert after.error is None and after.rank == 0, after
    finally:
        os.kill(pid, signal.SIGCONT)

    async def back(group: VllmGroup) -> Result:
        with trio.fail_after(DETECTION):
            await group.rank_state(1).wait_value(RankState.UP)
        return await collect(group, request("resumed", 6, rank=1, eos=None))

    resumed = faulty.run(back, timeout=60)
    assert resumed.error is None and len(resumed.tokens) == 6, resumed
    assert faulty.engines.engine_core_pid(1) == pid  # the same process, not a restart


def test_sigkill_of_an_idle_engine_core_is_seen_at_once(faulty: GroupHost) -> None:
    group = faulty.group
    assert group is not None
    before = group.statistics()
    faulty.engines.kill_engine_core(1)
    faulty.run(_down_within, 1, timeout=60)
    after = group.statistics()
    assert after.failed == before.failed  # it held nothing
    assert after.connections_lost == before.connections_lost + 1
    _restart(faulty, 1)


def test_an_engine_side_fatal_error_fails_only_its_rank(faulty: GroupHost) -> None:
    """A prompt token outside the vocabulary, pinned to rank 1, kills that engine core
    (vLLM: "EngineCore encountered a fatal error", then ENGINE_CORE_DEAD on its output
    socket, then the process exits). vLLM's sentinel names no rank, but it came on rank
    1's own output socket: only rank 1's requests end (with `EngineDead`), rank 0's
    stream to their end, and new requests go to rank 0. (vLLM's own frontend fails
    everything here.)"""

    async def run(group: VllmGroup) -> tuple[list[Result], Result, Result]:
        results: list[Result] = []
        bad = Result(1)
        started = trio.Event()
        async with trio.open_nursery() as nursery:

            async def load() -> None:
                results.extend(await _run_both(group, "fatal", 2, 400, started))

            nursery.start_soon(load)
            await started.wait()
            bad = await collect(group, request("out-of-vocab", 4, prompt=[5, VOCAB + 7], rank=1))
        await _down_within(group, 1)
        after = await collect(group, request("after-dead", 4))
        return results, bad, after

    results, bad, after = faulty.run(run, timeout=120)
    assert isinstance(bad.error, EngineDead) and bad.error.rank == 1, bad
    for r in results:
        if r.rank == 0:
            assert r.error is None and r.finish == "length" and len(r.tokens) == 400, r
        else:
            assert isinstance(r.error, EngineDead) and r.error.rank == 1, r
    assert after.error is None and after.rank == 0, after
    assert faulty.group is not None and faulty.group.closed is None
    _restart(faulty, 1)
    final = faulty.run(collect, request("rejoined-after-fatal", 4, rank=1), timeout=60)
    assert final.error is None and len(final.tokens) == 4, final

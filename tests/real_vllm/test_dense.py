"""Real vLLM engine cores, dense model, DP=2 (one rank per process), driven by
`zmqdp.vllm.connect`'s group: streaming, pinning, least-loaded spread, aborts, utility calls,
sampling, length limits, stop tokens and EOS, deadlines and drain. The tests share one
group (real engines do the handshake once); the last one drains and closes it."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from zmqdp import (
    CallFailed,
    CallTimeout,
    GroupDraining,
    InvalidRequest,
    RankState,
    RequestTimeout,
)
from zmqdp.vllm import VllmGroup

from .engines import MAX_MODEL_LEN, MAX_NUM_SEQS, EngineProcs, GroupHost, running_group
from .helpers import EOS, PROMPT, AbortSpy, Result, collect, request


@pytest.fixture(scope="module")
def dense(vllm_venv: Path, models: Path, engine_logs: Path) -> Iterator[GroupHost]:
    engines = EngineProcs(vllm_venv, models / "dense", 2, engine_logs / "dense")
    with running_group(engines, ready_timeout=300) as host:
        yield host


async def _greedy(group: VllmGroup, rank: int, n: int = 24) -> list[int]:
    r = await collect(group, request(f"greedy-{rank}-{n}", n, rank=rank, eos=None))
    assert r.error is None and r.finish == "length", r
    return r.tokens


def test_ready_responses_come_from_real_engines(dense: GroupHost) -> None:
    group = dense.group
    assert group is not None
    for rank, engine in enumerate(group.engines):
        info = engine.info
        assert info["vllm_version"].startswith("0.32"), info
        assert info["max_model_len"] == MAX_MODEL_LEN
        assert info["max_num_seqs"] == MAX_NUM_SEQS
        assert info["data_parallel_rank"] == rank
    health = group.health()
    assert health.ready and health.ranks_up == 2


def test_a_request_streams_its_tokens_to_the_length_limit(dense: GroupHost) -> None:
    r = dense.run(collect, request("stream-1", 20, eos=None))
    assert r.error is None
    assert r.finish == "length"
    assert len(r.tokens) == 20
    assert len(r.outputs) > 1, "the tokens came in one output: nothing was streamed"
    assert [o.finish for o in r.outputs[:-1]] == [None] * (len(r.outputs) - 1)
    assert all(0 <= t < 1024 for t in r.tokens)


def test_pinned_requests_run_on_their_rank(dense: GroupHost) -> None:
    async def run(group: VllmGroup) -> list[Result]:
        out: list[Result] = []
        for rank in (0, 1, 1, 0):
            out.append(await collect(group, request(f"pin-{len(out)}", 4, rank=rank)))
        return out

    results = dense.run(run)
    assert [r.rank for r in results] == [0, 1, 1, 0]
    assert all(r.error is None and r.finish is not None for r in results), results


def test_unpinned_requests_spread_over_both_ranks(dense: GroupHost) -> None:
    async def run(group: VllmGroup) -> list[Result]:
        results: list[Result] = []

        async def one(i: int) -> None:
            results.append(await collect(group, request(f"spread-{i}", 32, eos=None)))

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, i)
        return results

    results = dense.run(run, timeout=120)
    assert all(r.error is None and len(r.tokens) == 32 for r in results)
    per_rank = [sum(1 for r in results if r.rank == rank) for rank in (0, 1)]
    assert min(per_rank) >= 6, f"least-loaded sent {per_rank} to ranks 0 and 1"


def test_more_requests_than_max_num_seqs_all_finish(dense: GroupHost) -> None:
    """Twice the engines' batch size at once: the engines queue the rest."""

    async def run(group: VllmGroup) -> list[Result]:
        results: list[Result] = []

        async def one(i: int) -> None:
            results.append(await collect(group, request(f"many-{i}", 8, eos=None)))

        async with trio.open_nursery() as nursery:
            for i in range(4 * MAX_NUM_SEQS):
                nursery.start_soon(one, i)
        return results

    results = dense.run(run, timeout=180)
    assert len(results) == 4 * MAX_NUM_SEQS
    assert all(r.error is None and len(r.tokens) == 8 for r in results)
    stats = dense.group.statistics() if dense.group else None
    assert stats is not None and all(s.inflight == 0 for s in stats.ranks)


def test_abort_sends_one_abort_and_the_engine_stops(dense: GroupHost) -> None:
    """Leave a long request after two outputs: exactly one ABORT goes to its rank, a
    second `abort()` sends nothing, and the engine stops it (its next load report,
    with the terminal output of a short request, shows nothing running)."""

    async def run(group: VllmGroup) -> tuple[Result, str, list[int], Result, int]:
        spy = AbortSpy(group)
        try:
            r = Result(None)
            async with group.submit(request("long-1", 400, rank=1, eos=None)) as stream:
                wire_id = stream.wire_id
                async for out in stream:
                    r.outputs.append(out)
                    if len(r.outputs) == 2:
                        break
            await group.abort("long-1")  # idempotent: already ended
            short = await collect(group, request("after-abort", 3, rank=1, eos=None))
            running = group.statistics().ranks[1].load.running
            return r, wire_id, spy.naming(wire_id), short, running
        finally:
            spy.close()

    r, wire_id, aborts, short, running = dense.run(run)
    assert len(r.outputs) == 2
    assert aborts == [1], f"ABORTs naming {wire_id}: to ranks {aborts}"
    assert short.error is None and len(short.tokens) == 3
    assert running == 0, f"rank 1 still runs {running} request(s) after the abort"


def test_utility_calls(dense: GroupHost) -> None:
    async def run(group: VllmGroup) -> tuple[object, object, BaseException | None]:
        sleeping = await group.call(0, "is_sleeping", timeout=30)
        other = await group.call(1, "is_sleeping", timeout=30)
        try:
            await group.call(0, "no_such_method", timeout=30)
        except CallFailed as exc:
            return sleeping, other, exc
        return sleeping, other, None

    sleeping, other, failed = dense.run(run)
    assert sleeping is False and other is False
    assert isinstance(failed, CallFailed)
    assert "no_such_method" in str(failed) and "rank 0" in str(failed)


def test_a_utility_call_to_a_stopped_engine_times_out(dense: GroupHost) -> None:
    """SIGSTOP rank 1's engine core: a call times out with `CallTimeout`; after SIGCONT
    the late reply is dropped and the next call answers."""
    pid = dense.engines.engine_core_pid(1)

    async def stopped(group: VllmGroup) -> BaseException | None:
        try:
            await group.call(1, "is_sleeping", timeout=2.0)
        except CallTimeout as exc:
            return exc
        return None

    os.kill(pid, signal.SIGSTOP)
    try:
        error = dense.run(stopped)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert isinstance(error, CallTimeout) and "rank 1" in str(error)

    async def again(group: VllmGroup) -> object:
        return await group.call(1, "is_sleeping", timeout=30)

    assert dense.run(again) is False
    assert dense.group is not None and dense.group.rank_state(1).value is RankState.UP


def test_seeded_sampling_is_equal_across_ranks(dense: GroupHost) -> None:
    async def run(group: VllmGroup) -> list[list[int]]:
        out = []
        for rank, seed in ((0, 1234), (1, 1234), (0, 99)):
            r = await collect(
                group,
                request(f"seed-{rank}-{seed}", 24, rank=rank, eos=None, temperature=1.5, seed=seed),
            )
            assert r.error is None and len(r.tokens) == 24
            out.append(r.tokens)
        return out

    a0, a1, b0 = dense.run(run)
    assert a0 == a1, "the same seed sampled different tokens on the two ranks"
    assert a0 != b0, "two seeds sampled the same 24 tokens: is the seed sent at all?"


def test_max_tokens_none_runs_to_the_model_length(dense: GroupHost) -> None:
    r = dense.run(collect, request("to-the-end", None, eos=None, ignore_eos=True), timeout=180)
    assert r.error is None, r.error
    assert r.finish == "length"
    assert len(r.tokens) == MAX_MODEL_LEN - len(PROMPT)


def test_stop_token_and_eos(dense: GroupHost) -> None:
    """Stop on a token the greedy output is known to produce: as a stop token (stop
    reason = the id) and as the EOS token (stop reason None); `ignore_eos` runs on."""

    async def run(group: VllmGroup) -> tuple[list[int], Result, Result, Result]:
        greedy = await _greedy(group, 0)
        stop_id = next(t for t in greedy[1:] if t != greedy[0])
        by_stop = await collect(
            group, request("stop-token", 24, rank=1, eos=None, stop_token_ids=[stop_id])
        )
        by_eos = await collect(group, request("eos", 24, rank=0, eos=stop_id))
        ignoring = await collect(group, request("ignore-eos", 24, eos=stop_id, ignore_eos=True))
        return greedy, by_stop, by_eos, ignoring

    greedy, by_stop, by_eos, ignoring = dense.run(run)
    stop_id = next(t for t in greedy[1:] if t != greedy[0])
    cut = greedy[: greedy.index(stop_id) + 1]
    assert (by_stop.finish, by_stop.stop_reason, by_stop.tokens) == ("stop", stop_id, cut)
    assert (by_eos.finish, by_eos.stop_reason, by_eos.tokens) == ("stop", None, cut)
    assert (ignoring.finish, ignoring.tokens) == ("length", greedy)


def test_eos_of_the_model_is_honoured(dense: GroupHost) -> None:
    """With the model's real EOS id (0) the engine may stop early; if it does, the last
    token is EOS and the finish is stop."""
    r = dense.run(collect, request("model-eos", 200, eos=EOS, temperature=1.0, seed=7))
    assert r.error is None
    if r.finish == "stop":
        assert r.tokens[-1] == EOS and r.stop_reason is None
    else:
        assert r.finish == "length" and len(r.tokens) == 200 and EOS not in r.tokens


def test_a_deadline_aborts_the_request_on_its_engine(dense: GroupHost) -> None:
    """The tiny model makes 400 tokens in about 0.3 s here when the machine is busy
    elsewhere (a concurrent CI run); a client held up that long reads the terminal
    output before it judges the deadline, and rightly finishes the request. So the
    deadline is a tenth of a second, well inside the generation."""

    async def run(group: VllmGroup) -> tuple[Result, list[int], Result, int]:
        spy = AbortSpy(group)
        try:
            r = request("deadline", 400, rank=0, eos=None)
            late = await collect(group, dataclasses.replace(r, timeout=0.1))
            wire = [rank for rank, _ids in spy.aborts]
            short = await collect(group, request("after-deadline", 3, rank=0, eos=None))
            return late, wire, short, group.statistics().ranks[0].load.running
        finally:
            spy.close()

    late, aborts, short, running = dense.run(run)
    assert isinstance(late.error, RequestTimeout), late
    assert "rank 0" in str(late.error) and "deadline" in str(late.error)
    assert 0 < len(late.tokens) < 400
    assert aborts == [0]
    assert short.error is None and running == 0


def test_prompt_limits_follow_the_engines_max_model_len(dense: GroupHost) -> None:
    async def run(group: VllmGroup) -> tuple[BaseException | None, Result]:
        too_long: BaseException | None = None
        try:
            group.submit(request("too-long", 4, prompt=[5] * MAX_MODEL_LEN))
        except InvalidRequest as exc:
            too_long = exc
        fits = await collect(
            group, request("fits", None, prompt=[5] * (MAX_MODEL_LEN - 1), eos=None)
        )
        return too_long, fits

    too_long, fits = dense.run(run)
    assert isinstance(too_long, InvalidRequest) and "max_model_len" in str(too_long)
    assert fits.error is None and (fits.finish, len(fits.tokens)) == ("length", 1)


def test_other_utilities_and_load_reports(dense: GroupHost) -> None:
    async def run(group: VllmGroup) -> tuple[object, object]:
        reset = await group.call(0, "reset_prefix_cache", timeout=30)
        r = await collect(group, request("load", 8, rank=1, eos=None))
        assert r.error is None
        return reset, group.statistics().ranks[1].load

    reset, load = dense.run(run)
    assert reset is True
    assert load.running == 0 and load.waiting == 0  # the engine's own count


def test_drain_lets_live_requests_finish_then_closes(dense: GroupHost) -> None:
    """The last test of the module: it closes the group."""

    async def run(group: VllmGroup) -> tuple[list[Result], BaseException | None]:
        results: list[Result] = []
        refused: BaseException | None = None
        started = trio.Event()

        async def one(i: int) -> None:
            nonlocal refused
            r = request(f"draining-{i}", 64, eos=None)
            res = Result(None)
            results.append(res)
            async with group.submit(r) as stream:
                started.set()
                async for out in stream:
                    res.tokens += out.body.token_ids
                    res.finish = out.finish
                    if i == 0 and refused is None and group.health().draining:
                        # draining and still streaming: a new request is refused
                        try:
                            group.submit(request("refused", 2))
                        except GroupDraining as exc:
                            refused = exc

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
            await started.wait()
            nursery.start_soon(group.drain, 60)
        return results, refused

    results, refused = dense.run(run, timeout=120)
    assert isinstance(refused, GroupDraining)
    assert [(r.finish, len(r.tokens)) for r in results] == [("length", 64)] * 6
    assert dense.group is not None and not dense.group.health().live

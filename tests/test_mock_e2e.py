"""End to end over ipc, with `python -m zmqdp mock` in a subprocess.

Lockstep groups must never hang (docs/protocol.md §5), each injected fault must produce
the error the client promises and lose nothing, and least-loaded selection must shun a
slow rank; `run_mock_group` (the mock in process) reports which of its ranks the
client took. Every test runs under the absolute time limit of conftest.py (raised with
`timeout_s` for these longer runs).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from functools import partial
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import trio

from zmqdp import EngineDead, EngineGroup, GroupClosed, HandshakeTimeout, RankState, Request
from zmqdp.mock import MockConfig, MockRejected, RankFaults, mock_process, run_mock_group

from .helpers import collect

NO_RICH = find_spec("rich") is None  # the demo extra


def body(tokens: int) -> dict[str, Any]:
    return {"prompt": [1, 2, 3], "max_tokens": tokens}


LOCKSTEP = [
    pytest.param(n, self_wake, id=f"n{n}-{'self-wake' if self_wake else 'waits-for-wake'}")
    for n in (2, 4)
    for self_wake in (False, True)
]


@pytest.mark.timeout_s(90)
@pytest.mark.parametrize(("n", "self_wake"), LOCKSTEP)
async def test_lockstep_submit_finish_park_repeats_without_a_hang(
    tmp_path: Path, n: int, self_wake: bool
) -> None:
    url = f"ipc://{tmp_path}/g"
    args = ["--lockstep", "--step-time", "0.001", "--sync-interval", "2", "--no-wave-agreement"]
    args += ["--self-wake"] if self_wake else []
    async with mock_process(url, n, *args), EngineGroup.connect(url, n) as group:
        for i in range(50):
            parked_at = group.wave.value
            outs = await collect(group, Request(f"r{i}", body(1 + i % 3), rank=i % n))
            assert outs[-1].finish == "length"
            await group.wave.wait_value(lambda w, p=parked_at: w > p)  # the group parked
        stats = group.statistics()
        assert stats.finished == 50 and stats.failed == 0 and stats.stall_wakes == 0


# rank r handles each inbound message r * SKEW s late: WAKEs and ADDs reach the ranks at
# different times, the delivery skew that makes wave bugs bite
SKEW = "0.003"


async def bursts(group: EngineGroup, n: int, rounds: int) -> int:
    """Each burst starts the moment the previous one finished, while the group parks."""
    done = 0
    for round_ in range(rounds):
        async with trio.open_nursery() as nursery:
            for k in range(1 + round_ % 4):
                req = Request(f"b{round_}-{k}", body(1 + k % 2), rank=(round_ + k) % n)
                nursery.start_soon(collect, group, req)
                done += 1
    return done


@pytest.mark.timeout_s(90)
@pytest.mark.parametrize(("n", "self_wake"), LOCKSTEP)
async def test_lockstep_bursts_while_the_group_parks(
    tmp_path: Path, n: int, self_wake: bool
) -> None:
    url = f"ipc://{tmp_path}/g"
    args = ["--lockstep", "--step-time", "0.001", "--sync-interval", "1", "--no-wave-agreement"]
    args += ["--skew", SKEW, *(["--self-wake"] if self_wake else [])]
    async with mock_process(url, n, *args), EngineGroup.connect(url, n) as group:
        done = await bursts(group, n, 30)
        stats = group.statistics()
        assert stats.finished == done and stats.failed == 0
        assert all(r.inflight == 0 for r in stats.ranks)


FAULTS = {
    # the mock's fault, EngineGroup.connect's options, what rank 1's `EngineDead` says
    "dead": (["--fault", "1:dead=5"], {}, "injected fault: dead_after"),
    "silent": (["--fault", "1:silent=5"], {"silence_timeout": 1.0}, "silent for"),
    "garbage": (["--fault", "1:garbage=3"], {}, "connection error"),
    # a rejoining mock closes its connections first: the close, the HELLO or the new
    # incarnation's handshake (while the close of its output connection alone waits
    # its grace), whichever the client sees first, ends the incarnation
    "rejoin": (
        ["--fault", "1:rejoin=5"],
        {},
        r"said HELLO again \(rejoin\)|connection closed|a new incarnation completed",
    ),
}
TOKENS = 10
"""Tokens per request: more than rank 1 emits before any of its faults (5 outputs, or
none before its garbage), so no request of rank 1 can complete before the fault."""


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize("fault", FAULTS)
async def test_each_fault_fails_only_its_rank_and_loses_nothing(tmp_path: Path, fault: str) -> None:
    """20 requests, alternately pinned to ranks 0 and 1, all submitted before rank 1 can
    fail: each of rank 1's is live when its fault strikes and ends with `EngineDead`
    naming it and the fault, each of rank 0's completes, and rank 0 goes on serving."""
    url = f"ipc://{tmp_path}/g"
    args, options, cause = FAULTS[fault]
    outcomes: dict[str, str] = {}
    async with (
        mock_process(url, 2, "--step-time", "0.005", *args),
        EngineGroup.connect(url, 2, **options) as group,
    ):

        async def one(i: int) -> None:
            rid = f"r{i}"
            try:
                outs = await collect(group, Request(rid, body(TOKENS), rank=i % 2))
                outcomes[rid] = "ok" if outs[-1].finish == "length" else "bad"
            except EngineDead as exc:
                assert exc.rank == 1 and exc.request_id == rid, exc
                outcomes[rid] = f"dead: {exc.cause}"

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, i)
        # rank 0 kept serving throughout, and still does
        assert (await collect(group, Request("after", body(2), rank=0)))[-1].finish
        stats = group.statistics()
    assert len(outcomes) == 20  # every request ended exactly once, with a result
    assert all(outcomes[f"r{i}"] == "ok" for i in range(0, 20, 2))  # rank 0's
    rank1 = Counter(outcomes[f"r{i}"].split(":")[0] for i in range(1, 20, 2))
    assert rank1 == {"dead": 10}, outcomes
    for i in range(1, 20, 2):
        assert re.search(cause, outcomes[f"r{i}"]), outcomes[f"r{i}"]
    assert stats.submitted == stats.finished + stats.failed + stats.aborted + stats.truncated
    assert all(r.inflight == 0 for r in stats.ranks)


@pytest.mark.timeout_s(60)
async def test_lockstep_fault_fails_the_whole_group(tmp_path: Path) -> None:
    """Rank 1 of a lockstep mock group announces `dead` after 3 outputs: its requests
    end with `EngineDead`, rank 0's with `GroupClosed` naming rank 1, and the group
    refuses new requests. (Each request asks for 10 tokens and the ranks step together,
    so none can complete before rank 1 dies.)"""
    url = f"ipc://{tmp_path}/g"
    ended: list[int] = []
    async with (
        mock_process(url, 2, "--lockstep", "--step-time", "0.005", "--fault", "1:dead=3"),
        EngineGroup.connect(url, 2) as group,
    ):

        async def one(i: int) -> None:
            request = Request(f"r{i}", body(10), rank=i % 2)
            if i % 2:
                with pytest.raises(EngineDead, match=rf"rank 1, request 'r{i}'.*dead_after"):
                    await collect(group, request)
            else:
                with pytest.raises(
                    GroupClosed, match=rf"request 'r{i}'.*lockstep group failed.*rank 1"
                ):
                    await collect(group, request)
            ended.append(i)

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
        assert sorted(ended) == list(range(6))
        with pytest.raises(GroupClosed, match="lockstep group failed"):
            group.submit(Request("late", body(1)))


@pytest.mark.timeout_s(60)
async def test_bad_hello_is_rejected_and_named_by_the_timeout(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    async with mock_process(url, 2, "--fault", "1:bad_hello=size"):
        with pytest.raises(HandshakeTimeout) as info:
            async with EngineGroup.connect(url, 2, ready_timeout=3):
                pass  # pragma: no cover
    # the rank is named by its refusal, not as one that said nothing ("no HELLO yet")
    [why] = info.value.missing.values()
    assert list(info.value.missing) == [1] and why.startswith("its HELLO was rejected: ")
    assert "size 3, the client expects 2" in why
    assert any("size 3, the client expects 2" in r for r in info.value.rejected)


@pytest.mark.timeout_s(90)
async def test_least_loaded_sends_fewer_requests_to_a_slow_rank(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    async with (
        mock_process(url, 2, "--step-time", "0.004", "--fault", "1:slow=3"),
        EngineGroup.connect(url, 2) as group,
    ):
        limiter = trio.CapacityLimiter(12)
        ranks: Counter[int] = Counter()

        async def one(i: int) -> None:
            async with limiter:
                stream = group.submit(Request(f"r{i}", body(12)))
                ranks[stream.rank] += 1
                async with stream:
                    async for _ in stream:
                        pass

        async with trio.open_nursery() as nursery:
            for i in range(120):
                nursery.start_soon(one, i)
    assert ranks[0] + ranks[1] == 120
    assert ranks[1] < 0.4 * 120, ranks  # an even split would be 60


def demo_command(*options: str) -> list[str]:
    """`python -m zmqdp demo` with `options`, its progress bar off."""
    return [sys.executable, "-m", "zmqdp", "demo", "--no-progress", *options]


@pytest.mark.skipif(NO_RICH, reason="the demo extra: pip install -e '.[demo]'")
@pytest.mark.timeout_s(120)
async def test_the_demo_command_runs(tmp_path: Path) -> None:
    result = await trio.run_process(
        demo_command("--requests", "24", "--step-time", "0.005"),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "24 completed, 0 failed" in out and "OK: every request completed" in out
    assert "tokens/s" in out and "TTFT p50 / p99" in out
    # one duration, named; tokens/s said to be the mock's (simulated engines)
    assert out.count("run time") == 1 and "wall time" not in out and "finished in" not in out
    assert "simulated" in out and "--step-time 0.005 s" in out


@pytest.mark.skipif(NO_RICH, reason="the demo extra: pip install -e '.[demo]'")
@pytest.mark.timeout_s(120)
async def test_the_demo_exits_nonzero_when_a_fault_is_not_what_it_predicts(
    tmp_path: Path,
) -> None:
    """With a fault that the workload never reaches, the prediction fails: exit 1."""
    result = await trio.run_process(
        demo_command(
            "--requests", "4", "--step-time", "0.005", "--fault", "dead", "--fault-after", "100000"
        ),
        capture_stdout=True,
        check=False,
    )
    assert result.returncode == 1
    assert "FAILED: the injected fault (dead) caused no failure" in result.stdout.decode()


@pytest.mark.skipif(NO_RICH, reason="the demo extra: pip install -e '.[demo]'")
@pytest.mark.timeout_s(120)
async def test_the_demo_rejoin_fault_is_one_restart_with_no_conflict_warning() -> None:
    """`--fault rejoin` restarts rank 1 once: its live requests fail alike (one row of
    the error table, the request id as `<id>`), and the client does not take the
    restart for two processes claiming the rank."""
    result = await trio.run_process(
        demo_command(
            "--requests", "60", "--step-time", "0.005", "--fault", "rejoin", "--fault-after", "20"
        ),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, out + err
    assert "claiming" not in out + err and "restarting in a loop" not in out + err
    assert "OK: " in out and "failed as the fault predicts" in out
    rows = [line for line in out.splitlines() if "EngineDead" in line and "<id>" in line]
    assert len(rows) == 1, out


@pytest.mark.timeout_s(60)
async def test_a_rejoin_fault_capped_by_rejoins_restarts_the_rank_once(tmp_path: Path) -> None:
    """`1:rejoin=5` with `1:rejoins=1`: the requests live at the restart fail; every
    later one completes however many outputs rank 1 emits, with no identity conflict."""
    url = f"ipc://{tmp_path}/g"
    faults = ["--fault", "1:rejoin=5", "--fault", "1:rejoins=1"]
    async with (
        mock_process(url, 2, "--step-time", "0.002", *faults),
        EngineGroup.connect(url, 2) as group,
    ):
        with pytest.raises(EngineDead):
            await collect(group, Request("first", body(TOKENS), rank=1))
        await group.rank_state(1).wait_value(lambda s: s is RankState.UP)
        for i in range(6):  # 60 outputs: without the cap, a rejoin every 5
            outs = await collect(group, Request(f"r{i}", body(TOKENS), rank=1))
            assert outs[-1].finish == "length"
        assert group.statistics().identity_conflicts == 0


# -- run_mock_group: which ranks it reports up -----------------------------------------


async def test_run_mock_group_reports_only_the_ranks_that_are_up(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    cfg = MockConfig(engines=2, step_time=0.001, faults={1: RankFaults(bad_hello="size")})
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:

            async def client() -> None:
                async with EngineGroup.connect(url, 2, ready_timeout=30):
                    pass  # pragma: no cover - rank 1 never comes

            nursery.start_soon(client)
            up = await nursery.start(partial(run_mock_group, wait_for_client=True), url, cfg)
            assert up == (0,)
            nursery.cancel_scope.cancel()


async def test_run_mock_group_raises_when_every_rank_is_rejected(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:

            async def client() -> None:
                async with EngineGroup.connect(url, 3, ready_timeout=30):
                    pass  # pragma: no cover - no rank comes

            nursery.start_soon(client)
            with pytest.raises(MockRejected) as rejected:
                await nursery.start(
                    partial(run_mock_group, wait_for_client=True), url, MockConfig(engines=2)
                )
            nursery.cancel_scope.cancel()
    message = str(rejected.value)
    assert message.startswith("rank ") and "(and 1 more rank(s) likewise)" in message
    assert "HELLO says size 2, the client expects 3" in message

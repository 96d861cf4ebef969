"""End to end over ipc, with `python -m zmqdp mock` in a subprocess.

Lockstep groups must never hang (PROTOCOL.md §5), each injected fault must produce the
error the client promises and lose nothing, and least-loaded selection must shun a slow
rank. Every test has an absolute `trio.fail_after`.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from zmqdp import (
    EngineDead,
    EngineGroup,
    GroupClosed,
    HandshakeTimeout,
    Output,
    Request,
    ZmqdpError,
)


@asynccontextmanager
async def mock(url: str, engines: int, *args: str) -> AsyncIterator[None]:
    cmd = [sys.executable, "-m", "zmqdp", "mock", "--url", url, "--engines", str(engines)]
    proc = await trio.lowlevel.open_process([*cmd, *args], stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.terminate()
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def collect(group: EngineGroup, request: Request) -> list[Output]:
    async with group.submit(request) as stream:
        return [out async for out in stream]


def body(tokens: int) -> dict[str, Any]:
    return {"prompt": [1, 2, 3], "max_tokens": tokens}


LOCKSTEP = [
    pytest.param(n, self_wake, id=f"n{n}-{'self-wake' if self_wake else 'waits-for-wake'}")
    for n in (2, 4)
    for self_wake in (False, True)
]


@pytest.mark.parametrize(("n", "self_wake"), LOCKSTEP)
async def test_lockstep_submit_finish_park_repeats_without_a_hang(
    tmp_path: Path, n: int, self_wake: bool
) -> None:
    url = f"ipc://{tmp_path}/g"
    args = ["--lockstep", "--step-time", "0.001", "--sync-interval", "2", "--no-wave-agreement"]
    args += ["--self-wake"] if self_wake else []
    with trio.fail_after(90):
        async with mock(url, n, *args), EngineGroup.connect(url, n) as group:
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


@pytest.mark.parametrize(("n", "self_wake"), LOCKSTEP)
async def test_lockstep_bursts_while_the_group_parks(
    tmp_path: Path, n: int, self_wake: bool
) -> None:
    url = f"ipc://{tmp_path}/g"
    args = ["--lockstep", "--step-time", "0.001", "--sync-interval", "1", "--no-wave-agreement"]
    args += ["--skew", SKEW, *(["--self-wake"] if self_wake else [])]
    with trio.fail_after(90):
        async with mock(url, n, *args), EngineGroup.connect(url, n) as group:
            done = await bursts(group, n, 30)
            stats = group.statistics()
            assert stats.finished == done and stats.failed == 0
            assert all(r.inflight == 0 for r in stats.ranks)


FAULTS = {
    "dead": (["--fault", "1:dead=5"], {}),
    "silent": (["--fault", "1:silent=5"], {"silence_timeout": 1.0}),
    "garbage": (["--fault", "1:garbage=3"], {}),
    "rejoin": (["--fault", "1:rejoin=5"], {}),
}


@pytest.mark.parametrize("fault", FAULTS)
async def test_each_fault_fails_only_its_rank_and_loses_nothing(tmp_path: Path, fault: str) -> None:
    url = f"ipc://{tmp_path}/g"
    args, options = FAULTS[fault]
    outcomes: dict[str, str] = {}
    with trio.fail_after(60):
        async with (
            mock(url, 2, "--step-time", "0.005", *args),
            EngineGroup.connect(url, 2, **options) as group,
        ):

            async def one(i: int) -> None:
                rid = f"r{i}"
                try:
                    outs = await collect(group, Request(rid, body(4), rank=i % 2))
                    outcomes[rid] = "ok" if outs[-1].finish == "length" else "bad"
                except EngineDead as exc:
                    assert exc.rank == 1 and exc.request_id == rid, exc
                    outcomes[rid] = f"dead: {exc.cause}"
                except ZmqdpError as exc:  # pinned to rank 1 while it is down
                    outcomes[rid] = f"{type(exc).__name__}"

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(one, i)
            # rank 0 kept serving throughout, and still does
            assert (await collect(group, Request("after", body(2), rank=0)))[-1].finish
            stats = group.statistics()
    assert len(outcomes) == 20  # every request ended exactly once, with a result
    assert all(outcomes[f"r{i}"] == "ok" for i in range(0, 20, 2))  # rank 0's
    rank1 = Counter(outcomes[f"r{i}"].split(":")[0] for i in range(1, 20, 2))
    assert rank1["dead"] >= 1, outcomes
    assert set(rank1) <= {"ok", "dead", "InvalidRank"}, outcomes
    assert stats.submitted == stats.finished + stats.failed + stats.aborted + stats.truncated
    assert all(r.inflight == 0 for r in stats.ranks)


async def test_lockstep_fault_fails_the_whole_group(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(60):
        async with (
            mock(url, 2, "--lockstep", "--step-time", "0.005", "--fault", "1:dead=3"),
            EngineGroup.connect(url, 2) as group,
        ):
            errors: list[BaseException] = []

            async def one(i: int) -> None:
                try:
                    await collect(group, Request(f"r{i}", body(10), rank=i % 2))
                except (EngineDead, GroupClosed) as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i)
            assert len(errors) == 6
            assert any(isinstance(e, EngineDead) and e.rank == 1 for e in errors)
            with pytest.raises(GroupClosed, match="lockstep group failed"):
                group.submit(Request("late", body(1)))


async def test_bad_hello_is_rejected_and_named_by_the_timeout(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(60):
        async with mock(url, 2, "--fault", "1:bad_hello=size"):
            with pytest.raises(HandshakeTimeout) as info:
                async with EngineGroup.connect(url, 2, ready_timeout=3):
                    pass  # pragma: no cover
    assert info.value.missing == {1: "no HELLO yet"}
    assert any("size 3, the client expects 2" in r for r in info.value.rejected)


async def test_least_loaded_sends_fewer_requests_to_a_slow_rank(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(90):
        async with (
            mock(url, 2, "--step-time", "0.004", "--fault", "1:slow=3"),
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


async def test_the_demo_command_runs(tmp_path: Path) -> None:
    with trio.fail_after(120):
        result = await trio.run_process(
            [
                sys.executable,
                "-m",
                "zmqdp",
                "demo",
                "--requests",
                "24",
                "--no-progress",
                "--step-time",
                "0.005",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "24 completed, 0 failed" in out and "OK: every request completed" in out
    assert "tokens/s" in out and "TTFT p50 / p99" in out


async def test_the_demo_exits_nonzero_when_a_fault_is_not_what_it_predicts(
    tmp_path: Path,
) -> None:
    """With a fault that the workload never reaches, the prediction fails: exit 1."""
    with trio.fail_after(120):
        result = await trio.run_process(
            [
                sys.executable,
                "-m",
                "zmqdp",
                "demo",
                "--requests",
                "4",
                "--no-progress",
                "--step-time",
                "0.005",
                "--fault",
                "dead",
                "--fault-after",
                "100000",
            ],
            capture_stdout=True,
            check=False,
        )
    assert result.returncode == 1
    assert "FAILED: the injected fault (dead) caused no failure" in result.stdout.decode()

"""`routing="prefix"` on a native group of scripted engines: a session's follow-up turns go
to the rank that has its prefix while the loads are within the band, and leave it when it
is overloaded; statistics count it; requests without token ids route by load."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from tests.helpers import collect, group_of, inflight, wait_until
from zmqdp import InvalidRequest, Request

SYSTEM = list(range(500, 564))  # a shared 64-token system prompt: 4 blocks


def turn(session: int, n: int) -> list[int]:
    """The prompt of a session's n-th turn: the system prompt, then n 32-token turns."""
    return SYSTEM + [session] * (32 * n)


async def test_a_session_follows_its_prefix_within_the_band_and_leaves_an_overloaded_rank(
    tmp_path: Path,
) -> None:
    with trio.fail_after(20):
        async with group_of(tmp_path, 2, routing="prefix") as (group, engines):
            # the first turn has nothing cached anywhere: the load decision (rank 0)
            await collect(group, Request("t1", {"tokens": 1}, tokens=turn(1, 1)))
            home = 0
            # rank 1 holds one request: loads 0 and 1, within the band either way
            async with group.submit(Request("other", {"hold": True}, rank=1)):
                await wait_until(lambda: engines[1].holds("other"))
                for n in (2, 3):
                    request = Request(f"t{n}", {"tokens": 1}, tokens=turn(1, n))
                    async with group.submit(request) as s:
                        assert s.rank == home, f"turn {n} left its rank"
                        _ = [o async for o in s]
                # without token ids: the load decision (the least loaded, rank 0)
                async with group.submit(Request("plain", {"tokens": 1})) as s:
                    assert s.rank == 0
                    _ = [o async for o in s]
            await wait_until(lambda: inflight(group) == [0, 0])
            # overload the session's rank: 3 held there, 0 on the other, past the band
            # (0 x 1.25 + 2): the next turn goes where it costs a recompute
            async with AsyncExitStack() as held:
                for i in range(3):
                    await held.enter_async_context(
                        group.submit(Request(f"h{i}", {"hold": True}, rank=home))
                    )
                await wait_until(lambda: all(engines[home].holds(f"h{i}") for i in range(3)))
                async with group.submit(Request("t4", {"tokens": 1}, tokens=turn(1, 4))) as s:
                    assert s.rank == 1 - home, "an overloaded rank kept the session"
                    _ = [o async for o in s]
            await wait_until(lambda: inflight(group) == [0, 0])
            # the session's newest turn is on the other rank now: it follows it there
            async with group.submit(Request("t5", {"tokens": 1}, tokens=turn(1, 5))) as s:
                assert s.rank == 1 - home
                _ = [o async for o in s]
            stats = group.statistics().prefix
            assert stats is not None
            assert stats.routed == 5 and stats.hits == 3
            # turns 2 and 3 hit 4 + 2n blocks of 16 tokens (the system prompt and the
            # turns before), turn 5 the 12 blocks of turn 4
            assert stats.cached_tokens == 16 * (6 + 8 + 12)
            assert stats.blocks == sum(stats.rank_blocks) > 0 and stats.exact_ranks == ()
            assert group.statistics().to_json()["prefix"]["hits"] == 3


async def test_tokens_that_are_not_ints_are_refused_at_submit(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with group_of(tmp_path, 2, routing="prefix") as (group, _):
            with pytest.raises(InvalidRequest, match=r"'bad'.*tokens"):
                group.submit(Request("bad", {"tokens": 1}, tokens=["a"]))  # type: ignore[list-item]
            assert group.statistics().submitted == 0


async def test_other_routings_take_token_ids_and_ignore_them(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with group_of(tmp_path, 2, routing="speed") as (group, _):
            ranks = []
            for n in (1, 2, 3, 4):
                async with group.submit(Request(f"t{n}", {"hold": True}, tokens=turn(1, n))) as s:
                    ranks.append(s.rank)
            assert ranks[:2] == [0, 1]  # by load alone
            assert group.statistics().prefix is None

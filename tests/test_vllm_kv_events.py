"""The exact mode of prefix affinity on vLLM's wire (`zmqdp.vllm.kv_events`), against the
fake engines' prefix cache and KV-event publisher over real sockets.

The first part drives `KvEvents` alone with a reference index (a per-rank set of our
block keys, as the naive reference of tests/models/prefix.py): what the engine caches
is what the index holds, through late joins, gaps with and without a replay socket,
a replay that never answers, junk and floods. The second part runs the whole group
(`routing="prefix"`): a follow-up goes to the rank that stored the prefix, a rank's
death forgets its index, and a lying engine draws no more than the load band allows."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio
import zmq

import zmqdp.vllm
from tests.fakes.vllm import FakeVllmEngine, FakeVllmGroup
from zmqdp._core.prefix import chain
from zmqdp.vllm import SamplingParams, VllmGroup, VllmRequest
from zmqdp.vllm.kv_events import KvEvents, peer_host

KV = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "topic": "kv"}
REPLAY = {**KV, "replay_endpoint": "tcp://*:0"}


class RefIndex:
    """The reference: per rank, the set of our keys the engine holds; and what the
    task said about holds and exactness. Stale incarnations are ignored, as the
    index does."""

    def __init__(self) -> None:
        self.keys: dict[int, set[int]] = {}
        self.inc: dict[int, int] = {}
        self.held: dict[int, bool] = {}
        self.exact: dict[int, bool] = {}
        self.drops: dict[int, int] = {}
        self.stale = 0

    def _live(self, rank: int, incarnation: int) -> bool:
        if incarnation != self.inc.get(rank, 0):
            self.stale += 1
            return False
        return True

    def incarnation(self, rank: int) -> int:
        return self.inc.get(rank, 0)

    def store(self, rank: int, keys: list[int], incarnation: int) -> None:
        if self._live(rank, incarnation):
            self.keys.setdefault(rank, set()).update(keys)

    def remove(self, rank: int, keys: list[int], incarnation: int) -> None:
        if self._live(rank, incarnation):
            self.keys.setdefault(rank, set()).difference_update(keys)

    def drop(self, rank: int, incarnation: int) -> None:
        if self._live(rank, incarnation):
            self.keys[rank] = set()
            self.drops[rank] = self.drops.get(rank, 0) + 1

    def hold(self, rank: int, held: bool, incarnation: int) -> None:
        if self._live(rank, incarnation):
            self.held[rank] = held

    def set_exact(self, rank: int, on: bool, incarnation: int) -> None:
        if self._live(rank, incarnation):
            self.exact[rank] = on

    def of(self, rank: int) -> set[int]:
        return self.keys.get(rank, set())


def engine_keys(engine: FakeVllmEngine, prompts: dict[int, list[int]]) -> set[int]:
    """Our keys of the blocks `engine` caches, from the prompts it was sent (its own
    hashes are seeded: the client cannot compute them, so map through the prompts)."""
    bs = engine.block_size
    seed = engine.hash_seed
    ours: dict[int, int] = {}
    for tokens in prompts.values():
        parent: int | None = None
        for key, i in zip(chain(tokens, bs), range(len(tokens) // bs), strict=False):
            parent = hash((seed, parent, *tokens[i * bs : (i + 1) * bs])) & ((1 << 64) - 1)
            ours[parent] = key
    return {ours[h] for h in engine.cache}


@asynccontextmanager
async def fakes(
    n: int, **fake_kw: Any
) -> AsyncIterator[tuple[VllmGroup, FakeVllmGroup, trio.Nursery]]:
    """A plain group of `n` fakes (least-loaded routing: no KV task of its own)."""
    d = tempfile.mkdtemp(prefix="zkv", dir="/tmp")
    fake = FakeVllmGroup(f"ipc://{d}/hs", n, **fake_kw)
    try:
        async with trio.open_nursery() as nursery:
            fake.nursery = nursery
            for e in fake.engines:
                nursery.start_soon(e.run)
            async with zmqdp.vllm.connect(fake.url, n, ready_timeout=5.0) as group:
                yield group, fake, nursery
            nursery.cancel_scope.cancel()
    finally:
        fake.close()
        shutil.rmtree(d, ignore_errors=True)


@asynccontextmanager
async def follower(
    group: VllmGroup, index: RefIndex, **kw: Any
) -> AsyncIterator[tuple[KvEvents, trio.Nursery]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    kv = KvEvents(ctx, enabled=True, **kw)
    kv.attach(index)
    try:
        async with trio.open_nursery() as nursery:
            yield kv, nursery
            kv.close()
    finally:
        ctx.destroy(linger=0)


async def follow(
    kv: KvEvents, nursery: trio.Nursery, group: VllmGroup, fake: FakeVllmGroup, rank: int
) -> None:
    """Follow `rank` and wait until its PUB has the subscription (no slow joiner)."""
    engine = fake.engines[rank]
    before = engine.kv_subscriptions
    assert kv.rank_up(nursery, rank, group.engines[rank].info, "127.0.0.1")
    await engine.wait_for(lambda: engine.kv_subscriptions > before)


async def run(group: VllmGroup, rid: str, prompt: list[int], rank: int | None = None) -> None:
    request = VllmRequest(rid, prompt, SamplingParams(max_tokens=2), rank=rank)
    async with group.submit(request) as stream:
        async for _ in stream:
            pass


def keys_of(prompt: list[int]) -> set[int]:
    """Our keys of a prompt's full blocks (the fakes' 16-token blocks)."""
    return set(chain(prompt, 16))


def prompt_of(seed: int, length: int = 40) -> list[int]:
    return [seed * 1000 + i for i in range(length)]


async def test_the_index_is_what_the_engine_caches_through_a_late_join_and_evictions() -> None:
    """Requests served before the client subscribed come back by replay from seq 0;
    evictions (a 6-block cache) remove what they evicted; our keys, not the engine's."""
    index = RefIndex()
    with trio.fail_after(20):
        async with fakes(1, kv_events=REPLAY, num_gpu_blocks=6) as (group, fake, _):
            engine = fake.engines[0]
            prompts = {i: prompt_of(i) for i in range(2)}
            for i in (0, 1):  # published before anyone listens (lost but buffered)
                await run(group, f"early{i}", prompts[i], rank=0)
            async with follower(group, index) as (kv, nursery):
                await follow(kv, nursery, group, fake, 0)
                for i in range(2, 6):
                    prompts[i] = prompt_of(i)
                    await run(group, f"r{i}", prompts[i], rank=0)
                    want = engine_keys(engine, prompts)
                    await kv.wait(lambda want=want: index.of(0) == want)
                counters = kv.counters()
                assert counters.replays == 1 and counters.removed > 0
                assert len(index.of(0)) == len(engine.cache) == 6
                assert index.exact == {0: True} and index.held == {0: False}
                assert not index.drops


@pytest.mark.parametrize("replay", [True, False])
async def test_a_gap_is_replayed_or_drops_the_rank(replay: bool) -> None:
    index = RefIndex()
    with trio.fail_after(20):
        async with fakes(1, kv_events=REPLAY if replay else KV) as (group, fake, _):
            engine = fake.engines[0]
            async with follower(group, index) as (kv, nursery):
                await follow(kv, nursery, group, fake, 0)
                prompts = {0: prompt_of(0)}
                await run(group, "r0", prompts[0], rank=0)
                await kv.wait(lambda: index.of(0) == engine_keys(engine, prompts))
                engine.kv_lose(2)  # the PUB drops two batches
                for i in (1, 2, 3):
                    prompts[i] = prompt_of(i)
                    await run(group, f"r{i}", prompts[i], rank=0)
                if replay:  # everything, the lost batches included
                    await kv.wait(lambda: index.of(0) == engine_keys(engine, prompts))
                    assert not index.drops and kv.counters().replays == 2  # at start, at the gap
                else:  # what came after the gap only: the lost blocks are unknown
                    await kv.wait(lambda: index.drops.get(0) == 1)
                    await kv.wait(lambda: index.of(0) == keys_of(prompts[3]))
                    assert kv.counters().gaps == 1


async def test_a_replay_that_never_answers_drops_the_rank_and_holds_it_meanwhile() -> None:
    index = RefIndex()
    with trio.fail_after(20):
        async with fakes(1, kv_events=REPLAY) as (group, fake, _):
            engine = fake.engines[0]
            async with follower(group, index, replay_timeout=0.3) as (kv, nursery):
                await follow(kv, nursery, group, fake, 0)
                await run(group, "r0", prompt_of(0), rank=0)
                await kv.wait(lambda: bool(index.of(0)))
                engine.kv_replay_mute = True
                engine.kv_lose(1)
                await run(group, "r1", prompt_of(1), rank=0)
                await run(group, "r2", prompt_of(2), rank=0)
                await kv.wait(lambda: index.held.get(0) is True)  # not used meanwhile
                await kv.wait(lambda: index.drops.get(0) == 1)
                assert index.held[0] is False
                assert kv.counters().replay_failures == 1
                # after the drop, what follows is indexed again
                await run(group, "r3", prompt_of(3), rank=0)
                want = keys_of(prompt_of(3))
                await kv.wait(lambda: want <= index.of(0))


async def test_junk_and_floods_are_bounded_and_never_end_the_task() -> None:
    """Lies and floods: a batch is capped, the feed's map is bounded by the rank's
    capacity, junk drops the rank's index, and the task keeps following."""
    index = RefIndex()
    with trio.fail_after(30):
        async with fakes(1, kv_events=KV, num_gpu_blocks=512) as (group, fake, _):
            engine = fake.engines[0]
            async with follower(group, index) as (kv, nursery):
                await follow(kv, nursery, group, fake, 0)
                await run(group, "r0", prompt_of(0), rank=0)
                await kv.wait(lambda: bool(index.of(0)))
                for n in range(4):  # 4 x 5000 blocks, never served, in one chain each
                    engine.publish_kv(
                        [
                            {
                                "type": "BlockStored",
                                "block_hashes": list(range(n * 10**6, n * 10**6 + 5000)),
                                "parent_block_hash": None,
                                "token_ids": [7] * (5000 * 16),
                                "block_size": 16,
                                "lora_id": None,
                                "medium": "GPU",
                                "lora_name": None,
                            }
                        ]
                    )
                await kv.wait(lambda: kv.counters().batches >= 5)
                counters = kv.counters()
                assert counters.capped == 4 * (5000 - 4096)  # the per-batch cap
                feed = kv._follows[0].feed
                assert feed is not None and len(feed) <= 1024  # 2 x 512, min 1024
                assert counters.overflowed > 0
                engine.publish_kv([{"type": "NotAnEvent"}])
                await kv.wait(lambda: kv.counters().junk == 1)
                assert index.of(0) == set() and index.drops[0] == 1
                await run(group, "r1", prompt_of(1), rank=0)  # still followed
                want = keys_of(prompt_of(1))
                await kv.wait(lambda: index.of(0) == want)


async def test_a_rank_down_closes_its_task_and_a_stale_incarnation_changes_nothing() -> None:
    index = RefIndex()
    with trio.fail_after(20):
        async with (
            fakes(2, kv_events=REPLAY) as (group, fake, _),
            follower(group, index) as (kv, nursery),
        ):
            for r in (0, 1):
                await follow(kv, nursery, group, fake, r)
            await run(group, "r0", prompt_of(0), rank=1)
            await kv.wait(lambda: bool(index.of(1)))
            index.inc[1] = 1  # the core took a new incarnation (the rank died)
            kv.rank_down(1)
            await kv.wait(lambda: not kv.following(1))
            await run(group, "r1", prompt_of(1), rank=1)
            await run(group, "r2", prompt_of(2), rank=0)
            await kv.wait(lambda: bool(index.of(0)))
            assert index.of(1) == keys_of(prompt_of(0))
            assert kv.following(0) and not kv.following(1)


async def test_endpoints_with_a_wildcard_host_and_hostile_endpoints() -> None:
    """`tcp://*:P` is reached at the engine's address; endpoints that are no tcp/ipc
    address start no task; a disabled follower starts none."""
    index = RefIndex()
    with trio.fail_after(20):
        with socket_port() as port:
            cfg = {**KV, "endpoint": f"tcp://*:{port}"}
            async with fakes(1, kv_events=cfg) as (group, fake, _):
                info = group.engines[0].info
                assert info["kv_events_config"]["endpoint"] == f"tcp://*:{port}"
                async with follower(group, index) as (kv, nursery):
                    await follow(kv, nursery, group, fake, 0)
                    await run(group, "r0", prompt_of(0), rank=0)
                    await kv.wait(lambda: bool(index.of(0)))
                    bad = {**info, "kv_events_config": {**KV, "endpoint": "inproc://x"}}
                    assert not kv.rank_up(nursery, 0, bad, "127.0.0.1")
                    assert not kv.following(0)
                    kv.enabled = False
                    assert not kv.rank_up(nursery, 0, info, "127.0.0.1")


class socket_port:
    """A TCP port free on 127.0.0.1 now."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        s.close()
        return port

    def __exit__(self, *exc: object) -> None:
        pass


def test_peer_host() -> None:
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    try:
        assert peer_host(server.fileno()) == "127.0.0.1"
        a, b = socket.socketpair()
        assert peer_host(a.fileno()) is None
        a.close()
        b.close()
        assert peer_host(10**6) is None
    finally:
        for s in (client, server, listener):
            s.close()


# -- the whole group: routing="prefix" with KV events ---------------------------------


@asynccontextmanager
async def prefix_group(
    n: int, *, kv_events: bool = True, **fake_kw: Any
) -> AsyncIterator[tuple[VllmGroup, FakeVllmGroup, KvEvents]]:
    """`n` fakes publishing KV events (with a replay socket unless `fake_kw` says
    otherwise) behind a group with prefix routing; every rank followed and subscribed
    (when `kv_events`)."""
    fake_kw.setdefault("kv_events", REPLAY)
    d = tempfile.mkdtemp(prefix="zkv", dir="/tmp")
    fake = FakeVllmGroup(f"ipc://{d}/hs", n, **fake_kw)
    try:
        async with trio.open_nursery() as nursery:
            fake.nursery = nursery
            for e in fake.engines:
                nursery.start_soon(e.run)
            async with zmqdp.vllm.connect(
                fake.url, n, ready_timeout=5.0, routing="prefix", kv_events=kv_events
            ) as group:
                kv: KvEvents = group._transport.kv  # type: ignore[attr-defined]
                if kv_events:
                    for e in fake.engines:
                        await e.wait_for(lambda e=e: e.kv_subscriptions > 0)
                    await kv.wait(lambda: kv.counters().replays == n)  # the start replays
                yield group, fake, kv
            nursery.cancel_scope.cancel()
    finally:
        fake.close()
        shutil.rmtree(d, ignore_errors=True)


def prefix_index(group: VllmGroup) -> Any:
    index = group._core.prefix  # type: ignore[attr-defined]
    assert index is not None
    return index


async def submit_and_rank(group: VllmGroup, rid: str, prompt: list[int]) -> int:
    request = VllmRequest(rid, prompt, SamplingParams(max_tokens=2))
    async with group.submit(request) as stream:
        async for _ in stream:
            pass
        assert stream.rank is not None
        return stream.rank


async def test_the_exact_index_fills_from_the_engines_events_and_a_follow_up_goes_there() -> None:
    with trio.fail_after(20):
        async with prefix_group(2) as (group, fake, kv):
            index = prefix_index(group)
            assert [index.is_exact(r) for r in (0, 1)] == [True, True]
            system = prompt_of(7, 64)  # 4 blocks of 16
            first = await submit_and_rank(group, "t1", [*system, 1, 2, 3])
            # the engine's BlockStored makes its blocks exact entries of that rank
            await kv.wait(lambda: index.stored(first) == 4)
            assert index.stored(1 - first) == 0
            for n in range(2, 5):  # turns of one session stay where their prefix is
                turn = [*system, *range(100, 100 + 16 * n)]
                assert await submit_and_rank(group, f"t{n}", turn) == first
            engine = fake.engines[first]
            assert engine.cache_hits >= 3 * 64  # num_cached_tokens: true, and hits
            assert fake.engines[1 - first].cache_hits == 0
            stats = group.statistics().prefix
            assert stats is not None and stats.exact_ranks == (0, 1)
            assert stats.kv_events["stored"] == index.stored(first) > 4
            assert stats.kv_events["junk"] == 0 and stats.kv_events["replays"] == 2


async def test_a_cleared_cache_empties_the_rank_and_without_kv_events_it_is_approximate() -> None:
    with trio.fail_after(20):
        async with prefix_group(1) as (group, fake, kv):
            index = prefix_index(group)
            await submit_and_rank(group, "a", prompt_of(1, 64))
            await kv.wait(lambda: index.stored(0) == 4)
            fake.engines[0].reset_prefix_cache()  # AllBlocksCleared
            await kv.wait(lambda: index.stored(0) == 0)
            assert group.statistics().prefix.kv_events["cleared"] == 1  # type: ignore[union-attr]
        async with prefix_group(1, kv_events=False) as (group, fake, kv):
            index = prefix_index(group)
            await submit_and_rank(group, "a", prompt_of(1, 64))
            assert not kv.following(0) and not index.is_exact(0)
            assert index.blocks(0) == 4 and index.stored(0) == 0  # predicted, approximate


async def test_a_dead_rank_forgets_its_exact_index_and_its_new_incarnation_is_followed() -> None:
    with trio.fail_after(20):
        async with prefix_group(2) as (group, fake, kv):
            index = prefix_index(group)
            await submit_and_rank(group, "a", prompt_of(1, 64))
            await submit_and_rank(group, "b", prompt_of(2, 64))
            await kv.wait(lambda: index.stored(0) == index.stored(1) == 4)
            before = index.incarnation(1)
            fake.engines[1].vanish()
            await group.rank_state(1).wait_value(zmqdp.RankState.DOWN)
            assert index.blocks(1) == 0 and index.incarnation(1) > before
            assert not kv.following(1) and kv.following(0)
            engine = fake.restart(1)
            fake.nursery.start_soon(engine.run)  # type: ignore[union-attr]
            await group.rank_state(1).wait_value(zmqdp.RankState.UP)
            await engine.wait_for(lambda: engine.kv_subscriptions > 0)
            assert kv.following(1) and index.is_exact(1)
            assert index.stored(0) == 4  # the other rank's index untouched


async def test_a_lying_engine_draws_no_more_than_the_band_and_its_flood_stays_capped() -> None:
    """Rank 1 claims (BlockStored) every block of a prompt it never served, then floods
    claims; requests for that prompt pile up (the engines are frozen): rank 1 gets at
    most what the load band allows, and the index stays within its caps."""
    with trio.fail_after(30):
        async with prefix_group(2, num_gpu_blocks=2048) as (group, fake, kv):
            index = prefix_index(group)
            prompt = prompt_of(9, 256)  # 16 blocks
            liar = fake.engines[1]
            hashes = list(range(1, 17))
            liar.publish_kv(
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": hashes,
                        "parent_block_hash": None,
                        "token_ids": prompt,
                        "block_size": 16,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                    }
                ]
            )
            await kv.wait(lambda: index.stored(1) == 16)
            for e in fake.engines:
                e.freeze()  # requests stay in flight: the loads grow
            counts = [0, 1]
            async with AsyncExitStack() as streams:
                pinned = VllmRequest("pinned", [1, 2], SamplingParams(max_tokens=2), rank=1)
                await streams.enter_async_context(group.submit(pinned))
                for i in range(24):
                    request = VllmRequest(f"r{i}", [*prompt, i], SamplingParams(max_tokens=2))
                    stream = await streams.enter_async_context(group.submit(request))
                    assert stream.rank is not None
                    counts[stream.rank] += 1
                    if i == 0:  # loads 0 and 1: only the claim makes it rank 1
                        assert stream.rank == 1
                    # the band: 25 % over the least loaded rank, plus 2 requests
                    assert counts[1] <= counts[0] * 1.25 + 3, counts
                assert counts[0] >= 8  # the liar did not take everything
                for n in range(8):  # the flood: 8 x 4096 more claimed blocks
                    liar.publish_kv(
                        [
                            {
                                "type": "BlockStored",
                                "block_hashes": list(
                                    range(10**6 * (n + 1), 10**6 * (n + 1) + 4096)
                                ),
                                "parent_block_hash": None,
                                "token_ids": [n] * (4096 * 16),
                                "block_size": 16,
                                "lora_id": None,
                                "medium": "GPU",
                                "lora_name": None,
                            }
                        ]
                    )
                await kv.wait(lambda: kv.counters().batches >= 1 + 8 + 0)
                assert index.blocks(1) <= index.limit(1) == 2048  # its own capacity
                assert index.total <= index.max_blocks
                for e in fake.engines:
                    e.frozen = False
                    e.changed.set()

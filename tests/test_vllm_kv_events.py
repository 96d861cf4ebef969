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
from contextlib import asynccontextmanager
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

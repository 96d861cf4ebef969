"""Real vLLM engine cores, dense model, DP=2, with prefix caching and KV events
(``--kv-events-config``, ``--block-size 32``), behind a group with ``routing="prefix"``:
the client follows each rank's events (a wildcard PUB endpoint reached at the
engine's address, a ``tcp://*:0`` replay endpoint the engine resolved itself), its
index gets the blocks a request stored, and a repeat of the prompt goes to the same
rank, whose first output says tokens came from its cache (``num_cached_tokens``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zmqdp.vllm import VllmGroup
from zmqdp.vllm.stats import EngineStats

from .engines import MAX_MODEL_LEN, EngineProcs, GroupHost, free_port, running_group
from .helpers import VOCAB, collect, request

BLOCK = 32


@pytest.fixture(scope="module")
def prefix(vllm_venv: Path, models: Path, engine_logs: Path) -> Iterator[GroupHost]:
    pub = free_port()  # the engines use pub and pub + 1 (offset by their rank)
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": "tcp://*:0",
        "topic": "kv",
    }
    extra = (
        "--enable-prefix-caching",
        "--block-size",
        str(BLOCK),
        "--kv-events-config",
        json.dumps(config),
    )
    engines = EngineProcs(vllm_venv, models / "dense", 2, engine_logs / "prefix", extra=extra)
    with running_group(engines, ready_timeout=300, routing="prefix") as host:
        yield host


def _kv(group: VllmGroup) -> Any:
    return group._transport.kv  # type: ignore[attr-defined]


def _index(group: VllmGroup) -> Any:
    index = group._core.prefix  # type: ignore[attr-defined]
    assert index is not None
    return index


def test_the_client_follows_every_ranks_kv_events(prefix: GroupHost) -> None:
    group = prefix.group
    assert group is not None
    for engine in group.engines:
        info = engine.info
        assert info["block_size"] == BLOCK
        cfg = info["kv_events_config"]
        assert cfg["enable_kv_cache_events"] and cfg["topic"] == "kv"
        assert cfg["endpoint"].startswith("tcp://*:")  # the client substitutes the host
        assert cfg["replay_endpoint"].startswith("tcp://127.0.0.1:")  # *:0, resolved

    async def check(group: VllmGroup) -> None:
        kv = _kv(group)
        # each feed asked for a replay from 0 at start; wait until both are live
        await kv.wait(lambda: kv.live(0) and kv.live(1))
        assert kv.following(0) and kv.following(1)
        index = _index(group)
        assert index.block_size == BLOCK and index.is_exact(0) and index.is_exact(1)
        assert kv.counters().junk == 0 and kv.counters().replay_failures == 0

    prefix.run(check, timeout=30)


def test_a_prompts_blocks_are_indexed_and_its_repeat_hits_the_same_rank(
    prefix: GroupHost,
) -> None:
    prompt = [(7 * i) % (VOCAB - 10) + 5 for i in range(6 * BLOCK + 5)]  # 6 full blocks

    async def check(group: VllmGroup) -> None:
        stats = group._wire.stats = EngineStats(MAX_MODEL_LEN)  # type: ignore[attr-defined]
        index = _index(group)
        kv = _kv(group)
        first = await collect(group, request("p1", 4, prompt=prompt, eos=None))
        assert first.error is None and first.rank is not None, first
        rank = first.rank
        # the engine's BlockStored, after its prefill: the prompt's 6 blocks, exact
        await kv.wait(lambda: index.stored(rank) >= 6)
        assert index.match(index.chain(prompt))[rank] == 6
        assert stats.rank(rank).prompt_tokens_cached == 0
        for n in range(2, 5):
            again = await collect(group, request(f"p{n}", 4, prompt=prompt, eos=None))
            assert again.error is None and again.rank == rank, (again, rank)
        # num_cached_tokens of the repeats' first outputs: every full block but the last
        # (vLLM recomputes at least one token; 197 tokens: blocks 1..6 hit)
        cached = stats.rank(rank).prompt_tokens_cached
        assert cached == 3 * 6 * BLOCK, cached
        counters = kv.counters()
        assert counters.stored >= 6 and counters.junk == 0, counters
        prefix_stats = group.statistics().prefix
        assert prefix_stats is not None and prefix_stats.exact_ranks == (0, 1)
        assert prefix_stats.kv_events["stored"] == counters.stored

    prefix.run(check, timeout=120)

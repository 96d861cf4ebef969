"""The native mock's fake prefix cache (`zmqdp.mock.PrefixCache`), which
benchmarks/bench_prefix.py measures prefix affinity against: vLLM's model (whole blocks,
never the whole prompt, LRU with the leaf evicted before its root), `"cached": n` in a
request's first output, the ready info's `block_size` and `num_gpu_blocks`, and the
prefill cost of the uncached tokens.

Every I/O test runs under conftest.py's `trio.fail_after`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqdp import EngineGroup, Request
from zmqdp.mock import MockConfig, PrefixCache, mock_command, run_mock_group

from .helpers import collect


class NaiveCache:
    """The reference: an LRU list of token prefixes of whole blocks (most recent last)."""

    def __init__(self, blocks: int, block_size: int) -> None:
        self.capacity, self.size = blocks, block_size
        self.lru: list[tuple[int, ...]] = []

    def _touch(self, prefixes: list[tuple[int, ...]]) -> None:
        for p in reversed(prefixes):  # the shortest prefix (the root) most recent
            if p in self.lru:
                self.lru.remove(p)
            self.lru.append(p)

    def lookup(self, prompt: list[int]) -> int:
        n = (len(prompt) - 1) // self.size if prompt else 0
        hits = []
        for i in range(1, n + 1):
            p = tuple(prompt[: i * self.size])
            if p not in self.lru:
                break
            hits.append(p)
        self._touch(hits)
        return len(hits) * self.size

    def store(self, tokens: list[int]) -> None:
        self._touch(
            [tuple(tokens[: i * self.size]) for i in range(1, len(tokens) // self.size + 1)]
        )
        del self.lru[: max(0, len(self.lru) - self.capacity)]


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.integers(0, 6),
    size=st.integers(1, 3),
    ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 1), max_size=9)), max_size=30),
)
def test_the_cache_is_a_block_lru_of_prefixes(
    blocks: int, size: int, ops: list[tuple[bool, list[int]]]
) -> None:
    """Against the reference: every lookup's answer, and the number of blocks held (so
    a leaf is evicted before its root, and the capacity holds)."""
    cache, ref = PrefixCache(blocks, size), NaiveCache(blocks, size)
    for is_lookup, tokens in ops:
        if is_lookup:
            got = cache.lookup(tokens)
            assert got == ref.lookup(tokens), (tokens, ref.lru)
            assert got % size == 0 and (got < len(tokens) or got == 0)
        else:
            cache.store(tokens)
            ref.store(tokens)
        assert len(cache) == len(ref.lru) <= blocks


def test_a_cached_prefix_is_never_the_whole_prompt() -> None:
    cache = PrefixCache(100, 4)
    cache.store(list(range(8)))
    assert cache.lookup(list(range(8))) == 4  # vLLM computes the last token: one block
    assert cache.lookup(list(range(9))) == 8
    assert cache.lookup([9, *range(1, 9)]) == 0  # another first block: another chain


@asynccontextmanager
async def mock_group(url: str, cfg: MockConfig) -> AsyncIterator[EngineGroup[Request]]:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_mock_group, url, cfg)
        async with EngineGroup.connect(url, cfg.engines) as group:
            yield group
        nursery.cancel_scope.cancel()


def body(prompt: list[int], tokens: int = 2) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": tokens}


async def test_the_first_output_says_the_cached_tokens(tmp_path: Path) -> None:
    cfg = MockConfig(engines=2, step_time=0.001, kv_tokens=1024, block_size=16)
    prompt = list(range(40))
    async with mock_group(f"ipc://{tmp_path}/g", cfg) as group:
        info = group.engines[0].info
        assert (info["block_size"], info["num_gpu_blocks"]) == (16, 64)
        cold = await collect(group, Request("a", body(prompt), rank=0))
        assert cold[0].body == {"token": 1001, "cached": 0}
        assert "cached" not in cold[1].body  # said once, in the first output
        warm = await collect(group, Request("b", body(prompt), rank=0))
        assert warm[0].body["cached"] == 32  # two whole blocks of 40 tokens
        other = await collect(group, Request("c", body(prompt), rank=1))
        assert other[0].body["cached"] == 0  # the other rank's own cache
        # the next turn: prompt + the answer (1001, 1002) + new text; the answer is cached
        turn = [*prompt, 1001, 1002, *range(500, 530)]
        again = await collect(group, Request("d", body(turn), rank=0))
        assert again[0].body["cached"] == 32  # 42 tokens stored: still two whole blocks
        turn3 = [*turn, 1001, 1002, 7]
        third = await collect(group, Request("e", body(turn3), rank=0))
        assert third[0].body["cached"] == 64  # the 74 tokens of turn + answer: 4 blocks


async def test_without_the_cache_nothing_is_said(tmp_path: Path) -> None:
    cfg = MockConfig(engines=1, step_time=0.001, prefix_cache=False)
    async with mock_group(f"ipc://{tmp_path}/g", cfg) as group:
        assert "block_size" not in group.engines[0].info
        for rid in ("a", "b"):
            outs = await collect(group, Request(rid, body(list(range(40))), rank=0))
            assert outs[0].body == {"token": 1001}


async def test_uncached_prompt_tokens_cost_prefill_time(tmp_path: Path) -> None:
    """The step admitting a 200-token prompt lasts at least 200 x prefill_time longer:
    its first output comes no sooner (a lower bound: sleeps never end early)."""
    cfg = MockConfig(engines=1, step_time=0.001, prefill_time=0.001)
    async with mock_group(f"ipc://{tmp_path}/g", cfg) as group:
        start = trio.current_time()
        async with group.submit(Request("a", body(list(range(200))), rank=0)) as stream:
            first = await stream.__anext__()
            elapsed = trio.current_time() - start
            async for _ in stream:
                pass
    assert first.body["cached"] == 0 and elapsed >= 0.2


def test_the_cache_settings_have_no_command_line_form() -> None:
    for cfg in (MockConfig(prefix_cache=False), MockConfig(prefill_time=0.001)):
        with pytest.raises(ValueError, match="has no command-line form"):
            mock_command("ipc:///tmp/zmqdp-m/g", cfg)

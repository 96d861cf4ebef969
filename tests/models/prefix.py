"""Naive references for prefix affinity (`_core/prefix.py`), and a Hypothesis state machine.

`Reference` keeps, per rank, the token prefixes (tuples of whole blocks) it caches in a
list, least recent first, and does everything by brute force: a prompt's match on a
rank is the longest run of its block prefixes, from the first, that the rank's list
holds; an insert touches them longest first (so the shortest is the most recent); a
rank keeps at most its limit, written out here from the docstring's formula; past the
global cap the rank holding most (the lowest such) drops its least recent prefix.

`IndexMachine` drives `PrefixIndex` and the reference side by side over small token
alphabets (so prompts share prefixes and blocks recur under other parents) and checks
every match, the memory bounds, the per-rank counts and the distinct blocks kept (a
hash no rank holds any more is a leak). `check_pick` states the policy's guarantees for
one pick. A plain module, so that tests/core/test_prefix.py can run both against the
broken variants in tests/models/mutants.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from zmqdp._core.prefix import BAND, SLACK, PrefixIndex

Prefix = tuple[int, ...]


class Reference:
    def __init__(
        self, size: int, block_size: int, max_blocks: int, rank_blocks: int, min_blocks: int
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.rank_blocks = min(rank_blocks, max_blocks)
        self.min_blocks = min(min_blocks, self.rank_blocks)
        self.lru: list[list[Prefix]] = [[] for _ in range(size)]
        self.capacity: list[int | None] = [None] * size
        self.usage = [0.0] * size

    def limit(self, rank: int) -> int:
        capacity = self.capacity[rank]
        c = self.rank_blocks if capacity is None else capacity
        u = self.usage[rank]
        return min(self.rank_blocks, max(self.min_blocks, round(c * (1.0 - u))))

    def prefixes(self, tokens: Sequence[int]) -> list[Prefix]:
        b = self.block_size
        return [tuple(tokens[:end]) for end in range(b, len(tokens) + 1, b)]

    def match(self, tokens: Sequence[int]) -> list[int]:
        out = []
        for lru in self.lru:
            held = set(lru)
            n = 0
            for p in self.prefixes(tokens):
                if p not in held:
                    break
                n += 1
            out.append(n)
        return out

    def insert(self, rank: int, tokens: Sequence[int]) -> None:
        lru = self.lru[rank]
        for p in reversed(self.prefixes(tokens)[: self.limit(rank)]):
            if p in lru:
                lru.remove(p)
            lru.append(p)
        self.shrink(rank)
        while sum(len(x) for x in self.lru) > self.max_blocks:
            counts = [len(x) for x in self.lru]
            self.lru[counts.index(max(counts))].pop(0)

    def shrink(self, rank: int) -> None:
        lru = self.lru[rank]
        del lru[: max(0, len(lru) - self.limit(rank))]

    def forget(self, rank: int) -> None:
        self.lru[rank] = []
        self.capacity[rank] = None
        self.usage[rank] = 0.0


TOKENS = st.lists(st.integers(0, 2), max_size=14)


class IndexMachine(RuleBasedStateMachine):
    """Subclass and set `index_cls` to run a variant of the index."""

    index_cls: type[PrefixIndex] = PrefixIndex

    @initialize(
        size=st.integers(1, 4),
        block_size=st.integers(1, 3),
        max_blocks=st.integers(1, 24),
        rank_blocks=st.integers(1, 16),
        min_blocks=st.integers(0, 4),
    )
    def setup(
        self, size: int, block_size: int, max_blocks: int, rank_blocks: int, min_blocks: int
    ) -> None:
        self.size = size
        self.index = self.index_cls(
            size,
            block_size=block_size,
            max_blocks=max_blocks,
            rank_blocks=rank_blocks,
            min_blocks=min_blocks,
        )
        self.ref = Reference(size, block_size, max_blocks, rank_blocks, min_blocks)
        self.sent: list[list[int]] = []

    @rule(rank=st.integers(0, 3), tokens=TOKENS, stale=st.booleans())
    def insert(self, rank: int, tokens: list[int], stale: bool) -> None:
        rank %= self.size
        current = self.index.incarnation(rank)
        if stale:  # a prompt of the incarnation before: ignored
            self.index.insert(rank, self.index.chain(tokens), current - 1)
        else:
            self.index.insert(rank, self.index.chain(tokens), current)
            self.ref.insert(rank, tokens)
        self.sent.append(tokens)

    @rule(rank=st.integers(0, 3), blocks=st.none() | st.integers(0, 20))
    def capacity(self, rank: int, blocks: int | None) -> None:
        rank %= self.size
        self.index.set_capacity(rank, blocks)
        self.ref.capacity[rank] = blocks
        self.ref.shrink(rank)

    @rule(rank=st.integers(0, 3), kv=st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0, 1.5, math.nan]))
    def usage(self, rank: int, kv: float) -> None:
        rank %= self.size
        self.index.observe_usage(rank, kv)
        self.ref.usage[rank] = min(kv, 1.0) if kv > 0 else 0.0
        self.ref.shrink(rank)

    @rule(rank=st.integers(0, 3))
    def forget(self, rank: int) -> None:
        rank %= self.size
        self.index.forget(rank)
        self.ref.forget(rank)

    @rule(tokens=TOKENS)
    def lookup(self, tokens: list[int]) -> None:
        self.check_match(tokens)

    @rule(data=st.data())
    def lookup_sent(self, data: st.DataObject) -> None:
        if self.sent:
            self.check_match(data.draw(st.sampled_from(self.sent)))

    def check_match(self, tokens: list[int]) -> None:
        got = self.index.match(self.index.chain(tokens))
        want = self.ref.match(tokens)
        assert got == want, f"match of {tokens}: {got}, the reference holds {want}"

    @invariant()
    def bounded(self) -> None:
        if not hasattr(self, "index"):
            return
        index, ref = self.index, self.ref
        assert index.total <= ref.max_blocks, f"{index.total} blocks past max_blocks"
        for r in range(self.size):
            n = index.blocks(r)
            assert n <= ref.limit(r), f"rank {r} keeps {n} blocks past its limit {ref.limit(r)}"
            assert n == len(ref.lru[r]), f"rank {r} keeps {n} blocks, expected {len(ref.lru[r])}"
        assert index.total == sum(index.blocks(r) for r in range(self.size))
        distinct = len({p for lru in ref.lru for p in lru})
        assert index.distinct == distinct, f"{index.distinct} distinct blocks kept, {distinct} held"


def check_pick(
    chosen: int,
    loads: Sequence[float],
    cached: Sequence[int],
    prompt: int,
    start: int,
    pending: Sequence[float] | None,
    band: float = BAND,
    slack: float = SLACK,
) -> None:
    """The guarantees of one `pick`: a rank is chosen iff one has a finite load; it is
    within the band; independent ranks: none in the band caches more, and with nothing
    cached it is the load decision (the first strictly least load from `start`), and of
    those that cache most it is the least loaded; lockstep: no rank in the band ends
    with less load of its own (pending + uncached), nor leaves a smaller maximum load.
    Cached tokens count for at most the prompt (a claim past it beats no whole-prompt
    hit)."""
    cached = [min(max(c, 0), prompt) for c in cached]  # a claim past the prompt: the prompt
    finite = [r for r, load in enumerate(loads) if load < math.inf]
    if not finite:
        assert chosen == -1, f"picked {chosen} with no candidate"
        return
    least = min(loads)
    bound = least * (1 + band) + slack
    assert chosen in finite, f"picked {chosen}, not a candidate"
    assert loads[chosen] <= bound, f"picked rank {chosen} out of the band ({loads[chosen]})"
    band_ranks = [r for r in finite if loads[r] <= bound]
    if pending is None:
        most = max(cached[r] for r in band_ranks)
        assert cached[chosen] == most, f"rank {chosen} caches {cached[chosen]}, another {most}"
        lightest = min(loads[r] for r in band_ranks if cached[r] == most)
        assert loads[chosen] == lightest, (
            f"rank {chosen} (load {loads[chosen]}) is not the least loaded that caches most"
        )
        if not any(cached):
            size = len(loads)
            order = [(start + i) % size for i in range(size)]
            first = next(r for r in order if loads[r] == least)
            assert chosen == first, f"picked {chosen}, the load decision is {first}"
        return

    def worst(r: int) -> float:
        return max(pending[q] + (prompt - cached[q] if q == r else 0) for q in range(len(loads)))

    own = {r: pending[r] + prompt - cached[r] for r in band_ranks}
    assert own[chosen] == min(own.values()), f"lockstep: rank {chosen}'s own load is not least"
    best = min(worst(r) for r in band_ranks)
    assert worst(chosen) <= best, f"lockstep: rank {chosen} leaves max {worst(chosen)} > {best}"

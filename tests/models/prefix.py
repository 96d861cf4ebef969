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

import copy
import math
from collections.abc import Sequence

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from zmqdp._core.errors import NoEngineAvailable, Overloaded
from zmqdp._core.messages import Load
from zmqdp._core.prefix import BAND, SLACK, PrefixIndex
from zmqdp._core.routing import Routing

Prefix = tuple[int, ...]


class Reference:
    def __init__(
        self,
        size: int,
        block_size: int,
        max_blocks: int,
        rank_blocks: int,
        min_blocks: int,
        predicted_blocks: int = 1 << 30,
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.rank_blocks = min(rank_blocks, max_blocks)
        self.min_blocks = min(min_blocks, self.rank_blocks)
        self.predicted_blocks = predicted_blocks
        self.lru: list[list[Prefix]] = [[] for _ in range(size)]
        # exact mode: what the engine said it stores, oldest store first
        self.stored: list[list[Prefix]] = [[] for _ in range(size)]
        self.exact = [False] * size
        self.held = [False] * size
        self.incarnation = [0] * size
        self.capacity: list[int | None] = [None] * size
        self.usage = [0.0] * size

    def limit(self, rank: int) -> int:
        capacity = self.capacity[rank]
        c = self.rank_blocks if capacity is None else capacity
        u = 0.0 if self.exact[rank] else self.usage[rank]
        return min(self.rank_blocks, max(self.min_blocks, round(c * (1.0 - u))))

    def count(self, rank: int) -> int:
        return len(self.lru[rank]) + len(self.stored[rank])

    def prefixes(self, tokens: Sequence[int]) -> list[Prefix]:
        b = self.block_size
        return [tuple(tokens[:end]) for end in range(b, len(tokens) + 1, b)]

    def match(self, tokens: Sequence[int]) -> list[int]:
        out = []
        for rank, lru in enumerate(self.lru):
            held = set(lru) | set(self.stored[rank])
            n = 0
            for p in self.prefixes(tokens):
                if self.held[rank] or p not in held:
                    break
                n += 1
            out.append(n)
        return out

    def insert(self, rank: int, tokens: Sequence[int]) -> None:
        lru = self.lru[rank]
        limit = self.limit(rank)
        if self.exact[rank]:
            limit = min(limit, self.predicted_blocks)
        for p in reversed(self.prefixes(tokens)[:limit]):
            if p in self.stored[rank]:
                continue
            if p in lru:
                lru.remove(p)
            lru.append(p)
        self.shrink(rank)
        self.cap()

    def store(self, rank: int, prefixes: list[Prefix]) -> None:
        stored = self.stored[rank]
        for p in prefixes:
            if p in stored:
                stored.remove(p)
            elif p in self.lru[rank]:
                self.lru[rank].remove(p)
            stored.append(p)
        self.shrink(rank)
        self.cap()

    def remove(self, rank: int, prefixes: list[Prefix]) -> None:
        for p in prefixes:
            for entries in (self.stored[rank], self.lru[rank]):
                if p in entries:
                    entries.remove(p)

    def set_exact(self, rank: int, on: bool) -> None:
        if self.exact[rank] == on:
            return
        self.exact[rank] = on
        if not on:
            self.lru[rank] = self.stored[rank] + self.lru[rank]
            self.stored[rank] = []
        self.shrink(rank)

    def cap(self) -> None:
        while sum(self.count(r) for r in range(len(self.lru))) > self.max_blocks:
            counts = [self.count(r) for r in range(len(self.lru))]
            self.evict(counts.index(max(counts)), 1)

    def evict(self, rank: int, n: int) -> None:
        for _ in range(n):
            (self.lru[rank] or self.stored[rank]).pop(0)

    def shrink(self, rank: int) -> None:
        excess = self.count(rank) - self.limit(rank)
        if self.exact[rank]:
            excess = max(excess, len(self.lru[rank]) - self.predicted_blocks)
        self.evict(rank, max(0, excess))

    def drop(self, rank: int) -> None:
        self.lru[rank] = []
        self.stored[rank] = []

    def forget(self, rank: int) -> None:
        self.drop(rank)
        self.capacity[rank] = None
        self.usage[rank] = 0.0
        self.exact[rank] = False
        self.held[rank] = False
        self.incarnation[rank] += 1


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
        predicted_blocks=st.integers(0, 4),
    )
    def setup(
        self,
        size: int,
        block_size: int,
        max_blocks: int,
        rank_blocks: int,
        min_blocks: int,
        predicted_blocks: int,
    ) -> None:
        self.size = size
        self.index = self.index_cls(
            size,
            block_size=block_size,
            max_blocks=max_blocks,
            rank_blocks=rank_blocks,
            min_blocks=min_blocks,
            predicted_blocks=predicted_blocks,
        )
        self.ref = Reference(
            size, block_size, max_blocks, rank_blocks, min_blocks, predicted_blocks
        )
        self.sent: list[list[int]] = []

    def incarnation(self, rank: int, stale: bool) -> int:
        """The reference's incarnation of `rank` (the one before it if `stale`): the
        machine tracks it itself, so an index that moves its own is caught."""
        return self.ref.incarnation[rank] - stale

    @rule(rank=st.integers(0, 3), tokens=TOKENS, stale=st.booleans())
    def insert(self, rank: int, tokens: list[int], stale: bool) -> None:
        rank %= self.size
        self.index.insert(rank, self.index.chain(tokens), self.incarnation(rank, stale))
        if not stale:  # a prompt of the incarnation before is ignored
            self.ref.insert(rank, tokens)
        self.sent.append(tokens)

    # -- exact mode: what KV events tell -------------------------------------------------

    @rule(rank=st.integers(0, 3), tokens=TOKENS, start=st.integers(0, 4), stale=st.booleans())
    def store(self, rank: int, tokens: list[int], start: int, stale: bool) -> None:
        """BlockStored: a chain's blocks from `start` on (their parents stored before)."""
        rank %= self.size
        self.index.store(rank, self.index.chain(tokens)[start:], self.incarnation(rank, stale))
        if not stale:
            self.ref.store(rank, self.ref.prefixes(tokens)[start:])
        self.sent.append(tokens)

    @rule(rank=st.integers(0, 3), data=st.data(), stale=st.booleans())
    def remove(self, rank: int, data: st.DataObject, stale: bool) -> None:
        """BlockRemoved: some blocks of a prompt sent or stored before."""
        rank %= self.size
        if not self.sent:
            return
        tokens = data.draw(st.sampled_from(self.sent))
        n = len(self.ref.prefixes(tokens))
        which = sorted(data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n)))
        which = [i for i in which if i < n]
        keys = self.index.chain(tokens)
        self.index.remove(rank, [keys[i] for i in which], self.incarnation(rank, stale))
        if not stale:
            prefixes = self.ref.prefixes(tokens)
            self.ref.remove(rank, [prefixes[i] for i in which])

    @rule(rank=st.integers(0, 3), stale=st.booleans())
    def drop(self, rank: int, stale: bool) -> None:
        rank %= self.size
        self.index.drop(rank, self.incarnation(rank, stale))
        if not stale:
            self.ref.drop(rank)

    @rule(rank=st.integers(0, 3), held=st.booleans(), stale=st.booleans())
    def hold(self, rank: int, held: bool, stale: bool) -> None:
        rank %= self.size
        self.index.hold(rank, held, self.incarnation(rank, stale))
        if not stale:
            self.ref.held[rank] = held

    @rule(rank=st.integers(0, 3), on=st.booleans(), stale=st.booleans())
    def set_exact(self, rank: int, on: bool, stale: bool) -> None:
        rank %= self.size
        self.index.set_exact(rank, on, self.incarnation(rank, stale))
        if not stale:
            self.ref.set_exact(rank, on)

    @rule(rank=st.integers(0, 3), blocks=st.none() | st.integers(0, 20))
    def capacity(self, rank: int, blocks: int | None) -> None:
        rank %= self.size
        self.index.set_capacity(rank, blocks)
        self.ref.capacity[rank] = blocks
        self.ref.shrink(rank)
        self.ref.cap()

    @rule(rank=st.integers(0, 3), kv=st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0, 1.5, math.nan]))
    def usage(self, rank: int, kv: float) -> None:
        rank %= self.size
        self.index.observe_usage(rank, kv)
        self.ref.usage[rank] = min(kv, 1.0) if kv > 0 else 0.0
        self.ref.shrink(rank)
        self.ref.cap()

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
            assert n == ref.count(r), f"rank {r} keeps {n} blocks, expected {ref.count(r)}"
            stored = index.stored(r)
            assert stored == len(ref.stored[r]), (
                f"rank {r} keeps {stored} stored blocks, expected {len(ref.stored[r])}"
            )
            assert index.is_exact(r) == ref.exact[r], f"rank {r}: exact mode differs"
        assert index.total == sum(index.blocks(r) for r in range(self.size))
        distinct = len({p for entries in ref.lru + ref.stored for p in entries})
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


# -- the prefix path of `Routing.select` -----------------------------------------------


SESSION_TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=10)


class PrefixRoutingMachine(RuleBasedStateMachine):
    """`Routing` with a prefix index, fed as the core feeds it (picks with and without
    token ids, pinned picks, releases, first outputs, load reports, caps, ranks down and
    up). Every unpinned pick with token ids is checked against what it must be, from
    the state just before it:

    * none with room: it raises, and nothing changes;
    * its load score is within the band (``least x (1 + BAND) + SLACK``);
    * if a rank in the band caches some of the prompt: independent ranks, the chosen
      caches the most of them, and is the least loaded of those; lockstep, the chosen's
      pending prefill plus uncached tokens is the least in the band;
    * otherwise it is the plain load decision (a copy of the routing, asked without
      token ids), so a workload with no shared prefixes routes as without affinity;
    * afterwards the rank holds the prompt's blocks (as many as its limit lets it: the
      global cap is out of reach here, `IndexMachine` checks it) and,
      lockstep, its pending prefill grew by the prompt's uncached tokens.

    Subclass and set `routing_cls` to run a variant."""

    routing_cls: type[Routing] = Routing

    @initialize(
        n=st.integers(1, 5),
        speed=st.booleans(),
        lockstep=st.booleans(),
        tree=st.booleans(),
        block_size=st.integers(1, 3),
    )
    def setup(self, n: int, speed: bool, lockstep: bool, tree: bool, block_size: int) -> None:
        self.n = n
        self.lockstep = lockstep
        self.index = PrefixIndex(n, block_size=block_size, max_blocks=1024, rank_blocks=32)
        self.routing = self.routing_cls(
            n, up=True, speed=speed, tree=tree, prefix=self.index, lockstep=lockstep
        )
        self.live: list[tuple[str, int]] = []
        self.sent: list[list[int]] = []
        self.serial = 0

    def _id(self) -> str:
        self.serial += 1
        return f"r{self.serial}"

    @rule(data=st.data(), fresh=SESSION_TOKENS, reuse=st.booleans())
    def submit(self, data: st.DataObject, fresh: list[int], reuse: bool) -> None:
        tokens = fresh
        if reuse and self.sent:  # a session's next turn: a prompt sent before, and more
            tokens = data.draw(st.sampled_from(self.sent)) + fresh
        routing, index = self.routing, self.index
        hashes = index.chain(tokens)
        cached = [min(c, len(tokens)) for c in index.cached_tokens(hashes)]
        loads = [routing.load_score(r) if routing.has_room(r) else math.inf for r in range(self.n)]
        pending = [routing.prefill_pending(r) for r in range(self.n)]
        plain = copy.deepcopy(routing)
        plain.prefix = None
        rid = self._id()
        least = min(loads)
        if least == math.inf:
            try:
                routing.select(rid, prefix=(tokens, 0))
            except (Overloaded, NoEngineAvailable):
                return
            raise AssertionError("picked with no rank free")
        chosen = routing.select(rid, prefix=(tokens, 0))
        self.live.append((rid, chosen))
        self.sent.append(tokens)
        bound = least * (1 + BAND) + SLACK
        band = [r for r in range(self.n) if loads[r] <= bound]
        assert chosen in band, f"rank {chosen} (load {loads[chosen]}) out of the band {bound}"
        if any(cached[r] for r in band):
            if self.lockstep:
                own = {r: pending[r] + len(tokens) - cached[r] for r in band}
                assert own[chosen] == min(own.values()), f"lockstep: {chosen} is not least"
            else:
                most = max(cached[r] for r in band)
                assert cached[chosen] == most, f"rank {chosen} caches {cached[chosen]} < {most}"
                least_of_most = min(loads[r] for r in band if cached[r] == most)
                assert loads[chosen] == least_of_most, f"rank {chosen} is not the least loaded"
        else:
            want = plain.select(rid)
            assert chosen == want, f"nothing cached in the band: picked {chosen}, plain {want}"
        held = index.match(hashes)[chosen]
        assert held == min(len(hashes), index.limit(chosen)), (
            f"rank {chosen} holds {held} of the prompt's {len(hashes)} blocks"
        )
        if self.lockstep:
            grew = routing.prefill_pending(chosen) - pending[chosen]
            assert grew == len(tokens) - cached[chosen], f"pending grew by {grew}"

    @rule(rank=st.integers(0, 4))
    def pinned(self, rank: int) -> None:
        rank %= self.n
        if self.routing.has_room(rank):
            rid = self._id()
            self.routing.select(rid, rank)
            self.live.append((rid, rank))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.live:
            rid, rank = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
            self.routing.release(rank, [rid])

    @rule(data=st.data())
    def first_output(self, data: st.DataObject) -> None:
        if self.live:
            rid, _ = data.draw(st.sampled_from(self.live))
            self.routing.started(rid)

    @rule(rank=st.integers(0, 4), waiting=st.integers(0, 4), running=st.integers(0, 4))
    def load(self, rank: int, waiting: int, running: int) -> None:
        self.routing.observe_load(rank % self.n, Load(waiting, running, 0.3))

    @rule(rank=st.integers(0, 4), cap=st.none() | st.integers(1, 3))
    def cap(self, rank: int, cap: int | None) -> None:
        self.routing.set_cap(rank % self.n, cap)

    @rule(rank=st.integers(0, 4))
    def down_and_up(self, rank: int) -> None:
        rank %= self.n
        held = self.routing.take_down(rank)
        self.live = [(rid, r) for rid, r in self.live if rid not in held]
        self.routing.set_up(rank)

    @invariant()
    def pending_is_the_sum_of_the_prefills_not_started(self) -> None:
        if not hasattr(self, "routing"):
            return
        routing = self.routing
        for r in range(self.n):
            want = sum(t for rank, t in routing.prefilling.values() if rank == r)
            assert routing.prefill_pending(r) == want, f"rank {r}: pending drifted"
        live = {rid for rid, _ in self.live}
        assert set(routing.prefilling) <= live, "a prefill outlived its request"
